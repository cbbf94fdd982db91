"""Hugging Face checkpoint adapter: config.json -> LLaMAConfig (by the family it names:
`fms_paged.models.families`), safetensors -> our state dict.

Adapter steps (FMS style): read config, pick the family, map tensor names, undo HF's q/k RoPE
permutation (of the q/k weights, biases and per-head norms), check every name and shape, then read
each tensor into its parameter of a model built on the meta device, converting it as it is read
(`safetensors_reader`: no second copy in memory). `save_hf_llama` does
the reverse for LLaMA, so our models are loadable by `transformers` too.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from fms_paged import native
from fms_paged.models import hugepages
from fms_paged.models.families import COMMON_NAMES, FAMILIES, CheckpointError, Family, config_fields
from fms_paged.models.llama import LLaMA, LLaMAConfig
from fms_paged.models.safetensors_reader import ChunkReader, HeaderError, TensorEntry, read_header

__all__ = ["CheckpointError", "config_from_hf", "config_to_hf", "hf_to_ours_name", "load_hf", "load_hf_llama",
           "ours_to_hf_name", "permute_rope", "read_hf_config", "save_hf_llama", "unpermute_rope"]

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _translate(name: str, src: int, names: tuple[tuple[str, str], ...]) -> str | None:
    for pair in names:
        pattern = re.escape(pair[src]).replace(r"\{\}", r"(\d+)")
        m = re.fullmatch(pattern, name)
        if m:
            return pair[1 - src].format(*m.groups())
    return None


def _names(family: Family) -> tuple[tuple[str, str], ...]:
    return family.names + COMMON_NAMES


def hf_to_ours_name(name: str, family: str = "llama") -> str | None:
    return _translate(name, 0, _names(FAMILIES[family]))


def ours_to_hf_name(name: str, family: str = "llama") -> str:
    hf = _translate(name, 1, _names(FAMILIES[family]))
    if hf is None:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return hf


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF "rotate half" q/k layout -> interleaved pairs. w: [heads * D, C], or [heads * D] (a
    bias, a per-head norm with heads=1)."""
    if w.dim() == 1:
        return unpermute_rope(w[:, None], heads)[:, 0]
    out_dim, in_dim = w.shape
    d = out_dim // heads
    return w.view(heads, 2, d // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _unpermute_rope_(w: torch.Tensor, heads: int, reader: ChunkReader) -> None:
    """`w.copy_(unpermute_rope(w, heads))` in place, a head at a time through the reader's scratch
    memory: a load allocates nothing per tensor (temporaries freed between the weights kept
    fragment the heap: some 40 MiB over a Gemma 3 checkpoint's 36 q/k weights, measured)."""
    w3 = w.view(heads, -1, w.shape[-1] if w.dim() == 2 else 1)  # [heads, D, C]
    _, d, c = w3.shape
    for h in range(heads):
        tmp = reader.scratch(w3[h].nbytes).view(w.dtype).view(d, c)
        tmp.copy_(w3[h])
        w3[h].view(d // 2, 2, c).copy_(tmp.view(2, d // 2, c).transpose(0, 1))


def permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved pairs -> HF "rotate half" layout (inverse of `unpermute_rope`)."""
    if w.dim() == 1:
        return permute_rope(w[:, None], heads)[:, 0]
    out_dim, in_dim = w.shape
    d = out_dim // heads
    return w.view(heads, d // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _rope_heads(name: str, config: LLaMAConfig) -> int | None:
    """How many RoPE heads a tensor of ours holds in HF's rotate-half layout (None: not rotated)."""
    if name.endswith(("attn.in_proj.query.weight", "attn.in_proj.query.bias")):
        return config.nheads
    if name.endswith(("attn.in_proj.key.weight", "attn.in_proj.key.bias")):
        return config.kvheads
    if name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):  # one head's worth, per head
        return 1
    return None


def config_from_hf(cfg: dict[str, Any], **overrides: Any) -> LLaMAConfig:
    """config.json (a dict) -> our config for the family it names; CheckpointError for a
    checkpoint we cannot compute exactly, naming the field."""
    _, fields = config_fields(cfg)
    fields.update(overrides)
    try:
        return LLaMAConfig(**fields)
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None


def config_to_hf(config: LLaMAConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A LLaMA config as config.json (`save_hf_llama`)."""
    if config.family != "llama":
        raise ValueError(f"config_to_hf writes LLaMA checkpoints, this model is {config.family!r}")
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.src_vocab_size,
        "hidden_size": config.emb_dim,
        "intermediate_size": config.hidden_dim,
        "num_attention_heads": config.nheads,
        "num_key_value_heads": config.kvheads,
        "num_hidden_layers": config.nlayers,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_expected_seq_len,
        "tie_word_embeddings": config.tie_heads,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return hf


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise CheckpointError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint shard(s) listed in the index are missing: {missing}")
    return files


def read_hf_config(model_path: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    try:
        return json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg_file} not found: not a Hugging Face checkpoint dir") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {cfg_file}: {e}") from None


def load_hf(
    model_path: str | os.PathLike,
    attn_impl: str = "sdpa",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    **config_overrides: Any,
) -> LLaMA:
    """A Hugging Face checkpoint of a family we load (`fms_paged.models.families`) as our model.

    Every shard's header is read and every name and shape checked first (CheckpointError, before
    any data is read); then each tensor is read from its file straight into its parameter's final
    storage, converted to `dtype` as it is read (`safetensors_reader`), so the weights exist once:
    peak memory is the loaded weights plus one read buffer, whatever the checkpoint's dtype.
    `progress`: a bar over the bytes read (tqdm, on stderr); None shows it on a terminal for a load
    that takes more than a couple of seconds, as `transformers` does; False never."""
    path = Path(model_path)
    hf_cfg = read_hf_config(path)
    config = config_from_hf(hf_cfg, attn_impl=attn_impl, **config_overrides)
    # the kernels a paged CPU model needs first, built while its tensors load (the checkpoint's
    # dtype as its config names it, where none is asked for)
    stored = getattr(torch, str(hf_cfg.get("torch_dtype", hf_cfg.get("dtype"))), None)
    native.prebuild_model(torch.device(device), dtype or stored, config.head_dim, attn_impl)
    with torch.device("meta"):
        model = LLaMA(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_heads:
        expected.pop("head.weight")
    plan = _plan(path, config, expected)
    # CPU weights go straight into huge pages (models/hugepages.py); the arena's size takes fp32 for
    # a checkpoint's own dtype (an upper bound: the pages it does not hand out are never backed)
    arena = None
    if torch.device(device).type == "cpu":
        item = (dtype or torch.float32).itemsize
        arena = hugepages.arena_for(math.prod(s) * item for s in expected.values())
    state: dict[str, torch.Tensor] = {}
    reader = ChunkReader()
    total = sum(entry.nbytes for entry, _ in plan)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="Loading weights",
               disable=None if progress is None else not progress, delay=2.0, leave=False)
    with bar:
        file, f = None, None
        try:
            for entry, name in plan:
                if entry.file != file:
                    if f is not None:
                        f.close()
                    file, f = entry.file, open(entry.file, "rb", buffering=0)
                target_dtype = dtype if dtype is not None else entry.dtype
                dst = arena.empty(entry.shape, target_dtype) if arena is not None else None
                if dst is None:  # not CPU, no huge pages, or past the arena (a wider dtype)
                    dst = torch.empty(entry.shape, dtype=target_dtype, device=device)
                state[name] = dst
                if dst.is_meta:  # (a model's shapes alone: nothing to read)
                    continue
                reader.read_into(f, entry, dst, bar)
                heads = _rope_heads(name, config)
                if heads is not None:  # (a permutation: the same values as permuting before converting)
                    _unpermute_rope_(dst, heads, reader)
        except OSError as e:
            raise CheckpointError(f"cannot read {file}: {e}") from None
        except HeaderError as e:  # (a file that shrank since its header was read)
            raise CheckpointError(str(e)) from None
        finally:
            if f is not None:
                f.close()
    model.load_state_dict(state, strict=not config.tie_heads, assign=True)
    if config.tie_heads:
        model.head.weight = model.embedding.weight
    model.reset_buffers()
    return model.eval()


def _plan(path: Path, config: LLaMAConfig, expected: dict[str, torch.Size]) -> list[tuple[TensorEntry, str]]:
    """Every tensor to read (its entry, our name), file by file in the order of its data, after
    checking every name and shape against `expected`: CheckpointError for a tensor we do not know,
    one given twice, one of another shape, or one missing, before any data is read."""
    names = _names(FAMILIES[config.family])
    plan: list[tuple[TensorEntry, str]] = []
    seen: dict[str, Path] = {}
    for file in _checkpoint_files(path):
        try:
            entries = read_header(file)
        except OSError as e:
            raise CheckpointError(f"cannot read {file}: {e}") from None
        except HeaderError as e:  # (it names the file)
            raise CheckpointError(str(e)) from None
        for entry in entries:
            if _IGNORED.fullmatch(entry.name):
                continue
            name = _translate(entry.name, 0, names)
            if name is None or name not in expected:
                raise CheckpointError(f"unexpected tensor {entry.name!r} in {file.name}")
            if name in seen:
                raise CheckpointError(f"tensor {entry.name!r} is in both {seen[name].name} and {file.name}")
            if entry.shape != tuple(expected[name]):
                raise CheckpointError(
                    f"tensor {entry.name!r} has shape {entry.shape}, "
                    f"expected {tuple(expected[name])} for this config"
                )
            seen[name] = file
            plan.append((entry, name))
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing tensors: {missing[:8]}")
    return plan


load_hf_llama = load_hf  # (its name from when LLaMA was the one family)


def save_hf_llama(model: LLaMA, model_path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors in Hugging Face LLaMA format."""
    if model.config.family != "llama":
        raise ValueError(f"save_hf_llama writes LLaMA checkpoints, this model is {model.config.family!r}")
    path = Path(model_path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    dtype = dtype or model.dtype
    tensors = {}
    for name, t in model.state_dict().items():
        if config.tie_heads and name == "head.weight":
            continue
        t = t.detach().to("cpu", dtype)
        heads = _rope_heads(name, config)
        if heads is not None:
            t = permute_rope(t, heads)
        tensors[ours_to_hf_name(name)] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2) + "\n")
