#!/usr/bin/env python
"""Latency, peak memory and perplexity of the dense and paged backends (see fms_paged/bench/cli.py).

python scripts/benchmark_inference.py --attn-impl both --scenario all --out results/bench-compare
"""

from fms_paged.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
