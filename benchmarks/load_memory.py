"""Process memory of a served model: peak RSS while loading a checkpoint, and steady RSS after a
small mixed workload through the Engine, beside llama.cpp on the same model at the same weight
precision (`make bench-load-memory`).

The model: Gemma 3 270M's published shape (18 layers, hidden 640, 4 heads, 1 KV head, head_dim
256, intermediate 2048, vocab 262144, sliding window 512) with random weights written by
`transformers`' own `Gemma3ForCausalLM`, stored in fp32 and loaded in bf16 (the hard case for a
loader: the file holds twice the loaded bytes). Each measurement runs in a fresh process, one at a
time, and reads the process's own `VmHWM` (peak) and `VmRSS` (now) from /proc:
- `import`: python + torch + fms_paged imported (the baseline every figure is measured over);
- `ours-packed`: `get_model(..., dtype=bfloat16)`, then the workload through an `Engine`, with the
  prefill GEMMs through oneDNN on a packed copy of each weight (`FMS_PAGED_GEMM=packed`);
- `ours-own`: the same with the project's GEMM kernel on the plain weights the GEMV reads
  (`FMS_PAGED_GEMM=own`, the default on x86 CPUs with AVX-512 and no AMX): each weight held once.
  What the packed copies buy in speed is timed inside the `ours-packed` processes, both GEMMs
  alternating on the same weights (`fms_paged.native.configure` after switching `gemm.GEMM`), so
  that both share the machine's state (a shared 2-core VM's noise between processes is larger
  than the difference);
- `llama.cpp`: llama-cpp-python (`make peer-llamacpp`) on the checkpoint converted to a bf16 GGUF
  by llama.cpp's own convert_hf_to_gguf.py (a synthetic sentencepiece tokenizer of the checkpoint's
  vocabulary size: it has none, and the converter needs one), the same requests one after another.
The two `ours` runs alternate (ABAB). The RoPE tables grow with the positions the steps read
(`RotaryEmbedding.ensure`): none at load.

The workload: a prefill phase (prompts of 32, 300, 900 and 2,000 tokens, one new token each) and a
decode phase (four prompts of 16 tokens, 64 new tokens each), greedy; KV room for 4,096 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFILL_LENS = (32, 300, 900, 2000)
DECODE = (4, 16, 64)  # requests, prompt tokens, new tokens
CTX = 4096
SPEED_REPEATS, SPEED_NEW = 3, 32  # packed against own GEMM: rounds, and new tokens of the decode phase
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                   max_position_embeddings=32768)


def proc_status() -> dict[str, int]:
    """This process's VmHWM / VmRSS / RssAnon / RssFile in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def make_checkpoint(path: Path) -> Path:
    """The Gemma 3 270M-shaped fp32 checkpoint at `path` (written once, random weights)."""
    if (path / "model.safetensors").is_file():
        return path
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    with torch.no_grad():
        model = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3_270M)).float()
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prefill phase's prompts and the decode phase's (deterministic token ids)."""
    pre = [[(7 * i + 13 * n) % (vocab - 10) + 5 for i in range(n)] for n in PREFILL_LENS]
    dec = [[(11 * i + 3 * r) % (vocab - 10) + 5 for i in range(DECODE[1])] for r in range(DECODE[0])]
    return pre, dec


# ---------------------------------------------------------------------------------- ours (child)


def ours(ckpt: Path, packed: bool) -> dict:
    base = proc_status()
    import torch

    from fms_paged import Engine, SamplingParams, get_model
    from fms_paged.kv.paged import model_groups
    from fms_paged.modules.linear import packed_copy
    from fms_paged.native import gemm

    gemm.GEMM = "packed" if packed else "own"  # (before the operators load and take their rules)
    imported = proc_status()
    t0 = time.perf_counter()
    model = get_model(model_path=ckpt, attn_impl="paged", device="cpu", dtype=torch.bfloat16, progress=False)
    load_s = time.perf_counter() - t0
    loaded = proc_status()
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.nbytes for p in params)
    buffers = sum(b.nbytes for b in model.buffers())
    page = model.config.page_size
    # the fewest pages that hold one request of CTX tokens (the null page and, with layer groups, each
    # group's own pages included)
    num_pages = model_groups(model).min_pool_pages(CTX, page, 512)
    eng = Engine(model, max_num_seqs=4, max_num_batched_tokens=512, num_pages=num_pages,
                 max_model_len=CTX, enable_prefix_caching=False, compile=False)
    pre, dec = prompts(model.config.src_vocab_size)

    def run(batch: list[list[int]], new: int) -> float:
        t = time.perf_counter()
        for p in batch:
            eng.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t

    prefill_s = run(pre, 1)
    decode_s = run(dec, DECODE[2])
    packed_bytes = sum(c.numel() * c.element_size() for p in params if (c := packed_copy(p)) is not None)
    buffers_end = sum(b.nbytes for b in model.buffers())  # the RoPE tables the workload grew
    end = proc_status()
    out = {"import": imported, "base": base, "loaded": loaded, "end": end, "weights": weights,
           "buffers": buffers, "buffers_end": buffers_end, "packed_bytes": packed_bytes, "load_s": load_s,
           "prefill_s": prefill_s,
           "decode_s": decode_s, "kv_tokens": num_pages * page}
    if packed:  # the speed the packed copies buy: both GEMMs in this process, alternating (ABAB)
        from fms_paged import native

        times: dict[str, dict[str, list[float]]] = {m: {"prefill": [], "decode": []}
                                                    for m in ("packed", "own")}
        for rep in range(SPEED_REPEATS + 1):  # (the first round warms both up: not counted)
            for mode in ("packed", "own"):
                gemm.GEMM = mode
                native.configure()
                p, d = run(pre[2:3], 1), run(dec, SPEED_NEW)
                if rep:
                    times[mode]["prefill"].append(p)
                    times[mode]["decode"].append(d)
        out["speed"] = times
    return out


def baseline() -> dict:
    import torch  # noqa: F401

    import fms_paged  # noqa: F401

    return {"import": proc_status()}


# ----------------------------------------------------------------------------- llama.cpp (child)


def llamacpp(gguf: Path) -> dict:
    base = proc_status()
    import llama_cpp

    imported = proc_status()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=CTX, n_batch=512, n_threads=os.cpu_count(),
                          verbose=False)
    load_s = time.perf_counter() - t0
    loaded = proc_status()
    vocab = llm.n_vocab()
    pre, dec = prompts(vocab)

    def run(batch: list[list[int]], new: int) -> float:
        t = time.perf_counter()
        for p in batch:
            llm.reset()
            llm.create_completion(prompt=p, max_tokens=new, temperature=0.0)
        return time.perf_counter() - t

    prefill_s = run(pre, 1)
    decode_s = run(dec, DECODE[2])
    return {"import": imported, "base": base, "loaded": loaded, "end": proc_status(), "load_s": load_s,
            "prefill_s": prefill_s, "decode_s": decode_s}


def convert_gguf(ckpt: Path, out: Path, python: Path) -> Path:
    """`ckpt` as a bf16 GGUF at `out`, by llama.cpp's converter in the peer's venv."""
    if out.is_file():
        return out
    src = out.parent / (ckpt.name + "-tok")
    src.mkdir(exist_ok=True)
    for p in ckpt.iterdir():
        if not (src / p.name).exists():
            (src / p.name).symlink_to(p.resolve())
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    tok = [str(python), "-m", "benchmarks.load_memory", "--sp-tokenizer", str(src / "tokenizer.model"),
           str(vocab)]
    subprocess.run(tok, check=True, cwd=ROOT)
    conv = subprocess.run([str(python), "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           "import peer_llamacpp as p; print(p.converter())", str(ROOT / "scripts")],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([str(python), conv, str(src), "--outfile", str(out), "--outtype", "bf16"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def sentencepiece_tokenizer(path: Path, vocab: int) -> None:
    """A sentencepiece model of exactly `vocab` pieces (control, byte fallback, then made-up
    pieces): what convert_hf_to_gguf.py needs to write a Gemma 3 GGUF; its text is never used."""
    from sentencepiece import sentencepiece_model_pb2 as sp

    m = sp.ModelProto()
    m.trainer_spec.model_type = sp.TrainerSpec.BPE
    m.trainer_spec.vocab_size = vocab
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.eos_id, m.trainer_spec.bos_id, m.trainer_spec.pad_id = 0, 1, 2, 3
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    kind = sp.ModelProto.SentencePiece
    for piece, t in (("<unk>", kind.UNKNOWN), ("<eos>", kind.CONTROL), ("<bos>", kind.CONTROL),
                     ("<pad>", kind.CONTROL)):
        m.pieces.add(piece=piece, type=t)
    for b in range(256):
        m.pieces.add(piece=f"<0x{b:02X}>", type=kind.BYTE)
    while len(m.pieces) < vocab:
        m.pieces.add(piece=f"\u2581t{len(m.pieces)}", type=kind.NORMAL, score=-float(len(m.pieces)))
    path.write_bytes(m.SerializeToString())


# ------------------------------------------------------------------------------------- parent


def child(python: Path, mode: str, arg: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [str(python), "-m", "benchmarks.load_memory", "--child", mode, arg, f.name]
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
        return json.loads(Path(f.name).read_text())


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def report(runs: dict[str, list[dict]], out: Path) -> str:
    base = statistics.median(r["import"]["VmHWM"] for r in runs["import"])
    ours = runs["ours-packed"][0]
    weights = ours["weights"]
    lines = [
        f"Gemma 3 270M shape, fp32 checkpoint loaded in bf16 ({mib(weights)} MiB of bf16 weights, "
        f"{mib(ours['buffers'])} MiB of RoPE tables at load, {mib(ours.get('buffers_end', 0))} after the "
        "workload); baseline (python + torch + fms_paged imported) "
        f"{mib(base)} MiB. Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs.",
        "",
        "| run | peak RSS at load (MiB) | over baseline / weights | steady RSS after workload (MiB) | "
        "peak RSS (MiB) | packed copies (MiB) | load s | prefill s | decode s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ("ours-packed", "ours-own", "llama.cpp"):
        if not runs.get(name):
            continue
        def med(f, rs=runs[name]):
            return statistics.median(f(r) for r in rs)

        peak_load = med(lambda r: r["loaded"]["VmHWM"])
        over = (peak_load - base) / weights
        lines.append(
            f"| {name} | {mib(peak_load)} | {over:.2f} | {mib(med(lambda r: r['end']['VmRSS']))} | "
            f"{mib(med(lambda r: r['end']['VmHWM']))} | "
            f"{mib(med(lambda r: r.get('packed_bytes', 0)))} | {med(lambda r: r['load_s']):.2f} | "
            f"{med(lambda r: r['prefill_s']):.2f} | {med(lambda r: r['decode_s']):.2f} |")
    speed = [r["speed"] for r in runs["ours-packed"] if "speed" in r]
    if speed:
        lines.append("\nSpeed of the packed copies (in the `ours-packed` processes, oneDNN packed and "
                     "own GEMM alternating, "
                     f"{len(speed[0]['packed']['prefill'])} rounds each; a {PREFILL_LENS[2]}-token prefill, "
                     f"then {DECODE[0]} x {SPEED_NEW} decode steps), median seconds:")
        lines.append("\n| phase | packed | own | own / packed |\n| --- | ---: | ---: | ---: |")
        for phase in ("prefill", "decode"):
            a = statistics.median(t for s in speed for t in s["packed"][phase])
            b = statistics.median(t for s in speed for t in s["own"][phase])
            lines.append(f"| {phase} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    if runs.get("llama.cpp"):
        lc = statistics.median(r["end"]["VmRSS"] for r in runs["llama.cpp"])
        for name in ("ours-packed", "ours-own"):
            ratio = statistics.median(r["end"]["VmRSS"] for r in runs[name]) / lc
            lines.append(f"\n{name} steady RSS / llama.cpp's: {ratio:.2f}")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_memory.json").write_text(json.dumps(runs, indent=1))
    (out / "load_memory.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "fms_paged_load_memory",
                    help="where the checkpoint and its GGUF are written (kept for the next run)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "load_memory")
    ap.add_argument("--llamacpp-python", type=Path, default=ROOT / ".venv-llamacpp" / "bin" / "python",
                    help="the python of `make peer-llamacpp`'s venv")
    ap.add_argument("--repeats", type=int, default=2, help="ABAB pairs of the two `ours` runs")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--sp-tokenizer", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sp_tokenizer:
        return sentencepiece_tokenizer(Path(args.sp_tokenizer[0]), int(args.sp_tokenizer[1]))
    if args.child:
        mode, arg, dst = args.child
        fn = {"import": lambda: baseline(), "ours-packed": lambda: ours(Path(arg), True),
              "ours-own": lambda: ours(Path(arg), False), "llama.cpp": lambda: llamacpp(Path(arg))}[mode]
        Path(dst).write_text(json.dumps(fn()))
        return None
    args.dir.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(args.dir / "gemma3-270m-fp32")
    runs: dict[str, list[dict]] = {"import": [], "ours-packed": [], "ours-own": [], "llama.cpp": []}
    for _ in range(args.repeats):
        runs["import"].append(child(Path(sys.executable), "import", ""))
        for mode in ("ours-packed", "ours-own"):
            runs[mode].append(child(Path(sys.executable), mode, str(ckpt)))
    if args.llamacpp_python.is_file():
        gguf = convert_gguf(ckpt, args.dir / "gemma3-270m-bf16.gguf", args.llamacpp_python)
        runs["llama.cpp"] = [child(args.llamacpp_python, "llama.cpp", str(gguf)) for _ in range(args.repeats)]
    else:
        print(f"no {args.llamacpp_python} (make peer-llamacpp): llama.cpp left out", file=sys.stderr)
    print(report(runs, args.out))
    return None


if __name__ == "__main__":
    main()
