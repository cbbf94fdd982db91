"""`make bench-structured`: what grammar masks cost the engine's step. 16 requests decode at once
(`max_num_seqs` 16), all free-form (`ignore_eos`) or all held to a JSON schema (xgrammar bitmasks
filled in the runner's masker thread while the forward runs, applied to the logits before
sampling), the same prompts, seeds and token budget; the schema's shortest document is longer than
the budget, so both kinds decode every step of it. Rounds alternate free, JSON, free, JSON ...
in one process on one warmed-up engine. Per round: the median wall time of the steps where all 16
decode (the prefill step and the last one left out); per JSON round also the bitmask fill time per
step (in the masker's thread) and the time the step waited for it after the forward (the part the
forward did not hide). The figure: median JSON step / median free step over the pairs of rounds.

Models: the embedded default model (its 4096-token sentencepiece vocabulary; its forward is so
small that the masks weigh the most they can) and, with `--synthetic`, a random-weight LLaMA of
`--hidden-size` / `--layers` with a byte-level BPE tokenizer of `--vocab-size` tokens trained here
on the Python standard library's sources (xgrammar's work per token grows with the vocabulary).
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fms_paged.bench.environment import environment_info
from fms_paged.bench.report import table, write_report
from fms_paged.engine import Engine, SamplingParams
from fms_paged.engine.structured import Grammar
from fms_paged.models import default_model_path, get_model
from fms_paged.tokenizers import load_tokenizer

# an array of records, at least ROWS of them: no document of it ends within the token budget
ROWS = 64
SCHEMA = {
    "type": "object",
    "properties": {"rows": {"type": "array", "minItems": ROWS, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999999},
                       "name": {"type": "string", "maxLength": 16},
                       "kind": {"type": "string", "enum": ["user", "group", "bot"]},
                       "ok": {"type": "boolean"}},
        "required": ["id", "name", "kind", "ok"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False,
}


def synthetic_checkpoint(d: Path, vocab_size: int, hidden_size: int, layers: int, seed: int) -> Path:
    """A random-weight HF LLaMA with a BPE tokenizer trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in files], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    heads = max(1, hidden_size // 64)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden_size, num_hidden_layers=layers,
                      intermediate_size=hidden_size * 8 // 3 // 64 * 64, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 4), max_position_embeddings=4096,
                      bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
                      torch_dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "unk_token": "<unk>",
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


def run_round(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    """One batch to the end -> its full-batch decode step times and the masker's seconds."""
    runner = eng.runner
    fill0, wait0 = runner.mask_fill_s, runner.mask_wait_s
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    times, finished = [], 0
    while eng.has_unfinished():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        done = sum(o.finished for o in outs)
        if finished == 0 and done == 0 and all(o.new_token_ids for o in outs) and len(outs) == len(prompts):
            times.append(dt)  # every request decoded a token and none ended
        finished += done
    steps = times[1:]  # the first: the prompts' prefill
    return {"step_ms": 1000 * statistics.median(steps), "steps": len(steps),
            "fill_ms_per_step": 1000 * (runner.mask_fill_s - fill0) / max(1, len(times) + 1),
            "wait_ms_per_step": 1000 * (runner.mask_wait_s - wait0) / max(1, len(times) + 1)}


def bench_model(name: str, model_dir: Path, args) -> dict[str, Any]:
    tok = load_tokenizer(model_dir)
    model = get_model(model_path=model_dir, attn_impl="paged", dtype=args.dtype)
    eng = Engine(model, args.batch, max(1024, args.batch * args.prompt_len), compile=args.compile,
                 tokenizer=tok, enable_prefix_caching=False)
    warmup_s = eng.warmup(progress=False)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, tok.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.batch)]
    grammar = Grammar.json_schema(SCHEMA)
    kinds = {
        "free": [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=i, ignore_eos=True)
                 for i in range(args.batch)],
        "json": [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=i, grammar=grammar)
                 for i in range(args.batch)],
    }
    run_round(eng, prompts[:2], kinds["json"][:2])  # compiles the schema, starts the masker thread
    rounds = []
    for r in range(args.rounds):
        for kind in ("free", "json"):
            rounds.append({"round": r, "kind": kind, **run_round(eng, prompts, kinds[kind])})
            print(f"[bench-structured] {name} round {r} {kind}: {rounds[-1]['step_ms']:.2f} ms/step",
                  flush=True)
    pairs = [(a, b) for a, b in zip(rounds[::2], rounds[1::2])]
    ratios = [b["step_ms"] / a["step_ms"] for a, b in pairs]
    jsons = [b for _, b in pairs]
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    return {"model": name, "vocab_size": tok.vocab_size, "params_m": params_m, "warmup_s": warmup_s,
            "rounds": rounds,
            "free_step_ms": statistics.median(a["step_ms"] for a, _ in pairs),
            "json_step_ms": statistics.median(b["step_ms"] for b in jsons),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "fill_ms_per_step": statistics.median(b["fill_ms_per_step"] for b in jsons),
            "wait_ms_per_step": statistics.median(b["wait_ms_per_step"] for b in jsons)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/bench-structured"))
    p.add_argument("--model-dir", type=Path, default=None, help="a checkpoint (default: the embedded model)")
    p.add_argument("--synthetic", action="store_true", help="also a random-weight model of the sizes below")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--compile", default="auto", help="the engine's compile setting (auto | true | false)")
    p.add_argument("--batch", type=int, default=16, help="requests decoding at once")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="pairs of rounds (free, JSON)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.compile = {"true": True, "false": False}.get(args.compile, args.compile)
    torch.manual_seed(args.seed)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results: dict[str, Any] = {"config": config,
                               "environment": environment_info(torch.device("cpu")), "models": []}
    results["models"].append(bench_model("embedded" if args.model_dir is None else args.model_dir.name,
                                         args.model_dir or default_model_path(), args))
    if args.synthetic:
        with tempfile.TemporaryDirectory() as tmp:
            d = synthetic_checkpoint(Path(tmp), args.vocab_size, args.hidden_size, args.layers, args.seed)
            results["models"].append(bench_model(f"synthetic {args.hidden_size}x{args.layers}", d, args))
    env = results["environment"]
    cols = [("model", "model", ""), ("vocab", "vocab_size", "d"), ("params (M)", "params_m", ".0f"),
            ("free ms/step", "free_step_ms", ".2f"), ("JSON ms/step", "json_step_ms", ".2f"),
            ("JSON / free", "ratio", ".3f"), ("mask fill ms/step", "fill_ms_per_step", ".2f"),
            ("waited ms/step", "wait_ms_per_step", ".2f")]
    md = (f"## Grammar masks: {args.batch} requests decoding at once, JSON schema vs free-form, "
          f"{args.dtype}, {env.get('cpu_model') or env.get('device_name')}\n\n"
          + table(results["models"], cols) + "\n")
    rows = {m["model"]: {k: v for k, v in m.items() if isinstance(v, (int, float))}
            for m in results["models"]}
    figures = {"step_times.png": [{"title": "decode step, 16 requests", "xlabel": "round", "ylabel": "ms",
                                   "series": [{"label": f"{m['model']} {kind}",
                                               "x": [r["round"] for r in m["rounds"] if r["kind"] == kind],
                                               "y": [r["step_ms"] for r in m["rounds"] if r["kind"] == kind]}
                                              for m in results["models"] for kind in ("free", "json")]}]}
    write_report(args.out, results, markdown=md, rows=rows, figures=figures)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
