"""Weight-only quantized projections ("quantize on load", vLLM's `quantization="int8" | "int4"`),
computed by ATen's CPU kernels, the ones torchao's int8/int4 weight-only configs run on the CPU
(torchao itself is not needed):

- int8: per-output-channel symmetric, w ~= q * scale[n], q in [-127, 127];
  `torch.ops.aten._weight_int8pack_mm(x [M, K], q int8 [N, K], scales [N])`.
- int4: per group of `group_size` input channels (32, 64, 128 or 256; torchao's default 128),
  affine with a scale and a zero point, w ~= (q - 8) * scale[n, g] + zero[n, g], q in [0, 15];
  `torch.ops.aten._convert_weight_to_int4pack_for_cpu` packs q (two per byte) once, and
  `torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K], packed, group_size, scales_and_zeros
  [K / group_size, N, 2])` runs it.

Both kernels take activations in fp32, bf16 or fp16 with the scales in the same dtype, a 2-D x,
and accumulate in fp32; int4 also wants N a multiple of 16 and K a multiple of the group size.
What they cannot do is refused with a `QuantizationError` naming the reason, before any weight
changes. They are CPU kernels: on CUDA ATen's int4 kernel is another one (`_weight_int4pack_mm`,
tinygemm's layout, bf16 only), not wired here, so a CUDA model is refused.

A `QuantizedLinear` holds the quantized weight alone (no full-precision copy): `quantize_model`
replaces the decoder's projections one by one, each full-precision weight dropped as its
replacement is made. The embedding and the LM head stay in the model's dtype (the head is a small
share of the weight bytes of the models we run, and its error lands on every logit directly).
A model so quantized has no one-call C++ forward (`LLaMABlock.fused_weights` is None for it):
its layers run module by module.

`BlockLinear` holds a GGUF file's Q8_0, Q4_0, Q5_0, Q4_K, Q5_K or Q6_K weight as the file's own
blocks (uint8 [N, K / block values, bytes per block]: `BLOCK_TYPES`, ggml's block bytes, no
repacking and no full-precision copy; layouts in csrc/kernels/qgemv_blocks.h), computed by the
project's kernel on those blocks (`csrc/kernels/qgemv.cpp`, `torch.ops.fms_paged.qlinear`): each
row of x quantized to int8 per block of 32 and integer dot products, llama.cpp's scheme. Unlike
`QuantizedLinear` it runs inside the one-call C++ forward (`fms_paged::DecoderStack` takes the
blocks as a projection's weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fms_paged import native
from fms_paged.modules.linear import Linear

__all__ = ["BLOCK_TYPES", "BLOCK_VALUES", "BlockEmbedding", "BlockLinear", "DEFAULT_GROUP_SIZE",
           "GROUP_SIZES", "QUANTIZATIONS", "QuantizationError", "QuantizedLinear", "dequantize_blocks",
           "qgemv_isa", "qgemv_kernel", "check", "check_scheme", "describe", "layer_formats",
           "quantize_model", "quantize_weight"]

QUANTIZATIONS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)  # what `_weight_int4pack_mm_for_cpu` takes
DEFAULT_GROUP_SIZE = 128  # torchao's Int4WeightOnlyConfig default
INT4_N_MULTIPLE = 16  # `_convert_weight_to_int4pack_for_cpu` wants N % 16 == 0
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNELS = {"int8": "aten _weight_int8pack_mm", "int4": "aten _weight_int4pack_mm_for_cpu"}
# the GGUF block types the qgemv kernel reads -> bytes per block (csrc/kernels/qgemv_blocks.h)
BLOCK_TYPES = {"Q8_0": 34, "Q4_0": 18, "Q5_0": 22, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# -> values per block: 32, or 256 for the K-quants (a row of K values is K / this many blocks)
BLOCK_VALUES = {"Q8_0": 32, "Q4_0": 32, "Q5_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
QK = 32  # values per block of x's int8 quantization (and per Q8_0 / Q4_0 / Q5_0 block)


class QuantizationError(ValueError):
    """A quantization the kernels cannot run: the scheme, group size, shape, dtype or device."""


def check_scheme(scheme: str, group_size: int, device: torch.device) -> None:
    """Raise `QuantizationError` for what no weight of `scheme` could run: an unknown scheme, an
    int4 group size the kernel lacks, a device without the kernels."""
    if scheme not in QUANTIZATIONS:
        raise QuantizationError(f"quantization={scheme!r}; expected one of {QUANTIZATIONS} (or None)")
    if scheme == "int4" and group_size not in GROUP_SIZES:
        raise QuantizationError(f"int4 group size {group_size!r}; the kernel takes one of {GROUP_SIZES}")
    if device.type != "cpu":
        raise QuantizationError(
            f"quantization={scheme!r} runs ATen's CPU kernels ({KERNELS[scheme]}); the model is on {device}: "
            "the CUDA int4 kernel (_weight_int4pack_mm, tinygemm layout) is not wired here: load on the CPU "
            "or without quantization")


def check(scheme: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
          group_size: int = DEFAULT_GROUP_SIZE, name: str = "weight") -> None:
    """Raise `QuantizationError` where `scheme` cannot serve a weight [N, K] of `dtype` on `device`."""
    check_scheme(scheme, group_size, device)
    if dtype not in ACT_DTYPES:
        raise QuantizationError(f"quantization={scheme!r}: {name} is {dtype}; the kernels take "
                                f"{', '.join(map(str, ACT_DTYPES))}")
    n, k = shape
    if scheme == "int4":
        if k % group_size:
            raise QuantizationError(f"int4 group size {group_size} does not divide {name}'s input width "
                                    f"K={k}; pick one of {GROUP_SIZES} that divides it")
        if n % INT4_N_MULTIPLE:
            raise QuantizationError(f"int4: {name} has N={n} output rows; the kernel's packing wants a "
                                    f"multiple of {INT4_N_MULTIPLE}")


def quantize_weight(weight: torch.Tensor, scheme: str, group_size: int = DEFAULT_GROUP_SIZE
                    ) -> dict[str, torch.Tensor]:
    """The quantized tensors of `weight` [N, K] (computed in fp32; scales in the weight's dtype):
    int8: {"qweight": int8 [N, K], "scales": [N]}; int4: {"qweight": int32 [N, K] in [0, 15]
    (unpacked), "scales_zeros": [K / group_size, N, 2]}."""
    w = weight.detach().float()
    n, k = w.shape
    if scheme == "int8":
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
        scales = scales.to(weight.dtype).float()  # the kernel's scales: rounded before q is chosen
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return {"qweight": q, "scales": scales.to(weight.dtype)}
    wg = w.reshape(n, k // group_size, group_size)  # [N, G, g]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, G]
    scales = ((hi - lo) / 15).clamp(min=1e-6).to(weight.dtype).float()
    zeros = (lo + 8 * scales).to(weight.dtype).float()  # w = (q - 8) * scale + zero
    q = torch.round((wg - zeros[..., None]) / scales[..., None] + 8).clamp(0, 15).to(torch.int32)
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)  # [G, N, 2]
    return {"qweight": q.reshape(n, k), "scales_zeros": sz}


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b with W held quantized (`scheme` "int8" or "int4", see the module docstring),
    computed by ATen's kernel. Inference only (no gradient to the weight). Activations must be in
    the dtype of the scales (the model's dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str,
                 group_size: int = DEFAULT_GROUP_SIZE):
        super().__init__()
        check(scheme, tuple(weight.shape), weight.dtype, weight.device, group_size)
        self.scheme = scheme
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size if scheme == "int4" else None
        self.act_dtype = weight.dtype
        parts = quantize_weight(weight, scheme, group_size)
        if scheme == "int8":
            self.register_buffer("qweight", parts["qweight"])
            self.register_buffer("scales", parts["scales"])
        else:
            # [N, K / 2] uint8, two per byte in the kernel's layout
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(parts["qweight"], 1)
            self.register_buffer("qweight", packed)
            self.register_buffer("scales_zeros", parts["scales_zeros"])
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def kernel(self) -> str:
        return KERNELS[self.scheme]

    def describe(self) -> str:
        """The format and kernel, as `fms-paged info` says them (e.g. "int4 g128, aten ...")."""
        fmt = "int8 per-channel" if self.scheme == "int8" else f"int4 g{self.group_size}"
        return f"{fmt}, {self.kernel}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if x.dtype != self.act_dtype:
            raise QuantizationError(f"{self.scheme} projection: x is {x.dtype}; its scales are "
                                    f"{self.act_dtype} (the kernel wants both in one dtype)")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.scheme == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size,
                                                           self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The weight [N, K] the kernel computes with, in `dtype` (the tests' reference)."""
        if self.scheme == "int8":
            return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]
        n, k, g = self.out_features, self.in_features, self.group_size
        eye = torch.eye(k, dtype=torch.float32)  # the kernel applied to the identity: W^T exactly in fp32
        # (scales and zeros as fp32 here: the fp32 kernel reproduces (q - 8) * s + z without rounding
        # beyond fp32's)
        wt = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, g, self.scales_zeros.float())
        q = torch.round((wt.T.double().reshape(n, k // g, g) - self._zeros64()[..., None])
                        / self._scales64()[..., None] + 8)
        return ((q - 8) * self._scales64()[..., None] + self._zeros64()[..., None]).reshape(n, k).to(dtype)

    def _scales64(self) -> torch.Tensor:
        return self.scales_zeros[..., 0].T.double()  # [N, G]

    def _zeros64(self) -> torch.Tensor:
        return self.scales_zeros[..., 1].T.double()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.describe()}"


def qgemv_isa() -> str:
    """How the qgemv kernel built for `native.isa()` takes its dot products on this CPU."""
    flags = native.cpu_flags()
    which = native.isa()
    if which == "native" and "avx512_vnni" in flags and "avx512vl" in flags:
        return "AVX512-VNNI vpdpbusd"
    if which == "native" and "avx_vnni" in flags:
        return "AVX-VNNI vpdpbusd"
    if which in ("native", "avx2") and "avx2" in flags:
        return "AVX2 vpmaddubsw"
    return "scalar"


def qgemv_kernel() -> str:
    """What runs a projection held as GGUF blocks here, as `fms-paged info` says it: the qgemv
    kernel's decode rows (int8 activations, `qgemv_isa`) and its prefill rows: bf16 panels where
    its build has AVX512_BF16 (csrc/kernels/qgemv.cpp's FMS_QTILES), fp32 panels in an AVX2 build
    (FMS_QPANELS), else the int8 path too."""
    flags = native.cpu_flags()
    decode = f"int8 activations per block of 32, {qgemv_isa()}"
    if native.isa() == "native" and {"avx512_bf16", "avx512bw"} <= set(flags):
        return f"fms_paged qgemv ({decode} for decode rows, bf16 panels with vdpbf16ps for prefill)"
    avx2_build = native.isa() == "avx2" or (native.isa() == "native" and "avx512f" not in flags)
    if avx2_build and "avx2" in flags:
        return f"fms_paged qgemv ({decode} for decode rows, fp32 panels for prefill)"
    return f"fms_paged qgemv ({decode})"


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 scale bytes [..., 12] (int32) -> the eight 6-bit scales and mins [..., 8]:
    sub-blocks 0-3 in the low six bits of bytes j and j + 4, sub-blocks 4-7 in the nibbles of
    bytes 8-11 (scale low, min high) and the top two bits of bytes 0-3 (scale) and 4-7 (min)."""
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (top & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    m = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, m


def dequantize_blocks(blocks: torch.Tensor, ggml_type: str,
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """GGUF blocks [N, K / block values, bytes] of `ggml_type` (`BLOCK_TYPES`) -> the weight [N, K]
    in `dtype`: computed in float64, exactly (each value an fp16 scale times a small integer, less
    an fp16 times another for Q4_K / Q5_K), then rounded once to `dtype` (exact in fp32 but for
    Q4_K / Q5_K); Q8_0 / Q4_0 in `dtype` itself, as before. The layouts:
    csrc/kernels/qgemv_blocks.h."""
    if ggml_type not in BLOCK_TYPES:
        raise QuantizationError(f"GGUF block type {ggml_type!r}; the qgemv kernel reads "
                                f"{', '.join(BLOCK_TYPES)}")
    n, nb, _ = blocks.shape
    f64 = torch.float64

    def f16(part: torch.Tensor) -> torch.Tensor:
        return part.contiguous().view(torch.float16).to(f64)

    if ggml_type in ("Q8_0", "Q4_0"):  # in `dtype` itself (exact in fp32 and float64)
        d = blocks[..., :2].contiguous().view(torch.float16).to(dtype)  # [N, nb, 1]
        if ggml_type == "Q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8).to(dtype)  # [N, nb, 32]
        else:
            qs = blocks[..., 2:].to(torch.int16)  # [N, nb, 16]: element j (low nibble), j + 16 (high)
            q = (torch.cat([qs & 0x0F, qs >> 4], dim=-1) - 8).to(dtype)
        return (q * d).reshape(n, nb * QK)
    b = blocks.to(torch.int32)
    if ggml_type == "Q5_0":
        qs = b[..., -16:]  # element j (low nibble), j + 16 (high), as Q4_0
        qh = b[..., 2:6] << torch.tensor([0, 8, 16, 24], dtype=torch.int32)  # fifth bits: bit i, element i
        qh = qh.sum(-1, keepdim=True).to(torch.int64)  # [N, nb, 1] (the top byte may wrap: bits kept)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1) + ((qh >> torch.arange(32)) & 1).to(torch.int32) * 16
        w = (q - 16).to(f64) * f16(blocks[..., :2])
    elif ggml_type in ("Q4_K", "Q5_K"):
        d, dmin = f16(blocks[..., 0:2]), f16(blocks[..., 2:4])  # [N, nb, 1]
        sc, m = _k_scales(b[..., 4:16])  # [N, nb, 8]
        qs = b[..., -128:].reshape(n, nb, 4, 1, 32)  # bytes 32 p ..: sub-block 2 p low, 2 p + 1 high
        q = ((qs >> torch.tensor([0, 4]).reshape(2, 1)) & 0x0F).reshape(n, nb, 8, 32)
        if ggml_type == "Q5_K":  # bit j of qh byte i: element i of sub-block j
            qh = b[..., 16:48].reshape(n, nb, 1, 32)
            q = q | (((qh >> torch.arange(8).reshape(8, 1)) & 1) << 4)
        w = (d * sc.to(f64))[..., None] * q.to(f64) - (dmin * m.to(f64))[..., None]
    else:  # Q6_K: ql [128], qh [64], 16 int8 scales, d
        ql = b[..., :128].reshape(n, nb, 2, 1, 2, 32)  # half h, then bytes 32 (r % 2) ..
        qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)
        lo = (ql >> (4 * torch.arange(2)).reshape(2, 1, 1)) & 0x0F  # [N, nb, 2, 2 (r / 2), 2 (r % 2), 32]
        hi = (qh >> (2 * torch.arange(4)).reshape(4, 1)) & 3  # [N, nb, 2, 4 (r), 32]
        q = lo.reshape(n, nb, 2, 4, 32) | (hi << 4)  # sub-block 4 h + r
        scales = blocks[..., 192:208].contiguous().view(torch.int8).to(f64).reshape(n, nb, 16, 1)
        w = f16(blocks[..., 208:210])[..., None] * scales * (q.reshape(n, nb, 16, 16) - 32).to(f64)
    return w.reshape(n, nb * BLOCK_VALUES[ggml_type]).to(dtype)


class BlockLinear(nn.Module):
    """y = x @ W^T + b with W held as a GGUF file's blocks (`ggml_type` one of `BLOCK_TYPES`;
    `blocks` uint8 [N, K / block values, bytes per block]), computed by the qgemv kernel
    (`fms_paged::qlinear`) for decode and prefill rows alike; x in the model's dtype (fp32, bf16 or
    fp16), the bias too. Inference only. Where the kernel cannot be had (no C++ compiler) each call
    dequantizes the weight into a temporary and runs F.linear: correct, slow, and announced by
    `describe`."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str, bias: torch.Tensor | None = None):
        super().__init__()
        if ggml_type not in BLOCK_TYPES or blocks.dtype != torch.uint8 or blocks.dim() != 3 or \
                blocks.shape[-1] != BLOCK_TYPES.get(ggml_type):
            raise QuantizationError(f"BlockLinear: {ggml_type} blocks as uint8 [N, K / "
                                    f"{BLOCK_VALUES.get(ggml_type)}, {BLOCK_TYPES.get(ggml_type)}], "
                                    f"got {blocks.dtype} {tuple(blocks.shape)}; types read: "
                                    f"{', '.join(BLOCK_TYPES)}")
        self.ggml_type = ggml_type
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * BLOCK_VALUES[ggml_type]
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def kernel(self, dtype: torch.dtype | None = None) -> str:
        """The kernel that computes this projection here (for activations of `dtype`)."""
        if native.compiler() is None:
            return "dequantized per call + F.linear (no C++ compiler for the qgemv kernel)"
        return qgemv_kernel()

    def describe(self) -> str:
        """The format and kernel, as `fms-paged info` says them."""
        return f"GGUF {self.ggml_type} blocks, {self.kernel()}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if x.device.type == "cpu" and (native.kernel_ready("qgemv", x.dtype)
                                       or native.load_qgemv(x.dtype) is None):
            return torch.ops.fms_paged.qlinear(x, [self.blocks], self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def dequantized(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The weight [N, K] in `dtype` (exact in float64 and fp32: the tests' reference)."""
        return dequantize_blocks(self.blocks, self.ggml_type, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.describe()}"


class BlockEmbedding(nn.Module):
    """The token embedding held as a GGUF file's blocks (`ggml_type` one of `BLOCK_TYPES`; `blocks`
    uint8 [V, C / block values, bytes per block]): a lookup dequantizes the rows it reads into
    `dtype` (the model's), exactly where `dtype` is fp32 but for Q4_K / Q5_K (an fp16 scale times a
    small integer; those less a min: one fp32 rounding). A tied head
    shares the same blocks tensor (`BlockLinear(embedding.blocks, ...)`): one copy for both."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str, dtype: torch.dtype):
        super().__init__()
        if ggml_type not in BLOCK_TYPES or blocks.dtype != torch.uint8 or blocks.dim() != 3 or \
                blocks.shape[-1] != BLOCK_TYPES[ggml_type]:
            raise QuantizationError(f"BlockEmbedding: {ggml_type} blocks as uint8 [V, C / "
                                    f"{BLOCK_VALUES.get(ggml_type)}, {BLOCK_TYPES.get(ggml_type)}], got "
                                    f"{blocks.dtype} {tuple(blocks.shape)}; types read: "
                                    f"{', '.join(BLOCK_TYPES)}")
        self.ggml_type, self.dtype = ggml_type, dtype
        self.num_embeddings, self.embedding_dim = blocks.shape[0], blocks.shape[1] * BLOCK_VALUES[ggml_type]
        self.register_buffer("blocks", blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [...] int64 -> [..., C] in the model's dtype
        rows = self.blocks.index_select(0, tokens.reshape(-1))
        return dequantize_blocks(rows, self.ggml_type, torch.float32).to(self.dtype).reshape(
            *tokens.shape, self.embedding_dim)

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"GGUF {self.ggml_type} blocks, rows dequantized per lookup into {dtype}"

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.describe()}"


def _projections(model: nn.Module) -> list[tuple[nn.Module, str, Linear]]:
    """(parent, attribute, Linear) of each projection of the decoder blocks (not the LM head)."""
    found = []
    for layer in model.layers:
        for parent in layer.modules():
            for attr, child in parent.named_children():
                if isinstance(child, Linear):
                    found.append((parent, attr, child))
    return found


def quantize_model(model: nn.Module, scheme: str | None, group_size: int = DEFAULT_GROUP_SIZE) -> nn.Module:
    """Replace each projection of `model`'s decoder blocks by a `QuantizedLinear` (in place; the
    embedding and the head stay), dropping each full-precision weight as its replacement is made,
    and record `scheme` and `group_size` on `model.config`. None: the model as it is. Every
    projection is checked first: a refusal leaves the model unchanged."""
    if scheme is None:
        return model
    found = _projections(model)
    for _, attr, m in found:
        check(scheme, tuple(m.weight.shape), m.weight.dtype, m.weight.device, group_size, name=attr)
    if getattr(model, "tp", None) is not None:
        raise QuantizationError("quantization of a model split over ranks (tensor parallel) is not supported")
    with torch.no_grad():
        for parent, attr, m in found:
            q = QuantizedLinear(m.weight, m.bias, scheme, group_size)
            setattr(parent, attr, q)  # the Linear (and its weight) goes with the last reference
            del m
    model.config.quantization = scheme
    model.config.quantization_group_size = group_size if scheme == "int4" else None
    return model


def describe(model: nn.Module) -> list[dict[str, str]]:
    """Per layer, each projection's format and kernel (what `fms-paged info` prints); the head's too."""
    rows = []
    for i, layer in enumerate(model.layers):
        for name, m in layer.named_modules():
            if isinstance(m, (QuantizedLinear, BlockLinear)):
                rows.append({"layer": str(i), "module": name, "format": m.describe()})
            elif isinstance(m, Linear):
                rows.append({"layer": str(i), "module": name,
                             "format": f"{str(m.weight.dtype).removeprefix('torch.')}, fms_paged linear"})
    head = model.head
    rows.append({"layer": "head", "module": "head",
                 "format": head.describe() if isinstance(head, (QuantizedLinear, BlockLinear))
                 else f"{str(head.weight.dtype).removeprefix('torch.')}, fms_paged linear"})
    return rows


def layer_formats(model: nn.Module) -> dict[str, str]:
    """Per layer, its projections' format and kernel, one line each ("layer 3": "int4 g128, aten
    _weight_int4pack_mm_for_cpu (7 projections)"; modules that differ are named), then the head's
    and the embedding's: what `fms-paged info --quantization` prints."""
    by_layer: dict[str, dict[str, list[str]]] = {}
    for r in describe(model):
        by_layer.setdefault(r["layer"], {}).setdefault(r["format"], []).append(r["module"])
    out = {}
    for layer, formats in by_layer.items():
        key = "head" if layer == "head" else f"layer {layer}"
        if len(formats) == 1:
            (fmt, mods), = formats.items()
            out[key] = fmt if layer == "head" else f"{fmt} ({len(mods)} projections)"
        else:
            out[key] = "; ".join(f"{', '.join(mods)}: {fmt}" for fmt, mods in formats.items())
    emb = model.embedding
    out["embedding"] = emb.describe() if isinstance(emb, BlockEmbedding) else \
        str(emb.weight.dtype).removeprefix("torch.")
    return out
