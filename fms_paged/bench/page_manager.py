"""PageManager allocator throughput and metadata footprint.

    python -m fms_paged.bench.page_manager [--out results/page_manager]

For each pool size (num_pages) and number of live background sequences, the background sequences
hold pages for the whole run; the timed loop reserves a working set of fresh sequences (the same
`--batch` seqs x `--pages-per-seq` pages in every configuration) and erases it again. pages/s
counts each page allocated and freed once. Also prints the page-table/metadata bytes against the
KV pool bytes of a 7B model.
Writes `<out>/page_manager.json` (and the markdown table to `<out>/page_manager.md`).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from fms_paged.kv.page_manager import PageManager

MAX_PAGES_PER_SEQ = 64  # table width: bounded so the table does not grow with the pool


def _background_lengths(num_pages: int, live: int, page_size: int, ws_pages: int) -> list[int]:
    """Lengths of `live` background seqs holding up to half of what the working set leaves."""
    budget = min((num_pages - 1 - ws_pages) // 2, live * MAX_PAGES_PER_SEQ)
    base, extra = divmod(budget, live)
    return [(base + (i < extra)) * page_size for i in range(live)]


def bench_config(
    num_pages: int,
    live: int,
    *,
    batch: int,
    per_seq: int,
    page_size: int,
    iters: int,
    repeats: int,
    device: str,
) -> dict:
    """Median time of one (reserve working set, erase it) round at this pool size / live count."""
    ws_pages = batch * per_seq
    if ws_pages > num_pages - 1 or per_seq > MAX_PAGES_PER_SEQ:
        raise ValueError(
            f"working set {batch} x {per_seq} pages does not fit num_pages {num_pages} "
            f"(or exceeds {MAX_PAGES_PER_SEQ} pages per seq)"
        )
    pm = PageManager(
        num_pages,
        page_size,
        live + batch,
        device,
        max_seq_len=MAX_PAGES_PER_SEQ * page_size,
    )
    bg = _background_lengths(num_pages, live, page_size, ws_pages)
    for lo in range(0, live, 1024):  # background sequences: held for the whole run
        pm.reserve(range(lo, min(lo + 1024, live)), bg[lo : lo + 1024])
    bg_pages = num_pages - 1 - pm.num_free_pages
    ws_ids = list(range(live, live + batch))
    ws_lens = [per_seq * page_size] * batch

    def one_round() -> None:
        pm.reserve(ws_ids, ws_lens)
        pm.erase(ws_ids)

    for _ in range(max(3, iters // 10)):  # warm up
        one_round()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            one_round()
        if pm.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters)
    sec = statistics.median(times)
    assert pm.num_free_pages == num_pages - 1 - bg_pages, "working set leaked pages"
    return {
        "num_pages": num_pages,
        "live_seqs": live,
        "background_pages": bg_pages,
        "batch_seqs": batch,
        "pages_per_seq": per_seq,
        "pages_per_round": ws_pages,
        "round_us_median": sec * 1e6,
        "ns_per_page": sec / ws_pages * 1e9,
        "pages_per_s": ws_pages / sec,
    }


def footprint(
    max_seqs: int,
    *,
    context: int = 32768,
    page_size: int = 16,
    nlayers: int = 32,
    kvheads: int = 32,
    head_dim: int = 128,
    dtype_bytes: int = 2,
) -> dict:
    """Bytes of the device metadata vs the KV pool when every seq can hold the full context."""
    pages_per_seq = math.ceil(context / page_size)
    num_pages = max_seqs * pages_per_seq + 1  # + the null page
    pool = 2 * nlayers * kvheads * head_dim * dtype_bytes * num_pages * page_size  # K and V
    table = 4 * max_seqs * pages_per_seq
    p2l = 4 * num_pages
    lens = 4 * max_seqs
    meta = table + p2l + lens
    return {
        "max_seqs": max_seqs,
        "context": context,
        "num_pages": num_pages,
        "kv_pool_bytes": pool,
        "page_table_bytes": table,
        "phys_to_logical_bytes": p2l,
        "seq_lens_bytes": lens,
        "metadata_bytes": meta,
        "metadata_fraction": meta / pool,
        # host mirror: table + lens/live + refcount + p2l (numpy) + deque of ints (~8 B slot +
        # 28 B int object per free page when the pool is empty)
        "host_mirror_bytes_est": table + 9 * max_seqs + 8 * num_pages + 36 * num_pages,
    }


FOOTPRINT_ASSUMPTIONS = (
    "7B config: 32 layers, 32 kv heads, head_dim 128, fp16, page_size 16, 32k context; the pool "
    "holds max_seqs * 32768 tokens (+1 null page), K and V; device metadata = int32 page table "
    "[max_seqs, 2048] + int32 phys_to_logical [num_pages] + int32 seq_lens [max_seqs]."
)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def markdown(results: list[dict], fps: list[dict]) -> str:
    base = results[0]["ns_per_page"]
    lines = [
        (
            "| num_pages | live seqs | bg pages | batch (seqs x pages) | round us (median) "
            "| ns/page | pages/s (alloc+free) | cost vs first row |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['num_pages']:,} | {r['live_seqs']:,} | {r['background_pages']:,} "
            f"| {r['batch_seqs']} x {r['pages_per_seq']} | {r['round_us_median']:.1f} "
            f"| {r['ns_per_page']:.1f} | {r['pages_per_s'] / 1e6:.2f} M "
            f"| {r['ns_per_page'] / base:.2f}x |"
        )
    lines += [
        "",
        "Metadata footprint. " + FOOTPRINT_ASSUMPTIONS,
        "",
        (
            "| max_seqs | num_pages | KV pool | page table | phys_to_logical | seq_lens "
            "| metadata / pool | host mirror (est.) |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in fps:
        lines.append(
            f"| {f['max_seqs']} | {f['num_pages']:,} | {_fmt_bytes(f['kv_pool_bytes'])} "
            f"| {_fmt_bytes(f['page_table_bytes'])} | {_fmt_bytes(f['phys_to_logical_bytes'])} "
            f"| {_fmt_bytes(f['seq_lens_bytes'])} | {f['metadata_fraction']:.2e} "
            f"| {_fmt_bytes(f['host_mirror_bytes_est'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/page_manager", help="output directory")
    ap.add_argument("--num-pages", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--live", type=int, nargs="+", default=[1, 100, 10_000])
    ap.add_argument("--batch", type=int, default=32, help="working-set seqs per reserve/erase")
    ap.add_argument("--pages-per-seq", type=int, default=16, help="pages per working-set seq")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200, help="rounds per timed repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--footprint-seqs", type=int, nargs="+", default=[1, 64, 256])
    args = ap.parse_args(argv)

    results = []
    for num_pages in args.num_pages:
        for live in args.live:
            r = bench_config(
                num_pages,
                live,
                batch=args.batch,
                per_seq=args.pages_per_seq,
                page_size=args.page_size,
                iters=args.iters,
                repeats=args.repeats,
                device=args.device,
            )
            results.append(r)
            rate = r["pages_per_s"] / 1e6
            print(f"num_pages={num_pages:>9,} live={live:>6,}: {rate:.2f} M pages/s", file=sys.stderr)
    fps = [footprint(s) for s in args.footprint_seqs]
    table = markdown(results, fps)
    print(table)
    report = {
        "benchmark": "page_manager",
        "metric": "pages allocated+freed per second (batched reserve then erase)",
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "device": args.device,
            "page_size": args.page_size,
            "iters": args.iters,
            "repeats": args.repeats,
        },
        "results": results,
        "footprint_assumptions": FOOTPRINT_ASSUMPTIONS,
        "footprint": fps,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "page_manager.json").write_text(json.dumps(report, indent=2))
    (out / "page_manager.md").write_text(table + "\n")
    return report


if __name__ == "__main__":
    main()
