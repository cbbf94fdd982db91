"""The embedded default model (fms_paged/assets/default_model): loads by default, is actually trained
(held-out perplexity far below uniform, and as reported in its card), loads identically in Hugging Face
`transformers`, generates the card's greedy sample, and the script that made it is deterministic.
The model runs on the test device (`--device`); the HF reference and the training script on the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from fms_paged.bench.perplexity import heldout_perplexity, perplexity
from fms_paged.data import heldout_text
from fms_paged.data.stdlib_corpus import stdlib_files
from fms_paged.generation import generate
from fms_paged.models import get_model
from fms_paged.models.registry import DEFAULT_MODEL_DIR
from fms_paged.tokenizers import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
CARD = json.loads((DEFAULT_MODEL_DIR / "card.json").read_text())
SLICE_CHARS = CARD["eval"]["test_slice_chars"]  # the card also records this slice's perplexity
WINDOW = CARD["eval"]["window"]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"

paged_available = importlib.util.find_spec("fms_paged.kv.paged") is not None
ATTN_IMPLS = [
    "sdpa",
    pytest.param("paged", marks=pytest.mark.skipif(not paged_available,
                                                    reason="paged backend not built yet")),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def heldout_ids(tokenizer) -> list[int]:
    return tokenizer.encode(heldout_text(SLICE_CHARS), add_special_tokens=False)


def test_default_is_loaded_without_arguments() -> None:
    model = get_model()  # no variant, no path: the embedded model, on the default device
    ref = get_model(model_path=DEFAULT_MODEL_DIR, device="cpu")
    assert model.config.src_vocab_size == CARD["model"]["vocab_size"]
    assert sum(p.numel() for p in model.parameters()) == CARD["model"]["params"]
    assert torch.equal(model.embedding.weight.cpu(), ref.embedding.weight)
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size < 20e6


@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
def test_heldout_perplexity_cache_vs_no_cache(attn_impl: str, heldout_ids: list[int], device) -> None:
    """The cache path (chunked prefill through `attn_impl`'s backend) equals plain causal attention to
    fp32 round-off (NLL summed in float64), and the model is far better than uniform."""
    model = get_model(attn_impl=attn_impl, device=device, dtype=torch.float32)
    cached = perplexity(model, heldout_ids, window=WINDOW, chunk=100, use_cache=True)
    plain = perplexity(model, heldout_ids, window=WINDOW, use_cache=False)
    assert cached["tokens"] == plain["tokens"] > 2000
    assert cached["ppl"] == pytest.approx(plain["ppl"], rel=1e-5)
    # uniform baseline = vocab size; this first slice is harder than the card's 200k chars (183 vs 60)
    assert plain["ppl"] < model.config.src_vocab_size / 10


HELDOUT_FILES = len(stdlib_files("heldout"))


@pytest.mark.skipif(PY != CARD["python_version"] or HELDOUT_FILES != CARD["corpus"]["heldout_files"],
                    reason=f"the held-out files are this interpreter's stdlib ({PY}, {HELDOUT_FILES} "
                           f"held-out files); the card used Python {CARD['python_version_full']}'s "
                           f"({CARD['corpus']['heldout_files']}): a distribution's build ships others")
def test_heldout_perplexity_matches_card(tokenizer, device) -> None:
    """The card's recipe on the card's test slice (the full 200k-char figure is measured the same way
    by the training script; the slice keeps this test to a few seconds)."""
    model = get_model(device=device, dtype=torch.float32)
    out = heldout_perplexity(model, tokenizer, max_chars=SLICE_CHARS, window=WINDOW)
    assert out["tokens"] == CARD["eval"]["test_slice_tokens"]
    assert out["ppl"] == pytest.approx(CARD["eval"]["heldout_ppl_test_slice"], rel=0.10)
    assert CARD["eval"]["heldout_ppl"] < CARD["eval"]["uniform_baseline"] / 50


def test_transformers_logits_match(heldout_ids: list[int], device) -> None:
    """HF `LlamaForCausalLM` on the same directory gives the same logits (fp32; tolerance 1e-4 covers
    the different RoPE formulation and op order)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    ours = get_model(device=device, dtype=torch.float32)
    x = torch.tensor([heldout_ids[:WINDOW], heldout_ids[WINDOW : 2 * WINDOW]])  # [2, W]
    with torch.no_grad():
        ref = hf(x).logits  # [2, W, V] (on the CPU)
        got = ours(x.to(device)).cpu()
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_greedy_sample_is_code_and_matches_card(tokenizer, device) -> None:
    sample = CARD["sample"]
    model = get_model(device=device, dtype=torch.float32)
    prompt = tokenizer.encode(sample["prompt"])
    assert prompt == sample["prompt_ids"]
    new = generate(model, [prompt], max_new_tokens=sample["max_new_tokens"])[0]
    text = tokenizer.decode(prompt + new)
    assert new == sample["completion_ids"]
    assert text == sample["text"]
    completion = text[len(sample["prompt"]):]
    assert "\n    " in completion and any(k in completion for k in ("return", "(", "if ", "="))
    assert sample["text"] in (DEFAULT_MODEL_DIR / "README.md").read_text()


def _load_script():
    path = REPO / "scripts" / "make_default_model.py"
    spec = importlib.util.spec_from_file_location("make_default_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_script_is_deterministic(tmp_path: Path) -> None:
    """Two tiny runs with the same seed write byte-identical weights and tokenizer; another seed differs."""
    script = _load_script()
    threads = torch.get_num_threads()
    try:
        runs = {}
        for name, seed in (("a", 0), ("b", 0), ("c", 1)):
            out = tmp_path / name
            script.main(["--tiny", "--steps", "3", "--seed", str(seed), "--out", str(out), "--no-plot"])
            runs[name] = out
    finally:
        torch.set_num_threads(threads)
    a, b, c = runs["a"], runs["b"], runs["c"]
    for f in ("model.safetensors", "tokenizer.model", "config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    card = json.loads((a / "card.json").read_text())
    assert card["training"]["steps"] == 3 and card["sample"]["text"].startswith(card["sample"]["prompt"])
    model = get_model(model_path=a, device="cpu")  # the same loader as any user checkpoint (the CPU's run)
    assert model.config.src_vocab_size == 400


def test_a_draft_shares_the_default_models_tokenizer(tmp_path: Path) -> None:
    """`--tokenizer-from` (what --draft does) copies the default model's tokenizer byte for byte
    instead of training one, so the model trained on it drafts for the default model: a tiny one
    (2 steps) proposing in the engine leaves greedy tokens exactly dense generate()'s."""
    from fms_paged import Engine, SamplingParams

    script = _load_script()
    threads = torch.get_num_threads()
    try:
        script.main(["--tiny", "--steps", "2", "--tokenizer-from", str(DEFAULT_MODEL_DIR), "--out",
                     str(tmp_path), "--no-plot"])
    finally:
        torch.set_num_threads(threads)
    for f in ("tokenizer.model", "tokenizer_config.json"):
        assert (tmp_path / f).read_bytes() == (DEFAULT_MODEL_DIR / f).read_bytes(), f
    card = json.loads((tmp_path / "card.json").read_text())
    assert card["tokenizer"]["copied_from"] == str(DEFAULT_MODEL_DIR) and card["model"]["vocab_size"] == 4096
    target = get_model(device="cpu", attn_impl="paged")
    prompt = load_tokenizer(DEFAULT_MODEL_DIR).encode("def parse(line):\n")
    eng = Engine(target, max_num_seqs=1, max_num_batched_tokens=64, num_pages=16, max_model_len=128,
                 speculative={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3})
    eng.add_request(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    got = [t for out in eng.stream() for t in out.new_token_ids]
    assert got == generate(get_model(device="cpu"), [prompt], 24, eos_id=None)[0]
    assert eng.metrics()["spec_verifies"] > 0
