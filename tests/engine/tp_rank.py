"""One rank of `test_tensor_parallel.py`'s torchrun cases (not a test module), `tp_rank.py MODE OUT`:

- `engine`: each rank splits the same random-weight model (`fms_paged.parallel.shard`) and builds
  its `Engine`; rank 0 runs `requests()` through it, the others follow it (`run_worker`). Each rank
  writes OUT/rank{r}.pt: the tokens (rank 0), the cached pages and their K/V in its pool.
- `logits`: each rank splits every family's micro preset and writes OUT/logits{r}.pt
  (`logits_errors`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fms_paged import Engine, SamplingParams, get_model
from fms_paged.engine.tensor_parallel import run_worker
from fms_paged.parallel import shard

# a pool of 16 pages: the six requests preempt one another (one sequence at most 8 pages)
# (one token a step: tensor-parallel engines take no lookahead steps, and the one-rank engine the
# ranks are compared with page for page must take the same steps)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=48, num_pages=16, max_model_len=128, compile=False,
              decode_steps=1)
SHARED = list(range(5, 45))  # 40 tokens: two pages of 16 shared by the requests that start with it


def build() -> torch.nn.Module:
    return get_model("llama", variant="micro", attn_impl="paged", device="cpu", seed=0, page_size=16)


def requests() -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(6):
        tail = torch.randint(3, 256, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
        prompt = SHARED + tail if i % 2 else tail
        out.append((prompt, SamplingParams(max_new_tokens=24, ignore_eos=True, seed=i, n=2 if i == 4 else 1,
                                           temperature=0.0 if i % 3 else 0.9)))
    return out


def run(engine: Engine) -> dict[tuple[int, int], list[int]]:
    for prompt, params in requests():
        engine.add_request(prompt, params)
    got: dict[tuple[int, int], list[int]] = {}
    for out in engine.stream():
        got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    return got


def cached_kv(engine: Engine) -> dict:
    """The pages the prefix cache holds, and each layer's K and V on them: [pages, Hkv, P, D]."""
    pages = sorted(engine.prefix_cache.pages)
    P = engine.pm.page_size

    def on(pool: torch.Tensor) -> torch.Tensor:
        return torch.stack([pool[0, :, p * P : (p + 1) * P] for p in pages]) if pages else pool[:0]

    return {"pages": pages, "k": [on(k) for k in engine.backend.k_pools],
            "v": [on(v) for v in engine.backend.v_pools]}


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite", "gemma2", "gemma3")


def logits_errors(rank: int, size: int) -> dict[str, tuple[float, bool]]:
    """Per family: (the largest logit difference of the split model's forward from the whole's,
    relative to their largest; whether greedy `generate` through the paged cache gives the same
    tokens)."""
    from fms_paged import generate

    tokens = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    out = {}
    for family in FAMILIES:
        logits, gen = [], []
        for split in (False, True):
            model = get_model(family, variant="micro", attn_impl="paged", device="cpu", seed=0, page_size=16)
            if split:
                model = shard(model, rank, size)
            with torch.inference_mode():
                logits.append(model(tokens))
            gen.append(generate(model, tokens.tolist(), 12, eos_id=None))
        out[family] = (float((logits[0] - logits[1]).abs().max() / logits[0].abs().max()), gen[0] == gen[1])
    return out


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if mode == "logits":
        torch.save(logits_errors(rank, size), out / f"logits{rank}.pt")
        dist.destroy_process_group()
        return
    engine = Engine(shard(build(), rank, size), **ENGINE)
    if rank == 0:
        tokens = run(engine)
        result = {"tokens": tokens, "preemptions": engine.metrics()["preemptions"],
                  "hits": engine.metrics()["prefix_cache_hits"], **cached_kv(engine)}
        engine.shutdown()  # the workers' loops return
    else:
        run_worker(engine)
        result = cached_kv(engine)
        engine.shutdown()
    dist.destroy_process_group()
    torch.save({"rank": rank, "size": size, "kvheads": engine.model.config.kvheads, **result},
               out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
