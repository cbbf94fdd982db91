"""One tokenizer interface over sentencepiece `tokenizer.model` and HF `tokenizer.json`.

The reference for `encode` is `transformers.AutoTokenizer.from_pretrained(checkpoint_dir)` on the same
directory: ids equal with and without special tokens, for every text below. The tokenizers are
trained here from a few sentences (nothing downloaded); each checkpoint is a directory with the
tokenizer file, a config.json and, where the case needs one, a tokenizer_config.json."""

import io
import json

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from fms_paged import load_tokenizer
from fms_paged.models import default_model_path

transformers = pytest.importorskip("transformers")

TEXTS = ["def add(a, b):\n    return a + b  # ünïcödé\n", "hello world", " leading space",
         "  two leading spaces", "ünïcödé 日本 ✓ 🙂 (bytes the corpora lack)", "a\n\n  b\t c ", ""]
CORPUS = ["def f(x):\n    return x * 2\n", "hello world, the end.", "ünïcödé 日本 text",
          "  Leading spaces and\ttabs", "The quick brown fox jumps over the lazy dog."] * 30
BYTES = [f"<0x{b:02X}>" for b in range(256)]  # byte-fallback pieces


def write_checkpoint(d, tokenizer: Tokenizer | None = None, tokenizer_config: dict | None = None,
                     model_type: str = "llama"):
    """A checkpoint directory as transformers reads it: config.json (which picks the tokenizer class
    when tokenizer_config.json names none), tokenizer.json, tokenizer_config.json."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    if tokenizer is not None:
        tokenizer.save(str(d / "tokenizer.json"))
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return d


def assert_matches_transformers(d, cls: str | None = None):
    """Our ids == AutoTokenizer's for every text, with and without special tokens; -> ours.
    `cls`: the class AutoTokenizer must have picked, so the case tests the class it names."""
    ref = transformers.AutoTokenizer.from_pretrained(d)
    if cls is not None:
        assert type(ref).__name__ == cls
    tok = load_tokenizer(d)
    for text in TEXTS:
        for add in (True, False):
            want = ref(text, add_special_tokens=add)["input_ids"]
            assert tok.encode(text, add_special_tokens=add) == want, (text, add)
    return tok


def assert_matches_sentencepiece(d, model: bytes):
    """For a checkpoint with a tokenizer.model alone: our bare ids == the sentencepiece library's
    (what the file defines), and the special tokens `encode` adds == the ones AutoTokenizer adds;
    -> ours. Where transformers' own ids reproduce the library's (transformers 5.24 does; 5.17's
    converted tokenizer drops the dummy prefix: "hello world" -> 3 ids, not the library's 2), they
    are compared whole too (`assert_matches_transformers`)."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    ref = transformers.AutoTokenizer.from_pretrained(d)
    tok = load_tokenizer(d)
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
    text = "hello world"
    assert specials(tok, text) == split_specials(ref(text)["input_ids"],
                                                 ref(text, add_special_tokens=False)["input_ids"])
    if all(ref(t, add_special_tokens=False)["input_ids"] == sp.encode(t) for t in TEXTS):
        assert_matches_transformers(d)
    return tok


def split_specials(full: list[int], bare: list[int]) -> tuple[list[int], list[int]]:
    """-> (ids before `bare` in `full`, ids after it)."""
    i = next(i for i in range(len(full)) if full[i:i + len(bare)] == bare)
    return full[:i], full[i + len(bare):]


def specials(tok, text: str = "hello world") -> tuple[list[int], list[int]]:
    """-> (ids `encode` puts before the text's, ids it puts after)."""
    return split_specials(tok.encode(text), tok.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- tokenizers trained here


def bytelevel_bpe(special: list[str]) -> Tokenizer:
    """GPT-2 / Llama 3 / SmolLM2 style: byte-level BPE, no post-processor."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk


def metaspace_bpe() -> Tokenizer:
    """Llama 2 style: BPE over metaspace words with byte fallback (the pipeline transformers'
    LlamaTokenizer rebuilds, so that class gives the file's bare ids)."""
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>",
                                                                                       *BYTES]))
    return tk


def gemma_bpe() -> Tokenizer:
    """Gemma style: spaces normalized to U+2581, BPE with byte fallback, no pre-tokenizer."""
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *BYTES]))
    return tk


def add_bos(tk: Tokenizer, bos: str) -> Tokenizer:
    """The post-processor Llama 2/3 and Gemma ship: BOS before the text."""
    tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                      special_tokens=[(bos, tk.token_to_id(bos))])
    return tk


