"""`IncrementalText` (fms_paged/serve/text.py) with the default model's real tokenizer: a
sentencepiece model with byte-fallback tokens, so 'ü' is the two tokens <0xC3><0xBC> and each CJK
character three.

The reference for a completion's text is `decode(prompt + output)` with `decode(prompt)` taken off
the front: the text the output adds after the prompt, leading space included (OpenAI returns
" world" after "Hello", not "world"). `decode(output)` alone would be wrong for tokenizers that drop
the leading space of a sequence's first piece (sentencepiece's dummy prefix); the default tokenizer
does not drop it, so `DummyPrefix` below wraps it to behave like one that does."""

from __future__ import annotations

import pytest

from fms_paged.serve.text import IncrementalText

REPLACEMENT = "\ufffd"

TEXTS = [
    "ü 日本",  # 2- and 3-byte characters, all byte-fallback tokens
    " world, the end.",  # a leading space
    "def f(x):\n    return x  # ok\n",  # newlines, runs of spaces
    "naïve café 🙂 done",  # a 4-byte emoji between ASCII words
    "日",  # one character, three tokens, nothing after it
]


def feed(text: IncrementalText, ids: list[int]) -> list[str]:
    """Token by token; -> the strings `add` returned, then `finish`'s."""
    out = [text.add([t]) for t in ids]
    out.append(text.finish())
    return out


def reference(tok, prompt: list[int], output: list[int]) -> str:
    whole, head = tok.decode(prompt + output), tok.decode(prompt)
    assert whole.startswith(head)
    return whole[len(head):]


@pytest.mark.parametrize("prompt", ["Say:", "ü", "x"])
@pytest.mark.parametrize("out_text", TEXTS)
def test_one_token_at_a_time_is_the_decoded_text(tok, prompt, out_text):
    p, out = tok.encode(prompt), tok.encode(out_text, add_special_tokens=False)
    pieces = feed(IncrementalText(tok, p), out)
    assert not any(REPLACEMENT in s for s in pieces), pieces
    assert "".join(pieces) == reference(tok, p, out) == out_text


def test_byte_fallback_characters_wait_for_their_last_byte(tok):
    out = tok.encode("ü 日本", add_special_tokens=False)
    assert [tok.token_text(t) for t in out] == ["<0xC3>", "<0xBC>", " ", "<0xE6>", "<0x97>", "<0xA5>",
                                                "<0xE6>", "<0x9C>", "<0xAC>"]
    pieces = feed(IncrementalText(tok, tok.encode("a")), out)
    assert pieces == ["", "ü", " ", "", "", "日", "", "", "本", ""]


def test_several_tokens_per_add(tok):
    p, out = tok.encode("Hi"), tok.encode("ü 日本 and more text", add_special_tokens=False)
    text = IncrementalText(tok, p)
    pieces = [text.add(out[i:i + 4]) for i in range(0, len(out), 4)] + [text.finish()]
    assert not any(REPLACEMENT in s for s in pieces)
    assert "".join(pieces) == "ü 日本 and more text"


def test_an_unfinished_character_at_the_end_is_not_sent(tok):
    """A completion cut (max_tokens) inside a character: the complete text is sent, never U+FFFD."""
    out = tok.encode("ok 日", add_special_tokens=False)[:-1]  # 'o', 'k', ' ', <0xE6>, <0x97>
    pieces = feed(IncrementalText(tok, tok.encode("a")), out)
    assert not any(REPLACEMENT in s for s in pieces)
    assert "".join(pieces) == "ok "


class DummyPrefix:
    """The default tokenizer, decoding as sentencepiece with a dummy prefix does: the first piece's
    leading space is dropped (`decode([" world"]) == "world"`)."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids):
        s = self.tok.decode(ids)
        return s[1:] if s.startswith(" ") else s


def test_the_first_output_token_keeps_its_leading_space(tok):
    strip = DummyPrefix(tok)
    p, out = tok.encode("Hello"), tok.encode(" world, the end.", add_special_tokens=False)
    assert strip.decode(out) == "world, the end."  # what decoding the output alone would give
    assert "".join(feed(IncrementalText(strip, p), out)) == " world, the end."
    # a prompt whose context window starts with a spaced piece: dropped from both decodes alike
    p = tok.encode(" a b c d e f")
    assert "".join(feed(IncrementalText(strip, p), out)) == " world, the end."


# ------------------------------------------------------------------ stop strings
def stop_run(tok, out_text: str, stop: list[str], prompt: str = "Q:"):
    """-> (pieces, the text returned, the IncrementalText), checking that no text past the cut is
    ever returned: every prefix of the returned pieces is a prefix of the final text."""
    p, out = tok.encode(prompt), tok.encode(out_text, add_special_tokens=False)
    text = IncrementalText(tok, p, stop)
    pieces = []
    for t in out:
        pieces.append(text.add([t]))
        if text.stopped:
            break
    pieces.append(text.finish())
    got = "".join(pieces)
    for k in range(len(pieces)):
        assert got.startswith("".join(pieces[:k]))
    assert not any(REPLACEMENT in s for s in pieces)
    return pieces, got, text


def expected_cut(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if s in text]
    return text[:min(hits)] if hits else text


@pytest.mark.parametrize("out_text, stop", [
    ("Hello world, the end.", ["llo wo"]),  # "Hel" "lo" " w" "or": across four tokens
    ("Hello world, the end.", ["o w"]),  # the end of one token, the start of the next
    ("Hello world, the end.", ["world, the"]),  # " w" "or" "ld" "," " the"
    ("Hello world, the end.", ["end.", "wor"]),  # the earliest of two wins
    ("Hello world, the end.", ["Hel"]),  # at the very start: nothing is sent
    ("Hello world, the end.", ["."]),  # the last character
    ("say ü 日本 ok", ["日"]),  # inside byte-fallback tokens
    ("say ü 日本 ok", ["ü 日"]),
    ("a b a b c", ["b c", "a b a b c d"]),  # a longer stop string's prefix matched, never completed
])
def test_stop_strings_cut_before_the_first_occurrence(tok, out_text, stop):
    assert any(s in out_text for s in stop)
    pieces, got, text = stop_run(tok, out_text, stop)
    assert text.stopped
    assert got == expected_cut(out_text, stop)
    assert text.add(tok.encode(" more", add_special_tokens=False)) == ""  # nothing after the stop


def test_held_back_text_is_released_by_finish(tok):
    """A stop string that never completes: its possible starts are held back, then all sent."""
    out_text = "Hello world, the end."
    pieces, got, text = stop_run(tok, out_text, ["end!"])
    assert not text.stopped
    assert got == out_text
    assert "".join(pieces[:-1]) == out_text[: len(out_text) - 3]  # 'nd.' held: could start 'end!'
    assert pieces[-1] == "nd."


def test_a_stop_string_never_leaks_through_held_back_text(tok):
    """Every intermediate emission stays clear of the stop string's first character."""
    out = tok.encode("xx abc yy", add_special_tokens=False)
    text = IncrementalText(tok, tok.encode("Q"), ["abc"])
    sent = ""
    for t in out:
        sent += text.add([t])
        assert "a" not in sent or text.stopped
        if text.stopped:
            break
    assert sent + text.finish() == "xx "
