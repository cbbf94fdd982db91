"""The paged backend: K/V in a page pool, attention through the block table.

Per layer the pool is one tensor `[1, Hkv, num_pages * P, D]` (a tensor of its own, not a view of a
stacked one: under torch.compile an in-place write into a view copies the whole base). Each step:
RESERVE pages for the new tokens (host bookkeeping, only when a page boundary is crossed), then
build one `AttentionStep` shared by every layer (`fms_paged.kv.steps`): the new tokens' pool slots
and what the kernel needs to find each sequence's pages (a chunk list, a BlockMask, gather
indices). Each layer ASSIGNs its new k/v to those slots and attends through the pages.

Layouts: decode runs one row per sequence ([B, 1], B a fixed bucket, so shapes never change);
prefill packs all prompts into one row ([1, T], no padding to the longest prompt).

The kernel (`fms_paged.kv.kernels`): "cpp" on the CPU, compiled "flex" elsewhere, "gather" as the
fallback and reference; "auto" picks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fms_paged.flex.masks import decode_meta, paged_mask_mod, prefill_block_mask
from fms_paged.kv._pool_ops import to_device
from fms_paged.kv.geometry import opened_pages, page_slots, pool_pages
from fms_paged.kv.kernels import choose_kernel, flex_kernel_options
from fms_paged.kv.page_manager import PageManager
from fms_paged.kv.steps import (
    CppStep,
    FlexDecodeStep,
    FlexStep,
    GatherDecodeStep,
    GatherPrefillStep,
    MixedStep,
    prefill_bucket,
)

try:  # an int that torch.compile takes as a graph input (SymInt) rather than as a constant
    from torch.fx.experimental.sym_node import DynamicInt
except ImportError:  # older torch: the page size is a constant of each compiled graph
    DynamicInt = int


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
    ):
        c = model.config
        self.P = P = c.page_size
        self.device = model.device
        self.max_batch = max_batch
        self.num_pages = num_pages or pool_pages(max_batch, max_seq_len, P)
        self.kernel = choose_kernel(kernel, self.device, P, head_dim=c.head_dim, dtype=model.dtype,
                                    score_mod=score_mod)
        self.kernel_options = flex_kernel_options(self.device, P)
        self.pm = PageManager(self.num_pages, P, max_batch, self.device, max_seq_len=max_seq_len)
        shape = (1, c.kvheads, self.num_pages * P, c.head_dim)
        # one pool per layer: [1, Hkv, num_pages * P, D]. Left uninitialised: a page is zeroed when
        # a RESERVE hands it out (`_after_reserve`), so pool memory is touched (on the CPU: faulted
        # in) only as pages are used. The null page is zeroed now: padding writes to it and the
        # GATHER fallback reads it for rows that see nothing.
        self.k_pools = [torch.empty(shape, dtype=model.dtype, device=self.device) for _ in range(c.nlayers)]
        self.v_pools = [torch.empty(shape, dtype=model.dtype, device=self.device) for _ in range(c.nlayers)]
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
        # flex prefills through its BlockMask on CUDA or with a score_mod; on the CPU one SDPA
        # call per chunk (GatherPrefillStep) beats its one-page KV blocks
        self.flex_prefill = self.kernel == "flex" and (self.device.type != "cpu" or score_mod is not None)
        # decode packs the G = nheads / kvheads query heads of each kv head into the query length:
        # the flex kernel then reads each page once per kv head, not once per query head
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
        opened = []
        for s, o, n in zip(seq_ids, old_lengths, new_lengths):
            pages, new = self.pm.pages_of(s), opened_pages(o, n, P)
            opened += pages[new.start : new.stop]
        self._after_reserve(opened, copies)

    def _after_reserve(self, opened: list[int], copies: list[tuple[int, int]]) -> None:
        """Zero the pages a RESERVE just handed out, then run its copy-on-write copies (a copy's
        destination is one of the opened pages: it is overwritten whole).

        Zeroing matters: attention multiplies masked-out weights (exactly 0) by the values of the
        whole page, and 0 * NaN = NaN, so stale NaN/inf left by a page's previous owner in slots
        not yet written would leak into the output. The cpp kernel reads no slot past a row's
        position, so its pages are left as they are.
        """
        if opened and self.kernel != "cpp":
            idx = to_device(page_slots(np.asarray(opened), self.P).reshape(-1), self.device)
            for pool in self.k_pools + self.v_pools:
                pool.index_fill_(2, idx, 0)
        self.pm.apply_copies(copies, *self.k_pools, *self.v_pools)  # pages shared by fork

    def prefill(self, seq_ids, prompts, starts=None, min_tokens: int = 1):
        """`CacheBackend.prefill`; `min_tokens` (cpp): a step of fewer tokens is padded to that
        many with tokens of no sequence (zero attention output, their keys and values written to
        the null page), so that it takes the compiled prefill graph's shape, not one of its own."""
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
        tokens = torch.tensor([t for p in prompts for t in p])[None]  # [1, T]
        if self.kernel == "cpp":
            offsets = np.cumsum([0, *counts]).tolist()
            rows = [(s, st, n, o) for s, st, n, o in zip(seq_ids, starts, counts, offsets)]
            T, positions = tokens.shape[1], torch.from_numpy(tok_pos)[None]
            if T < min_tokens:  # padding of no sequence: position 0, the null page's slot 0
                pad = min_tokens - T
                rows.append((-1, 0, pad, T))
                tokens = torch.cat([tokens, torch.zeros(1, pad, dtype=tokens.dtype)], dim=1)
                positions = torch.cat([positions, torch.zeros(1, pad, dtype=positions.dtype)], dim=1)
                slots = torch.cat([slots, torch.zeros(pad, dtype=slots.dtype, device=slots.device)])
            return tokens, positions, CppStep(self, slots, torch.tensor(rows)), last
        if not self.flex_prefill:
            step = GatherPrefillStep(self, slots, seq_ids, counts, starts)
            return tokens.to(self.device), torch.from_numpy(tok_pos)[None].to(self.device), step, last
        # pad the packed row to a bucket size so few distinct shapes get compiled; pad tokens have
        # q_pos = -1 (they see nothing) and write into the null page
        T = len(tok_seq)
        pad = prefill_bucket(T) - T
        tokens = torch.cat([tokens, torch.zeros(1, pad, dtype=torch.long)], dim=1)
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
        rows' metadata (sequence, position, new slot, page counts), from which the step finds the
        rows' pages on the device. ValueError if a row's length is not what its sequence holds;
        nothing changes then."""
        B, P = len(seq_ids), self.P
        if len(lengths) != B or len(active) != B:
            raise ValueError(
                f"decode got {B} seq_ids, {len(lengths)} lengths and {len(active)} active flags"
            )
        ids = [s for s, a in zip(seq_ids, active) if a]
        held = [n for n, a in zip(lengths, active) if a]
        new_slots, copies = self.pm.reserve_next(ids, held)  # checks ids and that each holds `held`
        opened = [self.pm.pages_of(s)[n // P] for s, n in zip(ids, held) if n % P == 0]  # new pages
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
            step = GatherDecodeStep(self, meta[2], meta[0], positions, max(lengths) + 1, meta[1])
            return tokens.view(B, 1), positions, step
        return tokens.view(B, 1), positions, FlexDecodeStep(self, meta)

    def mixed(self, dec_ids, dec_tokens, dec_lengths, dec_active, pre_ids, chunks, starts):
        """Decode rows and prefill chunks in one packed row (cpp: one chunk list; flex and
        gather: a `MixedStep`).

        dec_*: a decode batch as `decode` takes it (rows padded with inactive ones; tokens [B] on
        device); pre_ids / chunks / starts: as `prefill`. -> tokens [1, B + Tp], positions
        [1, B + Tp], step, last [len(pre_ids)] (index of each chunk's last token in the row)."""
        B = len(dec_ids)
        tok_d, pos_d, dstep = self.decode(dec_ids, dec_tokens, dec_lengths, dec_active)
        tok_p, pos_p, pstep, last = self.prefill(pre_ids, chunks, starts)
        tokens = torch.cat([tok_d.view(1, B), tok_p], dim=1)
        positions = torch.cat([pos_d.view(1, B), pos_p], dim=1)
        if self.kernel == "cpp":  # one chunk list: the decode rows, then the prefill chunks after them
            chunks = torch.cat([dstep.chunks, pstep.chunks + torch.tensor([0, 0, 0, B])])
            return tokens, positions, CppStep(self, torch.cat([dstep.slots, pstep.slots]), chunks), last + B
        return tokens, positions, MixedStep(dstep, pstep, B), last + B
