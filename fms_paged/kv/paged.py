"""The paged backend: K/V in a page pool, attention by FlexAttention through the block table.

Per layer the pool is one tensor `[1, Hkv, num_pages * P, D]` (a tensor of its own, not a view of a
stacked one: under torch.compile an in-place write into a view copies the whole base). Each step:
RESERVE pages for the new tokens (host bookkeeping, only when a page boundary is crossed), then, once
per step before the layers (`prepare`, device ops only, so a compiled decode step fuses it), compute
the new tokens' pool slots and one BlockMask shared by every layer; each layer ASSIGNs its new k/v to
those slots and runs flex_attention over the whole pool (only the listed pages are read).

Layouts: decode runs one row per sequence ([B, 1], B fixed = max_batch, so shapes never change);
prefill packs all prompts into one row ([1, T], no padding to the longest prompt).

Kernels: "cpp" (the CPU kernel of `fms_paged.kv.cpu_kernel`: prefill chunks and decode rows in one
call per layer, K/V read in place through the page table), "flex" (compiled flex_attention: Triton
on CUDA, inductor C++ on CPU), or "gather" (GATHER each sequence's pages + SDPA; the fallback where
neither compiles, e.g. MPS or a CPU without a C++ compiler). "auto" picks cpp where it serves the
model (CPU, fp32, no score_mod), else flex when available, and announces a fallback to gather once.
"""

from __future__ import annotations

import functools
import os
import shutil
import sysconfig
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from fms_paged.flex.masks import (
    decode_block_mask,
    decode_meta,
    logical_score_mod,
    paged_mask_mod,
    prefill_block_mask,
)
from fms_paged.kv import cpu_kernel
from fms_paged.kv._pool_ops import to_device
from fms_paged.kv.page_manager import PageManager

try:  # an int that torch.compile takes as a graph input (SymInt) rather than as a constant
    from torch.fx.experimental.sym_node import DynamicInt
except ImportError:  # older torch: the page size is a constant of each compiled graph
    DynamicInt = int

KERNELS = ("auto", "cpp", "flex", "flex-eager", "gather")
PREFILL_KERNELS = ("auto", "flex", "sdpa")


