"""Llama (1, 2, 3.x): the base decoder as it is (RoPE with llama3 scaling, GQA, SwiGLU)."""

from fms_paged.models.families.base import Family, refuse


def fields(cfg: dict) -> dict:
    refuse(cfg, "Llama", attention_bias=False, mlp_bias=False)
    return {}


# its variants are `fms_paged.models.llama`'s presets
FAMILY = Family("llama", ("LlamaForCausalLM",), "llama", fields, summary="RoPE (llama3 scaling), GQA, SwiGLU")
