"""Who builds a served model from a checkpoint directory: our families (`get_model`), or IBM FMS
(`fms.models.get_model("hf_pretrained", ...)`, then served through our paged attention op:
`fms_paged.integrations.fms`), for `fms-paged serve --loader`."""

from __future__ import annotations

import os

import torch

from fms_paged.device import resolve_device, resolve_dtype
from fms_paged.models.families import CheckpointError, family_of
from fms_paged.models.gguf import is_gguf
from fms_paged.models.hf import read_hf_config

LOADERS = ("auto", "ours", "fms")


def choose_loader(model_dir: str | os.PathLike, loader: str = "auto") -> str:
    """"ours" for a GGUF file (`fms_paged.models.gguf`); else `loader` itself (checked), or for
    "auto": "ours" when config.json names a family we load,
    else "fms" when IBM FMS is installed (it loads more decoders: gpt_bigcode, mixtral, gpt-oss...),
    else CheckpointError saying both."""
    if loader not in LOADERS:
        raise ValueError(f"loader={loader!r}; expected one of {LOADERS}")
    if is_gguf(model_dir):  # a GGUF file: ours alone reads them
        if loader == "fms":
            raise CheckpointError(f"{model_dir} is a GGUF file: loader='fms' reads Hugging Face checkpoints; "
                                  "use loader='ours' (or 'auto')")
        return "ours"
    if loader != "auto":
        return loader
    try:
        family_of(read_hf_config(model_dir))
        return "ours"
    except CheckpointError as ours:
        try:
            import fms  # noqa: F401
        except ImportError:
            raise CheckpointError(f"{ours} (IBM FMS, which loads more decoders, is not installed: pip "
                                  "install 'fms_paged[fms]')") from None
        return "fms"


def load_for_engine(model_dir: str | os.PathLike, loader: str = "auto", device: str = "auto",
                    dtype: str | torch.dtype | None = None, page_size: int | None = None,
                    quantization: str | None = None, quantization_group_size: int = 128) -> torch.nn.Module:
    """The model an `Engine` serves from `model_dir`: ours with attn_impl="paged", or FMS's model
    wrapped for the engine (`fms_paged.integrations.fms.paged_model`, EOS from config.json).
    `quantization`: `get_model`'s (ours only: FMS's model is refused with it)."""
    if choose_loader(model_dir, loader) == "ours":
        from fms_paged.models.registry import get_model

        overrides = {} if page_size is None else {"page_size": page_size}
        return get_model(model_path=model_dir, attn_impl="paged", device=device, dtype=dtype,
                         quantization=quantization, quantization_group_size=quantization_group_size,
                         **overrides)
    if quantization is not None:
        from fms_paged.modules.quantized import QuantizationError

        raise QuantizationError(f"quantization={quantization!r} applies to the models we load; {model_dir} "
                                "is loaded by IBM FMS (loader='fms'): drop --quantization or use ours")
    from fms.models import get_model as fms_get_model

    from fms_paged.integrations.fms import paged_model

    dev, dt = resolve_device(device), resolve_dtype(dtype)
    model = fms_get_model("hf_pretrained", model_path=str(model_dir), device_type=dev.type,
                          data_type=dt).eval()
    if dev.index is not None:
        model = model.to(dev)
    eos = read_hf_config(model_dir).get("eos_token_id")
    return paged_model(model, page_size, tuple(eos) if isinstance(eos, list) else eos)
