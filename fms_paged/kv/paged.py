"""The paged backend: K/V in a page pool, attention through the block table.

Per layer the pool is one tensor `[1, Hkv, num_pages * P, D]` (a tensor of its own, not a view of a
stacked one: under torch.compile an in-place write into a view copies the whole base). The backend
reads; it never changes the page table. Whoever owns the sequences (the engine's scheduler, or
`fms_paged.kv.cache.PagedCache` for a static batch) RESERVEs their pages first and hands the
`Reservation` to `prepare_pages` (zeroing for a kernel that reads whole pages, copy-on-write
copies). Then `prefill_inputs` / `decode_inputs` / `mixed_inputs` read the new tokens' slots and
the sequences' pages off the page manager and ask the kernel (`fms_paged.kv.kernels`) for one
`AttentionStep` shared by every layer: each layer ASSIGNs its new k/v to those slots and attends
through the pages under its own `AttentionSpec`.

Layouts: decode runs one row per sequence ([B, 1], B a fixed bucket, so shapes never change);
prefill packs all prompts into one row ([1, T], no padding to the longest prompt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fms_paged.kv._pool_ops import to_device
from fms_paged.kv.geometry import page_slots, pool_pages, slot
from fms_paged.kv.groups import LayerGroups, layer_groups
from fms_paged.kv.kernels import choose_kernel, flex_max_pages
from fms_paged.kv.kernels.base import GroupedStep
from fms_paged.kv.page_groups import GroupedPages
from fms_paged.kv.page_manager import PageManager, Reservation
from fms_paged.kv.quant import allocate, check_kv_cache_dtype, raw, storage_dtype
from fms_paged.kv.spec import AttentionSpec, default_spec
from fms_paged.kv.view import DecodeBatch, PoolView, PrefillBatch

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


def model_groups(model: torch.nn.Module) -> LayerGroups:
    """The layer slices a model's pages are held in (`fms_paged.kv.groups`): per group where the
    model attends layer by layer through `PoolStep.attend` (`attends_by_layer`: ours), else one
    slice of every layer (IBM FMS's models hand each call its pools alone)."""
    return layer_groups(attention_specs(model), grouped=getattr(model, "attends_by_layer", False))


def attention_specs(model: torch.nn.Module) -> tuple[AttentionSpec, ...]:
    """Each layer's `AttentionSpec`, as the model declares it (`model.attention_specs()`), else the
    default (scale head_dim ** -0.5, no window) for every layer."""
    declared = getattr(model, "attention_specs", None)
    if declared is not None:
        return tuple(declared())
    c = model.config
    return (default_spec(c.head_dim),) * c.nlayers


class PagedBackend:
    """Per-layer page pools, the PageManager of their pages and the kernel that attends through
    them, for a model (`attn_impl="paged"`, or FMS's through `fms_paged.integrations.fms`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int,
        max_seq_len: int,
        *,
        num_pages: int | None = None,
        kernel: str = "auto",
        score_mod: Callable | None = None,
        kv_cache_dtype: str | None = None,
    ):
        c = model.config
        # what the pages store: the model's dtype ("auto"), or 8-bit values with fp32 scales
        # (`fms_paged.kv.quant`); None: the model config's choice
        self.kv_cache_dtype = check_kv_cache_dtype(
            getattr(c, "kv_cache_dtype", "auto") if kv_cache_dtype is None else kv_cache_dtype)
        kv_dtype = storage_dtype(self.kv_cache_dtype, model.dtype)
        self.P = P = c.page_size
        self.device = model.device
        self.max_batch = max_batch
        self.specs = attention_specs(model)
        self.groups = groups = model_groups(model)
        # (by default every sequence whole in every layer slice, and the null page)
        self.num_pages = num_pages or groups.num_slices * (pool_pages(max_batch, max_seq_len, P) - 1) + 1
        self.kernel = choose_kernel(kernel, self.device, P, head_dim=c.head_dim, dtype=model.dtype,
                                    score_mod=score_mod, sinks=any(s.sinks is not None for s in self.specs),
                                    kv_dtype=kv_dtype)
        if self.kernel.name == "flex" and self.device.type == "cuda":
            most = flex_max_pages(c.kvheads, c.head_dim, P)
            if self.num_pages > most:
                raise ValueError(f"num_pages={self.num_pages}; expected at most {most} for the flex kernel "
                                 f"on CUDA: a layer's pool of {c.kvheads} kv heads x {P}-token pages x "
                                 f"{c.head_dim} must stay under 2**31 elements for Triton's kernels")
        if groups.grouped:
            self.pm = GroupedPages(groups, self.num_pages, P, max_batch, self.device, max_seq_len=max_seq_len)
        else:
            self.pm = PageManager(self.num_pages, P, max_batch, self.device, max_seq_len=max_seq_len)
        shape = (1, c.kvheads, self.num_pages * P, c.head_dim)
        # a pool tensor per layer of a slice: [1, Hkv, num_pages * P, D], the j-th layer of every
        # slice reading tensor j (a page id belongs to one slice at a time), with an 8-bit pool's
        # scales beside it ([1, Hkv, num_pages * P, 1], addressed by slot as the values are; None
        # for 16/32 bits). Left uninitialised: a page is zeroed when a RESERVE hands it out
        # (`prepare_pages`), so pool memory is touched (on the CPU: faulted in) only as pages are
        # used. The null page is zeroed now: padding writes to it and the GATHER fallback reads it
        # for rows that see nothing.
        u = groups.layers_per_slice
        k_store = [allocate(shape, kv_dtype, self.device) for _ in range(u)]
        v_store = [allocate(shape, kv_dtype, self.device) for _ in range(u)]
        self.k_tensors = [p for p, _ in k_store] + [s for _, s in k_store if s is not None]
        self.v_tensors = [p for p, _ in v_store] + [s for _, s in v_store if s is not None]
        per_layer = groups.position_of  # layer -> its tensor
        self.k_pools, self.k_scales = [k_store[j][0] for j in per_layer], [k_store[j][1] for j in per_layer]
        self.v_pools, self.v_scales = [v_store[j][0] for j in per_layer], [v_store[j][1] for j in per_layer]
        for pool in self._storage():
            raw(pool)[:, :, :P].zero_()
        # the page size the cpp op is given: an int that a compiled step takes as an input
        # (SymInt), as it takes the pool length and the page table's size (dynamic dims:
        # `mark_dynamic`): one compiled decode graph serves every pool, page size and
        # `max_model_len` of a model shape
        page_size_arg = DynamicInt(P)
        self.view = PoolView(
            self.k_pools, self.v_pools, self.pm.page_table, self.pm.phys_to_logical, P, page_size_arg,
            self.num_pages, max_batch * self.pm.max_pages_per_seq, self.specs, c.nheads // c.kvheads,
            self.device, k_scales=self.k_scales, v_scales=self.v_scales, compute_dtype=model.dtype,
            num_slices=groups.num_slices)
        # a grouped model's steps: one per slice, over the view of its layers
        self.slice_views = [dataclasses.replace(self.view, layers=layers)
                            for layers in groups.slice_layers] if groups.grouped else [self.view]

    def _storage(self) -> list[torch.Tensor]:
        """Every tensor of the pages once (a slice's layers share them), indexed by slot along dim 2:
        values and 8-bit scales."""
        return self.k_tensors + self.v_tensors

    def mark_dynamic(self) -> None:
        """For a compiled step of a kernel with dynamic shapes (cpp): the pools' length and the
        page table's size as dynamic dims, so that one compiled decode graph serves every pool and
        `max_model_len` of a model shape. Called where a step is compiled (`decode_fn`), not when
        the pools are made: marking imports torch._dynamo, ~1 s of a start that runs eager steps."""
        if self.kernel.dynamic_shapes:
            for pool in self._storage():
                torch._dynamo.maybe_mark_dynamic(pool, 2)
            torch._dynamo.maybe_mark_dynamic(self.pm.page_table, 0)
            torch._dynamo.maybe_mark_dynamic(self.pm.page_table, 1)

    @property
    def kv_bytes(self) -> int:
        return sum(p.nbytes for p in self._storage())

    def prepare_pages(self, reservation: Reservation) -> None:
        """Make the pages a RESERVE handed out ready: zero them (for a kernel that reads whole
        pages), then run its copy-on-write copies (a copy's destination is one of them: the copy
        overwrites it whole, so it is not zeroed first). Both cover an 8-bit pool's scales with
        its values.

        Zeroing matters there: attention multiplies masked-out weights (exactly 0) by the values
        of the whole page, and 0 * NaN = NaN, so stale NaN/inf left by a page's previous owner in
        slots not yet written would leak into the output."""
        opened = reservation.opened
        if opened and reservation:  # (beam search's every step)
            copied = {dst for _, dst in reservation}
            opened = [p for p in opened if p not in copied]
        if opened and self.kernel.zero_new_pages:
            idx = to_device(page_slots(np.asarray(opened), self.P).reshape(-1), self.device)
            for pool in self._storage():
                raw(pool).index_fill_(2, idx, 0)  # (fp8: its bytes; 0x00 is +0.0)
        if reservation:  # copy-on-write copies of pages shared by fork
            self.pm.apply_copies(reservation, *self._storage())

    def prefill_batch(self, seq_ids: Sequence[int], chunks: Sequence[Sequence[int]],
                      starts: Sequence[int], min_tokens: int = 1, g: int = 0) -> PrefillBatch:
        """The host data of a prefill step whose tokens are RESERVEd already: chunk i appends
        `chunks[i]` to `seq_ids[i]` from position `starts[i]`; for slice g of a grouped model, its
        sequences are the slice's page-table rows."""
        counts = [len(p) for p in chunks]
        check_chunks(seq_ids, counts, starts)
        rows = self._rows(seq_ids, g)
        tok_seq = np.repeat(np.asarray(seq_ids, dtype=np.int64), counts)
        tok_pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
        pm = self.pm if not self.groups.grouped else self.pm.inner
        return PrefillBatch(
            rows, list(starts), counts, torch.tensor([t for p in chunks for t in p])[None],
            tok_pos, pm.slots(self._rows(tok_seq, g), tok_pos), [pm.pages_of(r) for r in rows], min_tokens)

    def decode_batch(self, seq_ids: Sequence[int], tokens: torch.Tensor, lengths: Sequence[int],
                     active: Sequence[bool], g: int = 0) -> DecodeBatch:
        """The host data of a decode step whose rows are RESERVEd already (an active row holds
        `lengths[i] + 1` tokens: its new one at position `lengths[i]`); slice g's rows as in
        `prefill_batch`."""
        B, P = len(seq_ids), self.P
        if len(lengths) != B or len(active) != B:
            raise ValueError(f"decode got {B} seq_ids, {len(lengths)} lengths and {len(active)} active flags")
        rows = self._rows(seq_ids, g)
        table = self.pm.host_table
        slots = [slot(int(table[s, n // P]), n, P) if a else 0 for s, n, a in zip(rows, lengths, active)]
        return DecodeBatch(rows, tokens, list(lengths), list(active), slots)

    def _rows(self, seq_ids, g: int):
        """Slice g's page-table rows of `seq_ids` (`GroupedPages.rows`; the ids themselves for one
        slice)."""
        if self.groups.grouped:
            return self.pm.rows(seq_ids, g)
        return seq_ids if isinstance(seq_ids, np.ndarray) else list(seq_ids)

    def _per_slice(self, build: Callable) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(tokens, positions, step) of the kernel's builder `build(view, g)`: itself for one
        slice, else one step per slice (`GroupedStep`), the tokens and positions being the same."""
        tokens, positions, step = build(self.slice_views[0], 0)
        if not self.groups.grouped:
            return tokens, positions, step
        steps = [step] + [build(view, g)[2] for g, view in enumerate(self.slice_views) if g]
        return tokens, positions, GroupedStep(steps, self.groups.slice_of, self.kernel.join(self.view, steps))

    def prefill_inputs(self, seq_ids, chunks, starts, min_tokens: int = 1):
        """-> tokens [1, T'], positions [1, T'], step, last [len(seq_ids)] (each chunk's last token
        in the row)."""
        tokens, positions, step = self._per_slice(lambda view, g: self.kernel.prefill(
            view, self.prefill_batch(seq_ids, chunks, starts, min_tokens, g)))
        last = np.cumsum([len(c) for c in chunks]) - 1
        return tokens, positions, step, torch.from_numpy(last).to(self.device)

    def decode_inputs(self, seq_ids, tokens, lengths, active):
        """-> tokens [B, 1], positions [B, 1], step. Inactive rows (padding) are masked out and
        write to the null page."""
        return self._per_slice(lambda view, g: self.kernel.decode(
            view, self.decode_batch(seq_ids, tokens, lengths, active, g)))

    def mixed_inputs(self, dec_ids, dec_tokens, dec_lengths, dec_active, pre_ids, chunks, starts):
        """Decode rows and prefill chunks in one packed row. dec_*: as `decode_inputs` takes them
        (rows padded with inactive ones; tokens [B] on device); pre_ids / chunks / starts: as
        `prefill_inputs`. -> tokens [1, B + Tp], positions [1, B + Tp], step, last [len(pre_ids)]
        (index of each chunk's last token in the row)."""
        tokens, positions, step = self._per_slice(lambda view, g: self.kernel.mixed(
            view, self.decode_batch(dec_ids, dec_tokens, dec_lengths, dec_active, g),
            self.prefill_batch(pre_ids, chunks, starts, 1, g)))
        last = np.cumsum([len(c) for c in chunks]) - 1 + len(dec_ids)
        return tokens, positions, step, torch.from_numpy(last).to(self.device)
