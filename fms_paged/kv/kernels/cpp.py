"""The "cpp" kernel: the project's C++ CPU kernel (`fms_paged.kv.cpu_kernel`), prefill chunks and
decode rows of a step in one call per layer, K/V read in place through the page table.

A step is one chunk list ([n, 4] int64: seq, first position, tokens, offset in the step's token
order; a decode row is a chunk of one token, a row of no sequence has seq -1 and a zero output).
The kernel takes each layer's spec (scale, window, soft-cap, sinks) as arguments and reads no slot
outside a row's window or past its position, so stale pages need no zeroing.
"""

from __future__ import annotations

import numpy as np
import torch

from fms_paged.kv import cpu_kernel
from fms_paged.kv._pool_ops import read_slots
from fms_paged.kv.kernels.base import Kernel, PoolStep
from fms_paged.kv.spec import AttentionSpec, attend, visible
from fms_paged.kv.view import DecodeBatch, PoolView, PrefillBatch


class CppStep(PoolStep):
    """A step of the cpp kernel: the slots of its new tokens and its chunk list. `fused`: an eager
    forward of our models runs the step's blocks in one call of the operator
    `fms_paged::decoder_stack` (`LLaMA.hidden`), decode rows and prefill chunks alike; compiled
    forwards and FMS's models attend layer by layer.

    While a first start's builds compile (`native.deferred`), or where the kernel could not be
    built, an eager step attends by torch's operations instead (`gathered`: GATHER each chunk's
    keys and values, then `attend`, the gather kernel's math) and is not fused."""

    def __init__(self, view: PoolView, slots: torch.Tensor, chunks: torch.Tensor):
        self.view, self.slots, self.chunks = view, slots, chunks
        self._fused: bool | None = None

    @property
    def fused(self) -> bool:
        """Whether an eager forward runs the step's blocks in one call: where the kernel is loaded,
        unless set False (the modules then run the step)."""
        return self.kernel_loaded() if self._fused is None else self._fused and self.kernel_loaded()

    @fused.setter
    def fused(self, value: bool) -> None:
        self._fused = value

    def kernel_loaded(self) -> bool:
        """Whether the kernel for the pools' head dim and dtype is loaded (`cpu_kernel.loaded`)."""
        return cpu_kernel.loaded_for(self.view)

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                  spec: AttentionSpec) -> torch.Tensor:
        # q: [B', H, S', D]; kp, vp: [1, Hkv, NP, D] -> [B', H, S', D] (a view of [B', S', H, D])
        if not torch.compiler.is_compiling() and not self.kernel_loaded():
            return self.gathered(q, kp, vp, spec)
        v = self.view
        sinks = None if spec.sinks is None else spec.sinks.float().contiguous()  # the op takes fp32 [H]
        out = torch.ops.fms_paged.paged_attention(q, kp, vp, v.page_table, self.chunks, v.page_size_arg,
                                                  spec.scale, spec.window or 0, spec.softcap or 0.0, sinks)
        return out.transpose(1, 2)

    def gathered(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                 spec: AttentionSpec) -> torch.Tensor:
        """What the kernel computes, by torch's operations: each chunk's queries (rows `offset` ..
        `offset + tokens - 1` of the step's tokens) over its sequence's keys up to its last
        position (from the first its window still sees), GATHERed from the pages, causal and
        within the layer's window (`attend`); rows of no sequence are zero.
        q: [B', H, S', D] -> [B', H, S', D]."""
        B, H, S, D = q.shape
        rows = q.transpose(1, 2).reshape(B * S, H, D)
        out = torch.zeros_like(rows)
        P, table = self.view.page_size, self.view.page_table
        for seq, first, n, off in self.chunks.tolist():
            if seq < 0:
                continue
            pos = torch.arange(0 if spec.window is None else max(0, first - spec.window + 1), first + n)
            keys, values = read_slots(kp, vp, table[seq, pos // P].long() * P + pos % P)  # [1, Hkv, L, D]
            mask = visible(torch.arange(first, first + n)[:, None], pos[None, :], spec.window)[None, None]
            qc = rows[off : off + n].transpose(0, 1)[None]  # [1, H, n, D]
            out[off : off + n] = attend(qc, keys, values, spec, mask=mask)[0].transpose(0, 1)
        return out.view(B, S, H, D).transpose(1, 2)


class CppKernel(Kernel):
    name = "cpp"
    # compile="auto" runs its steps eagerly: a step's layers, prefill or decode, are one C++
    # operator call (`fms_paged::decoder_stack`), so a compiled graph would save little and cost
    # its build (tens of seconds per shape) at start-up; compile=True compiles them all the same
    compiles = False
    zero_new_pages = False  # reads no slot past a row's position
    # one compiled decode graph for every batch past one row (`model_step._rows_dynamic`), pool
    # and page size; its compiled prefill graph takes every step of two tokens or more
    dynamic_shapes = True
    min_rows = 2
    min_prefill_tokens = 2
    one_call = True

    def load(self, view: PoolView) -> None:
        cpu_kernel.loaded_for(view)  # (a kernel that cannot be had was announced)

    def prefill(self, view: PoolView, batch: PrefillBatch) -> tuple[torch.Tensor, torch.Tensor, CppStep]:
        counts, T = batch.counts, batch.tokens.shape[1]
        offsets = np.cumsum([0, *counts]).tolist()
        rows = [(s, st, n, o) for s, st, n, o in zip(batch.seq_ids, batch.starts, counts, offsets)]
        tokens, positions, slots = batch.tokens, torch.from_numpy(batch.positions)[None], batch.slots
        if T < batch.min_tokens:  # padding of no sequence: position 0, the null page's slot 0
            pad = batch.min_tokens - T
            rows.append((-1, 0, pad, T))
            tokens = torch.cat([tokens, torch.zeros(1, pad, dtype=tokens.dtype)], dim=1)
            positions = torch.cat([positions, torch.zeros(1, pad, dtype=positions.dtype)], dim=1)
            slots = torch.cat([slots, torch.zeros(pad, dtype=slots.dtype, device=slots.device)])
        return tokens, positions, CppStep(view, slots, torch.tensor(rows))

    def decode(self, view: PoolView, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor, CppStep]:
        # a chunk of one token per row; an inactive row: no sequence (seq -1: zero output), its
        # key and value written to the null page (slot 0)
        rows = batch.rows()
        B = len(rows)
        chunks = torch.tensor([(s if n >= 0 else -1, max(n, 0), 1, i) for i, (s, n, _) in enumerate(rows)])
        slots = torch.tensor([slot for _, _, slot in rows])
        return batch.tokens.view(B, 1), chunks[:, 1:2], CppStep(view, slots, chunks)

    def mixed(self, view: PoolView, dec: DecodeBatch,
              pre: PrefillBatch) -> tuple[torch.Tensor, torch.Tensor, CppStep]:
        # one chunk list: the decode rows, then the prefill chunks after them
        B = len(dec.seq_ids)
        tok_d, pos_d, dstep = self.decode(view, dec)
        tok_p, pos_p, pstep = self.prefill(view, pre)
        tokens = torch.cat([tok_d.view(1, B), tok_p], dim=1)
        positions = torch.cat([pos_d.view(1, B), pos_p], dim=1)
        chunks = torch.cat([dstep.chunks, pstep.chunks + torch.tensor([0, 0, 0, B])])
        return tokens, positions, CppStep(view, torch.cat([dstep.slots, pstep.slots]), chunks)
