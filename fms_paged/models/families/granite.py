"""Granite 3.x: Llama with four multipliers: embeddings times `embedding_multiplier`, the softmax
scale `attention_multiplier`, each block's output times `residual_multiplier` before the residual
add, logits divided by `logits_scaling`."""

from fms_paged.models.families.base import MICRO, Family, refuse


def fields(cfg: dict) -> dict:
    refuse(cfg, "Granite", attention_bias=False, mlp_bias=False)
    return {
        "emb_scale": float(cfg.get("embedding_multiplier", 1.0)),
        "attn_scale": float(cfg["attention_multiplier"]) if cfg.get("attention_multiplier") else None,
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
    }


FAMILY = Family("granite", ("GraniteForCausalLM",), "granite", fields,
                summary="embedding, attention, residual multipliers and logits scaling",
                presets={"micro": {**MICRO, "family": "granite", "emb_scale": 12.0, "attn_scale": 1 / 16,
                                   "residual_multiplier": 0.22, "logits_scaling": 8.0}})
