"""Quantize on load, measured (docs/benchmarks.md, "Quantized weights"): one request's decode speed
(prompt 64, 64 new tokens, greedy, on the engine with default settings) with int8 / int4 weights
against the model's bf16 weights, on the default model and a SmolLM2-135M-shaped random model, in
one process, the variants alternated (A B C A B C ...) so that drift in the machine weighs on each
alike; and each variant's weight bytes. `python -m benchmarks.quantized_decode [--rounds 4]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fms_paged import Engine, SamplingParams, get_model
from fms_paged.bench.environment import environment_info, weight_bytes
from fms_paged.bench.tp import SMOLLM2_135M
from fms_paged.models.llama import LLaMA, LLaMAConfig
from fms_paged.modules.quantized import quantize_model

PROMPT, NEW = 64, 64
# the int4 group per model: SmolLM2's width 576 is 9 * 64 (128 does not divide it)
INT4_GROUP = {"default": 128, "smollm2": 64}


def build(which: str, scheme: str | None) -> torch.nn.Module:
    if which == "default":
        return get_model(attn_impl="paged", device="cpu", dtype=torch.bfloat16, quantization=scheme,
                         quantization_group_size=INT4_GROUP[which])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LLaMA(LLaMAConfig(**SMOLLM2_135M, attn_impl="paged", page_size=64)).to(torch.bfloat16)
        model.reset_parameters()
    return quantize_model(model.eval().requires_grad_(False), scheme, INT4_GROUP[which])


def decode_tok_s(eng: Engine, prompt: list[int]) -> float:
    """One request: decode tokens per second after its first token."""
    eng.add_request(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    first = None
    for _ in eng.stream():
        first = first or time.perf_counter()
    return (NEW - 1) / (time.perf_counter() - first)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--models", default="default,smollm2")
    args = p.parse_args(argv)
    out = {"environment": environment_info(torch.device("cpu")), "models": {}}
    for which in args.models.split(","):
        engines, info = {}, {}
        for scheme in (None, "int8", "int4"):
            model = build(which, scheme)
            name = scheme or "bf16"
            engines[name] = Engine(model, max_num_seqs=1, max_num_batched_tokens=256,
                                   max_model_len=PROMPT + NEW, enable_prefix_caching=False)
            info[name] = {"weight_bytes": weight_bytes(model),
                          "one_call_forward": model.decoder_stack() is not None}
        vocab = engines["bf16"].model.config.src_vocab_size
        prompt = torch.randint(3, vocab, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
        for eng in engines.values():  # warm-up (kernel loads, first-step costs)
            decode_tok_s(eng, prompt)
        rates: dict[str, list[float]] = {n: [] for n in engines}
        for _ in range(args.rounds):
            for name, eng in engines.items():
                rates[name].append(decode_tok_s(eng, prompt))
        for name in engines:
            info[name]["decode_tok_s"] = statistics.median(rates[name])
            info[name]["best_tok_s"] = max(rates[name])  # the least disturbed run (a shared machine)
            info[name]["runs"] = [round(r, 1) for r in rates[name]]
        out["models"][which] = info
        print(which, json.dumps(info, indent=1), flush=True)
    print(json.dumps(out["environment"].get("cpu_model", "")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
