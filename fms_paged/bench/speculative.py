"""`make bench-spec`: speculative decoding by prompt lookup against plain decoding, one stream on
the engine (the default model unless --model-path), output tokens per second of each workload with
speculation off (the engine's defaults, whose greedy requests take lookahead decode steps; a
token a step, decode_steps=1; and, for prompt lookup, lookahead calls as long as speculation's may
be, what those alone give) and on, measured alternately in the same process (median of --repeats
runs each), with the acceptance rate and the mean accepted proposals per verify.

Workloads (greedy unless said):
- "copy": a passage of code twice, then its first line (input-grounded, as quoting or
  refactoring). The default model is tiny (4 layers of 256) and does not copy: its output reuses
  the passage's n-grams now and then.
- "repeat": a seed line, the model's own greedy continuation of it (256 tokens), a blank line
  and the seed again: the prompt holds the text that the output repeats with edits (a model that
  copies would give this on "copy").
- "free greedy" / "free sampled": a short prompt and free generation (greedy; sampled at
  temperature 0.8, seeded), where prompt lookup finds only what the model itself repeats: what
  speculation costs there, or gains where the model repeats itself (the default model's greedy
  text loops).
Each figure: output tokens per second from the fastest of the runs (the run least disturbed by
other processes on a shared machine) and from their median; and the speed-up in process CPU
seconds (with --threads 1, what a loaded machine's time slicing does not inflate).
--draft: the "draft_model" method instead of prompt lookup, with the draft "self" (the target
proposing for itself: every proposal accepted, what the mechanism costs when the draft costs as
much as the target), "layers:N" (the target's first N layers with its embedding, final norm and
head: a layer-skip draft of no training) or a checkpoint path of the same tokenizer (`make
bench-spec-draft`: the draft `scripts/make_default_model.py --draft` trains for the default model);
each row then also gives what one proposal of k tokens cost the draft (`DraftModel.seconds` per
request proposed for) against the target's time per token without speculation.
Writes <out>/results.json and <out>/results.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from fms_paged import Engine, SamplingParams, generate, get_model, load_tokenizer
from fms_paged.bench.environment import environment_info
from fms_paged.bench.report import table
from fms_paged.engine.engine import AUTO_DECODE_STEPS
from fms_paged.models import default_model_path

PASSAGE = '''def parse_header(line):
    """Split a header line into its name and value."""
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def read_headers(lines):
    """The headers of a message, up to the first blank line."""
    headers = {}
    for line in lines:
        if not line.strip():
            break
        name, value = parse_header(line)
        headers[name] = value
    return headers


def header_value(headers, name, default=None):
    return headers.get(name.lower(), default)
'''
SEED = "class Reader:\n    def __init__(self, path):\n"


def workloads(model, tok) -> dict[str, tuple[list[int], float]]:
    """name -> (prompt ids, temperature)."""
    seed = tok.encode(SEED)
    own = generate(model, [seed], 256, eos_id=None)[0]  # the model's greedy continuation
    return {
        "copy": (tok.encode(PASSAGE + "\n\n" + PASSAGE + "\n\n" + PASSAGE.splitlines()[0] + "\n"), 0.0),
        "repeat": (seed + own + tok.encode("\n\n") + seed, 0.0),
        "free greedy": (tok.encode("import os\n"), 0.0),
        "free sampled": (tok.encode("import os\n"), 0.8),
    }


def run_once(engine: Engine, prompt: list[int], new_tokens: int,
             temperature: float) -> tuple[list[int], float, float]:
    """One request to its end -> (its tokens, wall seconds, process CPU seconds)."""
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=temperature,
                        seed=0 if temperature else None)
    t0, c0 = time.perf_counter(), time.process_time()
    engine.add_request(prompt, sp)
    out: list[int] = []
    for o in engine.stream():
        out += o.new_token_ids
    return out, time.perf_counter() - t0, time.process_time() - c0


def draft_model(which: str, target: torch.nn.Module) -> torch.nn.Module | str:
    """--draft: "self" -> the target; "layers:N" -> a copy of the target keeping its first N layers
    (embedding, final norm and head kept); else a checkpoint path (the engine loads it)."""
    if which == "self":
        return target
    if which.startswith("layers:"):
        n = int(which.split(":", 1)[1])
        if not 1 <= n <= target.config.nlayers:
            raise ValueError(f"--draft {which}; expected layers:N with 1 <= N <= {target.config.nlayers}")
        draft = copy.deepcopy(target)
        draft.layers = draft.layers[:n]
        draft.config = dataclasses.replace(draft.config, nlayers=n)
        return draft
    return which


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench-spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench-spec")
    p.add_argument("--model-path", type=Path, default=None, help="default: the embedded default model")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--num-speculative-tokens", type=int, default=8)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--draft", default=None,
                   help='method draft_model: "self", "layers:N" or a checkpoint path (default: ngram)')
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: CPU seconds that a loaded machine does not inflate; "
                        "0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model_path or default_model_path()
    tok = load_tokenizer(path)
    model = get_model(model_path=path, attn_impl="paged", device="cpu")
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if args.draft is not None:
        spec = {"method": "draft_model", "model": draft_model(args.draft, model),
                "num_speculative_tokens": args.num_speculative_tokens}
    # off: the engine's defaults (greedy requests take lookahead decode steps, `decode_steps="auto"`);
    # "one": a token a step (decode_steps=1); on: speculation, with the same defaults otherwise;
    # "long" (prompt lookup): lookahead calls of as many steps as speculation's calls may hold
    # (`decode_steps="auto"` with prompt lookup: AUTO_DECODE_STEPS forwards' tokens), without it:
    # what the longer calls alone give
    opts = dict(max_num_seqs=1, max_num_batched_tokens=1024, num_pages=256)
    engines = {False: Engine(model, **opts), "one": Engine(model, decode_steps=1, **opts),
               True: Engine(model, speculative=spec, **opts)}
    if args.draft is None:
        engines["long"] = Engine(model, decode_steps=AUTO_DECODE_STEPS * (1 + args.num_speculative_tokens),
                                 **opts)
    rows = []
    for name, (prompt, temperature) in workloads(model, tok).items():
        for eng in engines.values():  # warm: a first run of each
            run_once(eng, prompt, 16, temperature)
        engines[True].forget_totals()
        draft = engines[True].speculator.draft
        d0 = (draft.seconds, draft.asked) if draft is not None else None
        secs: dict = {on: [] for on in engines}
        cpu: dict = {on: [] for on in engines}
        outs: dict = {}
        for _ in range(args.repeats):  # alternately, so that the machine's load hits both alike
            for on, eng in engines.items():
                outs[on], dt, ct = run_once(eng, prompt, args.new_tokens, temperature)
                secs[on].append(dt)
                cpu[on].append(ct)
        m = engines[True].metrics()
        off, on = min(secs[False]), min(secs[True])
        moff, mon = statistics.median(secs[False]), statistics.median(secs[True])
        rows.append({
            "workload": name, "prompt_tokens": len(prompt), "temperature": temperature,
            "off_tok_s": args.new_tokens / off, "on_tok_s": args.new_tokens / on, "speedup": off / on,
            "median_speedup": moff / mon, "cpu_speedup": min(cpu[False]) / min(cpu[True]),
            "one_tok_s": args.new_tokens / min(secs["one"]), "speedup_vs_one": min(secs["one"]) / on,
            **({"long_tok_s": args.new_tokens / min(secs["long"]), "speedup_vs_long": min(secs["long"]) / on}
               if "long" in secs else {}),
            "acceptance_rate": m["spec_acceptance_rate"], "mean_accepted": m["spec_mean_accepted_length"],
            "mean_proposed": m["spec_proposed_tokens"] / m["spec_verifies"] if m["spec_verifies"] else None,
            "verifies_per_token": m["spec_verifies"] / (args.repeats * args.new_tokens),
            "same_tokens": all(o == outs[False] for o in outs.values()) if temperature == 0 else None,
            "sample": tok.decode(outs[True][:60]),
        })
        if draft is not None:  # (host ms: one proposal of k tokens; the target's decode, per token)
            rows[-1]["draft_ms"] = 1e3 * (draft.seconds - d0[0]) / max(1, draft.asked - d0[1])
            rows[-1]["target_ms"] = 1e3 * moff / args.new_tokens
        print(f"{name}: {rows[-1]['off_tok_s']:.0f} -> {rows[-1]['on_tok_s']:.0f} tok/s "
              f"(x{rows[-1]['speedup']:.2f}), acceptance {m['spec_acceptance_rate']}", flush=True)
    env = environment_info(torch.device("cpu"))
    load = os.getloadavg()
    cols = [("workload", "workload", ""), ("prompt tokens", "prompt_tokens", "d"),
            ("temperature", "temperature", ".1f"), ("off tok/s", "off_tok_s", ".0f"),
            ("on tok/s", "on_tok_s", ".0f"), ("speed-up", "speedup", ".2f"),
            ("one-token tok/s", "one_tok_s", ".0f"), ("speed-up vs one-token", "speedup_vs_one", ".2f"),
            ("speed-up (medians)", "median_speedup", ".2f"), ("speed-up (CPU s)", "cpu_speedup", ".2f"),
            ("acceptance rate", "acceptance_rate", ".2f"), ("proposed / verify", "mean_proposed", ".2f"),
            ("accepted / verify", "mean_accepted", ".2f"),
            ("verifies / token", "verifies_per_token", ".2f"), ("same tokens", "same_tokens", "")]
    if args.draft is None:
        cols[8:8] = [("long-call tok/s", "long_tok_s", ".0f"),
                     ("speed-up vs long calls", "speedup_vs_long", ".2f")]
    if args.draft is not None:
        cols[-1:-1] = [("draft ms / proposal", "draft_ms", ".2f"),
                       ("target ms / token (off)", "target_ms", ".2f")]
    method = (f"ngram, k={args.num_speculative_tokens}, n={args.prompt_lookup_min}..{args.prompt_lookup_max}"
              if args.draft is None else f"draft_model {args.draft}, k={args.num_speculative_tokens}")
    md = (f"## Speculative decoding ({method}), one stream, {args.new_tokens} new tokens, "
          f"best of {args.repeats}\n\n"
          f"{env['cpu_model']}, {env['cpu_count']} CPUs, {torch.get_num_threads()} torch threads, "
          f"torch {env['torch']}; load average "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end\n\n"
          + table(rows, cols) + "\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = {**spec, "model": args.draft} if args.draft else spec
    (out / "results.json").write_text(json.dumps({"environment": env, "load_average": load, "spec": saved,
                                                  "rows": rows}, indent=2))
    (out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
