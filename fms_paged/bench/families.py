"""`make bench-families`: `make bench-llama-paged`'s memory figures per family, on each family's
random-weight `micro` preset (3 layers; a 256-token window on the sliding layers of Mistral, Qwen2/3,
Gemma 2/3): the KV the paged and the dense cache hold against the KV the next token needs (every
token's on a full layer, the window's on a sliding one), for 16 sequences up to 4x the window (the
`mixed` scenario's sweep, from 1/16 of the length to it), in all and per layer group (a table and
kv_by_group.png). One `fms-paged bench` run per family
(its own report under <out>/<family>), then one table of them all (<out>/results.md, .json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fms_paged.bench import cli
from fms_paged.bench.report import MiB, plot, table
from fms_paged.models.families import FAMILIES

WINDOW = 256  # the micro presets' sliding window
LENGTH = 4 * WINDOW


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-families", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench-families")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    p.add_argument("--device", default="auto")
    args, rest = p.parse_known_args(argv)
    rows = []
    for family in args.families.split(","):
        out = Path(args.out) / family
        # scale: the sweep's longest length (8000 x scale) is 4x the window
        cli.main(["--architecture", family, "--variant", "micro", "--scenario", "mixed", "--attn-impl",
                  "sdpa,paged", "--no-ppl", "--no-memory", "--scale", str(LENGTH / 8000), "--new-tokens", "8",
                  "--device", args.device, "--out", str(out), *rest])
        res = json.loads((out / "results.json").read_text())
        by = {r["attn_impl"]: r for r in res["runs"] if r["length"] == max(x["length"] for x in res["runs"])}
        cfg = res["model"]["config"]
        types = cfg["layer_types"] or (["sliding_attention"] * cfg["nlayers"] if cfg["sliding_window"]
                                       else ["full_attention"] * cfg["nlayers"])
        dense, paged = by["sdpa"]["kv"], by["paged"]["kv"]
        rows.append({
            "family": family, "sliding layers": f"{types.count('sliding_attention')}/{len(types)}",
            "length": by["paged"]["length"], "needed": dense["kv_bytes_needed"] / MiB,
            "paged": paged["kv_bytes_held"] / MiB, "dense": dense["kv_bytes_held"] / MiB,
            "paged / needed": paged["kv_bytes_held"] / dense["kv_bytes_needed"],
            "dense / needed": dense["kv_bytes_held"] / dense["kv_bytes_needed"],
            "same tokens": all(c["outputs_match"] for c in res["compare"]),
            "device": res["environment"]["device_name"],
            "groups": paged.get("by_group", []),
        })
    cols = [("family", "family", ""), ("sliding layers", "sliding layers", ""), ("longest", "length", "d"),
            ("KV needed MiB", "needed", ".2f"), ("paged held MiB", "paged", ".2f"),
            ("dense held MiB", "dense", ".2f"), ("paged / needed", "paged / needed", ".2f"),
            ("dense / needed", "dense / needed", ".2f"), ("same tokens", "same tokens", "")]
    groups = [{"family": r["family"], "group": "full" if g["window"] is None else f"window {g['window']}",
               "layers": g["layers"], "needed": g["kv_bytes_needed"] / MiB, "held": g["kv_bytes_held"] / MiB,
               "ratio": g["held_over_needed"]} for r in rows for g in r["groups"]]
    md = (f"## KV held against KV needed, 16 sequences up to {LENGTH} tokens (4x the {WINDOW}-token window), "
          f"{rows[0]['device'] if rows else ''}\n\n" + table(rows, cols)
          + "\n\n### Per layer group (paged)\n\n"
          + table(groups, [("family", "family", ""), ("group", "group", ""), ("layers", "layers", "d"),
                           ("KV needed MiB", "needed", ".3f"), ("KV held MiB", "held", ".3f"),
                           ("held / needed", "ratio", ".3f")]) + "\n")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    plot(Path(args.out) / "kv_by_group.png", [{
        "title": f"KV per layer group, 16 sequences up to {LENGTH} tokens", "xlabel": "family / group",
        "ylabel": "MiB", "series": [
            {"label": "needed", "x": [f"{g['family']}\n{g['group']}" for g in groups],
             "y": [g["needed"] for g in groups], "fmt": "s"},
            {"label": "held (paged)", "x": [f"{g['family']}\n{g['group']}" for g in groups],
             "y": [g["held"] for g in groups], "fmt": "o"}]}])
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=2))
    (Path(args.out) / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
