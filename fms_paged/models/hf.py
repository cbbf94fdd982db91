"""Hugging Face LLaMA checkpoint adapter: config.json -> LLaMAConfig, safetensors -> our state dict.

Adapter steps (FMS style): read config, map tensor names, undo HF's q/k RoPE permutation, check every
name and shape, then load in place into a model built on the meta device (no second copy in memory).
`save_hf_llama` does the reverse, so our models are loadable by `transformers` too.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fms_paged.models.llama import LLaMA, LLaMAConfig


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (bad names, shapes, files or config)."""


# (Hugging Face name, our name); "{}" is the layer index
_NAME_MAP = [
    ("model.embed_tokens.weight", "embedding.weight"),
    ("model.norm.weight", "dec_norm.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.layers.{}.input_layernorm.weight", "layers.{}.ln.weight"),
    ("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ff_ln.weight"),
    ("model.layers.{}.self_attn.q_proj.weight", "layers.{}.attn.in_proj.query.weight"),
    ("model.layers.{}.self_attn.k_proj.weight", "layers.{}.attn.in_proj.key.weight"),
    ("model.layers.{}.self_attn.v_proj.weight", "layers.{}.attn.in_proj.value.weight"),
    ("model.layers.{}.self_attn.o_proj.weight", "layers.{}.attn.dense.weight"),
    ("model.layers.{}.mlp.gate_proj.weight", "layers.{}.ff_sub_module.wg.weight"),
    ("model.layers.{}.mlp.up_proj.weight", "layers.{}.ff_sub_module.w1.weight"),
    ("model.layers.{}.mlp.down_proj.weight", "layers.{}.ff_sub_module.w2.weight"),
]
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _translate(name: str, src: int) -> str | None:
    for pair in _NAME_MAP:
        pattern = re.escape(pair[src]).replace(r"\{\}", r"(\d+)")
        m = re.fullmatch(pattern, name)
        if m:
            return pair[1 - src].format(*m.groups())
    return None


def hf_to_ours_name(name: str) -> str | None:
    return _translate(name, 0)


def ours_to_hf_name(name: str) -> str:
    hf = _translate(name, 1)
    if hf is None:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return hf


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF "rotate half" q/k layout -> interleaved pairs. w: [heads * D, C]."""
    out_dim, in_dim = w.shape
    d = out_dim // heads
    return w.view(heads, 2, d // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved pairs -> HF "rotate half" layout (inverse of `unpermute_rope`)."""
    out_dim, in_dim = w.shape
    d = out_dim // heads
    return w.view(heads, d // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _rope_fields(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """RoPE theta and scaling from either `rope_theta` + `rope_scaling` or `rope_parameters`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10_000.0))
        kind = params.get("rope_type", "default")
        scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
        return float(theta), scaling
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10_000.0)), scaling


def config_from_hf(cfg: dict[str, Any], **overrides: Any) -> LLaMAConfig:
    def need(key: str):
        if key not in cfg:
            raise CheckpointError(f"config.json has no {key!r} (is this a LLaMA checkpoint?)")
        return cfg[key]

    if cfg.get("model_type", "llama") != "llama":
        raise CheckpointError(f"config.json model_type={cfg['model_type']!r}; expected 'llama'")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={cfg['hidden_act']!r}; only 'silu' is supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise CheckpointError("attention_bias / mlp_bias checkpoints are not supported")
    hidden, nheads = need("hidden_size"), need("num_attention_heads")
    head_dim = cfg.get("head_dim") or hidden // nheads
    if head_dim != hidden // nheads:
        raise CheckpointError(f"head_dim={head_dim} != hidden_size/num_attention_heads")
    theta, scaling = _rope_fields(cfg)
    fields: dict[str, Any] = dict(
        src_vocab_size=need("vocab_size"),
        emb_dim=hidden,
        nheads=nheads,
        kvheads=cfg.get("num_key_value_heads") or nheads,
        nlayers=need("num_hidden_layers"),
        hidden_grow_factor=need("intermediate_size") / hidden,
        multiple_of=1,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_expected_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_heads=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )
    fields.update(overrides)
    return LLaMAConfig(**fields)


def config_to_hf(config: LLaMAConfig, dtype: torch.dtype) -> dict[str, Any]:
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.src_vocab_size,
        "hidden_size": config.emb_dim,
        "intermediate_size": config.hidden_dim,
        "num_attention_heads": config.nheads,
        "num_key_value_heads": config.kvheads,
        "num_hidden_layers": config.nlayers,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_expected_seq_len,
        "tie_word_embeddings": config.tie_heads,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return hf


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise CheckpointError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint shard(s) listed in the index are missing: {missing}")
    return files


def read_hf_config(model_path: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    try:
        return json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg_file} not found: not a Hugging Face checkpoint dir") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {cfg_file}: {e}") from None


def load_hf_llama(
    model_path: str | os.PathLike,
    attn_impl: str = "sdpa",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> LLaMA:
    path = Path(model_path)
    hf_cfg = read_hf_config(path)
    config = config_from_hf(hf_cfg, attn_impl=attn_impl, **config_overrides)
    with torch.device("meta"):
        model = LLaMA(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_heads:
        expected.pop("head.weight")
    state: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {file}: {e}") from None
        with handle as f:
            for hf_name in f.keys():
                if _IGNORED.fullmatch(hf_name):
                    continue
                name = hf_to_ours_name(hf_name)
                if name is None or name not in expected:
                    raise CheckpointError(f"unexpected tensor {hf_name!r} in {file.name}")
                t = f.get_tensor(hf_name)
                if t.shape != expected[name]:
                    raise CheckpointError(
                        f"tensor {hf_name!r} has shape {tuple(t.shape)}, "
                        f"expected {tuple(expected[name])} for this config"
                    )
                if name.endswith("attn.in_proj.query.weight"):
                    t = unpermute_rope(t, config.nheads)
                elif name.endswith("attn.in_proj.key.weight"):
                    t = unpermute_rope(t, config.kvheads)
                target_dtype = dtype if dtype is not None else t.dtype
                state[name] = t.to(device=device, dtype=target_dtype).contiguous()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing tensors: {missing[:8]}")
    model.load_state_dict(state, strict=not config.tie_heads, assign=True)
    if config.tie_heads:
        model.head.weight = model.embedding.weight
    model.reset_buffers()
    return model.eval()


def save_hf_llama(model: LLaMA, model_path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors in Hugging Face LLaMA format."""
    path = Path(model_path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    dtype = dtype or model.dtype
    tensors = {}
    for name, t in model.state_dict().items():
        if config.tie_heads and name == "head.weight":
            continue
        t = t.detach().to("cpu", dtype)
        if name.endswith("attn.in_proj.query.weight"):
            t = permute_rope(t, config.nheads)
        elif name.endswith("attn.in_proj.key.weight"):
            t = permute_rope(t, config.kvheads)
        tensors[ours_to_hf_name(name)] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2) + "\n")
