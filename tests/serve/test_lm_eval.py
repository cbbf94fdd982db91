"""lm-evaluation-harness itself scores `fms-paged serve` (its `local-completions` model, over HTTP)
and transformers (its `hf` model, in this process) on the same checkpoint, the embedded default
model, with three small tasks this module writes: multiple choice (`loglikelihood`), rolling
perplexity (`loglikelihood_rolling`) and greedy generation (`generate_until`). The two must agree:
perplexities to 1e-4 relative, the same accuracies (an item may flip only on a near tie, shown in
the message), the same generation per item, and the same token ids handed to each backend.

The reference is independent of the server: `hf` runs transformers' own LlamaForCausalLM (SDPA,
fp32, CPU) tokenized by transformers' AutoTokenizer; nothing of fms_paged is on its path. The
server runs the paged engine on the same weights, in another process.

Tokenization. Both backends tokenize with AutoTokenizer on the checkpoint dir (local-completions
with `tokenizer_backend=huggingface`, `tokenized_requests=True`: it sends token-id prompts, so the
server's tokenizer does not pick the ids). Both models get `add_bos_token=False`: lm-eval then
encodes contexts with `add_special_tokens=False` in both (the checkpoint's tokenizer_config.json
asks for a BOS, which each would otherwise put in its own place), and rolling windows open with
the BOS prefix token (`prefix_token_id`) in both. The ids are checked, not only the scores.

Offline: the tasks read JSONL files written here (`dataset_path: json`), with HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE set; nothing is downloaded. Needs lm-eval with its `api` and `hf` extras
(tenacity, accelerate); skipped without them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

lm_eval = pytest.importorskip("lm_eval")
datasets = pytest.importorskip("datasets")
huggingface_hub = pytest.importorskip("huggingface_hub")
for _extra in ("tenacity", "aiohttp", "accelerate"):  # lm-eval[api] and lm-eval[hf]
    pytest.importorskip(_extra)
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from fms_paged.data.stdlib_corpus import stdlib_files  # noqa: E402
from fms_paged.models import default_model_path  # noqa: E402

PPL_RTOL = 1e-4  # the bar for word / byte perplexity and bits per byte
# Two fp32 forwards of the same weights (the paged engine's kernels vs transformers' SDPA) differ by
# float round-off: under 1e-5 nats over a choice of a few tokens on this model.
# LL_ATOL bounds every choice's difference; two choices may then swap order only when closer than
# 2 * LL_ATOL, which is what a near tie means here.
LL_ATOL = 5e-4
TIE_NATS = 2 * LL_ATOL
MAX_GEN_TOKS = 16

# (context, choices, index of the intended answer): Python-ish contexts where the toy model, trained
# on the stdlib, has clear preferences (not always the intended one); two (True/False, cls/self)
# are closer calls on purpose.
MC_ITEMS = [
    ("import os\nimport ", ["sys", "ZZZZ", "12345"], 0),
    ("    def __init__(self", [", name):", " = 3", "))))"], 0),
    ("if __name__ == ", ["'__main__':", "'__init__':", "None:"], 0),
    ("    for i in ", ["range(n):", "return:", "class"], 0),
    ("class Foo(", ["object):", "return)", "import"], 0),
    ("    except ", ["Exception:", "return", "def"], 0),
    ("from collections import ", ["namedtuple", "import", "(("], 0),
    ("        self.", ["name = name", "def", "import"], 0),
    ("        raise ", ["ValueError(", "import", "while"], 0),
    ("        if x is ", ["None:", "def", "class"], 0),
    ("    with open(", ["filename) as f:", "class):", "import"], 0),
    ("    @", ["property", "123", "import"], 0),
    ("print(", ["'hello')", "def", ")("], 0),
    ("x = [1, 2, ", ["3]", "def", "import"], 0),
    ("    while ", ["True:", "import", "def"], 0),
    ("        return self._", ["name", "import", "class"], 0),
    ("    assert ", ["isinstance(", "import", "def"], 0),
    ("        return ", ["True", "False"], 0),
    ("    @classmethod\n    def from_string(", ["cls", "self"], 0),
    ("        if not ", ["isinstance(", "self", "os"], 0),
]

# greedy continuations until a blank line; the targets only feed exact_match: the test compares the
# two backends' generations item by item
GEN_ITEMS = [
    ("def fibonacci(n):\n", "    pass"),
    ("import os\nimport sys\n", "import re"),
    ("class Foo:\n    def __init__(self):\n", "        pass"),
    ("    def __repr__(self):\n", "        return"),
    ("    try:\n", "        import"),
    ("for line in f:\n", "    pass"),
    ("    if self._closed:\n", "        raise"),
    ('"""Utilities for ', "the"),
]

