"""Beam search's cost on the engine (docs/benchmarks.md, "Beam search"), with the default model on
this device's production kernel:

- memory: the pages 4 beams of a 2,000-token prompt hold at their peak (prefix caching off, so
  every page counted is one the beams hold), against one sequence's prompt pages plus the beams'
  own tails (each beam's pages past the prompt's full pages);
- speed: the time per generated token of 4 beams against one greedy stream at the engine's defaults
  (lookahead decode steps: several tokens a call) and at one token a step (`decode_steps=1`, what
  a beam group's steps are), same prompt, same number of tokens (no stop token: every step runs),
  decode steps only (the prefill step is left out of all), median of `--repeats` interleaved runs,
  measured in the same process; and 4 greedy streams of that prompt at once, one token a step (a
  step of 4 rows without beam search's own work).

    python -m benchmarks.beam_search [--prompt-len 2000] [--new 32] [--beams 4] [--repeats 5]
        [--model-path DIR --dtype bfloat16]   (a pretrained checkpoint instead of the default model)
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


def run(eng: Engine, prompt: list[int], params: SamplingParams, copies: int = 1
        ) -> tuple[float, int, int, float]:
    """One request alone (or `copies` of it) -> (seconds of its steps after the first, the tokens
    those steps generated per sequence (a greedy stream's lookahead steps give several a step, a beam
    group's steps one each), peak pages held, the process's CPU seconds over those steps)."""
    for _ in range(copies):
        eng.add_request(prompt, params)
    eng.step()  # the prefill (and, for beams, the first step's FORKs)
    total = eng.pm.num_pages - 1
    peak = total - eng.pm.num_free_pages
    t0, c0 = time.perf_counter(), time.process_time()
    while eng.has_unfinished():
        eng.step()
        peak = max(peak, total - eng.pm.num_free_pages)
    return time.perf_counter() - t0, params.max_new_tokens - 1, peak, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--speed-prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--model-path", default=None, help="a Hugging Face checkpoint")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: the checkpoint's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = get_model(attn_impl="paged", model_path=args.model_path, dtype=args.dtype)
    P, k = model.config.page_size, args.beams
    opts = dict(max_num_seqs=k, max_num_batched_tokens=512, max_model_len=2048, num_pages=1024,
                enable_prefix_caching=False)
    eng, one_token = Engine(model, **opts), Engine(model, decode_steps=1, **opts)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.src_vocab_size

    # memory: the peak pages 4 beams hold, against the prompt's pages and the beams' tails
    prompt = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
    beam = SamplingParams(max_new_tokens=args.new, n=k, use_beam_search=True, ignore_eos=True)
    _, _, peak, _ = run(eng, prompt, beam)
    prompt_pages = pages_for(args.prompt_len, P)
    tails = k * pages_for(args.prompt_len % P + args.new, P)  # each beam's pages past the full ones
    bound = 1.1 * prompt_pages + tails
    _, _, one, _ = run(eng, prompt, SamplingParams(max_new_tokens=args.new, ignore_eos=True))

    # speed: decode steps of k beams against one greedy stream
    short = torch.randint(3, vocab, (args.speed_prompt_len,), generator=g).tolist()
    greedy = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    beam = SamplingParams(max_new_tokens=args.new, n=k, use_beam_search=True, ignore_eos=True)
    run(eng, short, greedy), run(eng, short, beam), run(one_token, short, greedy)  # warm
    # (and k greedy streams of the same prompt: the cost of k rows a step without beam search's work)
    cases = (("greedy", eng, greedy, 1), ("greedy_one_token", one_token, greedy, 1), ("beams", eng, beam, 1),
             ("streams", one_token, greedy, k))
    per: dict[str, list[float]] = {name: [] for name, *_ in cases}
    cpu: dict[str, list[float]] = {name: [] for name, *_ in cases}
    for _ in range(args.repeats):  # interleaved: a load change on the machine hits all alike
        for name, e, params, copies in cases:
            s, tokens, _, c = run(e, short, params, copies)
            per[name].append(s / tokens)
            cpu[name].append(c / tokens)
    g_s, o_s, b_s, s_s = (statistics.median(per[n]) for n, *_ in cases)
    g_c, o_c, b_c, s_c = (statistics.median(cpu[n]) for n, *_ in cases)
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "model": args.model_path or "default", "dtype": str(next(model.parameters()).dtype),
        "kernel": type(eng.backend.kernel).__name__,
        "page_size": P, "prompt_len": args.prompt_len, "new_tokens": args.new, "beams": k,
        "peak_pages_beams": peak, "peak_pages_one_sequence": one, "prompt_pages": prompt_pages,
        "beam_tails_pages": tails, "bound_pages": bound, "within_bound": peak <= bound,
        "greedy_ms_per_token": 1e3 * g_s, "greedy_one_token_ms_per_token": 1e3 * o_s,
        "beams_ms_per_token": 1e3 * b_s, "ratio": b_s / g_s, "ratio_vs_one_token": b_s / o_s,
        "k_streams_ms_per_token": 1e3 * s_s, "k_streams_ratio_vs_one_token": s_s / o_s,
        "cpu_ms_per_token": {"greedy": 1e3 * g_c, "greedy_one_token": 1e3 * o_c, "beams": 1e3 * b_c,
                             "k_streams": 1e3 * s_c},
        "cpu_ratio": b_c / g_c, "cpu_ratio_vs_one_token": b_c / o_c,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