def sentencepiece_model(**kw) -> bytes:
    """A tiny sentencepiece BPE model (trainer defaults: NFKC, a dummy prefix) with byte fallback."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=out, model_type="bpe",
                                   vocab_size=400, character_coverage=1.0, byte_fallback=True, unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, **kw)
    return out.getvalue()


# ---------------------------------------------------------------- sentencepiece tokenizer.model


def test_sentencepiece_roundtrip():
    tok = load_tokenizer(default_model_path())  # the default model ships a tokenizer.model
    text = "def add(a, b):\n    return a + b  # ünïcödé\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.eos_id is not None
    assert tok.decode(ids[1:]) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_default_model_matches_transformers():
    # its tokenizer_config.json says add_bos_token (the model is trained with a BOS before each file)
    tok = assert_matches_transformers(default_model_path())
    assert specials(tok) == ([tok.bos_id], [])


def test_sentencepiece_without_flags_adds_nothing(tmp_path):
    # transformers 5's default for a tokenizer.model whose tokenizer_config.json names no flags
    for cfg in (None, {"bos_token": "<s>", "eos_token": "</s>"}):
        d = write_checkpoint(tmp_path / str(cfg is None), tokenizer_config=cfg)
        (d / "tokenizer.model").write_bytes(model := sentencepiece_model())
        tok = assert_matches_sentencepiece(d, model)
        assert specials(tok) == ([], [])


def test_tokenizer_json_is_taken_over_tokenizer_model(tmp_path):
    """Both files: tokenizer.json, as transformers 5 takes (a tokenizer.model that would add a BOS
    and split differently beside a tokenizer.json that adds nothing)."""
    d = write_checkpoint(tmp_path, bytelevel_bpe(["<unk>", "<s>", "</s>"]), {"add_bos_token": True})
    (d / "tokenizer.model").write_bytes(sentencepiece_model())
    tok = assert_matches_transformers(d)
    assert type(tok).__name__ == "HFTokenizer" and specials(tok) == ([], [])


@pytest.mark.parametrize("flags", [{"add_bos_token": False, "add_eos_token": True},
                                   {"add_bos_token": True, "add_eos_token": True}])
def test_sentencepiece_flags_match_transformers(tmp_path, flags):
    d = write_checkpoint(tmp_path, tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", **flags})
    (d / "tokenizer.model").write_bytes(model := sentencepiece_model())
    tok = assert_matches_sentencepiece(d, model)
    assert specials(tok) == ([tok.bos_id] if flags["add_bos_token"] else [], [tok.eos_id])


def test_sentencepiece_flag_must_be_a_bool(tmp_path):
    d = write_checkpoint(tmp_path, tokenizer_config={"add_eos_token": "yes"})
    (d / "tokenizer.model").write_bytes(sentencepiece_model())
    with pytest.raises(ValueError, match="add_eos_token must be true, false or null, got 'yes'"):
        load_tokenizer(d)


# ---------------------------------------------------------------- HF tokenizer.json


def test_tokenizer_json_roundtrip(tmp_path):
    tk = bytelevel_bpe(["<unk>", "<s>", "</s>"])
    d = write_checkpoint(tmp_path, tk, {"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    tok = load_tokenizer(d)
    assert (tok.bos_id, tok.eos_id) == (tk.token_to_id("<s>"), tk.token_to_id("</s>"))
    text = "def f(x):\n    return x * 2\n"
    ids = tok.encode(text)
    assert ids == tok.encode(text, add_special_tokens=False)  # no post-processor: nothing added
    assert tok.decode(ids) == text


def test_llama3_style_post_processor_adds_bos(tmp_path):
    tk = bytelevel_bpe(["<|begin_of_text|>", "<|end_of_text|>"])
    tk.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                             add_bos(tk, "<|begin_of_text|>").post_processor])
    d = write_checkpoint(tmp_path, tk, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                                        "tokenizer_class": "PreTrainedTokenizerFast"})
    tok = assert_matches_transformers(d, "TokenizersBackend")
    assert specials(tok) == ([tk.token_to_id("<|begin_of_text|>")], [])


@pytest.mark.parametrize("post", [None, "ByteLevel"])
def test_smollm2_style_adds_nothing(tmp_path, post):
    tk = bytelevel_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    if post == "ByteLevel":
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    d = write_checkpoint(tmp_path, tk, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                        "tokenizer_class": "GPT2Tokenizer"})
    tok = assert_matches_transformers(d, "GPT2Tokenizer")
    assert tok.bos_id is not None and specials(tok) == ([], [])  # a BOS named, none added


STYLES = {  # tokenizer_class -> (the class AutoTokenizer loads, the tokenizer, its BOS and EOS)
    "LlamaTokenizerFast": ("LlamaTokenizer", metaspace_bpe, "<s>", "</s>"),
    "GemmaTokenizerFast": ("GemmaTokenizer", gemma_bpe, "<bos>", "<eos>"),
    "PreTrainedTokenizerFast": ("TokenizersBackend", lambda: bytelevel_bpe(["<unk>", "<s>", "</s>"]), "<s>",
                                "</s>"),
}


@pytest.mark.parametrize("flags", [{"add_bos_token": True}, {"add_bos_token": False},
                                   {"add_bos_token": False, "add_eos_token": True}])
@pytest.mark.parametrize("post", ["bos", None])
@pytest.mark.parametrize("tokenizer_class", list(STYLES))
def test_tokenizer_json_post_processor_decides_not_the_flags(tmp_path, tokenizer_class, post, flags):
    """transformers 5 drops add_bos_token / add_eos_token when a tokenizer.json is present, for the
    Llama and Gemma classes (whose transformers 4 fast tokenizers honoured them) as for the generic
    one: the file's post-processor alone decides."""
    cls, make, bos, eos = STYLES[tokenizer_class]
    tk = make()
    if post == "bos":
        add_bos(tk, bos)
    d = write_checkpoint(tmp_path, tk, {"bos_token": bos, "eos_token": eos, "unk_token": "<unk>",
                                        "tokenizer_class": tokenizer_class, **flags})
    tok = assert_matches_transformers(d, cls)
    assert specials(tok) == ([tk.token_to_id(bos)] if post == "bos" else [], [])


def test_tokenizer_json_truncation_and_padding_are_not_applied(tmp_path):
    tk = add_bos(bytelevel_bpe(["<unk>", "<s>", "</s>", "<pad>"]), "<s>")
    tk.enable_truncation(4)  # saved in tokenizer.json; AutoTokenizer(text) ignores both
    tk.enable_padding(pad_id=tk.token_to_id("<pad>"), pad_token="<pad>", length=64)
    d = write_checkpoint(tmp_path, tk, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    tok = assert_matches_transformers(d)
    assert len(tok.encode(TEXTS[0])) > 4 and tk.token_to_id("<pad>") not in tok.encode(TEXTS[0])


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.model or tokenizer.json"):
        load_tokenizer(tmp_path)
