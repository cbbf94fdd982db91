"""Evaluation text: the offline stdlib corpus (the running interpreter's standard library source) and,
when asked for, a `datasets` dataset (a Hub name or a folder saved with `save_to_disk`)."""

from __future__ import annotations

from fms_paged.data.dataset_text import DatasetSource, MissingSplit, MissingTextColumn
from fms_paged.data.stdlib_corpus import heldout_text, read_corpus, split_of, stdlib_dir, stdlib_files

__all__ = ["DatasetSource", "MissingSplit", "MissingTextColumn", "heldout_text", "read_corpus", "split_of",
           "stdlib_dir", "stdlib_files"]
