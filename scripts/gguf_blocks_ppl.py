"""Perplexity of GGUF models held as blocks (Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K) on the qgemv kernel
against the same file dequantized (`gguf_blocks=False`: the exact weights, 32-bit activations), on
real text: the Python standard library's held-out source (`fms_paged.data.heldout_text`), windows of
256 tokens, the paged model (the one-call C++ forward) in fp32. Two paths of the kernel: "decode",
the windows fed in chunks of `--decode-chunk` tokens (3: calls of fewer than qgemv.cpp's TILE_ROWS =
4 rows take int8 activations, llama.cpp's scheme), and "prefill", each window in one chunk (bf16
tiles where the CPU has AVX512_BF16).
docs/benchmarks.md, "Quantized GGUF kernels": the issue's bound is 0.5%.

    python scripts/gguf_blocks_ppl.py FILE.gguf [FILE.gguf ...] [--chars 20000]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fms_paged import get_model
from fms_paged.bench.perplexity import perplexity
from fms_paged.data import heldout_text
from fms_paged.tokenizers import load_tokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--chars", type=int, default=20_000)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--decode-chunk", type=int, default=3, help="tokens a call on the decode path")
    args = ap.parse_args()
    out = {}
    for f in args.files:
        ids = load_tokenizer(f).encode(heldout_text(max_chars=args.chars))
        row = {"tokens": len(ids)}
        paths = (("dequantized", False, None), ("decode", True, args.decode_chunk), ("prefill", True, None))
        for name, blocks, chunk in paths:
            model = get_model(model_path=f, device="cpu", dtype=torch.float32, attn_impl="paged",
                              gguf_blocks=blocks)
            row[name] = perplexity(model, ids, window=args.window, chunk=chunk)["ppl"]
            del model
        for name in ("decode", "prefill"):
            row[f"{name}_rel"] = row[name] / row["dequantized"] - 1
        out[f] = row
        print(f, json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
