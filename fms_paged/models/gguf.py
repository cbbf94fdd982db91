"""GGUF (llama.cpp's file format) adapter: a `.gguf` file -> our model, read with `gguf`, llama.cpp's
own reader (an optional dependency: `pip install 'fms_paged[gguf]'`).

Steps: open the file (`open_gguf`: each tensor's bytes checked against the file's end and its type
against the supported ones, naming the tensor), write its metadata as the config.json a Hugging
Face checkpoint of the same model would have (`hf_config`), so the families' readers
(`fms_paged.models.families`) pick the family and set our fields as they do for a checkpoint
directory, then stream the tensors (`tensors`: our name, ggml type, shape and the raw blocks, rows
already in our q/k layout) and dequantize each one into the model's parameters as it is read
(`dequantize`; no second copy of the whole model).

What llama.cpp's converter changed, undone here:
- names: `token_embd`, `blk.N.attn_q`, ... (`GGUF_NAMES`) -> the checkpoint's names -> ours;
- q/k rows: for the llama-converted architectures (llama, and Mistral and Granite, which it writes
  as Llama) the converter permuted HF's rotate-half rows into interleaved pairs, which is our layout
  already; the others (qwen2, qwen3, gemma2, gemma3) keep HF's rows, which we unpermute as for a
  checkpoint directory. Rows of every ggml type are independent blocks, so this permutes the raw
  blocks themselves: a kernel that keeps them quantized gets them in our layout.
- Gemma's norms: stored as 1 + w (llama.cpp computes x * w); our Gemma norms compute (1 + w).
- values llama.cpp derives in code rather than storing: Gemma's softmax scale (1/sqrt(head_dim),
  1/sqrt(hidden / heads) for the 27B models), Gemma 3's local-layer RoPE base (10000) and its five
  local layers to one global, Gemma 2's alternating layers; Llama 3.1's RoPE scaling, stored as a
  `rope_freqs` tensor of per-frequency divisors, which we match to the llama3 rule's parameters.

Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (`SUPPORTED_TYPES`: what
Q4_K_M / Q5_K_M / Q8_0 / Q4_0 files hold); others (Q2_K, Q3_K, the IQ and ternary types) are refused.
On the CPU, the decoder's projections stored as Q8_0, Q4_0, Q5_0, Q4_K, Q5_K or Q6_K (`BLOCK_TYPES`:
every tensor of a Q4_K_M / Q5_K_M file but the norms; Q5_0 is what such files hold for rows not a
multiple of 256 wide) are held as the file's blocks (`fms_paged.modules.quantized.BlockLinear`,
run by the qgemv kernel on the blocks, inside the one-call forward), where q/k/v of a layer are
all such (of one type or several: one kernel call computes them) and gate/up alike
(`_kept_as_blocks`); the embedding and the head too. Every other tensor (Q4_1 / Q5_1 ones among
them) is dequantized into the model's dtype. `gguf_blocks=False` dequantizes everything (the
reference the tests compare the kernel with).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fms_paged import native
from fms_paged.models import hugepages
from fms_paged.models.families import CheckpointError
from fms_paged.models.hf import config_from_hf, hf_to_ours_name, unpermute_rope
from fms_paged.models.llama import LLaMA, LLaMAConfig
from fms_paged.modules.positions import rope_inv_freq
from fms_paged.modules.quantized import BLOCK_TYPES, BLOCK_VALUES, BlockEmbedding, BlockLinear, qgemv_kernel

try:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize as _gguf_dequantize
except ImportError:  # optional: only GGUF files need it
    GGUFReader = None  # type: ignore[assignment,misc]

__all__ = ["SUPPORTED_TYPES", "GGUFTensor", "dequantize", "file_summary", "find_gguf", "hf_config", "is_gguf",
           "layer_kernels", "load_gguf", "open_gguf", "tensors"]

# Q4_1 / Q5_0 / Q5_1 too: llama.cpp's quantizer writes Q5_0 / Q5_1 / Q8_0 for a tensor whose rows
# are not a multiple of 256 wide in a Q4_K_M / Q5_K_M file (SmolLM2-135M's 576, Qwen2.5-0.5B's 896)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# general.architecture -> (config.json `architectures`, `model_type`)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "granite": ("GraniteForCausalLM", "granite"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# the architectures llama.cpp's converter writes with q/k rows permuted to interleaved pairs
_PERMUTED = ("llama", "granite")
_GEMMA = ("gemma2", "gemma3")

# (llama.cpp name, Hugging Face name); "{}" is the layer index. `ffn_norm` is the norm before the
# MLP: LLaMA's post_attention_layernorm, Gemma's pre_feedforward_layernorm.
GGUF_NAMES = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("blk.{}.attn_q.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("blk.{}.attn_k.weight", "model.layers.{}.self_attn.k_proj.weight"),
    ("blk.{}.attn_v.weight", "model.layers.{}.self_attn.v_proj.weight"),
    ("blk.{}.attn_q.bias", "model.layers.{}.self_attn.q_proj.bias"),
    ("blk.{}.attn_k.bias", "model.layers.{}.self_attn.k_proj.bias"),
    ("blk.{}.attn_v.bias", "model.layers.{}.self_attn.v_proj.bias"),
    ("blk.{}.attn_q_norm.weight", "model.layers.{}.self_attn.q_norm.weight"),
    ("blk.{}.attn_k_norm.weight", "model.layers.{}.self_attn.k_norm.weight"),
    ("blk.{}.attn_output.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("blk.{}.ffn_gate.weight", "model.layers.{}.mlp.gate_proj.weight"),
    ("blk.{}.ffn_up.weight", "model.layers.{}.mlp.up_proj.weight"),
    ("blk.{}.ffn_down.weight", "model.layers.{}.mlp.down_proj.weight"),
)
_LLAMA_NORMS = (("blk.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),)
_GEMMA_NORMS = (
    ("blk.{}.post_attention_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("blk.{}.ffn_norm.weight", "model.layers.{}.pre_feedforward_layernorm.weight"),
    ("blk.{}.post_ffw_norm.weight", "model.layers.{}.post_feedforward_layernorm.weight"),
)
_ROPE_FREQS = "rope_freqs.weight"


def _require_gguf() -> None:
    if GGUFReader is None:
        raise ImportError("reading a .gguf file needs llama.cpp's `gguf` package: "
                          "pip install 'fms_paged[gguf]'")


def is_gguf(model_path: str | os.PathLike) -> bool:
    """A `.gguf` file, or a directory holding one and no config.json."""
    path = Path(model_path)
    if path.suffix == ".gguf" and not path.is_dir():
        return True
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf"))


def find_gguf(model_path: str | os.PathLike) -> Path:
    """The .gguf file `model_path` names, or the one file a directory holds."""
    path = Path(model_path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) != 1:
            raise CheckpointError(f"{str(path)!r} holds {len(files)} .gguf files "
                                  f"({[f.name for f in files]}); expected one: pass the file itself")
        return files[0]
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    return path


if GGUFReader is not None:
    class _CheckedReader(GGUFReader):
        """`GGUFReader` whose tensor table is checked before it is mapped: each tensor's type is one
        ggml knows and its bytes lie within the file, else CheckpointError naming the tensor (the
        plain reader fails on a short file with a reshape error that names none)."""

        def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
            """The reader's own `_get`, sliced from a plain ndarray view of its memory map: slicing
            `np.memmap` itself runs its Python `__array_finalize__` for every view, and a tokenizer's
            vocabulary is read as ~10^5 small views (SmolLM2's file: 2.4 s to open, 0.4 s so). The
            views still read the mapped file, and they keep the map alive as before."""
            plain = self.__dict__.get("_plain")
            if plain is None or plain.base is not self.data:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            itemsize = np.dtype(dtype).itemsize
            arr = plain[offset : offset + itemsize * count].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                try:
                    qtype = GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise CheckpointError(f"tensor {name!r} has ggml type id {int(raw_dtype[0])}, which gguf "
                                          f"does not know; supported: {', '.join(SUPPORTED_TYPES)}") from None
                block, type_size = GGML_QUANT_SIZES[qtype]
                n = int(np.prod(dims.astype(np.int64)))
                end = int(start_offs + offset[0]) + n * type_size // block
                if n % block or end > size:
                    shape = tuple(reversed(dims.tolist()))
                    raise CheckpointError(f"tensor {name!r} ({qtype.name}, shape {shape}) "
                                          f"ends at byte {end}, past the end of the file ({size} bytes): "
                                          "the file is truncated or corrupt")
            super()._build_tensors(start_offs, fields)


def open_gguf(model_path: str | os.PathLike) -> GGUFReader:
    """The file's reader (memory-mapped: tensors are read when touched); CheckpointError for a file
    that is not a GGUF, is truncated or holds an unknown tensor type."""
    _require_gguf()
    path = find_gguf(model_path)
    try:
        return _CheckedReader(path)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (ValueError, KeyError, IndexError, OSError) as e:  # the reader's own: bad magic, short header
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from None


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


def _tensor(reader: GGUFReader, name: str):
    return next((t for t in reader.tensors if t.name == name), None)


def _llama3_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """The llama3 RoPE scaling whose per-frequency divisors are `freqs` (llama.cpp's `rope_freqs`
    tensor); CheckpointError when no usual one matches."""
    base = rope_inv_freq(head_dim, theta).double()
    for orig in (8192, 4096, 2048, 16384, 32768):
        for factor in (8.0, 32.0, 16.0, 4.0, 2.0, 64.0):
            for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
                scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                           "high_freq_factor": high, "original_max_position_embeddings": orig}
                divisors = base / rope_inv_freq(head_dim, theta, scaling).double()
                if np.allclose(divisors.numpy(), freqs.astype(np.float64), rtol=1e-4):
                    return scaling
    raise CheckpointError(f"tensor {_ROPE_FREQS!r} holds RoPE frequency divisors no llama3 scaling we tried "
                          f"matches (first ones: {freqs[:4].tolist()}); not supported")


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The file's metadata as the config.json of the same model (what `config_from_hf` reads)."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"GGUF general.architecture={arch!r}: not a model we load; supported: "
                              f"{', '.join(ARCHITECTURES)}")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if required and value is None:
            raise CheckpointError(f"GGUF metadata has no {arch}.{key!r}")
        if isinstance(value, list):  # per-layer values (llama.cpp allows them): one value for all
            if len(set(value)) != 1:
                raise CheckpointError(f"GGUF {arch}.{key} differs between layers ({value}): not supported")
            value = value[0]
        return value

    hidden, heads = get("embedding_length", required=True), get("attention.head_count", required=True)
    head_dim = get("attention.key_length") or hidden // heads
    value_dim = get("attention.value_length") or head_dim
    if value_dim != head_dim:
        raise CheckpointError(f"GGUF {arch}.attention.value_length={value_dim} differs from key_length "
                              f"{head_dim}: not supported")
    embd = _tensor(reader, "token_embd.weight")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (int(embd.shape[1]) if embd is not None else None) or (
        len(tokens) if tokens else None)
    architecture, model_type = ARCHITECTURES[arch]
    nlayers = get("block_count", required=True)
    theta = float(get("rope.freq_base", 10_000.0))
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads,
        "num_hidden_layers": nlayers,
        "head_dim": head_dim,
        "intermediate_size": get("feed_forward_length", required=True),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": _tensor(reader, "output.weight") is None,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    kind = get("rope.scaling.type")
    if kind == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise CheckpointError(f"GGUF {arch}.rope.scaling.type={kind!r}: not supported (none, linear)")
    freqs = _tensor(reader, _ROPE_FREQS)
    if freqs is not None:
        cfg["rope_scaling"] = _llama3_scaling(np.asarray(freqs.data, dtype=np.float32), head_dim, theta)
    if arch == "granite":
        cfg.update(embedding_multiplier=get("embedding_scale", 1.0),
                   attention_multiplier=get("attention.scale"),
                   residual_multiplier=get("residual_scale", 1.0), logits_scaling=get("logit_scale", 1.0))
    if arch in _GEMMA:
        big = nlayers == (46 if arch == "gemma2" else 62)  # the 27B models (llama.cpp's rule)
        cfg.update(hidden_activation="gelu_pytorch_tanh", sliding_window=get("attention.sliding_window"),
                   query_pre_attn_scalar=hidden // heads if big else head_dim,
                   attn_logit_softcapping=get("attn_logit_softcapping"),
                   final_logit_softcapping=get("final_logit_softcapping"))
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):  # one flag per layer: true where the layer slides
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern is not None:
            cfg["sliding_window_pattern"] = int(pattern)
        if arch == "gemma3":
            cfg["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10_000.0))
    return cfg


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file as a kernel that keeps it quantized would take it: our parameter name,
    its ggml type, its shape in torch order ([out, in] for a matrix), the raw blocks (a numpy view of
    the file: [out, bytes per row] for a block type, the values for F32 / F16), rows already in our
    q/k layout, and `offset`, a constant to add once dequantized (-1 for Gemma's norms)."""

    name: str
    gguf_name: str
    ggml_type: str
    shape: tuple[int, ...]
    raw: np.ndarray
    offset: float = 0.0


def _gguf_to_hf(name: str, names: tuple[tuple[str, str], ...]) -> str | None:
    for gguf_name, hf_name in names:
        m = re.fullmatch(re.escape(gguf_name).replace(r"\{\}", r"(\d+)"), name)
        if m:
            return hf_name.format(*m.groups())
    return None


def _rope_heads(name: str, config: LLaMAConfig) -> int | None:
    """How many RoPE heads a tensor's rows hold in rotate-half layout (its GGUF name; None: not
    rotated): q's weight and bias, k's, and the per-head q/k norms (one head's worth)."""
    kind = name.split(".")[-2] if name.startswith("blk.") else ""
    return {"attn_q": config.nheads, "attn_k": config.kvheads, "attn_q_norm": 1, "attn_k_norm": 1}.get(kind)


def _our_names(reader: GGUFReader, config: LLaMAConfig) -> Iterator[tuple[str | None, Any]]:
    """(our name, or None where the file's name is not one of this model's; the reader's tensor)
    of each tensor in the file, in file order."""
    arch = _field(reader, "general.architecture")
    names = GGUF_NAMES + (_GEMMA_NORMS if arch in _GEMMA else _LLAMA_NORMS)
    for t in reader.tensors:
        hf_name = _gguf_to_hf(t.name, names)
        yield (hf_to_ours_name(hf_name, config.family) if hf_name is not None else None), t


def tensors(reader: GGUFReader, config: LLaMAConfig) -> Iterator[GGUFTensor]:
    """The file's tensors under our names, in file order; CheckpointError naming a tensor that is
    not part of this model or whose type is not supported (`SUPPORTED_TYPES`)."""
    arch = _field(reader, "general.architecture")
    names = GGUF_NAMES + (_GEMMA_NORMS if arch in _GEMMA else _LLAMA_NORMS)
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:  # read into the config (`hf_config`)
            continue
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise CheckpointError(f"tensor {t.name!r} has ggml type {qtype}, which we do not load; "
                                  f"supported: {', '.join(SUPPORTED_TYPES)}")
        hf_name = _gguf_to_hf(t.name, names)
        name = hf_to_ours_name(hf_name, config.family) if hf_name is not None else None
        if name is None:
            raise CheckpointError(f"unexpected tensor {t.name!r} for a {arch} model")
        raw = t.data
        heads = None if arch in _PERMUTED else _rope_heads(t.name, config)
        if heads is not None:  # rows (whole blocks) back to interleaved pairs
            raw = unpermute_rope(torch.from_numpy(np.array(raw)), heads).numpy()  # (a copy of the rows)
        offset = -1.0 if arch in _GEMMA and t.name.endswith("norm.weight") else 0.0
        yield GGUFTensor(name, t.name, qtype, tuple(int(d) for d in reversed(t.shape.tolist())), raw, offset)


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """The tensor's values as fp32 (F16 and BF16 exactly, block types as llama.cpp dequantizes them)."""
    if t.ggml_type in ("F32", "F16"):
        values = torch.from_numpy(np.array(t.raw, dtype=np.float32))  # a copy: the file's map is read-only
    else:
        qtype = GGMLQuantizationType[t.ggml_type]
        values = torch.from_numpy(_gguf_dequantize(np.ascontiguousarray(t.raw), qtype))
    values = values.reshape(t.shape)
    return values + t.offset if t.offset else values


# our names of a layer's projections (`.weight` after each), the groups one kernel call computes
_QKV = ("attn.in_proj.query", "attn.in_proj.key", "attn.in_proj.value")
_GATE_UP = ("ff_sub_module.wg", "ff_sub_module.w1")
_PROJECTIONS = (*_QKV, "attn.dense", *_GATE_UP, "ff_sub_module.w2")


def _kept_as_blocks(reader: GGUFReader, config: LLaMAConfig) -> dict[str, str]:
    """Our name -> ggml type of each tensor held as its GGUF blocks: projections of a type the qgemv
    kernel reads (`BLOCK_TYPES`), in a layer whose q/k/v are all such (one kernel call computes
    them), gate/up alike; the embedding and the head where they are such (a tied head shares the
    embedding's blocks)."""
    kinds = {name: t.tensor_type.name for name, t in _our_names(reader, config)
             if name is not None and t.tensor_type.name in BLOCK_TYPES}
    kept = {n: kinds[n] for n in ("embedding.weight", "head.weight") if n in kinds}
    for i in range(config.nlayers):
        for group in (_QKV, ("attn.dense",), _GATE_UP, ("ff_sub_module.w2",)):
            full = [f"layers.{i}.{p}.weight" for p in group]
            if all(n in kinds for n in full):
                kept.update({n: kinds[n] for n in full})
    return kept


def _file_dtype(reader: GGUFReader) -> torch.dtype:
    """The dtype a model loads in when none is asked for: BF16 / F16 when every matrix is stored so,
    else fp32 (what llama.cpp computes block types in)."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    return {frozenset({"BF16"}): torch.bfloat16, frozenset({"F16"}): torch.float16}.get(frozenset(kinds),
                                                                                       torch.float32)


def load_gguf(
    model_path: str | os.PathLike,
    attn_impl: str = "sdpa",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    gguf_blocks: bool = True,
    **config_overrides: Any,
) -> LLaMA:
    """A GGUF file (or a directory holding one) as our model, each tensor dequantized into its
    parameter in `dtype` (None: `_file_dtype`) as it is read, except on the CPU (with
    `gguf_blocks`) the projections held as their blocks (`_kept_as_blocks`). Raises
    before returning anything when a tensor is missing, unexpected, of the wrong shape, of an
    unsupported type or cut short."""
    reader = open_gguf(model_path)
    path = find_gguf(model_path)
    config = config_from_hf(hf_config(reader), attn_impl=attn_impl, **config_overrides)
    dtype = dtype or _file_dtype(reader)
    native.prebuild_model(torch.device(device), dtype, config.head_dim, attn_impl)
    with torch.device("meta"):
        model = LLaMA(config)
    kept = _kept_as_blocks(reader, config) if gguf_blocks and torch.device(device).type == "cpu" else {}
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_heads:
        expected.pop("head.weight")
    if "embedding.weight" in kept:  # a BlockEmbedding (a tied head: a BlockLinear on its blocks, below)
        kind = kept["embedding.weight"]
        with torch.device("meta"):
            blocks = torch.empty(config.src_vocab_size, config.emb_dim // BLOCK_VALUES[kind],
                                 BLOCK_TYPES[kind], dtype=torch.uint8)
        model.embedding = BlockEmbedding(blocks, kind, dtype)
    for name, kind in kept.items():  # each such projection a BlockLinear (on meta, filled below)
        if name == "embedding.weight":
            continue
        parent_name, attr = name.removesuffix(".weight").rpartition(".")[::2]
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        n, k = old.weight.shape
        with torch.device("meta"):
            blocks = torch.empty(n, k // BLOCK_VALUES[kind], BLOCK_TYPES[kind], dtype=torch.uint8)
            bias = None if old.bias is None else torch.empty(n, dtype=old.bias.dtype)
        setattr(parent, attr, BlockLinear(blocks, kind, bias))
    state: dict[str, torch.Tensor] = {}
    # CPU weights go straight into huge pages, as a checkpoint's do (models/hugepages.py)
    arena = None
    if torch.device(device).type == "cpu":
        arena = hugepages.arena_for(math.prod(s) * dtype.itemsize
                                    for n, s in expected.items() if n not in kept)
    for t in tensors(reader, config):
        if t.name not in expected:
            raise CheckpointError(f"{path.name}: unexpected tensor {t.gguf_name!r} for this config")
        if t.shape != tuple(expected[t.name]):
            raise CheckpointError(f"{path.name}: tensor {t.gguf_name!r} has shape {t.shape}, expected "
                                  f"{tuple(expected[t.name])} for this config")
        if t.name in kept:  # the file's blocks themselves, one copy out of the map
            n, k = t.shape
            blocks = torch.from_numpy(np.array(t.raw, dtype=np.uint8))
            blocks = blocks.reshape(n, k // BLOCK_VALUES[t.ggml_type], BLOCK_TYPES[t.ggml_type])
            state[t.name.removesuffix("weight") + "blocks"] = blocks
            continue
        try:
            values = dequantize(t)
        except (ValueError, IndexError) as e:
            raise CheckpointError(f"{path.name}: tensor {t.gguf_name!r} ({t.ggml_type}) cannot be read: "
                                  f"{e}") from None
        dst = arena.empty(values.shape, dtype) if arena is not None else None
        if dst is None:  # not CPU, or no huge pages
            state[t.name] = values.to(device=device, dtype=dtype).contiguous()
        else:
            state[t.name] = dst.copy_(values)
    for name in kept:
        expected.pop(name)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{path.name} is missing tensors: {missing[:8]}")
    model.load_state_dict(state, strict=not config.tie_heads, assign=True)
    if config.tie_heads and type(model.embedding) is BlockEmbedding:  # one copy of the blocks for both
        model.head = BlockLinear(model.embedding.blocks, model.embedding.ggml_type)
    elif config.tie_heads:
        model.head.weight = model.embedding.weight
    model.reset_buffers()
    return model.eval()


def file_summary(model_path: str | os.PathLike) -> dict[str, str]:
    """What `fms-paged info x.gguf` says of a file: its architecture, how its weights run, and per
    layer ("layer 3") each tensor's ggml type ("attn_q Q4_K, ..., ffn_down Q6_K"), the tensors
    outside the layers under "other"."""
    reader = open_gguf(model_path)
    per: dict[str, list[str]] = {}
    for t in reader.tensors:
        short = t.name.removesuffix(".weight")
        m = re.match(r"blk\.(\d+)\.(.*)$", short)
        key, short = (f"layer {int(m.group(1))}", m.group(2)) if m else ("other", short)
        per.setdefault(key, []).append(f"{short} {t.tensor_type.name}")
    kinds = sorted({t.tensor_type.name for t in reader.tensors})
    out = {"file": str(find_gguf(model_path)), "architecture": str(_field(reader, "general.architecture")),
           "tensor types": ", ".join(kinds),
           "kernel": "on the CPU, Q8_0 / Q4_0 / Q5_0 / Q4_K / Q5_K / Q6_K projections, embedding and head "
                     "held as the file's blocks and "
                     "run by the fms_paged qgemv kernel (int8 activations per block of 32, integer dot "
                     "products, for decode rows, bf16 panels for prefill where the CPU has "
                     "AVX512_BF16), inside the one-call forward (`layers`: each layer's); every other "
                     "tensor dequantized at load into the model's dtype (fp32 for block types unless "
                     "--dtype) and run by that dtype's GEMMs"}
    layers = sorted((k for k in per if k != "other"), key=lambda k: int(k.split()[1]))
    out.update({k: ", ".join(per[k]) for k in layers + (["other"] if "other" in per else [])})
    return out


def layer_kernels(model_path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, str]:
    """What `fms-paged info x.gguf` says of each layer ("layer 3"): its projections' format and the
    kernel that runs each on the CPU, as `load_gguf` holds them (`_kept_as_blocks`), read from
    the file's table without loading a weight; then the embedding's and the head's. Projections
    alike are one line ("GGUF Q4_0 blocks, fms_paged qgemv (...) (7 projections)"), else each
    format names its projections."""
    reader = open_gguf(model_path)
    config = config_from_hf(hf_config(reader))
    dtype = dtype or _file_dtype(reader)
    kept = _kept_as_blocks(reader, config)
    types = {name: t.tensor_type.name for name, t in _our_names(reader, config) if name is not None}
    dt = str(dtype).removeprefix("torch.")
    qgemv = qgemv_kernel()

    def fmt(name: str) -> str:
        if name in kept:
            return f"GGUF {kept[name]} blocks, {qgemv}"
        return f"{types.get(name, 'absent')} held as {dt}, the {dt} GEMV / GEMM"

    out = {}
    for i in range(config.nlayers):
        by_fmt: dict[str, list[str]] = {}
        for p in _PROJECTIONS:
            by_fmt.setdefault(fmt(f"layers.{i}.{p}.weight"), []).append(p.rsplit(".", 1)[-1])
        if len(by_fmt) == 1:
            (f, mods), = by_fmt.items()
            out[f"layer {i}"] = f"{f} ({len(mods)} projections)"
        else:
            out[f"layer {i}"] = "; ".join(f"{', '.join(mods)}: {f}" for f, mods in by_fmt.items())
    emb = "embedding.weight"
    out["embedding"] = (f"GGUF {kept[emb]} blocks, rows dequantized per lookup into {dt}" if emb in kept
                        else fmt(emb).split(",")[0])
    head = "embedding.weight" if config.tie_heads else "head.weight"
    out["head"] = fmt(head) + (" (tied: the embedding's)" if config.tie_heads else "")
    return out
