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
    logits = []  # the model's own output: its head's, and whatever its forward does after (Granite scales)
    hook = model.register_forward_hook(
        lambda mod, args, out: logits.append((out[0] if isinstance(out, tuple) else out).detach().clone()))
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
    every page under one page table, and 2 ranks give the tokens of 1 (and of sdpa_causal), with
    FMS's generate and with our Engine (greedy and seeded sampling)."""
    one = run_tp(1, hf_dir, tmp_path / "one")[0]
    two = run_tp(2, hf_dir, tmp_path / "two")
    assert one["tokens"] == one["sdpa_tokens"]
    assert [len(t) for t in one["engine_tokens"]] == [16] * 3
    assert one["engine_tokens"][0] == one["tokens"][0]  # greedy: FMS's tokens
    for r, rank in enumerate(two):
        assert rank["world"] == 2 and rank["kvheads"] == 1 and one["kvheads"] == 2
        assert rank["tokens"] == one["tokens"] and rank["sdpa_tokens"] == one["tokens"]
        assert rank["engine_tokens"] == one["engine_tokens"]  # every rank returns rank 0's
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


# ------------------------------------------------------------------------------ every FMS decoder
# Each architecture of `fms.models.list_models()`: served by `Engine(fms_model)` with FMS's tokens
# (small random-weight instances of FMS's own classes, FMS's own `generate` as the reference), or
# refused by name with why; encoders and vision towers are not causal LMs.
TINY = dict(src_vocab_size=256, nheads=4, kvheads=2, nlayers=2, max_expected_seq_len=512)
SERVED = {
    "llama": dict(TINY, emb_dim=64),
    "gpt_bigcode": {k: v for k, v in dict(TINY, emb_dim=64).items() if k != "kvheads"},  # multi-query
    # sliding (128 tokens) and full layers, attention sinks
    "gpt_oss": dict(TINY, emb_dim=64, head_dim=16, num_experts=4,
                    layer_types=["sliding_attention", "full_attention"]),
    # its attention multiplier is FMS's scale_factor
    "granite": dict(TINY, emb_dim=64, head_dim=16, attention_multiplier=0.05, embedding_multiplier=12.0,
                    residual_multiplier=0.22, logits_scaling=8.0),
    # (FMS 1.13's is Granite 4's dense model: Granite's class)
    "granite_moe_hybrid": dict(TINY, emb_dim=64, pad_id=0, attention_multiplier=0.05, logits_scaling=8.0),
    "mistral": dict(TINY, emb_dim=64, head_dim=16),
    "mixtral": dict(TINY, dim=64, hidden_dim=96, num_experts=4),
    "qwen3": dict(TINY, emb_dim=64, head_dim=16),
}
REFUSED = {  # architecture -> (tiny overrides, words the refusal names)
    "bamba": (dict(TINY, emb_dim=64, head_dim=16, attn_layer_indices=[1], mamba_n_heads=4, n_groups=1,
                   state_size=16), "no attention"),
    "granite_swa": (dict(TINY, emb_dim=64, head_dim=16, is_swa_layer=[False, True], pad_id=0),
                    "window_length"),
}
MULTIMODAL = {"llava_next", "mistral3", "ministral3"}
NOT_CAUSAL_LM = {"roberta", "roberta_classification", "roberta_question_answering", "bert",
                 "bert_classification", "mpnet", "siglip_vision"}


def tiny_fms(arch: str, overrides: dict, device) -> torch.nn.Module:
    from fms.models import list_variants

    torch.manual_seed(0)
    model = get_model(arch, list_variants(arch)[0], device_type=device.type, data_type=torch.float32,
                      **overrides).eval()
    # FMS's init is not one to test with: it leaves some of gpt-oss's norms and expert biases and
    # gpt_bigcode's embedding uninitialised, zeroes the sinks, and makes scores so small that the
    # softmax is uniform whatever its scale. Norm scales around 1, small biases, matrices giving
    # activations and scores of order 1, random sinks:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def test_every_fms_architecture_is_classified():
    from fms.models import list_models

    assert set(list_models()) == set(SERVED) | set(REFUSED) | MULTIMODAL | NOT_CAUSAL_LM


SERVED_CASES = [(arch, "auto") for arch in SERVED] + [("gpt_oss", "flex"), ("gpt_oss", "gather")]


