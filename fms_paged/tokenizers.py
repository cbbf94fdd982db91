"""One small tokenizer interface over sentencepiece `tokenizer.model`, HF `tokenizer.json` and the
vocabulary a GGUF file holds (built by transformers: `gguf_tokenizer`).

`encode(text, add_special_tokens=True)` gives the ids
`transformers.AutoTokenizer.from_pretrained(checkpoint_dir)(text)["input_ids"]` gives, so the server
and the CLI feed a model the prompt `transformers` would; `add_special_tokens=False` gives the bare
ids (what a rendered chat template is tokenized with: the template writes its own BOS). Which
special tokens a checkpoint adds is its own rule, reproduced here from transformers 5
(`transformers/tokenization_utils_base.py`, `transformers/tokenization_utils_tokenizers.py`)
without importing it:

- `tokenizer.json`: its post-processor decides, applied by the `tokenizers` library itself (a
  `TemplateProcessing` adding `<s>` or `<|begin_of_text|>`, as Llama 2/3 and Gemma ship; a
  `ByteLevel` or no post-processor, as SmolLM2 ships, adds nothing). `add_bos_token` /
  `add_eos_token` in tokenizer_config.json are ignored: `PreTrainedTokenizerBase._from_pretrained`
  pops both from the init kwargs whenever a tokenizer.json is present, so
  `TokenizersBackend.__init__` keeps the file's post-processor (it rebuilds one only for explicit
  flags or a missing post-processor, and for a missing one the rebuilt template adds nothing: the
  flags default to False). The Llama and Gemma classes, which rebuild the rest of the pipeline, take
  the post-processor from the file too (`convert_to_native_format` passes it on); their
  transformers 4 fast tokenizers rebuilt it from the flags, transformers 5's do not. Not
  reproduced: GPTNeoXTokenizer and CodeLlamaTokenizer, whose `__init__` rebuilds the post-processor
  unconditionally (GPTNeoX: adds nothing; CodeLlama: BOS); they rebuild the pre-tokenizer as well,
  so their bare ids can differ from the file's anyway.
- `tokenizer.model` (sentencepiece), when the checkpoint has no tokenizer.json: `add_bos_token` /
  `add_eos_token` from tokenizer_config.json, both False where it does not name them (transformers
  5's `TokenizersBackend.__init__`: `kwargs.get("add_bos_token", False)`; LlamaTokenizer's old
  default of True is gone). A sentencepiece checkpoint trained with a BOS says so in its
  tokenizer_config.json, as the default model does. Not reproduced: special-token text inside a
  prompt (`"<s>"` typed out) is tokenized as text here, while transformers' classes read it as
  the token (each with its own spacing around it).

`load_tokenizer` takes tokenizer.json when a checkpoint ships both files, as transformers 5 does.

Truncation and padding saved in a tokenizer.json are switched off: `AutoTokenizer(text)` without
`truncation=` / `padding=` applies neither.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Protocol

import sentencepiece as spm
from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    @property
    def special_ids(self) -> frozenset[int]: ...


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


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    """The checkpoint's tokenizer_config.json ({} when there is none)."""
    cfg_file = directory / "tokenizer_config.json"
    if not cfg_file.is_file():
        return {}
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(cfg_file)!r}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _flag(cfg: dict[str, Any], key: str, default: bool, where: Path) -> bool:
    """tokenizer_config.json's `key`, `default` when absent; null reads as false, as transformers'
    `kwargs.get("add_bos_token", False)` does."""
    value = cfg.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{str(where / 'tokenizer_config.json')!r}: {key} must be true, false or "
                         f"null, got {value!r}")
    return bool(value)


