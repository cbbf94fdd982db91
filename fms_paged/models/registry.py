"""Model registry in the FMS style: `register_model(arch, variant, factory)`, `get_model`, `list_models`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fms_paged import native
from fms_paged.device import default_page_size, resolve_device, resolve_dtype
from fms_paged.models import hugepages
from fms_paged.modules.quantized import DEFAULT_GROUP_SIZE, check_scheme, quantize_model

# architecture -> variant -> factory(**config_overrides) -> nn.Module (on the meta device is fine)
_REGISTRY: dict[str, dict[str, Callable[..., nn.Module]]] = {}

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_model"


def register_model(architecture: str, variant: str, factory: Callable[..., nn.Module]) -> None:
    variants = _REGISTRY.setdefault(architecture, {})
    if variant in variants:
        raise KeyError(f"variant {variant!r} of architecture {architecture!r} is already registered")
    variants[variant] = factory


def list_models(architecture: str | None = None) -> list[str]:
    """`list_models()` -> architectures; `list_models("llama")` -> its variants."""
    if architecture is None:
        return sorted(_REGISTRY)
    if architecture not in _REGISTRY:
        raise KeyError(f"unknown architecture {architecture!r}; known: {sorted(_REGISTRY)}")
    return sorted(_REGISTRY[architecture])


def default_model_path() -> Path:
    """The project's embedded default model (see fms_paged/assets/default_model/README.md)."""
    override = os.environ.get("FMS_PAGED_DEFAULT_MODEL")
    return Path(override) if override else DEFAULT_MODEL_DIR


def get_model(
    architecture: str = "llama",
    variant: str | None = None,
    model_path: str | os.PathLike | None = None,
    attn_impl: str = "sdpa",
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    seed: int | None = 0,
    progress: bool | None = None,
    quantization: str | None = None,
    quantization_group_size: int = DEFAULT_GROUP_SIZE,
    **config_overrides: Any,
) -> nn.Module:
    """Build a registered variant with random weights, or load a Hugging Face checkpoint directory
    of a family we load (its config.json's `architectures` decides: `fms_paged.models.families`),
    or a GGUF file (or a directory holding one): `fms_paged.models.gguf`.

    With neither `variant` nor `model_path`, loads the project's embedded default model.
    The weights do not depend on `attn_impl`; only the attention backend does. The KV page size
    is the device's default (`fms_paged.device.DEFAULT_PAGE_SIZE`) unless `page_size=` is given.
    `device="auto"` picks cuda > mps > cpu; `dtype=None` keeps the checkpoint's dtype (a variant's
    parameters are fp32). A variant's random init draws from the default generators seeded with
    `seed` and restored after it (`seeded_rng`: the caller's RNG is left as it was; None: drawn from
    the global RNG as it stands), in the dtype asked for (the model never exists in fp32 first); a
    checkpoint ignores `seed`. A checkpoint is read tensor by tensor into the model's parameters,
    converted to `dtype` as it is read (`fms_paged.models.hf.load_hf`); `progress` shows a bar over
    its bytes (None: on a terminal, for a load past a couple of seconds; False: never). Other keyword
    arguments override
    `LLaMAConfig` fields (e.g. `linear_impl="torch"`).

    `quantization` ("int8" | "int4", vLLM's name; None: off): the decoder's projections quantized
    right after the weights are in, each full-precision weight dropped as it is replaced
    (`fms_paged.modules.quantized`: int8 per output channel, int4 per group of
    `quantization_group_size` input channels); recorded on `model.config`. Checked before anything
    loads where it can be (the scheme, the group size, the device): `QuantizationError`.
    """
    if quantization is not None:
        check_scheme(quantization, quantization_group_size, resolve_device(device))
    dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    config_overrides.setdefault("page_size", default_page_size(dev))
    if variant is not None and model_path is not None:
        raise ValueError("pass either variant= or model_path=, not both")
    if variant is None and model_path is None:
        model_path = default_model_path()
        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(
                f"no variant or model_path given and the default model is missing at {model_path}; "
                f"pass variant= one of {list_models(architecture) if architecture in _REGISTRY else []}"
            )
    if model_path is not None:  # config.json names the family; `architecture` must not contradict it
        from fms_paged.models.gguf import is_gguf, load_gguf
        from fms_paged.models.hf import load_hf

        if is_gguf(model_path):  # a .gguf file: llama.cpp's format
            if quantization is not None:  # quantize on load starts from the dequantized weights
                config_overrides["gguf_blocks"] = False
            model = load_gguf(model_path, attn_impl=attn_impl, device=dev, dtype=dt, **config_overrides)
        else:
            model = load_hf(model_path, attn_impl=attn_impl, device=dev, dtype=dt, progress=progress,
                            **config_overrides)
        if architecture not in ("llama", model.config.family):
            raise ValueError(f"architecture={architecture!r}, but {model_path} holds a "
                             f"{model.config.family!r} checkpoint (config.json decides: leave it out)")
        return _frozen_if_inference(_quantized(model, quantization, quantization_group_size))

    if architecture not in _REGISTRY:
        raise KeyError(f"unknown architecture {architecture!r}; known: {list_models()}")
    if variant not in _REGISTRY[architecture]:
        raise KeyError(
            f"unknown variant {variant!r} for architecture {architecture!r}; "
            f"known variants: {list_models(architecture)}"
        )
    with torch.device("meta"):
        model = _REGISTRY[architecture][variant](attn_impl=attn_impl, **config_overrides)
    native.prebuild_model(dev, dt or torch.float32, model.config.head_dim, attn_impl)  # beside the init
    if dt is not None:  # on the meta device: an 8B model in bf16 never exists in fp32 on the device
        model = model.to(dt)
    model = model.to_empty(device=dev)
    if seed is None:
        model.reset_parameters()
    else:
        with seeded_rng(dev, seed):
            model.reset_parameters()
    if dev.type == "cpu":  # (a checkpoint's CPU weights are loaded into huge pages by load_hf)
        hugepages.place_in_huge_pages(model)
    return _frozen_if_inference(_quantized(model.eval(), quantization, quantization_group_size))


