"""Gemma 2 and Gemma 3 (text): GeGLU, norms scaling by (1 + w) in fp32, a norm after attention
and after the MLP too, embeddings times sqrt(hidden_size) (rounded to the model's dtype), the
softmax scale `query_pre_attn_scalar ** -0.5`, local (sliding-window) and global layers.
Gemma 2 alternates them and soft-caps attention logits (`attn_logit_softcapping`) and the final
logits (`final_logit_softcapping`); Gemma 3 has five local layers to a global one, a RoPE base of
their own for the local layers (`rope_local_base_freq`) and an RMSNorm over each head of q and k.
Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration) are not text-only models and
are refused; its 1B and 270M checkpoints are."""

from fms_paged.models.families.base import (
    MICRO,
    CheckpointError,
    Family,
    layer_types,
    need,
    refuse,
    rope,
    sliding_fields,
)

# Gemma's names for its four norms of a layer
NAMES = (
    ("model.layers.{}.post_attention_layernorm.weight", "layers.{}.post_attn_ln.weight"),
    ("model.layers.{}.pre_feedforward_layernorm.weight", "layers.{}.ff_ln.weight"),
    ("model.layers.{}.post_feedforward_layernorm.weight", "layers.{}.post_ff_ln.weight"),
)


def _common(cfg: dict, family: str) -> dict:
    refuse(cfg, family, attention_bias=False, use_bidirectional_attention=False)
    return {
        "activation": "gelu_tanh",
        "sandwich_norm": True,
        "norm_unit_offset": True,
        "emb_scale": float(need(cfg, "hidden_size")) ** 0.5,
        "emb_scale_in_dtype": True,
        "attn_scale": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256) ** -0.5,
        "attn_softcap": cfg.get("attn_logit_softcapping"),
        "final_softcap": cfg.get("final_logit_softcapping"),
        "tie_heads": bool(cfg.get("tie_word_embeddings", True)),
    }


def gemma2_fields(cfg: dict) -> dict:
    types = layer_types(cfg, lambda i: (i + 1) % 2 == 1)  # local, global, local, ...
    return {**_common(cfg, "Gemma 2"), **sliding_fields(cfg.get("sliding_window"), types)}


def gemma3_fields(cfg: dict) -> dict:
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    types = layer_types(cfg, lambda i: (i + 1) % pattern != 0)  # five local layers, one global
    local_theta, local_scaling = rope(cfg, "sliding_attention")
    if "rope_local_base_freq" in cfg:
        local_theta, local_scaling = float(cfg["rope_local_base_freq"]), None
    if local_scaling is not None:
        raise CheckpointError(f"Gemma 3 local layers with RoPE scaling {local_scaling}: not supported")
    theta, scaling = rope(cfg, "full_attention")
    return {**_common(cfg, "Gemma 3"), **sliding_fields(cfg.get("sliding_window"), types),
            "qk_norm": True, "rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
_LOCAL, _GLOBAL = "sliding_attention", "full_attention"
_MICRO = {**MICRO, "activation": "gelu_tanh", "sandwich_norm": True, "norm_unit_offset": True, "head_dim": 32,
          "emb_scale": 8.0, "emb_scale_in_dtype": True, "attn_scale": 32**-0.5, "tie_heads": True,
          "sliding_window": 256}
GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",), "gemma2", gemma2_fields, NAMES, GEMMA_ACTIVATIONS,
                summary="GeGLU, sandwich norms, attention and final logit soft-caps, alternating "
                        "local/global layers",
                presets={"micro": {**_MICRO, "family": "gemma2", "attn_softcap": 50.0, "final_softcap": 30.0,
                                   "layer_types": (_LOCAL, _GLOBAL, _LOCAL)}})
GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM",), "gemma3_text", gemma3_fields, NAMES, GEMMA_ACTIVATIONS,
                summary="GeGLU, sandwich norms, q/k norms, 5 local : 1 global layers, local RoPE base",
                presets={"micro": {**_MICRO, "family": "gemma3", "qk_norm": True, "rope_theta": 1e6,
                                   "rope_local_theta": 1e4,
                                   "layer_types": (_LOCAL, _LOCAL, _GLOBAL)}})
