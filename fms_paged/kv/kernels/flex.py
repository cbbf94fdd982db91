"""The "flex" kernel: compiled FlexAttention through the block table (`fms_paged.flex.masks`), Triton
on CUDA, inductor's C++ template on the CPU (where the cpp kernel cannot serve the model).

Per step, one BlockMask per distinct window of the model's layers, built before the layers from the
page table (decode: by device ops; prefill: from the host's page lists). A layer's spec reaches
flex as its scale, the window's BlockMask and mask_mod, a soft-cap `score_mod`, and sinks applied
to flex's output through the log-sum-exp it returns: out * sigmoid(lse - sink), which is exactly
softmax with the sink's logit in the denominator.

Decode packs the G query heads of each kv head into the query dimension, so each page is read once
per kv head. On the CPU prefill chunks go through GATHER + one SDPA call per chunk
(`GatherPrefillStep`), which beats flex's one-page KV blocks there, unless a user score_mod needs
the BlockMask path (`blockmask_prefill`).
"""

from __future__ import annotations

import functools
import inspect
import os
import sysconfig
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

try:  # how flex_attention is asked for its log-sum-exp (torch >= 2.9; `return_lse` before)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxRequest = None

from fms_paged import native
from fms_paged.flex.masks import (
    decode_block_mask,
    decode_meta,
    logical_score_mod,
    paged_mask_mod,
    prefill_block_mask,
    softcap_score_mod,
)
from fms_paged.kv._pool_ops import to_device
from fms_paged.kv.geometry import pages_for
from fms_paged.kv.kernels.base import Kernel, PoolStep
from fms_paged.kv.kernels.gather import GatherPrefillStep
from fms_paged.kv.spec import AttentionSpec
from fms_paged.kv.view import DecodeBatch, PoolView, PrefillBatch

# Triton's flex kernels tile the KV axis in BLOCK_N columns and need each KV block (one page) to be
# a whole number of tiles; inductor's default BLOCK_N is 16..128 by GPU, dtype and head_dim, and
# tl.dot needs tiles of at least 16 columns.
TRITON_MIN_PAGE = 16
TRITON_MIN_HEAD_DIM = 16  # inductor's Triton flex lowering: "embedding dimension ... at least 16"
# a layer's pool [1, Hkv, N * P, D] of more elements than an int32 holds gives Triton 64-bit
# strides and lengths, and torch 2.11's flex decoding template then fails to compile ("Ternary
# expression with dynamic condition has inconsistent types int64 and int32"): a small model's
# pool sized by a GPU's free memory reaches it (4 layers of 2 kv heads of 32: ~2.1M pages of 16)
TRITON_MAX_POOL_ELEMENTS = 2**31 - 1


def flex_max_pages(kvheads: int, head_dim: int, page_size: int) -> int:
    """The most pages (the null page included) of a pool the Triton flex kernels address."""
    return TRITON_MAX_POOL_ELEMENTS // (kvheads * page_size * head_dim)


