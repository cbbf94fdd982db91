"""What a model family is to the loader (`Family`), and the readers of config.json fields that
several families share.

A family maps a Hugging Face `config.json` onto `LLaMAConfig` fields (`Family.fields`: what it
sets beyond the fields every family has, `common_fields`) and its tensor names onto ours
(`Family.names`, beyond the names every family has). Readers accept both spellings of a setting:
the published checkpoints' (`rope_theta`, `rope_scaling`, `use_sliding_window`,
`sliding_window_pattern`, ...) and transformers 5's (`rope_parameters`, `layer_types`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (bad names, shapes, files or config)."""


# (Hugging Face name, our name) for every family; "{}" is the layer index
COMMON_NAMES = (
    ("model.embed_tokens.weight", "embedding.weight"),
    ("model.norm.weight", "dec_norm.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.layers.{}.input_layernorm.weight", "layers.{}.ln.weight"),
    ("model.layers.{}.self_attn.q_proj.weight", "layers.{}.attn.in_proj.query.weight"),
    ("model.layers.{}.self_attn.k_proj.weight", "layers.{}.attn.in_proj.key.weight"),
    ("model.layers.{}.self_attn.v_proj.weight", "layers.{}.attn.in_proj.value.weight"),
    ("model.layers.{}.self_attn.q_proj.bias", "layers.{}.attn.in_proj.query.bias"),
    ("model.layers.{}.self_attn.k_proj.bias", "layers.{}.attn.in_proj.key.bias"),
    ("model.layers.{}.self_attn.v_proj.bias", "layers.{}.attn.in_proj.value.bias"),
    ("model.layers.{}.self_attn.q_norm.weight", "layers.{}.attn.q_norm.weight"),
    ("model.layers.{}.self_attn.k_norm.weight", "layers.{}.attn.k_norm.weight"),
    ("model.layers.{}.self_attn.o_proj.weight", "layers.{}.attn.dense.weight"),
    ("model.layers.{}.mlp.gate_proj.weight", "layers.{}.ff_sub_module.wg.weight"),
    ("model.layers.{}.mlp.up_proj.weight", "layers.{}.ff_sub_module.w1.weight"),
    ("model.layers.{}.mlp.down_proj.weight", "layers.{}.ff_sub_module.w2.weight"),
)
# LLaMA's name for the norm before the MLP (Gemma uses it for the norm after attention)
LLAMA_NORMS = (("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ff_ln.weight"),)


@dataclass(frozen=True)
class Family:
    """One family of checkpoints: the `architectures` (transformers classes) config.json may name
    and its `model_type`, the `LLaMAConfig` fields it sets from config.json beyond
    `common_fields` (`fields`), and its tensor names beyond `COMMON_NAMES` (`names`)."""

    name: str
    architectures: tuple[str, ...]
    model_type: str
    fields: Callable[[dict[str, Any]], dict[str, Any]]
    names: tuple[tuple[str, str], ...] = LLAMA_NORMS
    activations: tuple[str, ...] = ("silu",)  # hidden_act values it computes (as ours are named)
    summary: str = ""  # what sets it apart, for `fms-paged info`
    # random-weight variants registered under the family's name (`get_model(name, variant)`):
    # variant -> LLaMAConfig fields
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)


# the shape of every family's "micro" variant (tests, examples): its own fields on top
MICRO = dict(src_vocab_size=256, emb_dim=64, nheads=4, kvheads=2, nlayers=3, hidden_grow_factor=2.5,
             multiple_of=16, max_expected_seq_len=4096)


def need(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise CheckpointError(f"config.json has no {key!r}")
    return cfg[key]


def refuse(cfg: dict[str, Any], family: str, **unsupported: Any) -> None:
    """CheckpointError naming the first field of `unsupported` whose config.json value is set and
    differs from the value given (the one we compute)."""
    for key, ok in unsupported.items():
        value = cfg.get(key)
        if value not in (None, ok):
            raise CheckpointError(f"config.json {key}={value!r}: not supported for {family} checkpoints "
                                  f"(expected {ok!r})")


def rope(cfg: dict[str, Any], layer_type: str | None = None) -> tuple[float, dict | None]:
    """RoPE theta and scaling from `rope_parameters` (one dict, or one per layer type) or from
    `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    elif isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10_000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
        return float(theta), scaling
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10_000.0)), scaling


def layer_types(cfg: dict[str, Any], default: Callable[[int], bool]) -> tuple[str, ...]:
    """Each layer's type: config.json's `layer_types`, else "sliding_attention" where
    `default(layer)` says (the family's rule when the field is absent)."""
    n = need(cfg, "num_hidden_layers")
    given = cfg.get("layer_types")
    if given is not None:
        if len(given) != n:
            raise CheckpointError(f"config.json layer_types has {len(given)} entries for {n} layers")
        return tuple(given)
    return tuple("sliding_attention" if default(i) else "full_attention" for i in range(n))


def sliding_fields(window: int | None, types: tuple[str, ...]) -> dict[str, Any]:
    """`sliding_window` / `layer_types` fields: none when no layer slides."""
    if window is None or "sliding_attention" not in types:
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": int(window), "layer_types": types}


def common_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `LLaMAConfig` fields every family reads the same way."""
    hidden, nheads = need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
    theta, scaling = rope(cfg, "full_attention")
    eos = cfg.get("eos_token_id")
    return dict(
        src_vocab_size=need(cfg, "vocab_size"),
        emb_dim=hidden,
        nheads=nheads,
        kvheads=cfg.get("num_key_value_heads") or nheads,
        nlayers=need(cfg, "num_hidden_layers"),
        head_dim=cfg.get("head_dim") or hidden // nheads,
        hidden_grow_factor=need(cfg, "intermediate_size") / hidden,
        multiple_of=1,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_expected_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_heads=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        # several EOS ids (Llama 3.1 instruct): a tuple, every one of them stops a request
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )
