"""fms_paged: a paged KV cache for an FMS-style LLaMA, inside plain PyTorch."""

from fms_paged.engine import Engine, RequestOutput, SamplingParams
from fms_paged.generation import generate
from fms_paged.models import LLaMA, LLaMAConfig, get_model, list_models, register_model
from fms_paged.tokenizers import load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "LLaMA",
    "LLaMAConfig",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "generate",
    "get_model",
    "list_models",
    "load_tokenizer",
    "register_model",
]
