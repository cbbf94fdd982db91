"""A server that compiles (no --enforce-eager) answers /health 503 while its engine warms up, then
200; a request during warm-up gets a 503 with Retry-After (the client's to retry), and after it
the compiled steps give `generate()`'s greedy tokens.

On this 2-core CPU the warm-up takes ~3 s with torch's compile caches warm (a first run on a cold
machine: up to a minute or two, hence the 300 s limit), so the test is not marked slow."""

from __future__ import annotations

import time

import httpx
import openai

from fms_paged import generate
from tests.serve.conftest import launch, stop_server, wait_healthy

WARMUP_TIMEOUT_S = 300.0


def test_health_is_503_until_warm_then_200(tmp_path, paged_model, tok):
    t0 = time.monotonic()
    server = launch(["--max-num-seqs", "2"], tmp_path / "server.log")
    seen: list[tuple[int | None, float]] = []
    during: list[httpx.Response] = []

    def on_status(code):
        if not seen or seen[-1][0] != code:
            seen.append((code, time.monotonic() - t0))
        if code == 503 and not during:  # one completion while warming up
            during.append(httpx.post(f"{server.v1}/completions", json={"prompt": "x", "max_tokens": 2},
                                     timeout=30))

    try:
        wait_healthy(server, WARMUP_TIMEOUT_S, on_status)
        codes = [c for c, _ in seen if c is not None]
        assert codes == [503, 200], seen  # refused connections first, then exactly these
        r = during[0]
        if r.status_code != 200:  # (200 only if the warm-up ended between the two requests)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert r.json()["error"]["type"] == "service_unavailable"
            assert "warming up" in r.json()["error"]["message"]
        assert "ready (warm-up" in server.output()
        prompt = tok.encode("def add(a, b):")
        (want,) = generate(paged_model, [prompt], 12)
        with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120) as c:
            got = c.completions.create(model="default_model", prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True})
        assert got.choices[0].model_extra["token_ids"] == want
    finally:
        stop_server(server)
    print(f"/health over time (code, s since launch): {seen}")
