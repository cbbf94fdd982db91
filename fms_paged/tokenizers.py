"""One small tokenizer interface over sentencepiece `tokenizer.model` and HF `tokenizer.json`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str, bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer:
    def __init__(self, path: str | os.PathLike):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))


class HFTokenizer:
    """A `tokenizer.json` (the `tokenizers` library); BOS/EOS read from tokenizer_config.json."""

    def __init__(self, path: str | os.PathLike):
        import json

        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        self.tok = _Tok.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size()
        cfg_file = path.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return self.tok.token_to_id(tok) if tok else None

        self.bos_id = token_id("bos_token")
        self.eos_id = token_id("eos_token")

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_path: str | os.PathLike) -> Tokenizer:
    """`tokenizer.model` (sentencepiece) if present, else `tokenizer.json`."""
    path = Path(model_path)
    if path.is_file():
        return HFTokenizer(path) if path.suffix == ".json" else SentencePieceTokenizer(path)
    if (path / "tokenizer.model").is_file():
        return SentencePieceTokenizer(path / "tokenizer.model")
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path / "tokenizer.json")
    raise FileNotFoundError(f"no tokenizer.model or tokenizer.json in {str(path)!r}")
