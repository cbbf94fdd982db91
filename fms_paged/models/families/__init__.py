"""The model families `get_model(model_path=...)` loads from Hugging Face checkpoints, one adapter
each: which transformers architectures it names, how its config.json sets our decoder's fields
(`fms_paged.models.llama.LLaMAConfig`), its tensor names. config.json's `architectures` picks it."""

from __future__ import annotations

from typing import Any

from fms_paged.models.families import gemma, granite, llama, mistral, qwen
from fms_paged.models.families.base import COMMON_NAMES, CheckpointError, Family, common_fields

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, mistral.FAMILY, qwen.QWEN2, qwen.QWEN3, granite.FAMILY, gemma.GEMMA2, gemma.GEMMA3)}
ARCHITECTURES: dict[str, Family] = {a: f for f in FAMILIES.values() for a in f.architectures}

__all__ = ["ARCHITECTURES", "COMMON_NAMES", "FAMILIES", "CheckpointError", "Family", "family_of",
           "config_fields", "supported_architectures"]


def supported_architectures() -> list[str]:
    """The transformers architectures (config.json `architectures`) we load."""
    return sorted(ARCHITECTURES)


def family_of(cfg: dict[str, Any]) -> Family:
    """The family config.json names in `architectures` (a config without it: `model_type` llama);
    CheckpointError listing the supported ones otherwise."""
    names = cfg.get("architectures") or (["LlamaForCausalLM"] if cfg.get("model_type", "llama") == "llama"
                                         else [])
    for name in names:
        if name in ARCHITECTURES:
            family = ARCHITECTURES[name]
            if cfg.get("model_type", family.model_type) != family.model_type:
                raise CheckpointError(f"config.json model_type={cfg['model_type']!r} does not match its "
                                      f"architectures {names} (model_type {family.model_type!r})")
            return family
    got = names or f"none (model_type={cfg.get('model_type')!r})"
    raise CheckpointError(f"config.json architectures {got}: not a model we load; supported: "
                          f"{', '.join(supported_architectures())}")


def config_fields(cfg: dict[str, Any]) -> tuple[Family, dict[str, Any]]:
    """config.json -> (its family, the `LLaMAConfig` fields it sets)."""
    family = family_of(cfg)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or family.activations[0]
    if act not in family.activations:
        raise CheckpointError(f"config.json hidden_act={act!r}: {family.name} checkpoints compute "
                              f"{' or '.join(family.activations)}")
    fields = {**common_fields(cfg), "family": family.name, **family.fields(cfg)}
    return family, fields
