"""Shared fixtures: tiny random Hugging Face LLaMA checkpoints built in the test (no network)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HF_CONFIGS = {
    # (a) plain multi-head attention
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    # (b) grouped-query attention 4:1
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    # (c) llama3 RoPE: large theta + frequency scaling
    "llama3": dict(
        num_attention_heads=4, num_key_value_heads=1, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
}


def make_hf_llama(seed: int = 0, **overrides):
    """A random-weight transformers LlamaForCausalLM (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    # HF inits norms to ones; randomise them so the norm weights are actually tested
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: (hf_model, checkpoint_dir) saved with save_pretrained (safetensors)."""

    def build(name: str = "gqa", max_shard_size: str | None = None, **overrides):
        cfg = dict(HF_CONFIGS.get(name, {}))
        cfg.update(overrides)
        model = make_hf_llama(**cfg)
        path = tmp_path / name
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, safe_serialization=True, **kwargs)
        return model, path

    return build


@pytest.fixture
def hf_greedy():
    """HF `generate` on a batch of mixed-length prompts (left-padded, as HF batches): new tokens."""

    def run(hf, prompts, max_new_tokens):
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, width:].tolist()

    return run


class NoHostSync(TorchDispatchMode):
    """Fails on every aten op that reads device memory back to the host.

    On CPU, `.tolist()` / `.numpy()` and boolean-mask indexing do not dispatch a sync op, so the
    hot path is also run on `device="meta"` (no data at all: any read-back raises there) and
    boolean indices (a hidden `nonzero` on CUDA) are refused here.
    """

    BANNED = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.seen.append(name)
        if name in self.BANNED or "_local_scalar" in name:
            raise AssertionError(f"host sync: aten.{name}")
        if name.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args
            if isinstance(a, (list, tuple))
            for i in a
        ):
            raise AssertionError(f"host sync: aten.{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_host_sync():
    """The `NoHostSync` dispatch mode (a class: `with no_host_sync() as mode: ...`)."""
    return NoHostSync
