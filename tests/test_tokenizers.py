"""One tokenizer interface over sentencepiece `tokenizer.model` and HF `tokenizer.json`."""

import json

import pytest

from fms_paged import load_tokenizer
from fms_paged.models import default_model_path


def test_sentencepiece_roundtrip():
    tok = load_tokenizer(default_model_path())  # the default model ships a tokenizer.model
    text = "def add(a, b):\n    return a + b  # ünïcödé\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.eos_id is not None
    assert tok.decode(ids[1:]) == text
    assert tok.encode(text, bos=False) == ids[1:]


def test_tokenizer_json_roundtrip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["def f(x):\n    return x * 2\n"] * 50, trainer)
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (tk.token_to_id("<s>"), tk.token_to_id("</s>"))
    text = "def f(x):\n    return x * 2\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.decode(ids) == text


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.model or tokenizer.json"):
        load_tokenizer(tmp_path)
