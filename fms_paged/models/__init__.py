"""Models: the decoder (LLaMA and the families' fields), its presets registered as variants of
each family ("llama", "mistral", "qwen2", ...), and the checkpoint loader."""

from fms_paged.models.families import FAMILIES
from fms_paged.models.llama import _LLAMA_VARIANTS, LLaMA, LLaMAConfig
from fms_paged.models.registry import (
    DEFAULT_MODEL_DIR,
    default_model_path,
    get_model,
    list_models,
    register_model,
)


def _llama_factory(config: LLaMAConfig):
    def factory(**overrides) -> LLaMA:
        return LLaMA(config.updated(**overrides))

    return factory


for _name, _cfg in _LLAMA_VARIANTS.items():
    register_model("llama", _name, _llama_factory(_cfg))
for _family in FAMILIES.values():
    for _name, _fields in _family.presets.items():
        register_model(_family.name, _name, _llama_factory(LLaMAConfig(**_fields)))

__all__ = [
    "DEFAULT_MODEL_DIR",
    "LLaMA",
    "LLaMAConfig",
    "default_model_path",
    "get_model",
    "list_models",
    "register_model",
]
