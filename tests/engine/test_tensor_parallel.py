"""Tensor parallelism on the CPU (gloo), 2 ranks: `fms_paged.parallel.shard` and
`Engine(..., tensor_parallel_size=2)` against the same model and requests on one rank.

- A split model's logits are the whole model's (every family's micro preset, 2 and 4 ranks: 4
  replicates the 2 kv heads).
- The engine spawns its second rank: fp32 tokens equal one rank's, greedy and seeded sampling,
  under preemption, prefix hits, chunked prefill and n > 1, eager and compiled, for a full-attention
  model and one with sliding layers; bf16 tokens equal up to a near tie (the half-precision
  tests' rule).
- Under torchrun (the ranks given, as on several hosts): the same tokens, and each rank's pool
  holds its kv head's slice of the same cached pages as one rank's pool.
- Settings that cannot be split are refused with the numbers before a rank starts."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fms_paged import Engine, SamplingParams, get_model
from fms_paged.engine import tensor_parallel
from fms_paged.kv.paged import model_groups
from fms_paged.parallel import TensorParallelError, layout
from tests.engine import tp_rank
from tests.engine.test_half_precision import check_near_alone

pytestmark = pytest.mark.usefixtures("cpu_only")

ROOT = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, *args: str) -> None:
    """tests/engine/tp_rank.py ARGS on `nproc` ranks started by torchrun (a thread each)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                          "--standalone", str(Path(tp_rank.__file__)), *args],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_model_gives_the_whole_models_logits(tmp_path, size):
    """Every family's micro preset (4 query heads, 2 kv heads: 4 ranks replicate them), split
    over the ranks, against the whole model on each rank: logits to 1e-5 (relative to their
    largest), and greedy `generate`'s tokens through the paged cache."""
    torchrun(size, "logits", str(tmp_path))
    for r in range(size):
        errors = torch.load(tmp_path / f"logits{r}.pt")
        assert set(errors) == set(tp_rank.FAMILIES)
        assert all(err < 1e-5 and same for err, same in errors.values()), errors


def with_logprobs(params: SamplingParams) -> SamplingParams:
    """The near-tie check's settings: 20 log-probabilities per token, top_k 5 when sampling, n 1."""
    return dataclasses.replace(params, logprobs=20, top_k=None if params.greedy else 5, n=1)


def run_engine(family: str, size: int, dtype=torch.float32, compile=False, logprobs=False,
               kv_cache_dtype: str | None = None):
    model = get_model(family, variant="micro", attn_impl="paged", device="cpu", seed=0, page_size=16,
                      dtype=dtype)
    # (the KV bytes of ENGINE's pool in pages of one layer slice: pages held per layer group)
    pages = tp_rank.ENGINE["num_pages"] * model.config.nlayers // model_groups(model).layers_per_slice
    eng = Engine(model, **{**tp_rank.ENGINE, "compile": compile, "num_pages": pages},
                 tensor_parallel_size=size, kv_cache_dtype=kv_cache_dtype)
    try:
        reqs = tp_rank.requests()
        for prompt, params in reqs:
            eng.add_request(prompt, with_logprobs(params) if logprobs else params)
        got: dict[tuple[int, int], tuple[list[int], list]] = {}
        for out in eng.stream():
            toks, lps = got.setdefault((out.request_id, out.index), ([], []))
            toks.extend(out.new_token_ids)
            lps.extend(out.logprobs or [])
        m = eng.metrics()
    finally:
        eng.shutdown()
    return got, m


@pytest.mark.parametrize("family, compile", [("llama", False), ("gemma3", False), ("llama", True)])
def test_two_ranks_give_one_ranks_tokens(family, compile):
    threads = torch.get_num_threads()
    one, m1 = run_engine(family, 1, compile=compile)
    two, m2 = run_engine(family, 2, compile=compile)
    assert m1["preemptions"] > 0 and m1["prefix_cache_hits"] > 0  # the pool and the cache at work
    assert (m2["preemptions"], m2["prefix_cache_hits"]) == (m1["preemptions"], m1["prefix_cache_hits"])
    assert len(one) == 7  # six requests, one with n=2
    assert {k: t for k, (t, _) in two.items()} == {k: t for k, (t, _) in one.items()}
    assert torch.get_num_threads() == threads  # each rank's share of the cores, given back
    assert not torch.distributed.is_initialized()  # shutdown() left no group behind


def test_two_ranks_on_int8_pages_give_one_ranks_tokens():
    """8-bit KV pages (int8) split over 2 ranks: each rank holds its kv head's slice of every page
    with that slice's scales (one per token and kv head, so a slice quantizes as the whole pool
    does): the same tokens as one rank's, under preemption, prefix hits and n > 1."""
    one, m1 = run_engine("llama", 1, kv_cache_dtype="int8")
    two, m2 = run_engine("llama", 2, kv_cache_dtype="int8")
    assert m1["preemptions"] > 0 and m1["prefix_cache_hits"] > 0
    assert {k: t for k, (t, _) in two.items()} == {k: t for k, (t, _) in one.items()}


