from fms_paged.flex.masks import DecodeBlockMask, logical_score_mod, paged_mask_mod, prefill_block_mask

__all__ = ["DecodeBlockMask", "logical_score_mod", "paged_mask_mod", "prefill_block_mask"]
