#!/usr/bin/env python
"""Perplexity with the KV cache through the dense and paged backends, next to the no-cache reference.

python scripts/perplexity.py --out results/bench-ppl [--variant micro] [--text-file PATH]
    [--dataset wikitext --dataset-config wikitext-103-raw-v1 --split validation]
"""

from fms_paged.bench.cli import ppl_main

if __name__ == "__main__":
    raise SystemExit(ppl_main())
