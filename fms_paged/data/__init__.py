"""Offline text corpora (the running interpreter's standard library source)."""

from __future__ import annotations

from fms_paged.data.stdlib_corpus import heldout_text, read_corpus, split_of, stdlib_dir, stdlib_files

__all__ = ["heldout_text", "read_corpus", "split_of", "stdlib_dir", "stdlib_files"]