N_DOCS, DOC_CHARS = 5, 400  # rolling perplexity: the head of 5 held-out stdlib files


def rolling_docs() -> list[str]:
    """The first DOC_CHARS characters of the first N_DOCS held-out stdlib files that long (the
    interpreter's own source; the default model never trained on these files)."""
    docs = []
    for path in stdlib_files("heldout"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= DOC_CHARS:
            docs.append(text[:DOC_CHARS])
        if len(docs) == N_DOCS:
            return docs
    pytest.skip(f"fewer than {N_DOCS} held-out stdlib files of {DOC_CHARS}+ characters")


def write_tasks(root: Path) -> list[str]:
    """Three lm-eval task YAMLs over JSONL files in `root` -> their names. YAML is a superset of
    JSON, so each config is written with json.dumps (no quoting rules to get wrong)."""

    def task(name: str, rows: list[dict], **config) -> str:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = {"task": name, "dataset_path": "json",
               "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(root / "cache")},
               "test_split": "test", **config, "metadata": {"version": 1.0}}
        (root / f"{name}.yaml").write_text(json.dumps(cfg, indent=1))
        return name

    return [
        task("fmsp_mc", [{"context": c, "choices": ch, "label": y} for c, ch, y in MC_ITEMS],
             output_type="multiple_choice", doc_to_text="{{context}}", doc_to_choice="{{choices}}",
             doc_to_target="{{label}}", target_delimiter="",
             metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}]),
        task("fmsp_ppl", [{"text": t} for t in rolling_docs()],
             output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
             metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]),
        task("fmsp_gen", [{"context": c, "target": t} for c, t in GEN_ITEMS],
             output_type="generate_until", doc_to_text="{{context}}", doc_to_target="{{target}}",
             target_delimiter="",
             generation_kwargs={"until": ["\n\n"], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False,
                                "temperature": 0.0},
             metric_list=[{"metric": "exact_match"}]),
    ]


# ------------------------------------------------------------------ the two lm-eval models
@dataclass
class Evaluated:
    """One backend's simple_evaluate results, its lm-eval model, and what that model was asked:
    (context ids, continuation ids) per log-likelihood request, each token-id prompt POSTed to the
    server for scoring (local-completions only), and each generation prompt."""

    lm: object = None
    results: dict = field(default_factory=dict)
    pairs: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    scored: list[tuple[int, ...]] = field(default_factory=list)
    generate_prompts: list[tuple[int, ...]] = field(default_factory=list)

    def record_pairs(self) -> None:
        inner = self.lm._loglikelihood_tokens

        def record(requests, **kwargs):
            self.pairs.extend((tuple(ctx), tuple(cont)) for _, ctx, cont in requests)
            return inner(requests, **kwargs)

        self.lm._loglikelihood_tokens = record

    def samples(self, task: str) -> list[dict]:
        """The task's logged samples in document order."""
        return sorted(self.results["samples"][task], key=lambda s: s["doc_id"])

    def metric(self, task: str, name: str) -> float:
        return self.results["results"][task][f"{name},none"]


def local_completions(base_url: str, tokenizer_dir: str) -> Evaluated:
    """lm-eval's `local-completions` on the server: token-id prompts, 8 to a request, 2 requests in
    flight; every payload's prompts recorded as they are sent."""
    ev = Evaluated(get_model("local-completions").create_from_arg_obj({
        "model": "default_model", "base_url": base_url, "tokenizer_backend": "huggingface",
        "tokenizer": tokenizer_dir, "tokenized_requests": True, "add_bos_token": False,
        "num_concurrent": 2, "batch_size": 8, "max_retries": 1, "timeout": 120}))
    ev.record_pairs()
    inner = ev.lm._create_payload

    def payload(messages, generate=False, **kwargs):
        rows = [tuple(p) for p in messages]  # tokenized_requests: a list of token-id lists
        (ev.generate_prompts if generate else ev.scored).extend(rows)
        return inner(messages, generate=generate, **kwargs)

    ev.lm._create_payload = payload
    return ev