class SentencePieceTokenizer:
    """A sentencepiece `tokenizer.model`; BOS/EOS added as tokenizer_config.json's
    add_bos_token / add_eos_token say (both False when it does not: see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        cfg = _tokenizer_config(path.parent)
        add_bos = _flag(cfg, "add_bos_token", False, path.parent)
        add_eos = _flag(cfg, "add_eos_token", False, path.parent)
        # a flag naming a token the model lacks adds nothing (transformers' update_post_processor)
        self._prefix = [self.bos_id] if add_bos and self.bos_id is not None else []
        self._suffix = [self.eos_id] if add_eos and self.eos_id is not None else []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.sp.encode(text)
        return self._prefix + ids + self._suffix if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids that stand for no text: control pieces (BOS, EOS, padding) and the unknown one."""
        sp = self.sp
        return frozenset(i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i))

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
    """A `tokenizer.json` (the `tokenizers` library): special tokens from its own post-processor;
    BOS/EOS ids read from tokenizer_config.json."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        tok = _HFTokenizer.from_file(str(path))
        cfg = _tokenizer_config(path.parent)

        def token_id(key: str) -> int | None:
            name = cfg.get(key)
            if isinstance(name, dict):
                name = name.get("content")
            return tok.token_to_id(name) if name else None

        self._setup(tok, token_id("bos_token"), token_id("eos_token"))

    @classmethod
    def from_tokenizer(cls, tok: _HFTokenizer, bos_id: int | None, eos_id: int | None) -> HFTokenizer:
        """A `tokenizers.Tokenizer` built elsewhere (a GGUF file's, by transformers), its BOS/EOS ids."""
        self = cls.__new__(cls)
        self._setup(tok, bos_id, eos_id)
        return self

    def _setup(self, tok: _HFTokenizer, bos_id: int | None, eos_id: int | None) -> None:
        self.tok = tok
        self.tok.no_truncation()  # AutoTokenizer(text) neither truncates nor pads unless asked
        self.tok.no_padding()
        self.vocab_size = self.tok.get_vocab_size()
        self.bos_id, self.eos_id = bos_id, eos_id
        self._byte_level = "ByteLevel" in repr(self.tok.decoder)  # GPT-2 style: bytes as characters
        self._added = set(self.tok.get_added_tokens_decoder())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

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

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids that stand for no text: the added tokens marked special (BOS, EOS, chat markers)."""
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def token_text(self, token_id: int) -> str:
        """One token as text: its bytes, U+FFFD for a byte that is only part of a character."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def gguf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer a GGUF file's metadata holds (`tokenizer.ggml.*`), as transformers builds it
    (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`: its converters from llama.cpp's
    vocabularies), served through `HFTokenizer`: the same ids transformers' tokenizer gives.

    Building it reads the whole vocabulary through transformers' own GGUF reader and converts it:
    ~7 s for SmolLM2's 49k tokens on a 2-core CPU, most of a GGUF model's start. So the built
    tokenizer is kept (`tokenizer.json` and its BOS / EOS ids) in the cache directory
    (`gguf_tokenizer_cache`), keyed by the file's resolved path, size and modification time, and
    read from there (~0.1 s) the next time; a cache that cannot be written is skipped."""
    path = Path(path)
    cached = gguf_tokenizer_cache(path)
    if (cached / "tokenizer.json").is_file() and (cached / "ids.json").is_file():
        try:
            ids = json.loads((cached / "ids.json").read_text())
            return HFTokenizer.from_tokenizer(_HFTokenizer.from_file(str(cached / "tokenizer.json")),
                                              ids["bos"], ids["eos"])
        except Exception:  # a damaged entry (the tokenizers library raises plain Exception): built again
            pass
    from transformers import AutoTokenizer  # (heavy; only GGUF files need it here)

    from fms_paged.models.gguf import open_gguf  # (needs the optional `gguf` package)

    if "tokenizer.ggml.model" not in open_gguf(path).fields:
        raise FileNotFoundError(f"{str(path)!r} holds no tokenizer (no tokenizer.ggml.model in its metadata)")
    fast = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = HFTokenizer.from_tokenizer(fast.backend_tokenizer, fast.bos_token_id, fast.eos_token_id)
    try:  # (written to a temporary name, then renamed: a reader never sees half a file)
        cached.mkdir(parents=True, exist_ok=True)
        tmp = cached / f".tokenizer.{os.getpid()}.json"
        fast.backend_tokenizer.save(str(tmp))
        (cached / "ids.json").write_text(json.dumps({"bos": fast.bos_token_id, "eos": fast.eos_token_id}))
        os.replace(tmp, cached / "tokenizer.json")
    except OSError:
        pass
    return tok


def gguf_tokenizer_cache(path: str | os.PathLike) -> Path:
    """Where `gguf_tokenizer` keeps the tokenizer built from the GGUF file at `path`:
    `$FMS_PAGED_CACHE_DIR/tokenizers/<key>` (default `~/.cache/fms_paged/tokenizers/<key>`), the key
    a hash of the file's resolved path, size and modification time (a file rewritten in place gets
    a new entry)."""
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\n{st.st_size}\n{st.st_mtime_ns}".encode()).hexdigest()[:20]
    root = os.environ.get("FMS_PAGED_CACHE_DIR")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
        "fms_paged")
    return base / "tokenizers" / key


def load_tokenizer(model_path: str | os.PathLike) -> Tokenizer:
    """A checkpoint dir's `tokenizer.json` if present (as transformers 5 picks), else its
    `tokenizer.model` (sentencepiece), else the one .gguf file it holds; or any of these files
    itself."""
    path = Path(model_path)
    if path.is_file():
        if path.suffix == ".gguf":
            return gguf_tokenizer(path)
        return HFTokenizer(path) if path.suffix == ".json" else SentencePieceTokenizer(path)
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path / "tokenizer.json")
    if (path / "tokenizer.model").is_file():
        return SentencePieceTokenizer(path / "tokenizer.model")
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return gguf_tokenizer(ggufs[0])
    raise FileNotFoundError(f"no tokenizer.model or tokenizer.json (nor one .gguf file) in {str(path)!r}")
