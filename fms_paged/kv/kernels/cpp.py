"""The "cpp" kernel: the project's C++ CPU kernel (`fms_paged.kv.cpu_kernel`, built and loaded by
`fms_paged.native`), prefill chunks and decode rows of a step in one call per layer, K/V read in
place through the page table; and the one-call forward of our models on its steps: every block
(`fms_paged::decoder_stack`), the whole forward (`fms_paged::decoder_logits`), or several greedy
decode steps (`fms_paged::decode_greedy`) in one operator call, over the model's weights as one
`fms_paged::DecoderStack` (`LLaMA.decoder_stack`).

A step is one chunk list ([n, 4] int64: seq, first position, tokens, offset in the step's token
order; a decode row is a chunk of one token, a row of no sequence has seq -1 and a zero output).
The kernel takes each layer's spec (scale, window, soft-cap, sinks) as arguments and reads no slot
outside a row's window or past its position, so stale pages need no zeroing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from fms_paged import native
from fms_paged.kv._pool_ops import read_slots
from fms_paged.kv.geometry import slot
from fms_paged.kv.kernels.base import Kernel, PoolStep, Scales
from fms_paged.kv.spec import AttentionSpec, attend, visible
from fms_paged.kv.view import DecodeBatch, PoolView, PrefillBatch

if TYPE_CHECKING:  # (the model imports the kernels' modules, not the other way round)
    from fms_paged.models.llama import LLaMA


def ready(view: PoolView) -> bool:
    """Whether the C++ path runs now over `view`'s pools ([1, Hkv, NP, D]): `native.ready` for
    their dtype and head dim (the operators, the GEMV, rows and attention kernels loaded); for int8
    pools (8-bit KV pages), the attention kernel over them for the model's dtype."""
    kp = view.k_pools[0]
    if kp.device.type != "cpu":
        return False
    if kp.dtype == torch.int8:
        return native.ready(view.compute_dtype, kp.shape[-1], kv_int8=True)
    return native.ready(kp.dtype, kp.shape[-1])


def quantized(view: PoolView) -> bool:
    """Whether `view`'s pages are 8-bit (int8 values with their row scales)."""
    return bool(view.k_scales) and view.k_scales[0] is not None


def scale_lists(view: PoolView) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """What the one-call operators take for 8-bit pages: every layer's (k_scales, v_scales), or
    (None, None) for 16/32-bit pools."""
    return (list(view.k_scales), list(view.v_scales)) if quantized(view) else (None, None)