def hf(model_dir: str) -> Evaluated:
    """lm-eval's `hf` on the checkpoint dir: transformers, fp32, CPU, one sequence at a time (no
    padding); each generation prompt recorded as HFLM encodes it."""
    ev = Evaluated(get_model("hf").create_from_arg_obj({
        "pretrained": model_dir, "dtype": "float32", "device": "cpu", "batch_size": 1,
        "add_bos_token": False}))
    ev.record_pairs()
    inner = ev.lm.tok_batch_encode

    def encode(strings, **kwargs):
        ids, mask = inner(strings, **kwargs)
        ev.generate_prompts.extend(tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask))
        return ids, mask

    ev.lm.tok_batch_encode = encode
    return ev


def evaluate(ev: Evaluated, task_names: list[str], task_dir: Path) -> Evaluated:
    """simple_evaluate on the tasks in `task_dir`, samples logged; no bootstrap (stderrs take
    seconds and nothing here reads them) and no reseeding of the global random / numpy / torch."""
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)  # (indexing lm-eval's own: 4 s)
    ev.results = lm_eval.simple_evaluate(
        model=ev.lm, tasks=task_names, task_manager=tasks, log_samples=True, bootstrap_iters=0,
        random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    return ev


@pytest.fixture(scope="module")
def server(serve):
    return serve("--enforce-eager")


@pytest.fixture(scope="module")
def evals(server, tmp_path_factory) -> dict[str, Evaluated]:
    """{"local-completions": ..., "hf": ...}: both backends evaluated on the three tasks, offline."""
    model_dir = str(default_model_path())
    task_dir = tmp_path_factory.mktemp("lm_eval_tasks")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        # both libraries read the variables once, at import: the flags they keep are what they consult
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        names = write_tasks(task_dir)
        return {"local-completions": evaluate(local_completions(f"{server.v1}/completions", model_dir),
                                              names, task_dir),
                "hf": evaluate(hf(model_dir), names, task_dir)}


# ------------------------------------------------------------------ the same ids on both sides
def test_both_backends_get_the_same_token_ids(evals, server):
    """Equal scores could hide compensating differences; equal ids are the premise. lm-eval asked
    both backends to score the same (context, continuation) pairs and to continue the same prompts;
    local-completions sent the server exactly context + continuation (ids, nothing added or cut);
    rolling windows open with BOS, no other request has one. The server's own tokenizer
    (`/tokenize`, the path of a text prompt) gives AutoTokenizer's ids for every context."""
    api, ref = evals["local-completions"], evals["hf"]
    assert sorted(api.pairs) == sorted(ref.pairs), "lm-eval built different requests for the two backends"
    assert len(api.pairs) == sum(len(ch) for _, ch, _ in MC_ITEMS) + N_DOCS
    assert sorted(api.scored) == sorted(ctx + cont for ctx, cont in api.pairs), (
        "the server was not sent context + continuation for every scored pair")
    assert sorted(api.generate_prompts) == sorted(ref.generate_prompts), "generation prompts differ"
    assert len(api.generate_prompts) == len(GEN_ITEMS)

    tok = ref.lm.tokenizer
    bos = tok.bos_token_id
    assert bos is not None
    windows = [cont for ctx, cont in api.pairs if ctx == (bos,)]
    assert len(windows) == N_DOCS, f"{len(windows)} of {N_DOCS} rolling windows open with BOS={bos}"
    assert not any(bos in ctx + cont for ctx, cont in api.pairs if ctx != (bos,)), (
        "a multiple-choice request carries a BOS: the add_bos_token settings differ from what this "
        "test assumes")
    assert not any(bos in p for p in api.generate_prompts)

    for text in [c for c, _, _ in MC_ITEMS] + [c for c, _ in GEN_ITEMS]:
        r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                       timeout=10.0)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok(text, add_special_tokens=False).input_ids, repr(text)