@contextlib.contextmanager
def seeded_rng(device: torch.device, seed: int) -> Iterator[None]:
    """The default generators of the CPU and of `device` seeded with `seed` inside the block, and
    put back as they were after it: a variant's random init is reproducible without reseeding the
    caller's global RNG. A draw inside gives what it gives after `torch.manual_seed(seed)` (the same
    generators, the same seed); generators of other devices are neither read nor changed."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        forked, device_type = [index], "cuda"
    elif device.type == "cpu":
        forked, device_type = [], "cuda"  # the CPU's generator alone (fork_rng always keeps the CPU's)
    else:
        forked, device_type = [0], device.type  # mps: one device
    with torch.random.fork_rng(devices=forked, device_type=device_type):
        torch.random.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.default_generators[forked[0]].manual_seed(seed)
        elif device.type != "cpu":
            getattr(torch, device.type).manual_seed(seed)
        yield


def _quantized(model: nn.Module, quantization: str | None, group_size: int) -> nn.Module:
    """`quantize_model`, then on the CPU the parameters left (embedding, norms, head, biases) moved
    into a huge-page arena of their own: the loader's arena held every weight, and is unmapped only
    once none of its tensors is left, so without the move the full-precision projections' memory
    would stay with it."""
    if quantization is None:
        return model
    model = quantize_model(model, quantization, group_size)
    if model.device.type == "cpu":
        hugepages.place_in_huge_pages(model)
    return model


def _frozen_if_inference(model: torch.nn.Module) -> torch.nn.Module:
    """A model loaded under `torch.inference_mode()` holds inference tensors, which can never be
    recorded for autograd: its parameters say so (requires_grad=False), so that running it later
    with grad enabled does not fail on the first op that would save them for backward."""
    if torch.is_inference_mode_enabled():
        model.requires_grad_(False)
    return model
