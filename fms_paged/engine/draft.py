"""The draft model of speculative decoding's `"draft_model"` method: a smaller model of the target's
tokenizer that proposes each speculating request's next k tokens greedily, on pages of its own.

The draft has its own `PagedBackend` (its own pools and `PageManager`), sized to hold every row
whole (`max_num_seqs` rows of `max_model_len` tokens): it never preempts, and the target's
scheduler never plans its pages. A request gets a draft row the first time it speculates and
keeps it until the target's scheduler frees its own row (finish, abort, preemption: `release`);
a request that comes back after preemption prefills its tokens in the draft again.

What a row holds is tracked by tokens, not by steps: `valid` tokens known equal to the request's,
then `fed`, the proposals the draft computed after them (all but the last of its k). Before each
proposal the row keeps the longest prefix that still equals the request's tokens (the accepted
proposals among `fed`), is truncated to it (`PageManager.truncate`: rejected proposals' pages go
back), and catches up on the tokens it has not seen (the target's bonus token, the tokens of the
steps it did not speculate). Where the draft's kernel runs greedy decode steps in one call
(`Kernel.decodes_in_one_call`: the cpp kernel, our models), the tokens before the request's last
go in one chunk (none, most steps: the bonus token is the last) and one `Kernel.decode_greedy`
call of k + 1 steps from the last token gives the k proposals, with no return to Python between
them; the step past them computes the last proposal's keys and values, so that a verify that
keeps every proposal leaves the row nothing but the bonus token to catch up on (one draft
decode step, cheaper than the one-token forward it saves). The row then holds the request's
tokens and the k proposals. Elsewhere (the fallback) the whole catch-up goes in one chunk, whose
last logits give the first proposal, and k - 1 one-token forwards give the others: the row holds
the request's tokens and the first k - 1 proposals. Greedy outputs stay exactly non-speculative
greedy's whatever the draft proposes (`speculative.verify`); the draft only decides how many
proposals are kept.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field

import torch

from fms_paged.kv.paged import PagedBackend
from fms_paged.models.registry import get_model


class DraftModelError(ValueError):
    """A draft model that cannot draft for the target: names the mismatch."""


def load_draft(draft, target: torch.nn.Module) -> torch.nn.Module:
    """The draft model: `draft` itself (a model object), or the checkpoint at path `draft` loaded
    paged on the target's device and in its dtype."""
    if isinstance(draft, (str, os.PathLike)):
        return get_model(model_path=draft, attn_impl="paged", device=target.device, dtype=target.dtype)
    return draft


@dataclass
class _Row:
    """A request's draft row: its page-table row, the tokens known to match the request's, and the
    proposals computed after them."""

    row: int
    valid: int = 0
    fed: list[int] = field(default_factory=list)