# ------------------------------------------------------------------ rolling perplexity
def test_perplexities_agree(evals):
    """word / byte perplexity and bits per byte of the two backends within PPL_RTOL, and so each
    document's log-likelihood (what they aggregate)."""
    api, ref = evals["local-completions"], evals["hf"]
    docs = [(a["filtered_resps"][0], b["filtered_resps"][0])
            for a, b in zip(api.samples("fmsp_ppl"), ref.samples("fmsp_ppl"))]
    assert len(docs) == N_DOCS
    shown = "\n".join(f"  doc {j}: server {a:.6f}  hf {b:.6f}" for j, (a, b) in enumerate(docs))
    for j, (a, b) in enumerate(docs):
        assert math.isfinite(a) and a < 0, f"doc {j}: log-likelihood {a}\n{shown}"
        assert a == pytest.approx(b, rel=PPL_RTOL), f"doc {j}'s log-likelihood differs:\n{shown}"
    for name in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        a, b = api.metric("fmsp_ppl", name), ref.metric("fmsp_ppl", name)
        assert a == pytest.approx(b, rel=PPL_RTOL), f"{name}: server {a!r}, hf {b!r}\n{shown}"


# ------------------------------------------------------------------ multiple choice
def _best_two(scores: list[float]) -> tuple[int, float]:
    """-> (index of the best score, its margin over the runner-up)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[0], scores[order[0]] - scores[order[1]]


def test_multiple_choice_accuracies_agree(evals):
    """Every choice's log-likelihood within LL_ATOL of transformers', and its greedy flag the same;
    acc and acc_norm equal, except that an item whose pick differs must be a near tie (the two best
    choices within TIE_NATS on both sides; acc_norm compares log-likelihood per byte, as lm-eval's
    acc_norm does)."""
    api, ref = evals["local-completions"], evals["hf"]
    rows = list(zip(api.samples("fmsp_mc"), ref.samples("fmsp_mc")))
    assert len(rows) == len(MC_ITEMS)
    flips = {"acc": [], "acc_norm": []}
    for (a, b), (context, choices, _) in zip(rows, MC_ITEMS):
        lla, llb = [r[0] for r in a["filtered_resps"]], [r[0] for r in b["filtered_resps"]]
        greedy_a, greedy_b = [r[1] for r in a["filtered_resps"]], [r[1] for r in b["filtered_resps"]]
        where = f"item {a['doc_id']} ({context!r} -> {choices}): server {lla}, hf {llb}"
        assert all(x == pytest.approx(y, abs=LL_ATOL) for x, y in zip(lla, llb)), where
        assert greedy_a == greedy_b, f"{where}; is_greedy: server {greedy_a}, hf {greedy_b}"
        nbytes = [len(c.encode()) for c in choices]
        for name, sa, sb in (("acc", lla, llb),
                             ("acc_norm", [x / n for x, n in zip(lla, nbytes)],
                              [y / n for y, n in zip(llb, nbytes)])):
            (pa, ma), (pb, mb) = _best_two(sa), _best_two(sb)
            if pa != pb:
                flips[name].append(f"{where}: {name} picks {pa} vs {pb}, margins {ma:.2e} / {mb:.2e}")
                assert max(ma, mb) < TIE_NATS, f"a pick differs on no near tie: {flips[name][-1]}"
    for name in ("acc", "acc_norm"):
        a, b = api.metric("fmsp_mc", name), ref.metric("fmsp_mc", name)
        assert abs(a - b) <= len(flips[name]) / len(MC_ITEMS) + 1e-12, (
            f"{name}: server {a}, hf {b}; near-tie flips: {flips[name] or 'none'}")


# ------------------------------------------------------------------ greedy generation
def test_generations_agree(evals):
    """The same greedy continuation of every prompt, cut at the blank line (and not all empty: the
    comparison must compare something); exact_match then agrees too."""
    api, ref = evals["local-completions"], evals["hf"]
    rows = list(zip(api.samples("fmsp_gen"), ref.samples("fmsp_gen")))
    assert len(rows) == len(GEN_ITEMS)
    differ = [f"  {a['arguments'][0][0]!r}: server {a['filtered_resps'][0]!r}, hf {b['filtered_resps'][0]!r}"
              for a, b in rows if a["filtered_resps"] != b["filtered_resps"]]
    assert not differ, "generations differ:\n" + "\n".join(differ)
    texts = [a["filtered_resps"][0] for a, _ in rows]
    assert sum(bool(t) for t in texts) >= len(texts) // 2, f"mostly empty generations: {texts}"
    assert not any("\n\n" in t for t in texts), texts
    assert api.metric("fmsp_gen", "exact_match") == ref.metric("fmsp_gen", "exact_match")
