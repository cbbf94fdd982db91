"""One small tokenizer interface over sentencepiece `tokenizer.model` and HF `tokenizer.json`."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str, bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token


@functools.cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """Printable character -> byte, the inverse of GPT-2's byte-level alphabet."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a byte-fallback token `<0xNN>`: that one byte)."""
        piece = self.sp.id_to_piece(int(token_id))
        if self.sp.is_byte(int(token_id)):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """One token as a piece of text (its word-start marker as a space; a byte token as its
        character when it is ASCII, else as `<0xNN>`): what a log-probability listing names it by."""
        piece = self.sp.id_to_piece(int(token_id))
        if self.sp.is_byte(int(token_id)) and int(piece[3:5], 16) < 0x80:
            return chr(int(piece[3:5], 16))
        return piece.replace("\u2581", " ")


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
        self._byte_level = "ByteLevel" in repr(self.tok.decoder)  # GPT-2 style: bytes as characters
        self._added = set(self.tok.get_added_tokens_decoder())

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for: through the byte-level alphabet (GPT-2 style vocabularies),
        a byte-fallback token `<0xNN>` as its byte, a metaspace word-start marker as a space."""
        piece = self.tok.id_to_token(int(token_id)) or ""
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self._byte_level and int(token_id) not in self._added:
            dec = _gpt2_byte_decoder()
            if all(c in dec for c in piece):
                return bytes(dec[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """One token as text: its bytes, U+FFFD for a byte that is only part of a character."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


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
