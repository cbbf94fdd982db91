"""Half-precision fidelity: how far bf16 / fp16 runs of the same weights land from the fp32 model.

Measured the usual way: teacher-forced over real prose, every position's next-token distribution of a
system compared with the fp32 reference's. The prose is the Python standard library's own
documentation (`pydoc_data.topics`, topics in sorted-key order), text the default model did not see
in this form (it was trained on stdlib source). The token stream is cut into windows of `window`
tokens, each starting with BOS and scored from its own start.

The systems, each in the dtype under test, on the default model's weights rounded to that dtype:
- "ours paged": our LLaMA through the paged KV cache (`make_cache`, kernel "auto": the C++ kernel on
  the CPU): the first half of each window as chunked prefill (`chunk` tokens per call, later chunks
  reading the earlier ones' K/V from the page pool), then one decode step per remaining token,
  teacher-forced (the step's input is the text's token, not the model's choice);
- "ours dense": the same schedule through the dense contiguous cache (SDPA), so that paged vs dense
  differs only in the attention path;
- "hf sdpa" / "hf eager": `transformers.LlamaForCausalLM` with that attention, the whole window in one
  forward.
The reference is our dense model in fp32 on the whole window with no cache (the plainest path); HF in
fp32 and our paged path in fp32 are checked against it, so that what the half-precision rows show is
the dtype's error, not a path's. Every forward runs on the CPU; every metric is computed in float64.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import torch
import transformers

from fms_paged.bench.environment import environment_info
from fms_paged.bench.latency import with_config
from fms_paged.bench.perplexity import perplexity
from fms_paged.bench.report import fmt, table
from fms_paged.kv.cache import make_cache
from fms_paged.models.registry import default_model_path, get_model
from fms_paged.tokenizers import load_tokenizer

HALF_DTYPES = ("bfloat16", "float16")
SYSTEMS = ("ours paged", "ours dense", "hf sdpa", "hf eager")
FP32_CHECKS = ("hf sdpa", "ours paged")  # against the fp32 reference: the paths agree before rounding
PAIRS = (("ours paged", "ours dense"), ("hf sdpa", "hf eager"))  # (system, its baseline)
CPU = torch.device("cpu")
Log = Callable[[str], None]


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding a real to `dtype` (2^-8 for bf16, 2^-11
    for fp16, 2^-24 for fp32); the scale in which a dtype's error is stated."""
    return torch.finfo(dtype).eps / 2


def doc_text(max_chars: int) -> str:
    """The first `max_chars` characters of the stdlib documentation topics, concatenated in
    sorted-key order (deterministic for a given Python)."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    return "".join(topics[k] for k in sorted(topics))[:max_chars]


def bos_windows(ids: Sequence[int], window: int, bos_id: int) -> list[list[int]]:
    """Cut a token stream (no BOS) into windows of `window` tokens, each BOS + `window - 1` text
    tokens; a shorter tail is kept when it has a token to predict. -> windows, each [n <= window]."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens (BOS and one to predict), got {window}")
    step = window - 1
    windows = [[bos_id, *ids[i : i + step]] for i in range(0, len(ids), step)]
    if not windows:
        raise ValueError(f"the text encodes to no tokens (got {len(ids)})")
    return windows


def doc_windows(max_chars: int, window: int) -> tuple[list[list[int]], dict[str, Any]]:
    """-> (BOS windows of the documentation text through the default model's tokenizer, what they
    are: characters, topics, tokens, windows)."""
    tokenizer = load_tokenizer(default_model_path())
    if tokenizer.bos_id is None:
        raise ValueError(f"the tokenizer at {default_model_path()} has no BOS token")
    text = doc_text(max_chars)
    ids = tokenizer.encode(text, add_special_tokens=False)
    windows = bos_windows(ids, window, tokenizer.bos_id)
    info = {"source": "pydoc_data.topics (sorted keys, concatenated)", "chars": len(text),
            "text_tokens": len(ids), "windows": len(windows), "window": window,
            "positions": sum(len(w) - 1 for w in windows)}
    return windows, info


