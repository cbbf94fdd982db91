"""The `"paged_flex"` op inside IBM Foundation Model Stack against FMS's own `sdpa_causal`.

References are FMS itself: the same FMS model run by FMS's `generate` with its default attention
(`sdpa_causal`, a contiguous cache and a padding mask). Tolerance: 1e-5 relative to the largest
logit (fp32; the two paths sum attention in a different order). Greedy tokens must be identical.
FMS models run on the test device (`--device`); the tensor-parallel case stays on the CPU (gloo).
ibm-fms is optional: this module skips without it (test_fms_installed.py makes CI's CPU job, which
installs the extra, fail loudly instead).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fms", reason="ibm-fms is not installed (pip install 'fms_paged[fms]')")

from fms.models import get_model  # noqa: E402
from fms.utils.generation import generate as fms_generate  # noqa: E402
from fms.utils.generation import pad_input_ids  # noqa: E402

from fms_paged import Engine, SamplingParams  # noqa: E402
from fms_paged.integrations import fms as plugin  # noqa: E402
from tests.conftest import make_hf_llama  # noqa: E402

LENGTHS = (5, 17, 40, 9)
DECODE_STEPS = 32


def fms_micro(kvheads: int, device: torch.device) -> torch.nn.Module:
    """FMS's own `llama` / `micro` variant (192 wide, 4 heads, 5 layers), random weights."""
    torch.manual_seed(0)
    return get_model("llama", "micro", device_type=device.type, data_type=torch.float32,
                     kvheads=kvheads).eval()


def prompts_for(vocab: int, lengths=LENGTHS, seed: int = 1, device="cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).to(device) for n in lengths]


def run_fms_generate(model, prompts, cache=None, new_tokens=DECODE_STEPS + 1):
    """FMS generate (greedy), with sdpa_causal (cache=None) or our op; -> (tokens [B, S + new],
    logits of each forward: the real positions of the prefill [sum(len), V], then [B, V] per
    decode step)."""
    logits = []
    hook = model.head.register_forward_hook(lambda mod, args, out: logits.append(out.detach().clone()))
    try:
        if cache is None:
            ids, extra = pad_input_ids(prompts)
            hook_fn = None
        else:
            ids, extra = cache.pad_input_ids(prompts)
            hook_fn = cache.prepare_model_inputs_hook
        with torch.no_grad():
            out = fms_generate(model, ids, max_new_tokens=new_tokens, use_cache=True,
                               do_sample=False, extra_kwargs=extra, prepare_model_inputs_hook=hook_fn)
    finally:
        hook.remove()
    S = ids.shape[1]
    real = torch.cat([logits[0][b, S - len(p):] for b, p in enumerate(prompts)])
    return out, [real] + [x[:, -1] for x in logits[1:]]


def assert_same_run(got, ref) -> None:
    out, logits = got
    ref_out, ref_logits = ref
    assert len(logits) == len(ref_logits) == DECODE_STEPS + 1
    for i, (a, b) in enumerate(zip(logits, ref_logits)):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel <= 1e-5, f"forward {i} (0 = prefill): logits differ by {rel:.2e} relative"
    assert torch.equal(out, ref_out)


@pytest.mark.parametrize(
    "kvheads,kernel",
    [(0, "auto"), (2, "auto"), (2, "gather")],
    ids=["mha-flex", "gqa-flex", "gqa-gather"],
)
def test_fms_generate_matches_sdpa(kvheads, kernel, device):
    model = fms_micro(kvheads, device)
    assert model.config.nheads // (kvheads or model.config.nheads) == (2 if kvheads else 1)
    prompts = prompts_for(model.config.src_vocab_size, device=device)
    ref = run_fms_generate(model, prompts)
    cache = plugin.PagedFMSCache(model, max_batch=4, max_seq_len=128, kernel=kernel)
    got = run_fms_generate(model, prompts, cache)
    assert_same_run(got, ref)
    # each sequence holds exactly its own tokens (pads are not stored)
    want = [len(p) + DECODE_STEPS for p in prompts]
    assert [cache.backend.pm.length(s) for s in range(len(prompts))] == want
    # a second batch on the same cache starts clean
    again = run_fms_generate(model, prompts[:2], cache)
    ref2 = run_fms_generate(model, prompts[:2])
    assert torch.equal(again[0], ref2[0])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A Hugging Face LLaMA checkpoint (GQA 2:1, random weights) written by transformers."""
    path = tmp_path_factory.mktemp("fms_hf") / "ckpt"
    make_hf_llama(num_attention_heads=4, num_key_value_heads=2).save_pretrained(path)
    return path


def fms_from_hf(path: Path, device: torch.device, **kw) -> torch.nn.Module:
    return get_model("hf_pretrained", model_path=str(path), device_type=device.type,
                     data_type=torch.float32, **kw).eval()


def test_fms_hf_checkpoint_matches_sdpa(hf_dir, device):
    model = fms_from_hf(hf_dir, device)
    assert (model.config.nheads, model.config.kvheads) == (4, 2)
    prompts = prompts_for(model.config.src_vocab_size, seed=2, device=device)
    ref = run_fms_generate(model, prompts)
    got = run_fms_generate(model, prompts, plugin.PagedFMSCache(model, 4, 128))
    assert_same_run(got, ref)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_engine_serves_fms_model(hf_dir, compile, device):
    """Our Engine serving the FMS model (more requests than rows, so some wait and join later)
    gives each request the tokens FMS's own generate gives it alone."""
    model = fms_from_hf(hf_dir, device)
    prompts = prompts_for(model.config.src_vocab_size, lengths=(5, 17, 40, 9, 3, 23), seed=3, device=device)
    new = 12
    ref = []
    for p in prompts:
        out, _ = run_fms_generate(model, [p], new_tokens=new)
        ref.append(out[0, len(p):].tolist())
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=32, num_pages=64,
                    max_model_len=128, compile=compile)
    assert isinstance(engine.model, plugin.PagedFMSModel)
    ids = [engine.add_request(p.tolist(), SamplingParams(max_new_tokens=new, ignore_eos=True))
           for p in prompts]
    got = {i: [] for i in ids}
    for o in engine.stream():
        got[o.request_id] += o.new_token_ids
    assert [got[i] for i in ids] == ref
    assert engine.metrics()["kv_pages_used"] == 0  # no request holds a page (some stay cached)
    engine.reset_prefix_cache()
    assert engine.pm.num_free_pages == engine.pm.num_pages - 1  # every page returned


