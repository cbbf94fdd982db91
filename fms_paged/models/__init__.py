"""Models: the LLaMA, its presets registered as variants of "llama", and the checkpoint loader."""

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

__all__ = [
    "DEFAULT_MODEL_DIR",
    "LLaMA",
    "LLaMAConfig",
    "default_model_path",
    "get_model",
    "list_models",
    "register_model",
]
