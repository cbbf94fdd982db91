"""Our LLaMA against transformers.LlamaForCausalLM on the same random weights (fp32).

Tolerance 1e-4 (the issue's bound); observed differences are ~1e-7, i.e. fp32 round-off from a
different but equivalent RoPE layout (interleaved pairs vs rotate-half + weight permutation).
Our model runs on the test device (`--device`); the HF reference stays on the CPU (fp32), and our
logits are compared there.
"""

import json

import pytest
import torch

from fms_paged import generate, get_model
from fms_paged.models.hf import load_hf_llama, permute_rope, save_hf_llama, unpermute_rope


@pytest.mark.parametrize("name", ["mha", "gqa", "llama3"])
def test_logits_match_hf(hf_checkpoint, name, device):
    hf, path = hf_checkpoint(name)
    ours = get_model(model_path=path, device=device)
    torch.manual_seed(1)
    x = torch.randint(0, 256, (3, 200))  # 200 > original_max_position_embeddings: scaling matters
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x.to(device)).cpu()
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint(hf_checkpoint, device):
    hf, path = hf_checkpoint("gqa", max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "checkpoint was not sharded"
    ours = get_model(model_path=path, device=device)
    x = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        assert (ours(x.to(device)).cpu() - hf(x).logits).abs().max().item() <= 1e-4


def test_rope_parameters_field(hf_checkpoint, device):
    """transformers 5 writes `rope_parameters`; published Llama 3 configs carry the older fields.
    Both spellings of the same settings must load to the same model."""
    hf, path = hf_checkpoint("llama3")
    cfg = json.loads((path / "config.json").read_text())
    legacy = dict(cfg)
    params = legacy.pop("rope_parameters", None)
    if params is not None:  # rewrite as the older spelling
        legacy["rope_theta"] = params["rope_theta"]
        legacy["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    else:  # rewrite as the newer spelling
        legacy["rope_parameters"] = dict(legacy.pop("rope_scaling"), rope_theta=legacy.pop("rope_theta"))
    (path / "config.json").write_text(json.dumps(legacy))
    ours = get_model(model_path=path, device=device)
    assert ours.config.rope_theta == 500_000.0
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    x = torch.randint(0, 256, (1, 300))
    with torch.no_grad():
        assert (ours(x.to(device)).cpu() - hf(x).logits).abs().max().item() <= 1e-4


def test_dtype_honoured(hf_checkpoint, device):
    _, path = hf_checkpoint("gqa")
    ours = get_model(model_path=path, device=device, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 and p.device == ours.device for p in ours.parameters())
    assert ours.device.type == device.type


def test_greedy_generate_matches_hf_batch(hf_checkpoint, hf_greedy, device):
    """A batch of 6 mixed-length prompts x 32 new tokens: same tokens as HF generate (left-padded)."""
    hf, path = hf_checkpoint("gqa")
    ours = get_model(model_path=path, device=device)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 9, 33, 2, 24)]
    got = generate(ours, prompts, max_new_tokens=32, eos_id=None)
    assert got == hf_greedy(hf, prompts, 32)


def test_save_roundtrip_loads_in_transformers(tmp_path, device):
    from transformers import LlamaForCausalLM

    ours = get_model(variant="micro", device=device, seed=5)
    save_hf_llama(ours, tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    again = load_hf_llama(tmp_path, device=device)
    x = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert (hf(x).logits - ours(x.to(device)).cpu()).abs().max().item() <= 1e-4
        assert torch.equal(again(x.to(device)), ours(x.to(device)))


def test_rope_permutation_inverse():
    w = torch.randn(8 * 16, 32)
    assert torch.equal(permute_rope(unpermute_rope(w, 8), 8), w)
