"""perplexity(): cache paths (whole window, chunked) vs the no-cache path vs a hand computation.

The micro model is re-initialised with large weights (std 0.3) so its predictions are sharp, far from
uniform (NLL far from log 256, in either direction): a wrong cache read (stale or missing K/V,
off-by-one positions) then moves the
NLL by far more than the 1e-5 relative tolerance, which is only float32 round-off of different but
equivalent attention orders (the NLL itself is accumulated in float64). On the test device (`--device`).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from fms_paged.bench.perplexity import eval_tokens, perplexity
from fms_paged.data import DatasetSource, MissingSplit, MissingTextColumn
from fms_paged.models import default_model_path, get_model

RTOL = 1e-5
WINDOW = 64
N_TOKENS = 3 * WINDOW + 23  # a short tail window too

paged_available = importlib.util.find_spec("fms_paged.kv.paged") is not None
ATTN_IMPLS = [
    "sdpa",
    pytest.param("paged", marks=pytest.mark.skipif(not paged_available,
                                                    reason="paged backend not built yet")),
]


def _micro(device: torch.device, attn_impl: str = "sdpa") -> torch.nn.Module:
    """The micro model with weights drawn on the CPU (the same on every device: CUDA's generator
    draws others, for which the context guard below held by a smaller margin)."""
    weights = get_model(variant="micro", device="cpu")
    torch.manual_seed(0)
    weights.reset_parameters(std=0.3)
    model = get_model(variant="micro", device=device, attn_impl=attn_impl)
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights.parameters(), strict=True):
            p.copy_(w)
    return model.eval()


def _tokens(n: int = N_TOKENS, seed: int = 1) -> list[int]:
    # a repetitive stream (period 29) plus noise, so that context matters for the prediction
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (29,), generator=g)
    ids = base.repeat(n // 29 + 1)[:n]
    noise = torch.rand(n, generator=g) < 0.2
    ids[noise] = torch.randint(0, 256, (int(noise.sum()),), generator=g)
    return ids.tolist()


def _manual(model: torch.nn.Module, ids: list[int], window: int) -> tuple[float, int]:
    """Independent reference: log-softmax of full-window logits, gathered by hand, in float64."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), window):
            w = torch.tensor(ids[i : i + window], device=model.device)
            if len(w) < 2:
                continue
            logp = torch.log_softmax(model(w[None])[0].double(), dim=-1)  # [n, V]
            total -= logp[torch.arange(len(w) - 1, device=w.device), w[1:]].sum().item()
            count += len(w) - 1
    return total / count, count


@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
@pytest.mark.parametrize("chunk", [None, 37, 1])
def test_cache_matches_no_cache_and_manual(attn_impl: str, chunk: int | None, device) -> None:
    model = _micro(device, attn_impl)
    ids = _tokens()
    cached = perplexity(model, ids, window=WINDOW, chunk=chunk, use_cache=True)
    plain = perplexity(model, ids, window=WINDOW, use_cache=False)
    nll, count = _manual(model, ids, WINDOW)
    assert cached["tokens"] == plain["tokens"] == count == N_TOKENS - 4  # one unpredicted per window
    assert cached["windows"] == 4
    assert abs(plain["nll"] - math.log(256)) > 1.0, "the test model must be far from uniform"
    assert cached["nll"] == pytest.approx(plain["nll"], rel=RTOL)
    assert plain["nll"] == pytest.approx(nll, rel=RTOL)
    assert cached["ppl"] == pytest.approx(math.exp(cached["nll"]), rel=1e-12)


def test_cross_entropy_reference_and_tail_window(device) -> None:
    model = _micro(device)
    ids = _tokens(2 * WINDOW + 1)  # the 1-token tail predicts nothing and is dropped
    out = perplexity(model, ids, window=WINDOW)
    x = torch.tensor(ids[: 2 * WINDOW], device=device).view(2, WINDOW)  # [2, W]
    with torch.no_grad():
        logits = model(x)  # [2, W, V]
    ref = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), x[:, 1:].flatten()).item()
    assert out["tokens"] == 2 * (WINDOW - 1) and out["windows"] == 2
    assert out["nll"] == pytest.approx(ref, rel=RTOL)