@torch.inference_mode()
def full_logits(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """Our model on the whole window in one forward, no cache: ids [n] -> logits [n, V]."""
    return model(torch.tensor([list(ids)], device=model.device))[0]


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """A Hugging Face causal LM on the whole window in one forward: ids [n] -> logits [n, V]."""
    return model(torch.tensor([list(ids)]), use_cache=False).logits[0]


@torch.inference_mode()
def cached_logits(model: torch.nn.Module, cache: Any, ids: Sequence[int], chunk: int) -> torch.Tensor:
    """Teacher-forced logits at every position through `cache` (a `make_cache` backend for one
    sequence): the first half of the window (at least one token) prefilled in chunks of `chunk`
    tokens, then one decode step per token. ids [n] -> logits [n, V].

    Both halves matter: prefill runs the chunked kernel (queries attending within their chunk and to
    the cached chunks before it), decode the one-token path that serving spends most steps in."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    ids = [int(t) for t in ids]
    split = max(1, len(ids) // 2)
    out = []  # each [c, V]
    cache.reset()
    for start in range(0, split, chunk):
        piece = ids[start : min(start + chunk, split)]
        tokens, positions, step, _ = cache.prefill([0], [piece], [start])  # tokens [1, c]
        out.append(model(tokens, positions, step)[0, : len(piece)])
    for pos in range(split, len(ids)):
        token = torch.tensor([ids[pos]], device=model.device)  # [1]
        tokens, positions, step = cache.decode([0], token, [pos], [True])  # tokens [1, 1]
        out.append(model(tokens, positions, step)[0])
    cache.release([0])
    return torch.cat(out)


@dataclass
class System:
    """One way of computing a window's logits: `logits(ids [n]) -> [n, V]` on the CPU; `path` says how
    (backend, kernel, schedule)."""

    name: str
    dtype: str
    path: str
    logits: Callable[[Sequence[int]], torch.Tensor]


def load_ours(dtype: str) -> torch.nn.Module:
    """Our LLaMA with the default model's weights in `dtype`, on the CPU, paged attention backend."""
    return get_model(attn_impl="paged", dtype=dtype, device=CPU).eval()


def load_hf(dtype: str, attn_impl: str) -> torch.nn.Module:
    """`LlamaForCausalLM` from the default model's directory in `dtype` with `attn_impl` attention
    ("sdpa" or "eager"), read from disk only. RuntimeError if it did not load in `dtype` (a
    transformers older than `dtype=`, which would silently measure fp32)."""
    want = getattr(torch, dtype)
    model = transformers.LlamaForCausalLM.from_pretrained(
        default_model_path(), dtype=want, attn_implementation=attn_impl, local_files_only=True).eval()
    got = next(model.parameters()).dtype
    if got != want:
        raise RuntimeError(f"transformers {transformers.__version__} loaded the HF model in {got}, "
                           f"asked for {want}")
    return model


def ours_cached(model: torch.nn.Module, attn_impl: str, window: int, chunk: int, dtype: str) -> System:
    """Our model through the `attn_impl` cache ("paged" or "sdpa"), on a twin sharing its weights."""
    twin = with_config(model, attn_impl=attn_impl)
    cache = make_cache(twin, 1, window)
    kernel = getattr(getattr(cache, "kernel", None), "name", "sdpa")
    name = "ours paged" if attn_impl == "paged" else "ours dense"
    path = (f"{attn_impl} cache, kernel {kernel}: first half of each window prefilled in chunks of {chunk}, "
            "then one decode step per token")
    return System(name, dtype, path, lambda ids: cached_logits(twin, cache, ids, chunk))


def hf_system(dtype: str, attn_impl: str) -> System:
    """HF LLaMA with `attn_impl` attention in `dtype`, whole window per forward."""
    model = load_hf(dtype, attn_impl)
    return System(f"hf {attn_impl}", dtype, f"transformers {transformers.__version__} LlamaForCausalLM, "
                  f"attn_implementation={attn_impl}, whole window", lambda ids: hf_logits(model, ids))


def build_systems(dtype: str, window: int, chunk: int, names: Sequence[str] = SYSTEMS) -> dict[str, System]:
    """The systems named by `names` (of `SYSTEMS`) in `dtype`; ours share one set of weights."""
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; expected some of {SYSTEMS}")
    ours = load_ours(dtype) if any(n.startswith("ours") for n in names) else None
    make = {"ours paged": lambda: ours_cached(ours, "paged", window, chunk, dtype),
            "ours dense": lambda: ours_cached(ours, "sdpa", window, chunk, dtype),
            "hf sdpa": lambda: hf_system(dtype, "sdpa"),
            "hf eager": lambda: hf_system(dtype, "eager")}
    return {n: make[n]() for n in names}


@dataclass
class Tally:
    """Running float64 sums over predicted positions of a system's logits against a baseline's:
    top-1 agreement, KL(p_base || p_sys), the system's NLL of the text, the largest logit gap; and
    which positions agreed (`hits`, for a paired test between two systems)."""

    positions: int = 0
    agree: int = 0
    kl: float = 0.0
    nll: float = 0.0
    max_abs: float = 0.0
    hits: list[torch.Tensor] = field(default_factory=list)  # each [n] bool, one per `add`

    def add(self, base: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """base, logits: [n, V] (any float dtype, cast to float64); targets: [n] the next tokens."""
        if base.shape != logits.shape or base.shape[0] != targets.shape[0]:
            raise ValueError(f"shapes differ: base {tuple(base.shape)}, logits {tuple(logits.shape)}, "
                             f"targets {tuple(targets.shape)}")
        b, s = base.double(), logits.double()
        logp_b, logp_s = torch.log_softmax(b, -1), torch.log_softmax(s, -1)  # [n, V]
        self.positions += len(targets)
        self.hits.append(b.argmax(-1) == s.argmax(-1))
        self.agree += int(self.hits[-1].sum())
        self.kl += float((logp_b.exp() * (logp_b - logp_s)).sum())
        self.nll -= float(logp_s.gather(-1, targets[:, None].long()).sum())
        self.max_abs = max(self.max_abs, float((s - b).abs().max()))

    def summary(self) -> dict[str, Any]:
        """-> {"positions", "agreement" (fraction), "kl" (mean, nats), "nll" (mean), "ppl",
        "max_abs_logit_diff"}."""
        if not self.positions:
            raise ValueError("no positions were tallied")
        nll = self.nll / self.positions
        return {"positions": self.positions, "agreement": self.agree / self.positions,
                "kl": self.kl / self.positions, "nll": nll, "ppl": math.exp(nll),
                "max_abs_logit_diff": self.max_abs}


def score_window(ref: torch.Tensor, runs: dict[str, dict[str, System]], ids: Sequence[int],
                 tallies: dict[tuple[str, str], Tally], pairs: dict[tuple[str, str], Tally]) -> None:
    """Run every system on one window and add its predicted positions to the tallies.
    ref: [n, V] the fp32 reference's logits of `ids` [n]; runs: dtype -> name -> system;
    tallies: (dtype, system) -> vs the reference; pairs: (dtype, "a vs b") -> a vs its baseline b."""
    targets = torch.tensor(ids[1:])  # [n - 1]: position i predicts token i + 1
    for dtype, systems in runs.items():
        logits = {name: s.logits(ids)[:-1] for name, s in systems.items()}  # each [n - 1, V]
        for name, lg in logits.items():
            tallies[dtype, name].add(ref[:-1], lg, targets)
        for a, b in PAIRS:
            if (dtype, f"{a} vs {b}") in pairs:
                pairs[dtype, f"{a} vs {b}"].add(logits[b], logits[a], targets)


def pair_summary(tally: Tally) -> dict[str, Any]:
    """A pair's figures: agreement, KL and the largest logit gap (its NLL is the system's own)."""
    return {k: v for k, v in tally.summary().items() if k not in ("nll", "ppl")}


def paired_test(ours: Tally, hf: Tally) -> dict[str, Any]:
    """Exact McNemar test of two top-1 agreements measured on the same positions: only the positions
    where exactly one of the two agrees carry information, and if neither system is better each
    such position is a fair coin. -> {"ours_only_miss", "hf_only_miss", "p_value" (two-sided)}:
    how far a gap in agreement is from what near-ties flipped at random would give."""
    o, h = torch.cat(ours.hits), torch.cat(hf.hits)  # [N] bool each
    if o.shape != h.shape:
        raise ValueError(f"paired test over different positions: {tuple(o.shape)} vs {tuple(h.shape)}")
    a, b = int((~o & h).sum()), int((o & ~h).sum())
    n = a + b
    tail = sum(math.comb(n, k) for k in range(min(a, b) + 1)) / 2**n if n else 0.5
    return {"ours_only_miss": a, "hf_only_miss": b, "p_value": min(1.0, 2 * tail)}


def criteria(systems: dict[str, dict[str, Any]], pairs: dict[str, dict[str, Any]], ppl_fp32: float,
             paired: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The targets, per dtype: ours paged at least as close to fp32 as HF sdpa (top-1 agreement and
    |ppl - ppl_fp32|), and our paged-vs-dense gap no larger than HF's sdpa-vs-eager gap (KL and
    agreement). `paired`: dtype -> "vs fp32" / "pairwise" -> `paired_test` of the agreement rows.
    -> [{"dtype", "criterion", "ours", "hf", "met", "paired" (agreement rows)}]."""
    out = []
    for dtype, by in systems.items():
        paged, hf = by["ours paged"], by["hf sdpa"]
        ours_pair, hf_pair = pairs[dtype]["ours paged vs ours dense"], pairs[dtype]["hf sdpa vs hf eager"]
        rows = [("top-1 agreement vs fp32: ours paged >= hf sdpa", paged["agreement"], hf["agreement"], ">=",
                 paired[dtype]["vs fp32"]),
                ("abs(ppl - ppl_fp32): ours paged <= hf sdpa", abs(paged["ppl"] - ppl_fp32),
                 abs(hf["ppl"] - ppl_fp32), "<=", None),
                ("KL: ours paged vs dense <= hf sdpa vs eager", ours_pair["kl"], hf_pair["kl"], "<=", None),
                ("agreement: ours paged vs dense >= hf sdpa vs eager", ours_pair["agreement"],
                 hf_pair["agreement"], ">=", paired[dtype]["pairwise"])]
        out += [{"dtype": dtype, "criterion": c, "ours": o, "hf": h, "met": o >= h if op == ">=" else o <= h,
                 "paired": t} for c, o, h, op, t in rows]
    return out


def measure(windows: Sequence[Sequence[int]], dtypes: Sequence[str] = HALF_DTYPES, chunk: int = 32,
            log: Log | None = None) -> dict[str, Any]:
    """Score `windows` (each [n] token ids, BOS first) with the fp32 reference, the fp32 checks and
    every system in each of `dtypes` -> {"reference", "fp32_checks", "systems", "pairs", "criteria",
    "all_met"}. Windows are scored one at a time (memory stays one window's logits per system)."""
    bad = [d for d in dtypes if d not in HALF_DTYPES]
    if bad or not dtypes:
        raise ValueError(f"dtypes must be some of {HALF_DTYPES}, got {list(dtypes)}")
    if not windows or min(len(w) for w in windows) < 2:
        raise ValueError(f"need windows of >= 2 tokens, got lengths {[len(w) for w in windows]}")
    log = log or (lambda msg: None)
    window = max(len(w) for w in windows)
    ref_model = with_config(load_ours("float32"), attn_impl="sdpa")
    runs = {"float32": build_systems("float32", window, chunk, FP32_CHECKS),
            **{d: build_systems(d, window, chunk) for d in dtypes}}
    tallies = {(d, n): Tally() for d, systems in runs.items() for n in systems}
    pairs = {(d, f"{a} vs {b}"): Tally() for d in dtypes for a, b in PAIRS}
    ref_tally = Tally()
    for i, ids in enumerate(windows):
        ref = full_logits(ref_model, ids)  # [n, V] fp32
        ref_tally.add(ref[:-1], ref[:-1], torch.tensor(ids[1:]))
        score_window(ref, runs, ids, tallies, pairs)
        log(f"fidelity: window {i + 1}/{len(windows)} ({len(ids)} tokens)")
    # the same reference perplexity through fms_paged.bench.perplexity's scorer (no cache)
    flat = [t for w in windows for t in w]
    check = perplexity(ref_model, flat, window=len(windows[0]), use_cache=False)["ppl"]
    return summarize(dict(ref_tally.summary(), ppl_perplexity_py=check), runs, tallies, pairs)


def summarize(reference: dict[str, Any], runs: dict[str, dict[str, System]],
              tallies: dict[tuple[str, str], Tally], pairs: dict[tuple[str, str], Tally]) -> dict[str, Any]:
    """`measure`'s tallies as figures: per system (and fp32 check) vs the reference, per pair, the
    paired tests and the criteria. reference: the fp32 reference's summary."""
    def row(d: str, n: str) -> dict[str, Any]:  # one system's figures, its path and |ppl - ppl_fp32|
        r = tallies[d, n].summary()
        return dict(r, dtype=d, path=runs[d][n].path, abs_ppl_diff=abs(r["ppl"] - reference["ppl"]))

    summaries = {d: {n: row(d, n) for n in systems} for d, systems in runs.items()}
    dtypes = [d for d in runs if d != "float32"]
    pair_rows = {d: {f"{a} vs {b}": pair_summary(pairs[d, f"{a} vs {b}"]) for a, b in PAIRS} for d in dtypes}
    systems = {d: summaries[d] for d in dtypes}
    paired = {d: {"vs fp32": paired_test(tallies[d, "ours paged"], tallies[d, "hf sdpa"]),
                  "pairwise": paired_test(*(pairs[d, f"{a} vs {b}"] for a, b in PAIRS))} for d in dtypes}
    crit = criteria(systems, pair_rows, reference["ppl"], paired)
    return {"reference": dict(reference, system="ours dense fp32, whole window, no cache"),
            "fp32_checks": summaries["float32"], "systems": systems, "pairs": pair_rows,
            "criteria": crit, "all_met": all(c["met"] for c in crit)}


def fidelity(chars: int = 20_000, window: int = 256, dtypes: Sequence[str] = HALF_DTYPES, chunk: int = 32,
             log: Log | None = None) -> dict[str, Any]:
    """The whole benchmark: the first `chars` characters of the stdlib docs in BOS windows of
    `window` tokens, measured in each of `dtypes` -> results (config, text, environment and
    `measure`'s figures)."""
    windows, text = doc_windows(chars, window)
    config = {"dtypes": list(dtypes), "chars": chars, "window": window, "chunk": chunk,
              "unit_roundoff": {d: unit_roundoff(getattr(torch, d)) for d in dtypes}}
    return {"config": config, "text": text, "environment": environment_info(CPU),
            **measure(windows, dtypes, chunk, log)}


def markdown(results: dict[str, Any]) -> str:
    """One table (the reference, the fp32 checks, each system x dtype, then the pairwise rows), then
    the criteria, met or missed."""
    ref, text, env = results["reference"], results["text"], results["environment"]
    rows = [{"system": "reference: ours dense (no cache)", "dtype": "float32", "agreement": 1.0, "kl": 0.0,
             "ppl": ref["ppl"], "abs_ppl_diff": 0.0, "max_abs_logit_diff": 0.0}]
    rows += [dict(r, system=f"check: {n}") for n, r in results["fp32_checks"].items()]
    rows += [dict(r, system=n) for by in results["systems"].values() for n, r in by.items()]
    rows += [dict(r, system=n, dtype=d) for d, by in results["pairs"].items() for n, r in by.items()]
    cols = [("system", "system", ""), ("dtype", "dtype", ""), ("top-1 agreement", "agreement", ".4f"),
            ("mean KL (nats)", "kl", ".3e"), ("ppl", "ppl", ".4f"),
            ("abs(ppl - ppl_fp32)", "abs_ppl_diff", ".4f"),
            ("max abs logit diff", "max_abs_logit_diff", ".3g")]
    crit = [("dtype", "dtype", ""), ("criterion", "criterion", ""), ("ours", "ours", ".4g"),
            ("hf", "hf", ".4g"), ("verdict", "verdict", ""), ("paired test (agreement rows)", "test", "")]
    verdicts = [dict(c, verdict="met" if c["met"] else "MISSED", test=paired_note(c["paired"]))
                for c in results["criteria"]]
    head = (f"Half-precision fidelity vs fp32, teacher-forced on {text['chars']} characters of the stdlib "
            f"docs: {text['windows']} windows of <= {text['window']} tokens (BOS first), "
            f"{text['positions']} predicted positions; CPU: {env['cpu_model']}, torch {env['torch']}. "
            "KL is KL(p_ref || p_sys); a pairwise row compares a system with its baseline "
            "(KL(p_base || p_sys)). The reference's ppl through fms_paged.bench.perplexity: "
            f"{fmt(ref['ppl_perplexity_py'], '.4f')}.")
    paths = "; ".join(f"{n}: {r['path']}" for n, r in next(iter(results["systems"].values())).items())
    return "\n\n".join([head, f"Paths: {paths}.", table(rows, cols), table(verdicts, crit),
                        f"All criteria met: {'yes' if results['all_met'] else 'no'}"]) + "\n"


def paired_note(t: dict[str, Any] | None) -> str:
    """`paired_test`'s figures in a table cell ("-" for a row without one)."""
    if t is None:
        return "-"
    return (f"ours-only misses {t['ours_only_miss']}, hf-only {t['hf_only_miss']}, "
            f"McNemar p = {t['p_value']:.2g}")


def write(out: Path, results: dict[str, Any]) -> dict[str, Path]:
    """fidelity.json (everything) and fidelity.md (`markdown`) under `out` -> their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "fidelity.json", "md": out / "fidelity.md"}
    paths["md"].write_text(markdown(results))
    paths["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    return paths
