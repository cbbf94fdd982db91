"""Fake (meta) implementations of the operators of `csrc/ops/`, registered once they are
loaded (`fms_paged.native.ops`): the output shapes torch.compile traces with, no data read."""

from __future__ import annotations

import torch


def register_fakes() -> None:
    @torch.library.register_fake("fms_paged::paged_attention")
    def _paged_attention(q, k_pool, v_pool, page_table, chunks, page_size, scale, window=0, softcap=0.0,
                         sinks=None):
        B, H, S, D = q.shape  # -> [B, S, H, D]
        return q.new_empty(B, S, H, D)

    @torch.library.register_fake("fms_paged::paged_attention_i8")
    def _paged_attention_i8(q, k_pool, v_pool, k_scales, v_scales, page_table, chunks, page_size, scale,
                            window=0, softcap=0.0, sinks=None):
        B, H, S, D = q.shape  # -> [B, S, H, D]
        return q.new_empty(B, S, H, D)

    def _stacked(x, weights):
        return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))

    @torch.library.register_fake("fms_paged::gemv")
    def _gemv(x, weights):
        return _stacked(x, weights)

    @torch.library.register_fake("fms_paged::gemm")
    def _gemm(x, weights):
        return _stacked(x, weights)

    @torch.library.register_fake("fms_paged::linear")
    def _linear(x, weights, bias):
        return _stacked(x, weights)

    @torch.library.register_fake("fms_paged::qlinear")
    def _qlinear(x, weights, bias):
        return _stacked(x, weights)

    @torch.library.register_fake("fms_paged::rms_norm")
    def _rms_norm(x, weight, eps, unit_offset):
        return torch.empty_like(x)

    @torch.library.register_fake("fms_paged::argmax")
    def _argmax(x):
        return x.new_empty(x.shape[:-1], dtype=torch.int64)