RECOMPILE_LIMIT = 64  # specializations one compiled step may have (Dynamo's default: 8)
ACCUMULATED_RECOMPILE_LIMIT = 512  # torch without per-call limits: its process-wide cap (default 256)
_PER_CALL_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def compile_shape_variants(fn: Callable, **compile_kwargs) -> Callable:
    """`torch.compile(fn, **compile_kwargs)` allowed `RECOMPILE_LIMIT` specializations rather than
    Dynamo's 8. Each (pool size, rows, decode or prefill bucket) of the static-shape steps compiled
    here is a specialization of the same code object, and a process that serves several pools or
    page sizes meets more than 8 (within a pool, decode shapes never change: see the recompile test).

    The limit is this compiled function's own: torch.compile's `recompile_limit` where the torch
    has it (2.13 does; Dynamo applies it only while it compiles). On an older torch the limits are
    raised around each call of the returned function and restored after it. Either way Dynamo's
    process-wide settings are what they were for every other compiled function of the process."""
    if _PER_CALL_LIMIT:
        return torch.compile(fn, recompile_limit=RECOMPILE_LIMIT, **compile_kwargs)
    compiled = torch.compile(fn, **compile_kwargs)
    config = torch._dynamo.config

    @functools.wraps(fn)
    def call(*args, **kwargs):
        saved = config.recompile_limit, config.accumulated_recompile_limit
        config.recompile_limit = max(saved[0], RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(saved[1], ACCUMULATED_RECOMPILE_LIMIT)
        try:
            return compiled(*args, **kwargs)
        finally:
            config.recompile_limit, config.accumulated_recompile_limit = saved

    return call


@functools.cache
def compiled_flex(dynamic: bool) -> Callable:
    """One compiled flex_attention per shape policy, shared by every backend in the process."""
    # Inductor's CPU kernels and ATen share the OpenMP runtime; re-applying the thread count aligns
    # their team sizes (without it, decode steps that alternate ATen matmuls with the compiled flex
    # kernel ran an order of magnitude slower on a 2-core CPU). The count itself stays what it was.
    torch.set_num_threads(torch.get_num_threads())
    return compile_shape_variants(flex_attention, fullgraph=True, dynamic=dynamic)


def flex_kernel_options(device: torch.device, page_size: int, prefill: bool = False) -> dict | None:
    """`kernel_options` for flex_attention over pages of `page_size` tokens (`prefill`: for the
    prefill steps' kernel, else decode's).

    CUDA: unless the page is a multiple of 128 (every default tile divides it), BLOCK_N is set to
    the largest power of two dividing the page, at most 64, so that compiling does not fail on a
    default tile wider than the page. With pages of 128 or more, prefill's kernel pipelines 2
    stages rather than inductor's default 3: its dynamic-shape compile in bf16 with heads of 128
    asked 246,784 bytes of shared memory, over an H200's 232,448, and failed. CPU: the inductor
    C++ kernel takes the KV block as its tile, so nothing is set."""
    if device.type != "cuda":
        return None
    if page_size % 128 == 0:
        return {"num_stages": 2} if prefill else None
    return {"BLOCK_N": min(64, page_size & -page_size)}


def flex_unavailable_reason(device: torch.device, page_size: int | None = None,
                            head_dim: int | None = None) -> str | None:
    """Why compiled flex_attention cannot run on `device` (with pages of `page_size`, heads of
    `head_dim`) here (None if it can)."""
    if os.environ.get("FMS_PAGED_FORCE_GATHER"):
        return "FMS_PAGED_FORCE_GATHER is set"
    if device.type == "cuda":
        if page_size is not None and page_size % TRITON_MIN_PAGE:
            return f"page_size={page_size} is not a multiple of {TRITON_MIN_PAGE} (Triton's smallest KV tile)"
        if head_dim is not None and head_dim < TRITON_MIN_HEAD_DIM:
            return (f"head_dim={head_dim} is below {TRITON_MIN_HEAD_DIM}, the smallest head Triton's "
                    "flex_attention compiles")
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed"
        return None
    if device.type == "cpu":
        if native.compiler() is None:
            return "no C++ compiler found for inductor's CPU flex_attention ($CXX, g++ or c++)"
        headers = sysconfig.get_paths()["include"]
        if not os.path.exists(os.path.join(headers, "Python.h")):
            return (f"no Python.h in {headers}: inductor's CPU kernels need this Python's headers "
                    "(Debian/Ubuntu: apt-get install python3-dev)")
        try:
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            if not pick_vec_isa():
                return "this CPU has no AVX2/AVX512/NEON vector ISA for inductor"
        except Exception as e:  # pragma: no cover - depends on the torch build
            return f"inductor CPU support unavailable ({e})"
        return None
    return f"compiled flex_attention is not supported on {device.type} by this torch build"


def probe_compiled_flex(device: torch.device, page_size: int = 16) -> str | None:
    """Compile and run a tiny flex_attention call on `device` (seconds on a CPU): None if it
    works, else why not. The static checks of `flex_unavailable_reason` first."""
    reason = flex_unavailable_reason(device, page_size)
    if reason is not None:
        return reason
    try:
        # three buffers: inductor's CPU flex lowering of torch 2.11 refuses q, k, v in one
        q, k, v = (torch.randn(1, 1, 16, 16, device=device) for _ in range(3))
        # (flex_attention's code object is the one `compiled_flex` specializes: the same limit)
        compiled = compile_shape_variants(flex_attention, fullgraph=True, dynamic=False)
        out = compiled(q, k, v, kernel_options=flex_kernel_options(device, page_size))
        if not torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5):
            return "compiled flex_attention gave wrong numbers"
    except Exception as e:  # noqa: BLE001 - the reason is the report
        return f"compiling flex_attention failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return None


