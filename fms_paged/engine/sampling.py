"""Token selection: greedy, or temperature / top-k / top-p sampling from a seeded generator; and
the raw log-probabilities of the tokens chosen."""

from __future__ import annotations

import torch

from fms_paged import native


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits: [K, V] -> the index of each row's largest [K] int64 (the first of equals; a NaN's
    where a row has one, as torch.argmax). On the CPU where the rows kernel for their dtype is
    loaded (a paged model's engine loads it), its vectorised argmax on the logits as they are; else
    torch.argmax of an fp32 copy (on the CPU several times faster than on half precision)."""
    if logits.device.type == "cpu" and native.kernel_ready("rows", logits.dtype):
        return torch.ops.fms_paged.argmax(logits.contiguous())
    return logits.float().argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits: [B, V] -> tokens: [B] int64. `temperature == 0` is greedy (argmax)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = probabilities(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def probabilities(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """logits: [B, V] -> the fp32 probabilities [B, V] that `sample` draws from (temperature > 0,
    then top-k, then top-p); speculative decoding's rejection sampling reads the same ones."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens ranked above it already cover top_p (the first always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs


def sample_each(
    logits: torch.Tensor,
    settings: list[tuple[float, int | None, float | None, torch.Generator | None]],
) -> torch.Tensor:
    """logits: [K, V] -> tokens: [K] int64, row i drawn with its own (temperature, top_k, top_p,
    generator): a seeded row's token depends on its logits and its generator alone, not on the
    other rows (a seeded request samples the same tokens alone or in any batch). Greedy rows share
    one argmax (`greedy`, on the logits in their own dtype), unseeded rows with the same settings
    one draw from the global RNG (`sample`: their rows in fp32); no host sync."""
    tokens = greedy(logits)
    unseeded: dict[tuple, list[int]] = {}
    for i, (temperature, top_k, top_p, generator) in enumerate(settings):
        if temperature == 0:
            continue
        if generator is None:
            unseeded.setdefault((temperature, top_k, top_p), []).append(i)
        else:
            tokens[i] = sample(logits[i : i + 1], temperature, top_k, top_p, generator)[0]
    for (temperature, top_k, top_p), rows in unseeded.items():
        idx = torch.tensor(rows, device=logits.device)
        tokens[idx] = sample(logits.index_select(0, idx), temperature, top_k, top_p)
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [A, V], tokens: [A] (chosen from them) -> (the tokens' log-probabilities [A], the
    k largest log-probabilities of each row [A, k] (descending), their token ids [A, k]).
    Raw log-probabilities: the fp32 log-softmax of the logits as the model gave them, before any
    temperature, top-k or top-p (vLLM's "raw_logprobs"). No host sync."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [A, V]
    chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)  # [A]
    top = torch.topk(lp, k, dim=-1)  # values, indices: [A, k]
    return chosen, top.values, top.indices