def allow_shape_variants() -> None:
    """Raise Dynamo's recompile limits (per code object 8 -> 64, in all 256 -> 512) for the
    static-shape steps compiled here: each (pool size, rows, decode bucket or prefill bucket) is a
    specialization of the same code object, and a process that serves several pools or page sizes
    (`make bench-serve`) meets more than 8 (within a pool, decode shapes never change: see the
    recompile test). Process-wide, like Dynamo's own config; called where such a step is made."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 512
    )


@functools.cache
def compiled_flex(dynamic: bool) -> Callable:
    """One compiled flex_attention per shape policy, shared by every backend in the process."""
    # Inductor's CPU kernels and ATen share the OpenMP runtime; re-applying the thread count aligns
    # their team sizes (measured here: without it, decode steps that alternate ATen matmuls with the
    # compiled flex kernel took 10-20x longer on a 2-core CPU).
    torch.set_num_threads(torch.get_num_threads())
    allow_shape_variants()
    return torch.compile(flex_attention, fullgraph=True, dynamic=dynamic)


# Triton's flex kernels tile the KV axis in BLOCK_N columns and need each KV block (one page) to be
# a whole number of tiles; inductor's default BLOCK_N is 16..128 by GPU, dtype and head_dim, and
# tl.dot needs tiles of at least 16 columns.
TRITON_MIN_PAGE = 16


def flex_kernel_options(device: torch.device, page_size: int) -> dict | None:
    """`kernel_options` for flex_attention over pages of `page_size` tokens.

    CUDA: unless the page is a multiple of 128 (every default tile divides it), BLOCK_N is set to
    the largest power of two dividing the page, at most 64, so that compiling does not fail on a
    default tile wider than the page. CPU: the inductor C++ kernel takes the KV block as its tile,
    so nothing is set. (Not run on a GPU in this project's CI.)"""
    if device.type != "cuda" or page_size % 128 == 0:
        return None
    return {"BLOCK_N": min(64, page_size & -page_size)}


def flex_unavailable_reason(device: torch.device, page_size: int | None = None) -> str | None:
    """Why compiled flex_attention cannot run on `device` (with pages of `page_size`) here (None if
    it can)."""
    if os.environ.get("FMS_PAGED_FORCE_GATHER"):
        return "FMS_PAGED_FORCE_GATHER is set"
    if device.type == "cuda":
        if page_size is not None and page_size % TRITON_MIN_PAGE:
            return f"page_size={page_size} is not a multiple of {TRITON_MIN_PAGE} (Triton's smallest KV tile)"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed"
        return None
    if device.type == "cpu":
        if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
            return "no C++ compiler found for inductor's CPU flex_attention"
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
        q = torch.randn(1, 1, 16, 16, device=device)
        compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        out = compiled(q, q, q, kernel_options=flex_kernel_options(device, page_size))
        if not torch.allclose(out, F.scaled_dot_product_attention(q, q, q), atol=1e-5):
            return "compiled flex_attention gave wrong numbers"
    except Exception as e:  # noqa: BLE001 - the reason is the report
        return f"compiling flex_attention failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return None


def choose_kernel(kernel: str, device: torch.device, page_size: int | None = None, *,
                  head_dim: int | None = None, dtype: torch.dtype | None = None,
                  score_mod: Callable | None = None) -> str:
    """The kernel to run: `kernel` itself (checked), or for "auto" the first that serves the model
    here: cpp (needs `head_dim` and `dtype`; no score_mod), flex, gather (announced)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; expected one of {KERNELS}")
    cpp_reason = None
    if kernel in ("auto", "cpp"):
        cpp_reason = "it cannot apply a score_mod" if score_mod is not None else (
            cpu_kernel.unavailable_reason(device, dtype, head_dim, page_size or 16)
            if head_dim is not None and dtype is not None else "no head_dim / dtype given")
    if kernel == "cpp" and cpp_reason is not None:
        raise ValueError(f"kernel='cpp' cannot serve this model: {cpp_reason}")
    if kernel != "auto":
        return kernel
    if cpp_reason is None:
        return "cpp"
    reason = flex_unavailable_reason(device, page_size)
    if reason is None:
        return "flex"
    warnings.warn(f"fms_paged: paged attention falls back to GATHER + SDPA: {reason}", stacklevel=3)
    return "gather"


def choose_prefill_kernel(prefill_kernel: str, device: torch.device, score_mod: Callable | None) -> str:
    """How the flex kernel attends prefill chunks: "flex" (the paged BlockMask over the pool) or
    "sdpa" (GATHER each chunk's sequence into logical order, then SDPA per chunk: one kernel call
    per chunk and layer, no mask_mod per element, the CPU's flash kernel). "auto": "sdpa" on the
    CPU (measured here 2-3x faster than the CPU flex kernel, whose KV block is one page) unless a
    score_mod is set (SDPA cannot run it), "flex" elsewhere. Other kernels ignore the choice."""
    if prefill_kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill_kernel={prefill_kernel!r}; expected one of {PREFILL_KERNELS}")
    if prefill_kernel == "sdpa" and score_mod is not None:
        raise ValueError("prefill_kernel='sdpa' cannot apply a score_mod: use 'flex' or 'auto'")
    if prefill_kernel == "auto":
        return "sdpa" if device.type == "cpu" and score_mod is None else "flex"
    return prefill_kernel


def prefill_bucket(T: int) -> int:
    """Packed prefill length rounded up: powers of two from 128 to 1024, then multiples of 1024."""
    if T <= 1024:
        return max(128, 1 << (T - 1).bit_length())
    return -(-T // 1024) * 1024


def check_chunks(seq_ids: Sequence[int], counts: Sequence[int], starts: Sequence[int]) -> None:
    """Validate a prefill where data enters a backend: one non-empty chunk per sequence."""
    if not len(seq_ids) == len(counts) == len(starts):
        raise ValueError(
            f"prefill got {len(seq_ids)} seq_ids, {len(counts)} prompts and {len(starts)} starts"
        )
    if not counts:
        raise ValueError("prefill got no prompts")
    for s, n in zip(seq_ids, counts):
        if n == 0:
            raise ValueError(f"prefill of seq {s} is empty: each prompt (chunk) needs >= 1 token")


def default_num_pages(max_batch: int, max_seq_len: int, page_size: int) -> int:
    """Enough pages for every sequence at full length, plus the null page."""
    return max_batch * -(-max_seq_len // page_size) + 1


class PagedBackend:
    """Drives a PageManager + per-layer page pools for `generate` and the engine."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int,
        max_seq_len: int,
        *,
        num_pages: int | None = None,
        kernel: str = "auto",
        score_mod: Callable | None = None,
        prefill_kernel: str = "auto",
    ):
        c = model.config
        self.P = P = c.page_size
        self.device = model.device
        self.max_batch = max_batch
        self.num_pages = num_pages or default_num_pages(max_batch, max_seq_len, P)
        self.kernel = choose_kernel(kernel, self.device, P, head_dim=c.head_dim, dtype=model.dtype,
                                    score_mod=score_mod)
        self.kernel_options = flex_kernel_options(self.device, P)
        self.pm = PageManager(self.num_pages, P, max_batch, self.device, max_seq_len=max_seq_len)
        shape = (1, c.kvheads, self.num_pages * P, c.head_dim)
        # one pool per layer: [1, Hkv, num_pages * P, D]. Left uninitialised: a page is zeroed when
        # a RESERVE hands it out (`_after_reserve`), so pool memory is touched (on the CPU: faulted
        # in) only as pages are used. The null page is zeroed now: padding writes to it and the
        # GATHER fallback reads it for rows that see nothing. The eager flex reference multiplies
        # every slot of the pool (by a weight of 0 where masked): its pool is zeroed whole.
        alloc = torch.zeros if self.kernel == "flex-eager" else torch.empty
        self.k_pools = [alloc(shape, dtype=model.dtype, device=self.device) for _ in range(c.nlayers)]
        self.v_pools = [alloc(shape, dtype=model.dtype, device=self.device) for _ in range(c.nlayers)]
        for pool in self.k_pools + self.v_pools:
            pool[:, :, :P].zero_()
        # the page size the cpp kernel's op is given: an int that a compiled step takes as an input
        # (SymInt), as it takes the pool length and the page table's size (dynamic dims): one
        # compiled decode graph serves every pool, page size and `max_model_len` of a model shape
        self.page_size_arg = DynamicInt(P)
        if self.kernel == "cpp":
            for pool in self.k_pools + self.v_pools:
                torch._dynamo.maybe_mark_dynamic(pool, 2)
            torch._dynamo.maybe_mark_dynamic(self.pm.page_table, 0)
            torch._dynamo.maybe_mark_dynamic(self.pm.page_table, 1)
        self.score_mod = score_mod
        self.prefill_kernel = choose_prefill_kernel(prefill_kernel, self.device, score_mod)
        # decode packs the G = nheads / kvheads query heads of each kv head into the query length:
        # the CPU flex kernel then reads each page once per kv head (measured ~5x faster at B=8)
        self.gqa_group = c.nheads // c.kvheads
        self.head_dim = c.head_dim

    @property
    def kv_bytes(self) -> int:
        return sum(p.nbytes for p in self.k_pools + self.v_pools)

    def reset(self) -> None:
        self.pm.reset()

    def release(self, seq_ids: Sequence[int]) -> None:
        live = set(self.pm.live_seqs)
        ids = [s for s in seq_ids if s in live]
        if ids:
            self.pm.erase(ids)

    def _reserve(self, seq_ids: Sequence[int], old_lengths: Sequence[int],
                 new_lengths: Sequence[int]) -> None:
        """RESERVE (prefill), then prepare the pages it opened (`_after_reserve`)."""
        P = self.P
        copies = self.pm.reserve(seq_ids, new_lengths)
        opened = [  # logical pages ceil(old / P) .. ceil(new / P) - 1 of each seq
            p
            for s, o, n in zip(seq_ids, old_lengths, new_lengths)
            for p in self.pm.pages_of(s)[-(-o // P) : -(-n // P)]
        ]
        self._after_reserve(opened, copies)

    def _after_reserve(self, opened_pages: list[int], copies: list[tuple[int, int]]) -> None:
        """Zero the pages a RESERVE just handed out, then run its copy-on-write copies (a copy's
        destination is one of the opened pages: it is overwritten whole).

        Zeroing matters: attention multiplies masked-out weights (exactly 0) by the values of the
        whole page, and 0 * NaN = NaN, so stale NaN/inf left by a page's previous owner in slots
        not yet written would leak into the output. The cpp kernel reads no slot past a row's
        position, so its pages are left as they are.
        """
        if opened_pages and self.kernel != "cpp":
            P = self.P
            idx = (torch.tensor(opened_pages)[:, None] * P + torch.arange(P)).flatten().to(self.device)
            for pool in self.k_pools + self.v_pools:
                pool.index_fill_(2, idx, 0)
        self.pm.apply_copies(copies, *self.k_pools, *self.v_pools)  # pages shared by fork

    def prefill(self, seq_ids, prompts, starts=None):
        starts = [0] * len(prompts) if starts is None else list(starts)
        counts = [len(p) for p in prompts]
        check_chunks(seq_ids, counts, starts)
        live = set(self.pm.live_seqs)
        for s, start in zip(seq_ids, starts):
            have = self.pm.length(s) if s in live else 0
            if start != have:
                raise ValueError(f"prefill of seq {s} starts at {start}, but it holds {have} tokens")
        self._reserve(seq_ids, starts, [s + n for s, n in zip(starts, counts)])
        tok_seq = np.repeat(np.asarray(seq_ids, dtype=np.int64), counts)
        tok_pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
        slots = self.pm.slots(tok_seq, tok_pos)  # [T]
        last = torch.from_numpy(np.cumsum(counts) - 1).to(self.device)
        if self.kernel == "gather":  # padded rows for GATHER + SDPA
            B, S = len(prompts), max(counts)
            tokens = torch.zeros(B, S, dtype=torch.long)
            pos = torch.tensor(starts)[:, None] + torch.arange(S)  # pads sit past each row's end
            valid = torch.arange(S)[None, :] < torch.tensor(counts)[:, None]
            for b, p in enumerate(prompts):
                tokens[b, : len(p)] = torch.tensor(p)
            # padded tokens write into the null page's slot 0: never readable
            pad_slots = torch.zeros(B * S, dtype=torch.long, device=self.device)
            pad_slots[valid.flatten().nonzero()[:, 0].to(self.device)] = slots
            last = torch.tensor([b * S + n - 1 for b, n in enumerate(counts)], device=self.device)
            pos = pos.to(self.device)
            seqs = torch.tensor(list(seq_ids), device=self.device)
            step = GatherStep(self, pad_slots, seqs, pos, max(starts) + S)
            return tokens.to(self.device), pos, step, last
        if self.kernel == "cpp":
            chunks = torch.tensor([(s, st, n, o) for s, st, n, o in
                                   zip(seq_ids, starts, counts, np.cumsum([0, *counts]).tolist())])
            tokens = torch.tensor([t for p in prompts for t in p])[None]
            return tokens, torch.from_numpy(tok_pos)[None], CppStep(self, slots, chunks), last
        if self.kernel == "flex" and self.prefill_kernel == "sdpa":
            step = SdpaPrefillStep(self, slots, seq_ids, counts, starts)
            pos = torch.from_numpy(tok_pos)[None].to(self.device)
            return torch.tensor([t for p in prompts for t in p])[None].to(self.device), pos, step, last
        # pad the packed row to a bucket size so few distinct shapes get compiled; pad tokens have
        # q_pos = -1 (they see nothing) and write into the null page
        T = len(tok_seq)
        pad = prefill_bucket(T) - T if self.kernel == "flex" else 0
        flat = [t for p in prompts for t in p] + [0] * pad
        tokens = torch.tensor(flat, dtype=torch.long)[None]
        tok_seq = np.concatenate([tok_seq, np.zeros(pad, dtype=np.int64)])
        tok_pos = np.concatenate([tok_pos, np.full(pad, -1, dtype=np.int64)])
        if pad:
            slots = torch.cat([slots, torch.zeros(pad, dtype=torch.long, device=self.device)])
            counts_padded = counts + [pad]
        else:
            counts_padded = counts
        q_seq = torch.from_numpy(tok_seq.astype(np.int32))[None].to(self.device)
        q_pos = torch.from_numpy(tok_pos.astype(np.int32))[None].to(self.device)
        mask_mod = paged_mask_mod(self.pm.page_table, self.pm.phys_to_logical, q_seq, q_pos, self.P)
        block_mask = prefill_block_mask(
            [self.pm.pages_of(s) for s in seq_ids] + [[]],
            starts + [0],
            counts_padded,
            self.num_pages,
            self.P,
            mask_mod,
            self.device,
            max_blocks=self.max_batch * self.pm.max_pages_per_seq,
        )
        step = FlexStep(self, slots, block_mask, q_pos)
        return tokens.to(self.device), q_pos.long(), step, last

    def decode(self, seq_ids, tokens, lengths, active):
        """One token per row; `lengths[i]` tokens are cached already, the new one goes at that
        position. Inactive rows (finished sequences) are masked out and write to the null page.

        Host work: `reserve_next` (a Python pass over the rows; a full RESERVE, all-or-nothing,
        only when a row opens a page or grows into a shared one) and one host->device copy of the
        rows' metadata (sequence, position, new slot, page counts); the BlockMask is built from it
        and the device page table in `FlexDecodeStep.prepare`. ValueError if a row's length is not what
        its sequence holds; nothing changes then."""
        B, P = len(seq_ids), self.P
        if len(lengths) != B or len(active) != B:
            raise ValueError(
                f"decode got {B} seq_ids, {len(lengths)} lengths and {len(active)} active flags"
            )
        ids = [s for s, a in zip(seq_ids, active) if a]
        held = [n for n, a in zip(lengths, active) if a]
        new_slots, copies = self.pm.reserve_next(ids, held)  # checks ids and that each holds `held`
        opened = [self.pm.pages_of(s)[n // P] for s, n in zip(ids, held) if n % P == 0]
        self._after_reserve(opened, copies)
        new_slots = iter(new_slots)
        rows = [(s, n, next(new_slots)) if a else (0, -1, 0) for s, n, a in zip(seq_ids, lengths, active)]
        if self.kernel == "cpp":  # a chunk of one token per row; an inactive row: no sequence
            # (seq -1: zero output), its key and value written to the null page (slot 0)
            chunks = torch.tensor([(s if n >= 0 else -1, max(n, 0), 1, i)
                                   for i, (s, n, _) in enumerate(rows)])
            slots = torch.tensor([slot for _, _, slot in rows])
            return tokens.view(B, 1), chunks[:, 1:2], CppStep(self, slots, chunks)
        meta = to_device(decode_meta(*zip(*rows), P), self.device)  # [6, B]: one host->device copy
        positions = meta[5].view(B, 1)  # [B, 1] RoPE positions
        if self.kernel == "gather":
            step = GatherStep(self, meta[2], meta[0], positions, max(lengths) + 1, meta[1])
            return tokens.view(B, 1), positions, step
        return tokens.view(B, 1), positions, FlexDecodeStep(self, meta)


    def mixed(self, dec_ids, dec_tokens, dec_lengths, dec_active, pre_ids, chunks, starts):
        """Decode rows and prefill chunks in one packed row (flex kernels; see `MixedStep`).

        dec_*: a decode batch as `decode` takes it (rows padded with inactive ones; tokens [B] on
        device); pre_ids / chunks / starts: as `prefill`. -> tokens [1, B + Tp], positions
        [1, B + Tp], step, last [len(pre_ids)] (index of each chunk's last token in the row)."""
        if self.kernel == "gather":
            raise ValueError("mixed steps need a flex kernel; the gather kernel packs every token")
        B = len(dec_ids)
        tok_d, pos_d, dstep = self.decode(dec_ids, dec_tokens, dec_lengths, dec_active)
        tok_p, pos_p, pstep, last = self.prefill(pre_ids, chunks, starts)
        tokens = torch.cat([tok_d.view(1, B), tok_p], dim=1)
        positions = torch.cat([pos_d.view(1, B), pos_p], dim=1)
        if self.kernel == "cpp":  # one chunk list: the decode rows, then the prefill chunks after them
            chunks = torch.cat([dstep.chunks, pstep.chunks + torch.tensor([0, 0, 0, B])])
            return tokens, positions, CppStep(self, torch.cat([dstep.slots, pstep.slots]), chunks), last + B
        return tokens, positions, MixedStep(dstep, pstep, B), last + B


class PoolStep:
    """A prepared step over a backend's per-layer pools. `store` and `attention` work on pools
    handed in (FMS's attention op gets each layer's pools as its cache, see
    `fms_paged.integrations.fms`); `attend` runs both on layer `layer`'s pools (our own model)."""

    b: PagedBackend
    slots: torch.Tensor  # [B' * S'] pool slot of every new token, in the step's token order

    def prepare(self) -> PoolStep:
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B', H, S', D]; k, v: [B', Hkv, S', D]
        kp, vp = self.b.k_pools[layer], self.b.v_pools[layer]
        self.store(kp, vp, k, v)
        return self.attention(q, kp, vp)

    def store(self, kp: torch.Tensor, vp: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """ASSIGN the step's new k/v ([B', Hkv, S', D]) to their slots of pools kp, vp
        ([1, Hkv, NP, D]), in place (no checks: the step built the slots)."""
        for pool, x in ((kp, k), (vp, v)):  # x -> [1, Hkv, B' * S', D], the token order of the slots
            pool.index_copy_(2, self.slots, x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[3]))

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        """q: [B', H, S', D] over pools kp, vp (already written) -> [B', H, S', D]"""
        raise NotImplementedError


class CppStep(PoolStep):
    """A step of the cpp kernel: the slots of its new tokens and its chunk list ([n, 4] int64:
    seq, first position, tokens, offset in the step's token order; a decode row is a chunk of one
    token, an inactive row has seq -1). One kernel call per layer attends every chunk."""

    def __init__(self, backend: PagedBackend, slots: torch.Tensor, chunks: torch.Tensor):
        self.b, self.slots, self.chunks = backend, slots, chunks
        self.scale = backend.head_dim**-0.5

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # ASSIGN in the graph, the kernel as an opaque op
            return super().attend(layer, q, k, v)
        # eager: ASSIGN and attention in one kernel call (the new keys are still in cache)
        b = self.b
        return cpu_kernel.paged_attention(q, b.k_pools[layer], b.v_pools[layer], b.pm.page_table, self.chunks,
                                          b.P, self.scale, new=(k, v, self.slots)).transpose(1, 2)

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        # q: [B', H, S', D]; kp, vp: [1, Hkv, NP, D] -> [B', H, S', D] (a view of [B', S', H, D])
        out = torch.ops.fms_paged.paged_attention(q, kp, vp, self.b.pm.page_table, self.chunks,
                                                  self.b.page_size_arg, self.scale)
        return out.transpose(1, 2)


class FlexStep(PoolStep):
    """One step over the pool with flex_attention: slots and BlockMask shared by all layers.

    Prefill: built ready by the backend (slots and BlockMask from the host's page lists).
    Decode: the backend makes a `FlexDecodeStep` (metadata only) whose `prepare` builds this.
    """

    def __init__(self, backend: PagedBackend, slots: torch.Tensor, block_mask, q_pos: torch.Tensor,
                 gqa_group: int = 0):
        self.b = backend
        self.slots = slots  # [B' * S'] pool slot of every new token
        self.block_mask = block_mask
        self.gqa_group = gqa_group  # decode: the G query heads of each kv head packed into q
        self.score_mod = None
        if backend.score_mod is not None:  # q_pos: [B', S'] logical query positions
            self.score_mod = logical_score_mod(
                backend.score_mod, backend.pm.phys_to_logical, q_pos, backend.P, gqa_group
            )

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        # kp, vp: [1, Hkv, NP, D]; inside a compiled forward flex_attention is traced with the step
        if self.b.kernel == "flex" and not torch.compiler.is_compiling():
            attn = compiled_flex(dynamic=False)
        else:  # "flex-eager": reference semantics, materializes scores over the whole pool
            attn = flex_attention
        opts = self.b.kernel_options
        if not self.gqa_group:
            return attn(q, kp, vp, score_mod=self.score_mod, block_mask=self.block_mask,
                        enable_gqa=True, kernel_options=opts)
        B, H, _, D = q.shape  # decode: S' = 1; query head h reads kv head h // G
        qg = q.reshape(B, H // self.gqa_group, self.gqa_group, D)  # [B, Hkv, G, D]
        out = attn(qg, kp, vp, score_mod=self.score_mod, block_mask=self.block_mask, kernel_options=opts)
        return out.reshape(B, H, 1, D)


class SdpaPrefillStep(PoolStep):
    """Prefill chunks attended by SDPA: each chunk's sequence, positions 0 .. start + n - 1, is
    GATHERed from the pool (after the step's ASSIGN) into one packed logical-order K/V shared by
    all layers' index lists, then each chunk runs one SDPA call over its own keys: causal when the
    chunk starts the sequence, else with a [n, start + n] mask whose first `start` columns (the
    cached prefix) are all visible. No padding: the chunks' tokens are packed as they come."""

    def __init__(self, backend: PagedBackend, slots: torch.Tensor, seq_ids: Sequence[int],
                 counts: Sequence[int], starts: Sequence[int]):
        self.b, self.slots = backend, slots
        ctx = [s + n for s, n in zip(starts, counts)]
        # pool slot of every logical position 0 .. start + n - 1 of each chunk's sequence
        kv_seq = np.repeat(np.asarray(seq_ids, dtype=np.int64), ctx)
        kv_pos = np.concatenate([np.arange(n) for n in ctx])
        self.kv_slots = backend.pm.slots(kv_seq, kv_pos)
        q_off, k_off = np.cumsum([0, *counts]), np.cumsum([0, *ctx])
        self.chunks = []  # (query offset, n, key offset, keys, mask or None = causal)
        for i, (start, n) in enumerate(zip(starts, counts)):
            mask = None
            if start:  # query j (position start + j) sees keys 0 .. start + j
                mask = torch.ones(n, start + n, dtype=torch.bool, device=backend.device).tril(start)
            self.chunks.append((int(q_off[i]), n, int(k_off[i]), start + n, mask))

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        # q: [1, H, T, D]; kp, vp: [1, Hkv, NP, D] -> [1, H, T, D]
        keys = kp.index_select(2, self.kv_slots)  # [1, Hkv, sum(start + n), D], logical order
        values = vp.index_select(2, self.kv_slots)
        outs = [
            F.scaled_dot_product_attention(
                q[:, :, qo : qo + n], keys[:, :, ko : ko + L], values[:, :, ko : ko + L],
                attn_mask=mask, is_causal=mask is None, enable_gqa=True,
            )
            for qo, n, ko, L, mask in self.chunks
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class MixedStep(PoolStep):
    """Decodes and prefill chunks in one forward: the packed row holds `B` decode tokens (one per
    row of a decode batch, padded) and then the prefill tokens. Linear layers run on all of them
    at once; attention runs each part on its own (decode rows with a BlockMask listing their own
    pages; the prefill part with its query blocks' pages, or SDPA per chunk), so a decode token
    never scans the union of pages of the sequences sharing its query block.
    """

    def __init__(self, decode: FlexDecodeStep | FlexStep, prefill: FlexStep | SdpaPrefillStep, rows: int,
                 slots: torch.Tensor | None = None):
        self.decode, self.prefill, self.rows = decode, prefill, rows
        self.b = prefill.b
        self.slots = slots  # [B + Tp] pool slot of every token of the row (set by prepare)

    def prepare(self) -> MixedStep:
        if self.slots is not None:
            return self
        decode = self.decode.prepare()
        return MixedStep(decode, self.prefill, self.rows, torch.cat([decode.slots, self.prefill.slots]))

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        # q: [1, H, B + Tp, D], a view of [1, B + Tp, H, D]. The compiled flex kernels are
        # specialised on strides: each part gets the strides a pure decode / pure prefill step
        # gives it, so mixed steps reuse their kernels (a plain slice's strides would depend on
        # the other part's length: one recompilation per new (B, Tp) pair)
        B = self.rows
        rows = q.transpose(1, 2)  # [1, B + Tp, H, D]
        qd = rows[0, :B].unsqueeze(1).transpose(1, 2)  # [B, H, 1, D], no copy
        od = self.decode.attention(qd, kp, vp)
        qp = rows[:, B:].clone(memory_format=torch.contiguous_format).transpose(1, 2)  # [1, H, Tp, D]
        op = self.prefill.attention(qp, kp, vp)
        return torch.cat([od.squeeze(2).transpose(0, 1).unsqueeze(0), op], dim=2)


class FlexDecodeStep:
    """A decode step's metadata: `decode_meta` ([6, B] int64 on device, see
    `fms_paged.flex.masks.decode_meta`) holds each row's sequence, query position and new slot.
    `prepare` builds the ready `FlexStep` (BlockMask from the metadata and the device page table)
    with device ops only, and returns a new object rather than writing attributes on this one: in
    a compiled step, writes to an input object are replayed in Python after the graph (for a
    BlockMask and its mask_mod closure, a measurable cost per step)."""

    def __init__(self, backend: PagedBackend, decode_meta: torch.Tensor):
        self.b = backend
        self.decode_meta = decode_meta

    def prepare(self) -> FlexStep:
        b, meta = self.b, self.decode_meta
        q_seq, q_pos = meta[0][:, None], meta[1][:, None]  # [B, 1]
        mask_mod = paged_mask_mod(b.pm.page_table, b.pm.phys_to_logical, q_seq, q_pos, b.P,
                                  gqa_packed=True)
        block_mask = decode_block_mask(b.pm.page_table, meta, b.num_pages, b.P, mask_mod, b.gqa_group)
        return FlexStep(b, meta[2], block_mask, q_pos, b.gqa_group)


class GatherStep:
    """Fallback: GATHER each row's logical K/V from its pages, then SDPA with a causal mask.
    `prepare` returns a `PreparedGatherStep` (the gather indices and the mask)."""

    def __init__(
        self,
        backend: PagedBackend,
        slots: torch.Tensor,
        seqs: torch.Tensor,
        positions: torch.Tensor,
        span: int,
        q_pos: torch.Tensor | None = None,
    ):
        self.b = backend
        self.slots = slots  # [B * S] pool slot of every new token
        self.seqs = seqs  # [B] sequence of each row (decode: 0 for inactive rows)
        self.positions = positions  # [B, S]
        self.span = span  # host-known: 1 + the largest position this step
        self.q_pos = q_pos  # decode: [B] query positions, -1 for inactive rows

    def prepare(self) -> PreparedGatherStep:
        P, dev = self.b.P, self.positions.device
        j = torch.arange(self.span, device=dev)
        pages = self.b.pm.page_table.index_select(0, self.seqs)  # [B, max_pages]
        col = (j // P).clamp(max=pages.shape[1] - 1)
        kv_slots = pages[:, col].long() * P + j % P  # [B, L]
        # mask: [B, 1, S, L]; key position <= query position
        mask = (j[None, None, :] <= self.positions[:, :, None]).unsqueeze(1)
        if self.q_pos is not None:  # decode
            # inactive rows see only slot 0 of the null page (finite softmax; output discarded)
            inactive = (self.q_pos < 0)[:, None, None, None]
            mask = mask & ~inactive | (j == 0)[None, None, None, :] & inactive
        return PreparedGatherStep(self.b, self.slots, kv_slots, mask)


class PreparedGatherStep(PoolStep):
    """A `GatherStep` ready to attend: the gather indices and mask shared by all layers."""

    def __init__(self, backend: PagedBackend, slots: torch.Tensor, kv_slots: torch.Tensor,
                 mask: torch.Tensor):
        self.b = backend
        self.slots = slots  # [B * S] pool slot of every new token
        self.kv_slots = kv_slots  # [B, L] pool slot of each row's logical positions 0..L-1
        self.mask = mask  # [B, 1, S, L]

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        keys = kp[0][:, self.kv_slots].transpose(0, 1)  # [Hkv, B, L, D] -> [B, Hkv, L, D]
        values = vp[0][:, self.kv_slots].transpose(0, 1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=True)