TP_WORKER = Path(__file__).with_name("fms_tp_worker.py")


def run_tp(nproc: int, ckpt: Path, out: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(TP_WORKER), str(ckpt), str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) | {"pools": torch.load(out / f"rank{r}.pt")}
            for r in range(nproc)]


def test_tensor_parallel_two_ranks_equal_one(hf_dir, tmp_path):
    """FMS tensor parallelism (torchrun, gloo): each rank's pool holds its kv heads' slice of
    every page under one page table, and 2 ranks give the tokens of 1 (and of sdpa_causal)."""
    one = run_tp(1, hf_dir, tmp_path / "one")[0]
    two = run_tp(2, hf_dir, tmp_path / "two")
    assert one["tokens"] == one["sdpa_tokens"]
    for r, rank in enumerate(two):
        assert rank["world"] == 2 and rank["kvheads"] == 1 and one["kvheads"] == 2
        assert rank["tokens"] == one["tokens"] and rank["sdpa_tokens"] == one["tokens"]
        assert rank["page_table"] == one["page_table"]
        for (k1, v1), (k2, v2) in zip(one["pools"], rank["pools"]):
            # the slots in use, kv head r of the whole model's pool
            torch.testing.assert_close(k2, k1[:, r : r + 1], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v2, v1[:, r : r + 1], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ registration, errors
def test_register_is_idempotent_and_reimport_safe():
    assert plugin.register() == plugin.register() == "paged_flex"
    again = importlib.reload(plugin)  # a second copy of the module registers nothing new
    assert again.register() == "paged_flex"


def test_register_refuses_a_foreign_op_of_the_same_name(monkeypatch):
    monkeypatch.setattr(plugin, "ATTN_NAME", "sdpa_causal")
    with pytest.raises(KeyError, match="sdpa_causal.*fms.modules.attention"):
        plugin.register()


def test_missing_fms_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fms.modules.attention", None)
    with pytest.raises(ImportError, match=r"fms_paged\[fms\]"):
        plugin.register()


def test_bad_use_is_a_clear_error(device):
    model = fms_micro(2, device)
    ids = torch.tensor([[1, 2, 3]], device=device)
    with pytest.raises(ValueError, match="paged_step"):
        model(ids, position_ids=torch.arange(3, device=device)[None], use_cache=True, attn_name="paged_flex")
    cache = plugin.PagedFMSCache(model, max_batch=2, max_seq_len=64)
    with pytest.raises(ValueError, match="got 3 prompts; expected 1..2"):
        cache.pad_input_ids(prompts_for(256, (3, 4, 5), device=device))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        cache.pad_input_ids([torch.tensor([1, 2], device=device),
                             torch.tensor([], dtype=torch.long, device=device)])
    with pytest.raises(ValueError, match="no batch to prefill"):
        cache.prefill(4)
    with pytest.raises(TypeError, match="expected an FMS decoder model"):
        plugin.paged_model(torch.nn.Linear(2, 2))
