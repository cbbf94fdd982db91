"""`make bench-http`'s structured-output loads: the same random workload sent to a server twice over,
every request free-form (`ignore_eos`), then with a share of them (`--structured-ratio`, 25% by
default) held to a JSON schema (`structured_outputs: {"json": ...}`, which vLLM and fms-paged both
take), greedy, alternated (free, mixed, free, mixed, ...) and all sent at once (saturation). vLLM's
benchmark client sends no structured outputs, so this load has a client of its own: streamed
/v1/completions over httpx, token-id prompts, `stream_options.include_usage` for each request's
output tokens. The schema's shortest document is longer than any token budget here, so a
structured request decodes its whole budget, like a free one. Per run: output tok/s, TTFT, and
TPOT of the free and of the structured requests; the figures are medians over the runs of each
kind, and "mixed / free" compares them.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx

from fms_paged.bench.structured import SCHEMA


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion -> its TTFT, end-to-end latency and output tokens (or its error)."""
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # a failure after the 200 (the stream had begun)
                    return {"error": f"in the stream: {str(chunk['error'])[:200]}"}
                if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    e2el = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else e2el, "e2el": e2el, "tokens": tokens}


def _summary(done: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [d for d in done if "error" not in d]
    tpot = [(d["e2el"] - d["ttft"]) / (d["tokens"] - 1) for d in ok if d["tokens"] > 1]
    return {"requests": len(done), "failed": len(done) - len(ok),
            "ttft_p50_ms": 1000 * statistics.median(d["ttft"] for d in ok) if ok else None,
            "tpot_mean_ms": 1000 * statistics.fmean(tpot) if tpot else None,
            "output_tokens": sum(d["tokens"] for d in ok)}


async def _load(base: str, model: str, work: list[dict[str, Any]], structured: list[bool],
                timeout: float) -> dict[str, Any]:
    url = f"{base}/v1/completions"
    bodies = []
    for w, s in zip(work, structured):
        body = {"model": model, "prompt": w["prompt"], "max_tokens": w["max_tokens"], "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        body.update({"structured_outputs": {"json": SCHEMA}} if s else {"ignore_eos": True})
        bodies.append(body)
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*[_one(client, url, b) for b in bodies])
        duration = time.perf_counter() - t0
    free = [d for d, s in zip(done, structured) if not s]
    json_ = [d for d, s in zip(done, structured) if s]
    out = {"duration_s": duration, "structured": sum(structured), "all": _summary(done),
           "free": _summary(free), "json": _summary(json_) if json_ else None}
    out["output_tok_s"] = out["all"]["output_tokens"] / duration
    errors = [d["error"] for d in done if "error" in d]
    if errors:
        out["first_error"] = errors[0]
    return out


def workload(args, vocab_size: int) -> list[dict[str, Any]]:
    """The random requests (token-id prompts, budgets) of `bench-http`'s lengths, seeded."""
    rng = random.Random(args.seed + 1)
    r = args.range_ratio

    def length(mean: int) -> int:
        return rng.randint(max(1, int(mean * (1 - r))), max(1, int(mean * (1 + r))))

    return [{"prompt": [rng.randrange(3, vocab_size) for _ in range(length(args.input_len))],
             "max_tokens": length(args.output_len)} for _ in range(args.structured_prompts)]


def structured_loads(base: str, model: str, args, vocab_size: int, log=print) -> dict[str, Any]:
    """`args.structured_rounds` pairs of runs (free, mixed) against the server at `base` -> each run,
    the medians per kind and the mixed / free ratios."""
    work = workload(args, vocab_size)
    k = round(args.structured_ratio * len(work))  # exactly that share, at seeded places
    chosen = set(random.Random(args.seed + 2).sample(range(len(work)), k))
    mixed = [i in chosen for i in range(len(work))]
    runs: dict[str, list[dict[str, Any]]] = {"free": [], "mixed": []}
    for r in range(args.structured_rounds):
        for kind, structured in (("free", [False] * len(work)), ("mixed", mixed)):
            run = asyncio.run(_load(base, model, work, structured, args.client_timeout))
            runs[kind].append(run)
            log(f"[bench-http] structured loads, round {r} {kind} ({run['structured']} of {len(work)} "
                f"structured): {run['output_tok_s']:.0f} output tok/s, TPOT free "
                f"{run['free']['tpot_mean_ms'] or 0:.1f} ms" + (
                    f", JSON {run['json']['tpot_mean_ms'] or 0:.1f} ms" if run["json"] else "")
                + (f"; {run['all']['failed']} failed: {run['first_error']}" if run["all"]["failed"] else ""))

    def med(kind: str, f) -> float | None:
        xs = [f(r) for r in runs[kind]]
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    out = {"ratio": args.structured_ratio, "requests": len(work), "structured_requests": sum(mixed),
           "runs": runs, "failed": sum(r["all"]["failed"] for rs in runs.values() for r in rs)}
    for kind in runs:
        out[kind] = {"output_tok_s": med(kind, lambda r: r["output_tok_s"]),
                     "ttft_p50_ms": med(kind, lambda r: r["all"]["ttft_p50_ms"]),
                     "tpot_free_ms": med(kind, lambda r: r["free"]["tpot_mean_ms"]),
                     "tpot_json_ms": med(kind, lambda r: (r["json"] or {}).get("tpot_mean_ms"))}
    f, m = out["free"], out["mixed"]
    out["tok_s_ratio"] = m["output_tok_s"] / f["output_tok_s"] if f["output_tok_s"] else None
    both = f["tpot_free_ms"] and m["tpot_free_ms"]
    out["tpot_ratio"] = m["tpot_free_ms"] / f["tpot_free_ms"] if both else None
    return out
