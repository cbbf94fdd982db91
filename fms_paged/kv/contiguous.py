"""The dense baseline: a preallocated contiguous KV cache per layer (gpt-fast style) + SDPA.

Every sequence owns a row of `max_seq_len` slots whatever its real length: this is the memory the
paged backend saves. Batches are right-padded to the longest sequence (the padded baseline).
"""

from __future__ import annotations

import torch

from fms_paged.kv.spec import AttentionSpec, attend, default_spec, visible, windows


class ContiguousKVCache:
    """Per layer, k and v buffers `[max_batch, Hkv, max_seq_len, D]` (one tensor each, so that
    in-place writes stay in place under torch.compile)."""

    def __init__(
        self,
        nlayers: int,
        max_batch: int,
        max_seq_len: int,
        kvheads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        specs: tuple[AttentionSpec, ...] | None = None,
    ):
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.specs = specs or (default_spec(head_dim),) * nlayers  # per layer
        self.windows = windows(self.specs)
        shape = (max_batch, kvheads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(nlayers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(nlayers)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def step(self, positions: torch.Tensor, kv_len: int, mask_free: bool = False) -> DenseStep:
        """positions: [B, S] absolute positions of the new tokens of rows 0..B-1 (device);
        kv_len: host-known 1 + the largest position in the batch (attention span this step);
        mask_free: host-known that no mask is needed: a prefill of every row from position 0
        (causal over the span) or one decode row (it sees the whole span), and no layer's window
        is shorter than the span."""
        B = positions.shape[0]
        if B > self.max_batch or kv_len > self.max_seq_len:
            raise ValueError(
                f"step needs batch {B} x length {kv_len}; cache holds {self.max_batch} x "
                f"{self.max_seq_len}"
            )
        mask_free &= all(w is None or w >= kv_len for w in self.windows)
        return DenseStep(self, positions, kv_len, mask_free=mask_free)


class DenseStep:
    """One step of the dense backend; the masks are built once per window (`prepare`, which
    returns a new step holding them rather than writing to this one) and shared by all layers."""

    def __init__(self, cache: ContiguousKVCache, positions: torch.Tensor, kv_len: int,
                 masks: dict | None = None, rows: torch.Tensor | None = None,
                 mask_free: bool = False):
        self.cache = cache
        self.positions = positions  # [B, S]
        self.kv_len = kv_len
        # window -> [B, 1, S, L]; True where the key is visible to the query (causal, in the window)
        self.masks = masks
        self.rows = rows  # [B, 1] batch row indices
        # no mask needed (`ContiguousKVCache.step`): SDPA then runs without one, which on CUDA keeps
        # grouped-query attention on the flash kernel (a boolean mask sends it to the math kernel,
        # whose [B, H, S, L] scores a long batched prefill cannot hold)
        self.mask_free = mask_free

    def prepare(self) -> DenseStep:
        if self.rows is not None:
            return self
        B, dev = self.positions.shape[0], self.positions.device
        rows = torch.arange(B, device=dev)[:, None]
        masks = None
        if not self.mask_free:
            kv_pos = torch.arange(self.kv_len, device=dev)
            masks = {w: visible(self.positions[:, :, None], kv_pos[None, None, :], w).unsqueeze(1)
                     for w in self.cache.windows}
        return DenseStep(self.cache, self.positions, self.kv_len, masks, rows, self.mask_free)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, H, S, D]; k, v: [B, Hkv, S, D]
        B = q.shape[0]
        kc, vc = self.cache.k[layer], self.cache.v[layer]  # [Bmax, Hkv, Lmax, D]
        # advanced indices around a slice: the indexed view is [B, S, Hkv, D]
        kc[self.rows, :, self.positions] = k.transpose(1, 2)
        vc[self.rows, :, self.positions] = v.transpose(1, 2)
        keys, values = kc[:B, :, : self.kv_len], vc[:B, :, : self.kv_len]
        causal = self.mask_free and q.shape[2] > 1  # a prefill from 0: its span is its length
        spec = self.cache.specs[layer]
        mask = None if self.masks is None else self.masks[spec.window]
        return attend(q, keys, values, spec, mask=mask, is_causal=causal)