class CppStep(PoolStep):
    """A step of the cpp kernel: the slots of its new tokens and its chunk list. `fused`: an eager
    forward of our models runs in one operator call (`forward_model`: `fms_paged::decoder_logits`,
    or `run_blocks`: `fms_paged::decoder_stack`), decode rows and prefill chunks alike; compiled
    forwards and FMS's models attend layer by layer (`attention`).

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
        return (self._fused is None or self._fused) and ready(self.view)

    @fused.setter
    def fused(self, value: bool) -> None:
        self._fused = value

    def forward_model(self, model: LLaMA, tokens: torch.Tensor, positions: torch.Tensor | None,
                      logits_at: torch.Tensor | None) -> torch.Tensor | None:
        """`model.forward` on this step in one operator call (`fms_paged::decoder_logits`: the
        embedding, the RoPE rows, every block, the final norm and the head, as the modules compute
        them) -> the logits, or None where the model runs its own modules: the step is not `fused`,
        the model's stack has no ends (`LLaMA.logits_stack`), or autograd would record (the
        operator has no autograd formula). Eager only. tokens, positions: [B, S] -> [B, S, V], or
        [K, V] at `logits_at` [K]."""
        if torch.compiler.is_compiling() or positions is None or not self.fused:
            return None
        stack = model.logits_stack()
        if stack is None:
            return None
        # (a head held as GGUF blocks: the final norm's weight stands for its dtype and grad)
        h = getattr(model.head, "weight", model.dec_norm.weight)
        view = self.view  # (a cpp step needs no `prepare`: slots and chunks are all)
        # (`fused` found the C++ path ready for the pools' dtype: the head's, unless it was converted)
        if (torch.is_grad_enabled() and h.requires_grad) or (
                h.dtype != view.k_pools[0].dtype and not native.ready(h.dtype)) or (
                quantized(view) and h.dtype != view.compute_dtype):
            return None
        cos, sin = model.rope_tables(int(positions.max()) + 1 if positions.numel() else 0)
        return torch.ops.fms_paged.decoder_logits(
            stack, tokens, positions, cos, sin, view.k_pools, view.v_pools, self.slots, view.page_table,
            self.chunks, view.page_size, logits_at, *scale_lists(view))

    def run_blocks(self, model: LLaMA, x: torch.Tensor,
                   ropes: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> torch.Tensor | None:
        """Every block of `model` on this step in one operator call (`fms_paged::decoder_stack`: the
        function the blocks' modules compute, in C++ without a Python call per operation) -> the
        blocks' output, or None where the model runs its own blocks: the step is not `fused`, a
        block has no fused form (`LLaMA.decoder_stack`), or autograd would record. Eager only.
        x: [B, S, C] (decode rows [B, 1], or a packed row of prefill chunks [1, T]); ropes: per
        RoPE table (cos, sin) [B, S, 1, D] -> [B, S, C]."""
        if (torch.compiler.is_compiling() or not self.fused or not native.ready(x.dtype)
                or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        stack = model.decoder_stack()
        if stack is None:
            return None
        B, S, C = x.shape
        view = self.view
        out = torch.ops.fms_paged.decoder_stack(
            stack, x.reshape(B * S, C), [cos.reshape(B * S, -1) for cos, _ in ropes],
            [sin.reshape(B * S, -1) for _, sin in ropes], view.k_pools, view.v_pools, self.slots,
            view.page_table, self.chunks, view.page_size, *scale_lists(view))
        return out.view(B, S, C)

    def attention(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                  spec: AttentionSpec, scales: Scales = (None, None)) -> torch.Tensor:
        # q: [B', H, S', D]; kp, vp: [1, Hkv, NP, D] -> [B', H, S', D] (a view of [B', S', H, D])
        if not torch.compiler.is_compiling() and not ready(self.view):
            return self.gathered(q, kp, vp, spec, scales)
        v = self.view
        sinks = None if spec.sinks is None else spec.sinks.float().contiguous()  # the op takes fp32 [H]
        args = (v.page_table, self.chunks, v.page_size_arg, spec.scale, spec.window or 0, spec.softcap or 0.0,
                sinks)
        if scales[0] is not None:  # 8-bit KV pages: int8 pools with their row scales
            out = torch.ops.fms_paged.paged_attention_i8(q, kp, vp, *scales, *args)
        else:
            out = torch.ops.fms_paged.paged_attention(q, kp, vp, *args)
        return out.transpose(1, 2)

    def gathered(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor,
                 spec: AttentionSpec, scales: Scales = (None, None)) -> torch.Tensor:
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
            # [1, Hkv, L, D] (8-bit pages: dequantized to q's dtype)
            slots = slot(table[seq, pos // P].long(), pos, P)
            keys, values = read_slots(kp, vp, slots, *scales, dtype=q.dtype)
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

    def load(self, view: PoolView) -> None:
        ready(view)  # (a kernel that cannot be had was announced)

    def decodes_in_one_call(self, model: torch.nn.Module, view: PoolView) -> bool:
        """Whether `decode_greedy` runs `model` over `view`'s pools now: the operators and kernels
        loaded (not while a first start's builds compile, `native.deferred`) and the model's stack
        has its ends (`LLaMA.logits_stack`)."""
        logits_stack = getattr(model, "logits_stack", None)  # (our models; not FMS's)
        return logits_stack is not None and ready(view) and logits_stack() is not None

    def join(self, view: PoolView, steps: list) -> CppStep:
        """The slices' steps as one: their slots [slices, M] and the first slice's chunk list (the
        operators find each layer's rows: `DecoderStack.set_slices`)."""
        return CppStep(view, torch.stack([s.slots for s in steps]), steps[0].chunks)

    def decode_greedy(self, model: LLaMA, tokens: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor,
                      view: PoolView, steps: int) -> torch.Tensor | None:
        """`steps` greedy decode steps of the sequences `seqs` [B] in one operator call
        (`fms_paged::decode_greedy`): row b's last token tokens[b] at position positions[b], its
        pages RESERVEd in `view`'s page table for the steps' positions -> the tokens [B, steps];
        each step is `CppStep.forward_model`'s one call and the sampler's argmax. None where the
        forward is not one call (`decodes_in_one_call`)."""
        return self._steps(torch.ops.fms_paged.decode_greedy, model, tokens, positions, seqs, view, steps)

    def decode_lookup(self, model: LLaMA, tokens: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor,
                      view: PoolView, steps: int, history: torch.Tensor, offsets: torch.Tensor,
                      caps: torch.Tensor, n_max: int, n_min: int,
                      max_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`decode_greedy`'s tokens with prompt lookup speculation inside the call
        (`fms_paged::decode_lookup`): row b proposes up to caps[b] tokens a step from its own
        tokens (history[offsets[b]:offsets[b + 1]], ending with tokens[b], then the call's), a
        step's rows at most max_rows -> (tokens [B, steps], per row [verifying steps, proposed,
        kept, rejecting steps], per step [rows, rows with proposals, seconds]). None where the
        forward is not one call (`decodes_in_one_call`)."""
        return self._steps(torch.ops.fms_paged.decode_lookup, model, tokens, positions, seqs, view, steps,
                           history, offsets, caps, n_max, n_min, max_rows)

    def decode_beams(self, model: LLaMA, tokens: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor,
                     view: PoolView, steps: int, width: int, scores: torch.Tensor, stops: torch.Tensor,
                     keeps: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """`steps` beam-search steps in one operator call (`fms_paged::decode_beams`): groups of
        `width` consecutive rows (a group's beams, best first, at one position; their cumulative
        scores fp32 [groups * width]), then rows that decode greedily; each group's stop tokens
        stops[g] (-1 pads) and candidates kept a step keeps[g], the rows' pages RESERVEd for the
        steps' positions -> (candidate scores fp32 [steps, groups, keep], candidates [steps, groups,
        2, keep] (parent beams, then tokens; -1 past a group's keep), the rows' page table rows
        int32 [slices, B, pages] after the call: the page manager's `retable` takes them, for each
        row the index in `seqs` of the sequence that holds its beam at the end, the greedy rows'
        tokens [rows, steps]). None where the forward is not one call."""
        return self._steps(torch.ops.fms_paged.decode_beams, model, tokens, positions, seqs, view, steps,
                           width, scores, stops, keeps)

    def _steps(self, op, model: LLaMA, tokens: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor,
               view: PoolView, steps: int, *extra):
        """`op` (decode_greedy, decode_lookup, decode_beams) over the model's stack, its RoPE tables
        grown for the steps' positions (positions[b] .. positions[b] + steps - 1) and `view`'s
        pools, page table and scales, `extra` after its steps -> its result; None where the
        forward is not one call."""
        if not self.decodes_in_one_call(model, view):
            return None
        cos, sin = model.rope_tables(int(positions.max()) + steps if positions.numel() else 0)
        return op(model.logits_stack(), tokens, positions, seqs, cos, sin, view.k_pools, view.v_pools,
                  view.page_table, view.page_size, steps, *extra, *scale_lists(view))

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
        # key and value written to the null page (slot 0, as `batch.slots` has it)
        rows = zip(batch.seq_ids, batch.lengths, batch.active)
        B = len(batch.seq_ids)
        chunks = torch.tensor([(s, n, 1, i) if a else (-1, 0, 1, i) for i, (s, n, a) in enumerate(rows)])
        return batch.tokens.view(B, 1), chunks[:, 1:2], CppStep(view, torch.tensor(batch.slots), chunks)

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
