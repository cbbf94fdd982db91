"""Qwen2 / Qwen2.5 (bias on q, k and v) and Qwen3 (an RMSNorm over each head of q and k, its own
head_dim): Llama otherwise. Both may slide a window over the layers from `max_window_layers` on
(`use_sliding_window`; off in the published checkpoints)."""

from fms_paged.models.families.base import MICRO, Family, layer_types, refuse, sliding_fields


def _windows(cfg: dict) -> dict:
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    first = cfg.get("max_window_layers") or 0
    return sliding_fields(window, layer_types(cfg, lambda i: window is not None and i >= first))


def qwen2_fields(cfg: dict) -> dict:
    refuse(cfg, "Qwen2", mlp_bias=False)
    return {"attn_bias": True, **_windows(cfg)}


def qwen3_fields(cfg: dict) -> dict:
    refuse(cfg, "Qwen3", attention_bias=False, mlp_bias=False)  # its o_proj would have one too
    return {"qk_norm": True, **_windows(cfg)}


_MIXED = ("full_attention",) + ("sliding_attention",) * (MICRO["nlayers"] - 1)
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", qwen2_fields,
               summary="q/k/v bias, optional sliding-window layers",
               presets={"micro": {**MICRO, "family": "qwen2", "attn_bias": True, "sliding_window": 256,
                                  "layer_types": _MIXED}})
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", qwen3_fields,
               summary="q/k RMSNorm per head, optional sliding-window layers",
               presets={"micro": {**MICRO, "family": "qwen3", "qk_norm": True, "head_dim": 32,
                                  "sliding_window": 256, "layer_types": _MIXED}})