def prefill_bucket(T: int) -> int:
    """Packed prefill length of the flex kernel rounded up, so few distinct shapes are compiled:
    powers of two from 128 to 1024, then multiples of 1024."""
    if T <= 1024:
        return max(128, 1 << (T - 1).bit_length())
    return pages_for(T, 1024) * 1024


class FlexStep(PoolStep):
    """One step over the pool with flex_attention: slots and one BlockMask per window, shared by
    all layers.

    Prefill: built ready by the kernel (slots and BlockMasks from the host's page lists).
    Decode: the kernel makes a `FlexDecodeStep` (metadata only) whose `prepare` builds this.
    """

    def __init__(self, view: PoolView, kernel: FlexKernel, slots: torch.Tensor,
                 block_masks: dict, q_pos: torch.Tensor, gqa_group: int = 0):
        self.view, self.kernel = view, kernel
        self.slots = slots  # [B' * S'] pool slot of every new token
        self.block_masks = block_masks  # window -> BlockMask
        self.gqa_group = gqa_group  # decode: the G query heads of each kv head packed into q
        self.user_mod = None
        if kernel.score_mod is not None:  # q_pos: [B', S'] logical query positions
            self.user_mod = logical_score_mod(kernel.score_mod, view.phys_to_logical, q_pos,
                                              view.page_size, gqa_group)

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                  spec: AttentionSpec, scales=(None, None)) -> torch.Tensor:
        # kp, vp: [1, Hkv, NP, D] (16/32-bit pools only: `choose_kernel` refuses flex for 8-bit
        # pages, so `scales` is (None, None)); inside a compiled forward flex_attention is traced
        # with the step
        attn = flex_attention if torch.compiler.is_compiling() else compiled_flex(dynamic=False)
        if spec.window not in self.block_masks:
            raise ValueError(f"window {spec.window} has no BlockMask in this step (the model's layers "
                             f"declared windows {sorted(self.block_masks, key=str)})")
        mask = self.block_masks[spec.window]
        score_mod = self.user_mod
        if spec.softcap is not None:
            score_mod = softcap_score_mod(spec.softcap, score_mod)
        options = self.kernel.kernel_options if self.gqa_group else self.kernel.prefill_options
        kw = dict(score_mod=score_mod, block_mask=mask, scale=spec.scale, kernel_options=options)
        if spec.sinks is not None:  # the log-sum-exp too
            kw.update(return_aux=AuxRequest(lse=True)) if AuxRequest else kw.update(return_lse=True)
        B, H, S, D = q.shape
        if self.gqa_group:  # decode: S' = 1; query head h reads kv head h // G
            qg = q.reshape(B, H // self.gqa_group, self.gqa_group, D)  # [B, Hkv, G, D]
            out = attn(qg, kp, vp, **kw)
        else:
            out = attn(q, kp, vp, enable_gqa=True, **kw)
        if spec.sinks is not None:  # out, lse: [B, H, S, D], [B, H, S] (or [B, Hkv, G, ...] packed)
            out, aux = out
            lse = aux if AuxRequest is None else aux.lse
            sink = spec.sinks.to(device=q.device, dtype=torch.float32)
            sink = sink.view(1, -1, self.gqa_group) if self.gqa_group else sink.view(1, H, 1)
            out = (out.float() * torch.sigmoid(lse - sink)[..., None]).to(q.dtype)
        return out.reshape(B, H, 1, D) if self.gqa_group else out


class FlexDecodeStep:
    """A decode step's metadata: `decode_meta` ([6, B] int64 on device, see
    `fms_paged.flex.masks.decode_meta`) holds each row's sequence, query position and new slot.
    `prepare` builds the ready `FlexStep` (a BlockMask per window from the metadata and the device
    page table) with device ops only, and returns a new object rather than writing attributes on
    this one: in a compiled step, writes to an input object are replayed in Python after the graph."""

    def __init__(self, view: PoolView, kernel: FlexKernel, decode_meta: torch.Tensor):
        self.view, self.kernel = view, kernel
        self.decode_meta = decode_meta

    def prepare(self) -> FlexStep:
        v, meta, G = self.view, self.decode_meta, self.view.gqa_group
        q_seq, q_pos = meta[0][:, None], meta[1][:, None]  # [B, 1]
        if v.device.type != "cpu":
            # int32 copies: the mask_mod then indexes the int32 page table with int32 alone, as in
            # prefill (int64 rows of `meta` mixed with int32 tables made Triton reject the kernel:
            # "Ternary expression ... inconsistent types int64 and int32"); inductor's CPU flex
            # template finds no choice for such copies inside a compiled step, and needs none
            q_seq, q_pos = q_seq.to(torch.int32), q_pos.to(torch.int32)
        masks = {}
        for w in v.windows:
            mask_mod = paged_mask_mod(v.page_table, v.phys_to_logical, q_seq, q_pos, v.page_size,
                                      gqa_packed=True, window=w)
            masks[w] = decode_block_mask(v.page_table, meta, v.num_pages, v.page_size, mask_mod, G, w)
        return FlexStep(v, self.kernel, meta[2], masks, q_pos, G)


class FlexKernel(Kernel):
    name = "flex"
    compiles = True
    always_compiles = True  # its attention is compiled even in an eager step
    cuda_graphs = True
    takes_score_mod = True

    def __init__(self, device: torch.device, page_size: int, score_mod: Callable | None = None):
        self.kernel_options = flex_kernel_options(device, page_size)
        self.prefill_options = flex_kernel_options(device, page_size, prefill=True)
        self.score_mod = score_mod
        # prefill through the BlockMask on CUDA or with a score_mod; on the CPU one SDPA call per
        # chunk (GatherPrefillStep) beats its one-page KV blocks
        self.blockmask_prefill = device.type != "cpu" or score_mod is not None

    def prefill(self, view: PoolView, batch: PrefillBatch) -> tuple[torch.Tensor, torch.Tensor, PoolStep]:
        dev = view.device
        if not self.blockmask_prefill:
            step = GatherPrefillStep(view, batch)
            return batch.tokens.to(dev), torch.from_numpy(batch.positions)[None].to(dev), step
        # pad the packed row to a bucket size so few distinct shapes get compiled; pad tokens have
        # q_pos = -1 (they see nothing) and write into the null page
        T = batch.tokens.shape[1]
        pad = prefill_bucket(T) - T
        tokens = torch.cat([batch.tokens, torch.zeros(1, pad, dtype=torch.long)], dim=1)
        tok_seq = np.concatenate([np.repeat(np.asarray(batch.seq_ids, dtype=np.int64), batch.counts),
                                  np.zeros(pad, dtype=np.int64)])
        tok_pos = np.concatenate([batch.positions, np.full(pad, -1, dtype=np.int64)])
        # the model's positions: 0 for a pad token (-1 is the masks' "no query" alone: a model with
        # position embeddings would index its table with it, a device-side assert on CUDA)
        positions = np.maximum(tok_pos, 0)
        slots = batch.slots
        if pad:
            slots = torch.cat([slots, torch.zeros(pad, dtype=torch.long, device=dev)])
        q_seq = to_device(tok_seq.astype(np.int32)[None], dev)
        q_pos = to_device(tok_pos.astype(np.int32)[None], dev)
        masks = {}
        for w in view.windows:
            mask_mod = paged_mask_mod(view.page_table, view.phys_to_logical, q_seq, q_pos,
                                      view.page_size, window=w)
            masks[w] = prefill_block_mask(
                [*batch.pages, []], [*batch.starts, 0], [*batch.counts, pad], view.num_pages,
                view.page_size, mask_mod, dev, max_blocks=view.max_blocks, window=w)
        return tokens.to(dev), to_device(positions[None], dev), FlexStep(view, self, slots, masks, q_pos)

    def decode(self, view: PoolView, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor, FlexDecodeStep]:
        B = len(batch.seq_ids)
        meta = to_device(decode_meta(*zip(*batch.rows()), view.page_size), view.device)  # [6, B]: one copy
        positions = meta[5].view(B, 1)  # [B, 1] RoPE positions
        return batch.tokens.view(B, 1), positions, FlexDecodeStep(view, self, meta)
