"""Benchmarks: latency, memory, perplexity, peers, reporting (`python scripts/benchmark_inference.py`)."""
