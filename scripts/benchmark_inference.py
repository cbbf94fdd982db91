#!/usr/bin/env python
"""Latency, peak memory and perplexity against the sequence length, for no cache, the dense cache and
the paged cache on the same weights (`fms-paged bench`; options: --help, or fms_paged/bench/cli.py).

python scripts/benchmark_inference.py --attn-impl all --out results/bench-llama-paged
"""

from fms_paged.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
