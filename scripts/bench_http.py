#!/usr/bin/env python
"""`fms-paged serve` against vLLM's OpenAI server (when `make peer-vllm` made .venv-vllm), both
measured by vLLM's own benchmark client, and against the engine in-process (`make bench-http`;
options: --help, or fms_paged/bench/http.py).

python scripts/bench_http.py --out results/bench-http
"""

from fms_paged.bench.http import main

if __name__ == "__main__":
    raise SystemExit(main())
