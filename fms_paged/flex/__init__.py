from fms_paged.flex.masks import (
    decode_block_mask,
    decode_meta,
    logical_score_mod,
    paged_mask_mod,
    prefill_block_mask,
    softcap_score_mod,
    window_blocks,
)

__all__ = ["decode_block_mask", "decode_meta", "logical_score_mod", "paged_mask_mod", "prefill_block_mask",
           "softcap_score_mod", "window_blocks"]
