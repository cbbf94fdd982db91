"""Evaluation text from a `datasets` dataset: a Hugging Face Hub name (`datasets.load_dataset`, which
downloads and caches it) or a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
(`datasets.load_from_disk`: nothing downloaded).

This is how perplexity is usually reported: WikiText-103's validation or test split
(`--dataset wikitext --dataset-config wikitext-103-raw-v1 --split validation`), its rows joined with
blank lines into one text, as the `transformers` perplexity guide does. The stdlib corpus
(`fms_paged.data.stdlib_corpus`) stays the offline default; `datasets` is optional (the `bench`
extra) and imported only when a dataset is asked for.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROW_SEPARATOR = "\n\n"  # between rows, as `"\n\n".join(ds["text"])` in the transformers guide
BATCH_ROWS = 1000  # rows read at a time: a whole train split's column is never materialised


class MissingTextColumn(ValueError):
    """The dataset has no column of the name given (the message names it and the columns present)."""


class MissingSplit(ValueError):
    """A saved `DatasetDict` has no split of the name given (the message names the splits present)."""


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise ImportError("--dataset needs the `datasets` package: pip install 'fms_paged[bench]' "
                          f"(or pip install datasets): {e}") from None
    return datasets


@dataclass(frozen=True)
class DatasetSource:
    """Where evaluation text comes from. `path`: a folder saved with `save_to_disk` (an existing
    folder wins over a Hub name) or a Hub dataset name; `config`: the Hub configuration (e.g.
    wikitext-103-raw-v1; a saved folder has none); `split`: the split to read (a saved `Dataset`
    is one split already and is read whole); `text_column`: the column holding the text."""

    path: str
    config: str | None = None
    split: str = "validation"
    text_column: str = "text"

    @staticmethod
    def add_arguments(group: argparse._ActionsContainer) -> None:
        """The `--dataset / --dataset-config / --split / --text-column` arguments (`fms-paged ppl`
        and `fms-paged bench` share them; `from_args` reads them back)."""
        group.add_argument("--dataset", default=None,
                           help="score a `datasets` dataset instead: a Hub name (e.g. wikitext) or a "
                                "folder saved with save_to_disk (default: held-out stdlib source)")
        group.add_argument("--dataset-config", default=None,
                           help="the Hub dataset's configuration (e.g. wikitext-103-raw-v1)")
        group.add_argument("--split", default="validation", help="the dataset's split (default: validation)")
        group.add_argument("--text-column", default="text",
                           help="the column holding the text (default: text)")

    @classmethod
    def from_args(cls, args: Any) -> DatasetSource | None:
        """From the `--dataset / --dataset-config / --split / --text-column` arguments that
        `fms-paged ppl` and `fms-paged bench` share; None without --dataset."""
        if getattr(args, "dataset", None) is None:
            return None
        return cls(str(args.dataset), args.dataset_config, args.split, args.text_column)

    @property
    def is_saved(self) -> bool:
        return Path(self.path).is_dir()

    def load(self):
        """-> the `datasets.Dataset` of the split (memory-mapped Arrow: rows are read lazily)."""
        ds = _datasets()
        if self.is_saved:
            if self.config is not None:
                raise ValueError(f"--dataset-config {self.config!r}: {self.path} is a folder saved with "
                                 "save_to_disk, which has no configurations")
            loaded = ds.load_from_disk(self.path)
            if isinstance(loaded, ds.DatasetDict):
                if self.split not in loaded:
                    raise MissingSplit(f"--split {self.split!r}: the dataset saved in {self.path} has "
                                       f"no such split; its splits: {sorted(loaded)}")
                loaded = loaded[self.split]
        else:
            loaded = ds.load_dataset(self.path, self.config, split=self.split)
        if self.text_column not in loaded.column_names:
            raise MissingTextColumn(f"--text-column {self.text_column!r}: dataset {self} has no such "
                                    f"column; its columns: {loaded.column_names}")
        return loaded

    def text(self, max_chars: int | None = None) -> str:
        """The text column's rows joined by a blank line, cut at `max_chars` characters (rows past
        it are not read)."""
        parts: list[str] = []
        size = 0
        for batch in self.load().select_columns([self.text_column]).iter(batch_size=BATCH_ROWS):
            for row in batch[self.text_column]:
                size += len(row) + (len(ROW_SEPARATOR) if parts else 0)  # the joined text's length
                parts.append(row)
                if max_chars is not None and size >= max_chars:
                    return ROW_SEPARATOR.join(parts)[:max_chars]
        text = ROW_SEPARATOR.join(parts)
        return text if max_chars is None else text[:max_chars]

    def __str__(self) -> str:
        name = self.path if self.config is None else f"{self.path}/{self.config}"
        return name if self.is_saved else f"{name}:{self.split}"
