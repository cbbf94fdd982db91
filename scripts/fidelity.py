#!/usr/bin/env python
"""Half-precision fidelity (`make bench-fidelity`): bf16 / fp16 runs of the default model (ours paged,
ours dense, HF sdpa, HF eager) against the fp32 reference, teacher-forced over the stdlib docs; see
fms_paged/bench/fidelity.py. Writes <out>/fidelity.json and <out>/fidelity.md and prints the table;
progress goes to stderr.

python scripts/fidelity.py --out results/bench-fidelity [--dtypes bfloat16,float16] [--chars 20000]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fms_paged.bench.fidelity import HALF_DTYPES, fidelity, write


def dtype_list(value: str) -> list[str]:
    """"bfloat16,float16" -> ["bfloat16", "float16"]; an argparse error names what is wrong."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in HALF_DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--dtypes takes a comma list of {HALF_DTYPES}, got {value!r}")
    return names


def positive(value: str) -> int:
    """A positive int for argparse."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", type=dtype_list, default=list(HALF_DTYPES),
                   help="comma list of half-precision dtypes to measure (default: bfloat16,float16)")
    p.add_argument("--chars", type=positive, default=20_000,
                   help="characters of the docs text (default 20000)")
    p.add_argument("--window", type=positive, default=256,
                   help="tokens per window, BOS included (default 256)")
    p.add_argument("--chunk", type=positive, default=32,
                   help="prefill chunk of our cached systems, in tokens (default 32)")
    p.add_argument("--out", type=Path, default=Path("results/bench-fidelity"), help="output directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    results = fidelity(args.chars, args.window, args.dtypes, args.chunk, log=log)
    paths = write(args.out, results)
    print(paths["md"].read_text())
    log(f"fidelity: wrote {paths['json']} and {paths['md']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