@pytest.mark.parametrize("arch,kernel", SERVED_CASES, ids=[f"{a}-{k}" for a, k in SERVED_CASES])
def test_engine_serves_every_fms_decoder(arch, kernel, device, require_kernel):
    """Prompts past gpt-oss's 128-token window, decoding across it: each request's tokens are those
    FMS's generate gives it alone (with FMS's own attention: sdpa_causal, or sdpa_with_sinks), and
    so are the log-probabilities of every step (the 5 largest, to 1e-4: tokens alone may not tell a
    small random model's variants apart). gpt-oss's sinks and windows on every kernel."""
    if kernel != "auto":
        require_kernel(kernel)
    model = tiny_fms(arch, SERVED[arch], device)
    if kernel == "flex" and device.type == "cpu":  # refused: no log-sum-exp from inductor's CPU flex
        with pytest.raises(ValueError, match="flex.*sinks.*log-sum-exp"):
            Engine(model, max_num_seqs=2, num_pages=64, max_model_len=256, kernel="flex")
        return
    prompts = prompts_for(256, lengths=(150, 9, 131), seed=4, device=device)
    new = 10
    ref = []
    for p in prompts:
        out, logits = run_fms_generate(model, [p], new_tokens=new)
        steps = [logits[0][-1]] + [x[0] for x in logits[1:new]]  # the logits each token came from
        top = [torch.log_softmax(x.float(), -1).topk(5).values for x in steps]
        ref.append((out[0, len(p):].tolist(), top))
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=64, num_pages=64, max_model_len=256,
                    compile=False, kernel=kernel)
    windows = {s.window for s in engine.backend.specs}
    assert windows == ({None, 128} if arch == "gpt_oss" else {None})
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, logprobs=5)
    ids = [engine.add_request(p.tolist(), params) for p in prompts]
    got = {i: ([], []) for i in ids}
    for o in engine.stream():
        got[o.request_id][0].extend(o.new_token_ids)
        got[o.request_id][1].extend(o.logprobs)
    # CUDA, mixture of experts: FMS's expert matmuls are a Triton kernel whose fp32 dots run in
    # TF32 (unit roundoff 2**-11 ~ 4.9e-4), tiled by the tokens each expert gets, so a prompt alone
    # and in the engine's batches round differently (up to 2.1e-3 apart on log-probs of order 3
    # on an H100)
    atol = 5e-3 if device.type == "cuda" and arch in ("mixtral", "gpt_oss") else 1e-4
    for i, (tokens, top) in zip(ids, ref):
        assert got[i][0] == tokens
        for lp, want in zip(got[i][1], top):
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), want.cpu(), rtol=0, atol=atol)


@pytest.mark.parametrize("arch", list(REFUSED))
def test_fms_models_we_cannot_compute_are_refused_by_name(arch, device):
    overrides, why = REFUSED[arch]
    model = tiny_fms(arch, overrides, device)
    with pytest.raises(TypeError, match=why) as e:
        Engine(model, max_num_seqs=2, num_pages=16, max_model_len=64)
    assert type(model).__name__ in str(e.value)


@pytest.mark.parametrize("arch", ["llava_next", "mistral3"])
def test_multimodal_fms_models_point_to_their_language_model(arch):
    """(Built from their classes on the meta device: FMS's `get_model` cannot make them small.)"""
    import fms.models as fms_models

    module = getattr(fms_models, arch)
    cls = {"llava_next": "LlavaNext", "mistral3": "Mistral3"}[arch]
    with torch.device("meta"):
        model = getattr(module, cls)(getattr(module, cls + "Config")())
    with pytest.raises(TypeError, match="multimodal.*language_model"):
        plugin.paged_model(model)


def test_engine_serves_fms_model_on_int8_pages(hf_dir, device):
    """FMS's model on 8-bit KV pages (`Engine(kv_cache_dtype="int8")`: FMS's attention op writes and
    reads each layer's pages with that layer's scales): greedy tokens against the same engine on
    16-bit pages, measured as in tests/kv/test_kv_quant.py (tokens before each request's first
    mismatch, summed): at least 90% of them."""
    model = fms_from_hf(hf_dir, device)
    prompts = prompts_for(model.config.src_vocab_size, lengths=(5, 17, 9), seed=3, device=device)
    outs = {}
    for kv in ("auto", "int8"):
        engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, max_model_len=128,
                        compile=False, kv_cache_dtype=kv)
        for scales in engine.backend.k_scales:  # (8-bit pools are allocated untouched: any values)
            if scales is not None:
                scales.zero_()
        ids = [engine.add_request(p.tolist(), SamplingParams(max_new_tokens=12, ignore_eos=True))
               for p in prompts]
        got = {i: [] for i in ids}
        for o in engine.stream():
            got[o.request_id] += o.new_token_ids
        outs[kv] = [got[i] for i in ids]
        if kv == "int8":
            assert engine.backend.k_scales[0].abs().sum() > 0  # FMS's op wrote the scales
    agree = sum(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                for a, b in zip(outs["auto"], outs["int8"]))
    assert agree >= 0.9 * 3 * 12, outs
