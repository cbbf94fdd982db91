"""Token ids -> text while a request streams: valid UTF-8 at every chunk, stop strings cut where
OpenAI cuts (before the stop string, which never reaches the client).

`IncrementalText` decodes a window of the last few tokens instead of the whole output each step
(vLLM's `detokenize_incrementally`): the text new since the previous emission is
`decode(ids[prefix:])` minus `decode(ids[prefix:read])`. Both decodes start at the same token, so
a tokenizer that drops the leading space of a sequence's first piece (sentencepiece) drops it from
both; a window ending inside a multi-byte character decodes to U+FFFD and waits for the next token.
"""

from __future__ import annotations

from collections.abc import Sequence

from fms_paged.tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token: its leading space survives


class IncrementalText:
    """The text of one completion, fed its tokens as they are sampled.

    prompt_ids: the prompt (its last `CONTEXT_TOKENS` give the first output token its context).
    stop: strings that end the completion; the text stops before the first one found.
    `add(ids)` -> the text that may be sent now. Up to `len(longest stop) - 1` characters are held
    back while they could still be the start of a stop string; `finish()` releases them."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # the completion's text so far (decoded, before holding back)
        self.sent = 0  # characters of `text` already returned
        self.stopped = False  # a stop string was found; `text` ends before it

    def add(self, new_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        whole = self.tok.decode(self.ids[self.prefix :])
        if whole.endswith(REPLACEMENT):  # a character is still incomplete: wait for its bytes
            return ""
        before = self.tok.decode(self.ids[self.prefix : self.read])
        new = whole[len(before) :]
        # the window slides to the tokens just emitted, so each decode stays a few tokens long
        self.prefix, self.read = self.read, len(self.ids)
        if not new:
            return ""
        start = max(0, len(self.text) - self.hold)  # a stop string may straddle old and new text
        self.text += new
        hits = [at for at in (self.text.find(s, start) for s in self.stop) if at >= 0]
        if hits:  # the earliest stop string ends the text
            self.text, self.stopped = self.text[: min(hits)], True
            return self.finish()
        end = len(self.text) - self.hold
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> str:
        """The held-back text (the completion ended without completing a stop string)."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
