"""Paged KV cache: page allocation (PageManager) and pool writes."""

from fms_paged.kv.page_manager import OutOfPages, PageManager

__all__ = ["OutOfPages", "PageManager"]