def test_context_actually_matters(device) -> None:
    """Guard for the comparisons above: with 1 token of context (window=2) the NLL must differ clearly
    from full windows, so a cache that dropped or misplaced earlier chunks could not go unnoticed."""
    model = _micro(device)
    ids = _tokens()
    short, full = perplexity(model, ids, window=2)["nll"], perplexity(model, ids, window=WINDOW)["nll"]
    assert abs(short - full) > 0.02 * full


def test_bad_arguments(device) -> None:
    model = _micro(device)
    with pytest.raises(ValueError, match="window"):
        perplexity(model, [1, 2, 3], window=1)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, [5], window=8)
    with pytest.raises(ValueError, match="chunk"):
        perplexity(model, [1, 2, 3], window=8, chunk=0)
    with pytest.raises(ValueError, match="maximum sequence length"):
        perplexity(model, [1, 2, 3], window=10**6)


# ------------------------------------------------------------------ text from a `datasets` dataset
ROWS = [" = Valkyria Chronicles = \n", "", " Senjō no Valkyria 3 is a tactical role @-@ playing game .\n",
        " It was released in January 2011 in Japan .\n"]


def _saved(tmp_path, splits: bool = False, column: str = "text"):
    """A dataset saved with `save_to_disk` in the test (nothing downloads): one `Dataset`, or a
    `DatasetDict` with a validation and a test split."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({column: ROWS, "id": list(range(len(ROWS)))})
    if splits:
        ds = datasets.DatasetDict({"validation": ds, "test": ds.select([0])})
    ds.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


def test_dataset_text_is_the_rows_joined_by_a_blank_line(tmp_path) -> None:
    src = DatasetSource(str(_saved(tmp_path)))
    assert src.is_saved
    assert src.text() == "\n\n".join(ROWS)  # as `"\n\n".join(ds["text"])` in the transformers guide
    assert src.text(max_chars=30) == "\n\n".join(ROWS)[:30]  # cut at the characters asked for
    assert src.text(max_chars=10_000) == "\n\n".join(ROWS)


def test_dataset_dict_split_and_its_errors(tmp_path) -> None:
    path = str(_saved(tmp_path, splits=True))
    assert DatasetSource(path, split="test").text() == ROWS[0]
    assert DatasetSource(path).text() == "\n\n".join(ROWS)  # the validation split by default
    with pytest.raises(MissingSplit, match=r"'train'.*\['test', 'validation'\]"):
        DatasetSource(path, split="train").text()
    with pytest.raises(ValueError, match="wikitext-103-raw-v1"):
        DatasetSource(path, config="wikitext-103-raw-v1").text()


def test_a_missing_text_column_names_it_and_the_columns_present(tmp_path) -> None:
    path = str(_saved(tmp_path, column="content"))
    with pytest.raises(MissingTextColumn, match=r"'text'.*\['content', 'id'\]"):
        DatasetSource(path).text()
    assert DatasetSource(path, text_column="content").text() == "\n\n".join(ROWS)


def test_eval_tokens_of_a_dataset_are_those_of_the_same_text_in_a_file(tmp_path) -> None:
    """The dataset path and the text-file path (independent readers) give the same token ids."""
    model = get_model(variant="micro", device="cpu")
    text_file = tmp_path / "rows.txt"
    text_file.write_text("\n\n".join(ROWS), encoding="utf-8")
    src = DatasetSource(str(_saved(tmp_path)))
    ids, what = eval_tokens(model, str(default_model_path()), chars=100, dataset=src)
    ref, _ = eval_tokens(model, str(default_model_path()), text_file=str(text_file), chars=100)
    assert ids == ref and len(ids) > 10 and what.startswith("dataset ")
    with pytest.raises(ValueError, match="--text-file"):
        eval_tokens(model, None, text_file=str(text_file), dataset=src)
