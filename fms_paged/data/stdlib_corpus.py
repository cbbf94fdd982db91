"""The Python standard library's own source as an offline text corpus, split train / held-out by file.

Every machine that runs this package has it: the `*.py` files of the running interpreter's stdlib
(`sysconfig.get_paths()["stdlib"]`). Files are listed by sorted relative path; test suites,
`site-packages` and files over 200 KB are left out. The split is by file, from a stable hash of the
relative path (`sha1(path) % 20 == 0` -> held-out, about 5%), so it does not depend on the order of
the listing, the machine or the run. Nothing here is copied into the repository.
"""

from __future__ import annotations

import hashlib
import sysconfig
from functools import lru_cache
from pathlib import Path

SPLITS = ("train", "heldout")
HELDOUT_MODULUS = 20  # sha1(relpath) % 20 == 0 -> held-out
MAX_FILE_BYTES = 200_000
SEPARATOR = "\n\n"  # between files in read_corpus

_EXCLUDED_DIRS = ("site-packages", "test", "tests", "idle_test", "__pycache__")
_EXCLUDED_PREFIXES = ("idlelib/idle_test/", "lib2to3/tests/")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """'heldout' or 'train' for a POSIX relative path such as 'json/decoder.py'."""
    digest = int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16)
    return "heldout" if digest % HELDOUT_MODULUS == 0 else "train"


def _excluded(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in _EXCLUDED_DIRS for p in parts[:-1]) or rel.startswith(_EXCLUDED_PREFIXES)


@lru_cache(maxsize=4)
def _listing(root: str) -> tuple[tuple[str, str], ...]:
    """((relpath, split), ...) sorted by relpath, for every eligible `*.py` under `root`."""
    base = Path(root)
    out = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base).as_posix()
        if _excluded(rel) or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(rel)
    return tuple((rel, split_of(rel)) for rel in sorted(out))


def stdlib_files(split: str = "train", root: str | Path | None = None) -> list[Path]:
    """Absolute paths of the stdlib `*.py` files in `split` ("train" | "heldout"), sorted by relpath."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; expected one of {SPLITS}")
    base = Path(root) if root is not None else stdlib_dir()
    if not base.is_dir():
        raise FileNotFoundError(f"standard library directory {str(base)!r} does not exist")
    return [base / rel for rel, s in _listing(str(base)) if s == split]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def read_corpus(split: str = "train", max_chars: int | None = None, root: str | Path | None = None) -> str:
    """The files of `split` in listing order, joined by a blank line; cut at `max_chars` if given."""
    pieces: list[str] = []
    total = 0
    for path in stdlib_files(split, root):
        text = _read(path)
        pieces.append(text)
        total += len(text) + len(SEPARATOR)
        if max_chars is not None and total >= max_chars:
            break
    corpus = SEPARATOR.join(pieces)
    return corpus if max_chars is None else corpus[:max_chars]


def heldout_text(max_chars: int | None = None, root: str | Path | None = None) -> str:
    """The first `max_chars` characters of the held-out split (the perplexity evaluation text)."""
    return read_corpus("heldout", max_chars, root)
