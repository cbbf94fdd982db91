"""Many clients at once, clients that leave, and what /metrics says about them.

The reference for a request's tokens is the same request sent alone (greedy decoding on this engine
does not depend on the batch: see tests/engine/test_engine.py). After every test the server must be
idle: no request running or waiting and no KV page held (cached prefix pages count as free)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.serve.conftest import metric, scrape, wait_idle

MODEL = "default_model"
WORDS = ["os", "sys", "path", "json", "parse", "value", "items", "self", "return", "import", "class"]
# a client gone: its request aborted, its pages free, within this many seconds (the engine loop
# applies an abort at its next step, milliseconds here; the rest is slack for a loaded 2-core CI box)
ABORT_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def server(serve):
    return serve("--enforce-eager", "--max-num-seqs", "8")


def varied_requests(k: int) -> list[tuple[str, int]]:
    """k (prompt, max_tokens): prompts of 2 to ~40 tokens, outputs of 3 to 17 tokens."""
    out = []
    for i in range(k):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(1 + (i * 5) % 13)]
        out.append((f"def f{i}({', '.join(words)}):" if i % 2 else " ".join(words), 3 + (i * 11) % 15))
    return out


def test_32_concurrent_streams_get_the_tokens_they_get_alone(server):
    reqs = varied_requests(32)
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as c:
        alone = []
        for prompt, n in reqs:
            ch = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0]
            alone.append((ch.model_extra["token_ids"], ch.text, ch.finish_reason))

    async def one(c: openai.AsyncOpenAI, prompt: str, n: int):
        ids, text, reasons, usage = [], "", [], None
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                ids += ch.model_extra.get("token_ids") or []
                text += ch.text
                if ch.finish_reason is not None:
                    reasons.append(ch.finish_reason)
        return ids, text, reasons, usage

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*[one(c, p, n) for p, n in reqs])

    got = asyncio.run(all_at_once())
    for (ids, text, reasons, usage), (want_ids, want_text, want_reason), (p, n) in zip(got, alone, reqs):
        assert ids == want_ids, p
        assert text == want_text and reasons == [want_reason]
        assert usage.completion_tokens == len(want_ids) <= n
    wait_idle(server.url)


def assert_aborted_soon(server, before: float, aborted: int = 1) -> None:
    """`aborted` more requests counted as aborted, and the server idle, within ABORT_WITHIN_S of now."""
    gone = time.monotonic()
    m, _ = wait_idle(server.url, timeout=10, until=lambda m: metric(
        m, "fms_paged:request_success_total", finished_reason="abort") >= before + aborted)
    took = time.monotonic() - gone
    assert metric(m, "fms_paged:request_success_total", finished_reason="abort") == before + aborted
    assert took < ABORT_WITHIN_S, f"aborted and idle {took:.2f} s after the client left"


def test_a_stream_client_that_leaves_aborts_its_request(server):
    before = metric(scrape(server.url), "fms_paged:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    chunks = 0
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{server.v1}/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 2:
                    break
    assert_aborted_soon(server, before)


def test_a_waiting_client_that_times_out_aborts_its_request(server):
    before = metric(scrape(server.url), "fms_paged:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 1500, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(f"{server.v1}/completions", json=body)
    assert_aborted_soon(server, before)


def test_an_n3_stream_client_that_leaves_aborts_every_completion(server):
    before = metric(scrape(server.url), "fms_paged:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "import", "max_tokens": 1000, "ignore_eos": True, "stream": True,
            "n": 3, "temperature": 1, "seed": 3}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{server.v1}/completions", json=body) as r:
            for _ in zip(range(4), r.iter_lines()):  # two events (and the blank lines after them)
                pass
    assert_aborted_soon(server, before, aborted=3)


# ------------------------------------------------------------------ metrics
def deltas(a: dict, b: dict, *names: str) -> dict:
    return {n: metric(b, n) - metric(a, n) for n in names}


def test_metrics_count_what_was_served(server):
    wait_idle(server.url)
    before = scrape(server.url)
    usages, completions = [], 0
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as c:
        for prompt, n in varied_requests(5):
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True})
            usages.append(r.usage)
            completions += 1
        # n=2: two completions, one prompt
        r = c.completions.create(model=MODEL, prompt="import os", max_tokens=4, temperature=1, seed=0, n=2,
                                 extra_body={"ignore_eos": True})
        usages.append(r.usage)
        completions += 2
        stream = c.completions.create(model=MODEL, prompt=[1, 303, 288], max_tokens=6, temperature=0,
                                      stream=True, stream_options={"include_usage": True},
                                      extra_body={"ignore_eos": True})
        usages += [ch.usage for ch in stream if ch.usage is not None]
        completions += 1
    after, _ = wait_idle(server.url)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    d = deltas(before, after, "fms_paged:prompt_tokens_total", "fms_paged:generation_tokens_total",
               "fms_paged:e2e_request_latency_seconds_count", "fms_paged:time_to_first_token_seconds_count",
               "fms_paged:request_queue_time_seconds_count", "fms_paged:inter_token_latency_seconds_count",
               "fms_paged:e2e_request_latency_seconds_sum", "fms_paged:first_chunk_delay_seconds_count",
               "fms_paged:first_chunk_delay_seconds_sum")
    assert d["fms_paged:prompt_tokens_total"] == prompt_tokens
    assert d["fms_paged:generation_tokens_total"] == generated
    assert d["fms_paged:e2e_request_latency_seconds_count"] == completions
    assert d["fms_paged:time_to_first_token_seconds_count"] == completions
    assert d["fms_paged:request_queue_time_seconds_count"] == completions
    assert d["fms_paged:inter_token_latency_seconds_count"] == generated - completions  # gaps
    assert d["fms_paged:e2e_request_latency_seconds_sum"] > 0
    # one stream: its first chunk's delay after the engine's first token, observed once
    assert d["fms_paged:first_chunk_delay_seconds_count"] == 1
    assert 0 < d["fms_paged:first_chunk_delay_seconds_sum"] < 1.0
    for reason, k in (("length", completions), ("stop", 0), ("abort", 0)):
        got = (metric(after, "fms_paged:request_success_total", finished_reason=reason)
               - metric(before, "fms_paged:request_success_total", finished_reason=reason))
        assert got == k, reason
    # a histogram's buckets are cumulative and end at +Inf == _count
    inf = metric(after, "fms_paged:e2e_request_latency_seconds_bucket", le="+Inf")
    assert inf == metric(after, "fms_paged:e2e_request_latency_seconds_count")


def test_a_stop_string_counts_as_stop_not_abort(server):
    """The client sees finish_reason "stop"; the server's counters must say the same (vLLM counts a
    stop string as "stop")."""
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as c:
        full = c.completions.create(model=MODEL, prompt="import os\nimport sys\n", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        wait_idle(server.url)
        before = scrape(server.url)
        # the stop string is in the first 12 tokens; 200 allowed, so the request is still running
        # when the server sees it and aborts it (a stop string completed by a request's very last
        # output is counted by the engine's reason, "length": see docs/serving.md's limits)
        r = c.completions.create(model=MODEL, prompt="import os\nimport sys\n", max_tokens=200,
                                 temperature=0, stop=[full[3:6]], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    counted = lambda m, reason: metric(m, "fms_paged:request_success_total", finished_reason=reason)  # noqa: E731
    # the counters are updated as the request is finished, which may come just after the reply
    after, _ = wait_idle(server.url, until=lambda m: counted(m, "stop") + counted(m, "abort")
                         > counted(before, "stop") + counted(before, "abort"))
    stop = (metric(after, "fms_paged:request_success_total", finished_reason="stop")
            - metric(before, "fms_paged:request_success_total", finished_reason="stop"))
    abort = (metric(after, "fms_paged:request_success_total", finished_reason="abort")
             - metric(before, "fms_paged:request_success_total", finished_reason="abort"))
    assert (stop, abort) == (1, 0)


def test_a_burst_of_300_requests_all_succeed(server):
    """Submissions far faster than the engine steps (vLLM's benchmark at --request-rate inf sends
    hundreds at once): each one is answered 200, none is lost, and the server ends idle."""
    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=400)) as c:
            body = {"model": MODEL, "prompt": list(range(3, 200)), "max_tokens": 2, "ignore_eos": True}
            return await asyncio.gather(*[c.post(f"{server.v1}/completions", json=body) for _ in range(300)])

    replies = asyncio.run(burst())
    assert [r.status_code for r in replies] == [200] * 300
    assert all(r.json()["usage"]["completion_tokens"] == 2 for r in replies)
    m, _ = wait_idle(server.url)
    assert metric(m, "fms_paged:num_requests_running") == 0