def test_bf16_two_ranks_up_to_a_near_tie(monkeypatch):
    """bf16: each completion's tokens are one rank's, with log-probabilities within the
    half-precision tests' tolerance, up to a first difference (if any) at a near tie. One rank runs
    its blocks' modules, as the ranks do (a rank's split projections are not fused): the two runs
    differ by the split alone (the fused blocks against the modules: tests/models/test_decoder_layer.py)."""
    from fms_paged.kv.kernels.cpp import CppStep

    with monkeypatch.context() as m:
        m.setattr(CppStep, "run_blocks", lambda self, *args: None)
        one, _ = run_engine("llama", 1, torch.bfloat16, logprobs=True)
    two, _ = run_engine("llama", 2, torch.bfloat16, logprobs=True)
    params = [with_logprobs(p) for _, p in tp_rank.requests()]
    equal = sum(check_near_alone(want, two[key], params[key[0]], 256, 32 * torch.finfo(torch.bfloat16).eps,
                                 f"request {key}") for key, want in one.items())
    # every difference is a near tie (check_near_alone asserts it); this random model's next-token
    # distributions are nearly flat (its top log-probabilities lie within ~0.2 of each other), so
    # the split's rounding may turn up to half of them, not most
    assert equal >= len(one) // 2


def test_torchrun_ranks_hold_their_slice_of_the_same_pages(tmp_path):
    """torchrun starts the ranks; rank 0 drives its Engine, rank 1 `run_worker`."""
    torchrun(2, "engine", str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    one = Engine(tp_rank.build(), **tp_rank.ENGINE)
    tokens = tp_rank.run(one)
    whole = tp_rank.cached_kv(one)
    assert ranks[0]["tokens"] == tokens and ranks[0]["hits"] > 0 and ranks[0]["preemptions"] > 0
    for r, rank in enumerate(ranks):
        assert rank["kvheads"] == 1 and rank["pages"] == whole["pages"] and whole["pages"]
        for k1, k2, v1, v2 in zip(whole["k"], rank["k"], whole["v"], rank["v"]):
            torch.testing.assert_close(k2, k1[:, r : r + 1], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v2, v1[:, r : r + 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "granite", "gemma2", "gemma3"])
def test_the_layout_of_each_family_splits(family):
    c = get_model(family, variant="micro", device="cpu").config
    hidden = get_model(family, variant="micro", device="cpu").layers[0].ff_sub_module.wg.out_features
    assert layout(c.nheads, c.kvheads, hidden, 2) == (c.nheads // 2, c.kvheads // 2)
    assert layout(c.nheads, c.kvheads, hidden, 4) == (c.nheads // 4, 1)  # kv heads replicated


BAD = [
    (dict(nheads=6, kvheads=3, emb_dim=96), 4, "does not divide the model's 6 query heads"),
    (dict(nheads=6, kvheads=3, emb_dim=96), 2, "neither divides the model's 3 kv heads"),
    (dict(hidden_grow_factor=2.25, multiple_of=4), 3, "does not divide the model's 4 query heads"),
    (dict(hidden_grow_factor=149 / 64, multiple_of=1), 2, "does not divide the MLP's 149 hidden units"),
]


@pytest.mark.parametrize("overrides, size, match", BAD, ids=[b[2] for b in BAD])
def test_bad_settings_are_refused_before_a_rank_starts(overrides, size, match):
    model = get_model("llama", variant="micro", attn_impl="paged", device="cpu", **overrides)
    with pytest.raises(TensorParallelError, match=match):
        Engine(model, num_pages=30, max_model_len=256, compile=False, tensor_parallel_size=size)
    assert not torch.distributed.is_initialized() and model.tp is None  # nothing started or split
    with pytest.raises(TensorParallelError, match="expected an int >= 1"):
        Engine(model, num_pages=30, compile=False, tensor_parallel_size=0)


def test_cli_generate_on_two_ranks_gives_one_ranks_tokens():
    """`fms-paged generate --tensor-parallel-size 2` (the ranks spawned by the CLI), seeded sampling:
    the tokens of one rank."""
    def cli(*extra: str) -> str:
        res = subprocess.run([sys.executable, "-m", "fms_paged.cli", "generate", "--device", "cpu",
                              "--prompt-ids", "1 822 788 2989 2987 2989", "--max-new-tokens", "12",
                              "--temperature", "0.8", "--seed", "3", *extra],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout.strip()

    one = cli()
    assert one
    assert cli("--tensor-parallel-size", "2") == one


def test_a_kernel_or_pool_no_rank_can_run_is_refused_before_a_rank_starts():
    from fms_paged.kv.budget import KVBudgetError

    model = get_model("llama", variant="micro", attn_impl="paged", device="cpu")
    with pytest.raises(ValueError, match="kernel='bogus'"):
        Engine(model, num_pages=30, max_model_len=256, compile=False, kernel="bogus", tensor_parallel_size=2)
    with pytest.raises(KVBudgetError, match="num_pages=3 cannot hold"):
        Engine(model, num_pages=3, max_model_len=256, compile=False, tensor_parallel_size=2)
    assert not torch.distributed.is_initialized() and model.tp is None


def test_engine_and_its_tensor_parallel_driver_do_not_import_each_other():
    """engine.py imports tensor_parallel.py, never the reverse (not even inside a function): the
    workers drive their `Engine` through its public surface, and a spawned rank gets the class to
    build from its parent."""
    tree = ast.parse(Path(tensor_parallel.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {"fms_paged.engine.engine", "fms_paged.engine", "fms_paged"} & imported, imported
    private = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Name) and n.value.id == "engine" and n.attr.startswith("_")}
    assert not private, f"run_worker reaches into the engine's private names {sorted(private)}"
