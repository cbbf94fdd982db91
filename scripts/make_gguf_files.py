#!/usr/bin/env python
"""GGUF files of a model shape with seeded random weights, made by llama.cpp's own tools, for
`python -m benchmarks.gguf_blocks` (no download: the weights are written here).

    python scripts/make_gguf_files.py --shape tinyllama-1.1b --types q4_0,q8_0,q4_k_m --out DIR

The checkpoint is written by `save_hf_llama` (bf16), converted by llama.cpp's convert_hf_to_gguf.py
(`scripts/peer_llamacpp.py`'s converter, with its synthetic tokenizer where the checkpoint has none)
and quantized by `llama_model_quantize` from the `make peer-llamacpp` venv, as the issue's
benchmark asks (the project's interpreter runs this script; llama.cpp's steps run in that venv).
Writes DIR/<shape>-<type>.gguf for each type; the bf16 GGUF stays in peer_llamacpp's cache.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import REPO_ROOT
from fms_paged.bench.tp import SMOLLM2_135M
from fms_paged.models.hf import save_hf_llama
from fms_paged.models.llama import LLaMA, LLaMAConfig

# shapes of public checkpoints (LLaMAConfig fields)
SHAPES = {
    "smollm2-135m": SMOLLM2_135M,
    # TinyLlama-1.1B: 1.10B parameters, 22 layers of 2048, 32 heads / 4 KV heads, a 32k vocabulary
    "tinyllama-1.1b": dict(src_vocab_size=32000, emb_dim=2048, nheads=32, kvheads=4, nlayers=22,
                           hidden_grow_factor=5632 / 2048, multiple_of=1, rope_theta=10000.0,
                           max_expected_seq_len=2048, tie_heads=False),
}
LLAMACPP_PY = REPO_ROOT / ".venv-llamacpp" / "bin" / "python"
QUANTIZE = """
import ctypes, sys, llama_cpp
src, dst, name = sys.argv[1:]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + name.upper())
assert llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)) == 0, name
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    ap.add_argument("--types", default="q4_0,q8_0,q4_k_m", help="llama.cpp ftypes, comma-separated")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not LLAMACPP_PY.is_file():
        sys.exit(f"{LLAMACPP_PY} is missing: run `make peer-llamacpp` first")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        ckpt = Path(tmp) / "hf"
        torch.manual_seed(args.seed)
        model = LLaMA(LLaMAConfig(**SHAPES[args.shape]))
        model.reset_parameters()
        save_hf_llama(model.to(torch.bfloat16), ckpt)
        del model
        find = ("import sys; sys.path.insert(0, sys.argv[1]); from scripts.peer_llamacpp import gguf_for; "
                "print(gguf_for(__import__('pathlib').Path(sys.argv[2]), 'bfloat16')[0])")
        bf16 = subprocess.run([str(LLAMACPP_PY), "-c", find, str(REPO_ROOT), str(ckpt)], check=True,
                              capture_output=True, text=True).stdout.strip().splitlines()[-1]
        for name in args.types.split(","):
            dst = args.out / f"{args.shape}-{name}.gguf"
            subprocess.run([str(LLAMACPP_PY), "-c", QUANTIZE, bf16, str(dst), name], check=True)
            print(dst, f"{dst.stat().st_size / 2**20:.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
