"""The KV-data side of `PageManager` (fms_paged/kv/page_manager.py): the slots of tokens, and the
pool operations through them: ASSIGN (`assign`), GATHER (`gather`) and the copy-on-write copies
`reserve` hands back (`apply_copies`). A mixin: it reads the manager's host mirrors (`_lens`,
`_table`) and checks (`_check_ids`, `_check_live`) and keeps no state of its own."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fms_paged.kv import _pool_ops as ops
from fms_paged.kv._pool_ops import read_slots, write_slots
from fms_paged.kv.geometry import NULL_PAGE, slot


class PoolData:
    """Slots, ASSIGN, GATHER and copy-on-write copies of a `PageManager`."""

    def apply_copies(self, copies: Sequence[tuple[int, int]], *pools: torch.Tensor) -> None:
        """Run copy-on-write copies (src_page, dst_page), as returned by `reserve`, in every pool.

        # each pool: [L, Hkv, num_pages*P, D] (e.g. k_pool, v_pool, or every layer's pools)
        """
        if not copies or not pools:
            return
        src, dst = np.asarray(copies, dtype=np.int64).reshape(-1, 2).T
        ops.copy_pages(pools, src, dst, self.page_size)

    def slots(self, seq_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Pool slot of each token, from the host mirror, in one host->device copy.

        # seq_ids, positions: [T] host ints (list / numpy / CPU tensor)
        # returns slots: [T] int64 on device
        ValueError for a seq that is not live or a position outside [0, length).
        """
        seqs = self._check_ids(seq_ids, "seq_ids", unique=False)
        pos = ops.as_int_array(positions, "positions")
        if seqs.size != pos.size:
            raise ValueError(f"got {seqs.size} seq_ids but {pos.size} positions")
        self._check_live(seqs)
        lens = self._lens[seqs]
        bad = (pos < 0) | (pos >= lens)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"position {pos[i]} of seq {seqs[i]} out of range, expected 0 <= position < length {lens[i]}"
            )
        P = self.page_size
        pages = self._table[seqs, pos // P].astype(np.int64)
        gone = pages == NULL_PAGE
        if gone.any():
            i = int(np.argmax(gone))
            raise ValueError(f"position {pos[i]} of seq {seqs[i]} lies on a page released outside its "
                             "sliding window (release_prefix)")
        return ops.to_device(slot(pages, pos, P), self.device)

    def assign(
        self,
        seq_ids: Sequence[int],
        positions: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> None:
        """Write k/v of each token at its slot. Positions must be < the reserved length.

        # k, v: [T, Hkv, D] (pools with L == 1) or [L, T, Hkv, D]
        # k_pool, v_pool: [L, Hkv, num_pages*P, D]
        TypeError for a dtype/device mismatch, ValueError for shapes/ids/positions; pools unchanged.
        """
        ops.check_pool_pair(k_pool, v_pool)
        T = len(positions)
        ops._check_kv("k", k, k_pool, T)
        ops._check_kv("v", v, v_pool, T)
        self._check_pool_size(k_pool)
        write_slots(k_pool, v_pool, self.slots(seq_ids, positions), k, v)

    def gather(
        self, seq_ids: Sequence[int], k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logically contiguous K/V of each sequence, zero-padded to the longest.

        # returns k, v: [B, Hkv, max_len, D]; lens: [B] int64 on the pools' device
        """
        ids = self._check_ids(seq_ids, "seq_ids", unique=False)
        self._check_live(ids)
        ops.check_pool_pair(k_pool, v_pool)
        self._check_pool_size(k_pool)
        if not 0 <= layer < k_pool.shape[0]:
            raise ValueError(f"layer {layer} out of range, pool has {k_pool.shape[0]} layers")
        lens = self._lens[ids]
        S = int(lens.max()) if ids.size else 0
        valid = np.arange(S, dtype=np.int64) < lens[:, None]  # [B, S]
        seqs = np.broadcast_to(ids[:, None], valid.shape)[valid]
        pos = np.broadcast_to(np.arange(S, dtype=np.int64), valid.shape)[valid]
        slots = self.slots(seqs, pos)  # [sum(lens)], sequence by sequence
        k, v = read_slots(k_pool[layer : layer + 1], v_pool[layer : layer + 1], slots)  # [1, Hkv, T, D]
        dev = k_pool.device
        flat = ops.to_device(np.flatnonzero(valid.reshape(-1)), dev)  # where each token goes in [B * S]
        out = []
        for x in (k, v):
            H, D = x.shape[1], x.shape[3]
            padded = x.new_zeros(ids.size * S, H, D).index_copy_(0, flat, x[0].transpose(0, 1))
            out.append(padded.view(ids.size, S, H, D).transpose(1, 2))  # [B, Hkv, S, D]
        return out[0], out[1], ops.to_device(lens, dev)

    def _check_pool_size(self, pool: torch.Tensor) -> None:
        want = self.num_pages * self.page_size
        if pool.shape[2] != want:
            raise ValueError(f"pool slot dim {pool.shape[2]}, expected num_pages*page_size = {want}")
