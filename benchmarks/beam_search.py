"""Beam search's cost on the engine (docs/benchmarks.md, "Beam search"), with the default model on
this device's production kernel:

- memory: the pages 4 beams of a 2,000-token prompt hold at their peak (prefix caching off, so
  every page counted is one the beams hold), against one sequence's prompt pages plus the beams'
  own tails (each beam's pages past the prompt's full pages);
- speed: the time per generated token of 4 beams against one greedy stream, same prompt, same
  number of tokens (no stop token: every step runs), decode steps only (the prefill step is left
  out of both), median of `--repeats` runs, measured in the same process.

    python -m benchmarks.beam_search [--prompt-len 2000] [--new 32] [--beams 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from fms_paged import Engine, SamplingParams, get_model
from fms_paged.kv.geometry import pages_for


def run(eng: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, int, int]:
    """One request alone -> (seconds of its steps after the first, those steps, peak pages held)."""
    eng.add_request(prompt, params)
    eng.step()  # the prefill (and, for beams, the first step's FORKs)
    total = eng.pm.num_pages - 1
    peak, steps = total - eng.pm.num_free_pages, 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        steps += 1
        peak = max(peak, total - eng.pm.num_free_pages)
    return time.perf_counter() - t0, steps, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--speed-prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = get_model(attn_impl="paged")  # the default model
    P, k = model.config.page_size, args.beams
    eng = Engine(model, max_num_seqs=k, max_num_batched_tokens=512, max_model_len=2048, num_pages=1024,
                 enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.src_vocab_size

    # memory: the peak pages 4 beams hold, against the prompt's pages and the beams' tails
    prompt = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
    beam = SamplingParams(max_new_tokens=args.new, n=k, use_beam_search=True, ignore_eos=True)
    _, _, peak = run(eng, prompt, beam)
    prompt_pages = pages_for(args.prompt_len, P)
    tails = k * pages_for(args.prompt_len % P + args.new, P)  # each beam's pages past the full ones
    bound = 1.1 * prompt_pages + tails
    _, _, one = run(eng, prompt, SamplingParams(max_new_tokens=args.new, ignore_eos=True))

    # speed: decode steps of k beams against one greedy stream
    short = torch.randint(3, vocab, (args.speed_prompt_len,), generator=g).tolist()
    greedy = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    beam = SamplingParams(max_new_tokens=args.new, n=k, use_beam_search=True, ignore_eos=True)
    run(eng, short, greedy), run(eng, short, beam)  # warm
    per = {"greedy": [], "beams": []}
    for _ in range(args.repeats):
        for name, params in (("greedy", greedy), ("beams", beam)):
            s, steps, _ = run(eng, short, params)
            per[name].append(s / steps)
    g_s, b_s = statistics.median(per["greedy"]), statistics.median(per["beams"])
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "kernel": type(eng.backend.kernel).__name__,
        "page_size": P, "prompt_len": args.prompt_len, "new_tokens": args.new, "beams": k,
        "peak_pages_beams": peak, "peak_pages_one_sequence": one, "prompt_pages": prompt_pages,
        "beam_tails_pages": tails, "bound_pages": bound, "within_bound": peak <= bound,
        "greedy_ms_per_token": 1e3 * g_s, "beams_ms_per_token": 1e3 * b_s, "ratio": b_s / g_s,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