class DraftModel:
    """Proposes tokens with `model` for a target of vocabulary `vocab_size`, on pages of its own."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, max_num_seqs: int, max_model_len: int,
                 kernel: str = "auto"):
        c = model.config
        if getattr(c, "attn_impl", "paged") != "paged":
            raise DraftModelError(f"draft model attn_impl={c.attn_impl!r}; expected 'paged' "
                                  "(load it with get_model(..., attn_impl='paged'))")
        if c.src_vocab_size != vocab_size:
            raise DraftModelError(f"draft model vocabulary size {c.src_vocab_size} differs from the "
                                  f"target's {vocab_size}; expected the same tokenizer")
        if c.max_expected_seq_len < max_model_len:
            raise DraftModelError(f"draft model max_expected_seq_len={c.max_expected_seq_len} is shorter "
                                  f"than the engine's max_model_len={max_model_len}")
        self.model = model
        self.backend = PagedBackend(model, max_num_seqs, max_model_len, kernel=kernel)
        self.pm = self.backend.pm
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # over the draft's life: `propose` calls, the requests they proposed for, and their host
        # wall seconds (what the draft costs a step: `fms_paged.bench.speculative` reports it)
        self.calls = self.asked = 0
        self.seconds = 0.0

    def release(self, req) -> None:
        """The request left the target's rows (finished, aborted, preempted): its draft row and
        pages go back."""
        state = self._rows.pop(req, None)
        if state is not None:
            self.pm.erase([state.row])
            self.free_rows.append(state.row)

    def _reserve(self, ids: list[int], lengths: list[int]) -> None:
        """Rows `ids` hold lengths[i] slots (their pages made ready)."""
        self.backend.prepare_pages(self.pm.reserve(ids, lengths))

    def _forward(self, ids: list[int], chunks: list[list[int]], starts: list[int]) -> list[int]:
        """Append `chunks[i]` to row `ids[i]` from position `starts[i]` -> the draft's greedy next
        token after each chunk."""
        self._reserve(ids, [s + len(c) for s, c in zip(starts, chunks)])
        tokens, positions, step, last = self.backend.prefill_inputs(ids, chunks, starts, 2)
        logits = self.model(tokens, positions, step, logits_at=last)
        return logits.float().argmax(-1).tolist()

    def one_call(self) -> bool:
        """Whether the proposals come from one `decode_greedy` call now (`Kernel.decodes_in_one_call`:
        not while a first start's builds compile, nor on a kernel or model without it)."""
        return self.backend.kernel.decodes_in_one_call(self.model, self.backend.view)

    def _propose_in_one_call(self, ids: list[int], chunks: list[list[int]], starts: list[int],
                             ks: list[int]) -> list[list[int]]:
        """The tokens before each chunk's last in one forward (rows with any), then `ks[i]` + 1
        greedy decode steps of row `ids[i]` from its chunk's last token in one `decode_greedy`
        call per distinct k -> each row's k proposals (the row computed them all). Called where
        `one_call()`."""
        kernel, view = self.backend.kernel, self.backend.view
        behind = [i for i, c in enumerate(chunks) if len(c) > 1]
        if behind:
            self._forward([ids[i] for i in behind], [chunks[i][:-1] for i in behind],
                          [starts[i] for i in behind])
        ends = [s + len(c) for s, c in zip(starts, chunks)]  # each request's length L
        self._reserve(ids, [L + k for L, k in zip(ends, ks)])  # (slots of positions L - 1 .. L + k - 1)
        out: list[list[int]] = [[] for _ in ids]
        for k in sorted(set(ks)):
            rows = [i for i, ki in enumerate(ks) if ki == k]
            last = torch.tensor([chunks[i][-1] for i in rows])  # [B]: each row's last token
            at = torch.tensor([ends[i] - 1 for i in rows])  # [B]: its position
            seqs = torch.tensor([ids[i] for i in rows])
            got = kernel.decode_greedy(self.model, last, at, seqs, view, k + 1)  # [B, k + 1]
            if got is None:
                raise RuntimeError("the draft's proposals were asked of one decode_greedy call where its "
                                   "kernel cannot make it (DraftModel.one_call)")
            for i, toks in zip(rows, got.tolist()):
                out[i] = toks[:k]
        return out

    def propose(self, asks: list[tuple[object, int]]) -> list[list[int]]:
        """asks: (request, k) pairs, each request decoding (its last token not yet computed by the
        target) -> k greedy proposals of the draft for each."""
        if not asks:
            return []
        t0 = time.perf_counter()
        out = self._propose(asks)
        self.calls, self.asked = self.calls + 1, self.asked + len(asks)
        self.seconds += time.perf_counter() - t0
        return out

    @torch.inference_mode()
    def _propose(self, asks: list[tuple[object, int]]) -> list[list[int]]:
        ids, chunks, starts, cut_ids, cut_lens = [], [], [], [], []
        for req, _ in asks:
            state = self._rows.get(req)
            if state is None:
                state = self._rows[req] = _Row(self.free_rows.pop())
            L = req.num_tokens
            keep = state.valid
            if state.fed:  # the accepted proposals among those computed
                for a, b in zip(state.fed, req.token_slice(keep, min(keep + len(state.fed), L))):
                    if a != b:
                        break
                    keep += 1
            keep = min(keep, L - 1)  # (the last token's logits give the first proposal)
            if self.pm.length(state.row) > keep:
                cut_ids.append(state.row)
                cut_lens.append(keep)
            ids.append(state.row)
            starts.append(keep)
            chunks.append(req.token_slice(keep, L))
            state.valid, state.fed = L, []
        if cut_ids:
            self.pm.truncate(cut_ids, cut_lens)
        if self.one_call():
            out = self._propose_in_one_call(ids, chunks, starts, [k for _, k in asks])
            for (req, _), props in zip(asks, out):
                self._rows[req].fed = props
            return out
        out = [[t] for t in self._forward(ids, chunks, starts)]
        for step in range(1, max(k for _, k in asks)):
            live = [i for i, (_, k) in enumerate(asks) if k > step]
            fed = [out[i][-1] for i in live]
            starts = [asks[i][0].num_tokens + step - 1 for i in live]
            nxt = self._forward([ids[i] for i in live], [[t] for t in fed], starts)
            for i, t, f in zip(live, nxt, fed):
                self._rows[asks[i][0]].fed.append(f)
                out[i].append(t)
        return out
