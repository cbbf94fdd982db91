"""Bad requests get a 4xx (never a 5xx: the `openai` client retries those) with OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` naming the field, and leave the server serving.
Also the API key (401), the waiting-queue bound (429 + Retry-After) and graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from fms_paged.serve.app import MAX_BODY_BYTES
from tests.serve.conftest import launch, running_server, stop_server, stream_lines, wait_healthy

MODEL = "default_model"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(serve):
    return serve("--enforce-eager", "--max-num-seqs", "2", "--max-model-len", MAX_MODEL_LEN)


def check_error(r: httpx.Response, status: int, param: str | None, *in_message: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    assert err["param"] == param, err
    for s in in_message:
        assert s in err["message"], (s, err["message"])
    return err


def good_request_succeeds(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


LONG_PROMPT = "def f(x):\n    return x\n" * 12  # ~100 tokens

# (id, body, status, param, substrings of the message)
CASES = [
    ("empty prompt", {"prompt": ""}, 400, "prompt", ["empty"]),
    ("empty prompt list", {"prompt": []}, 400, "prompt", ["empty"]),
    ("empty id list in a batch", {"prompt": [[1, 2], []]}, 400, "prompt", ["empty"]),
    ("token outside the vocabulary", {"prompt": [1, 4096]}, 400, "prompt", ["4096", "vocabulary"]),
    ("negative token", {"prompt": [1, -3]}, 400, "prompt", ["-3"]),
    ("temperature -1", {"prompt": "x", "temperature": -1}, 400, "temperature", ["-1"]),
    ("temperature a string", {"prompt": "x", "temperature": "hot"}, 400, "temperature", ["hot"]),
    ("n 0", {"prompt": "x", "n": 0}, 400, "n", []),
    ("n 129", {"prompt": "x", "n": 129}, 400, "n", ["128"]),
    ("top_p 0", {"prompt": "x", "top_p": 0}, 400, "top_p", []),
    ("top_k -2", {"prompt": "x", "top_k": -2}, 400, "top_k", []),
    ("max_tokens 0 without echo", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ["echo"]),
    ("presence_penalty", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", ["0.5"]),
    ("frequency_penalty", {"prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty", []),
    ("logit_bias", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias", []),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options", ["stream"]),
    ("missing prompt", {"max_tokens": 3}, 400, "prompt", []),
    ("prompt of the wrong type", {"prompt": 3}, 400, "prompt", []),
    ("empty stop string", {"prompt": "x", "stop": ["a", ""]}, 400, "stop", []),
    ("stop token outside the vocabulary", {"prompt": "x", "stop_token_ids": [5000]}, 400,
     "stop_token_ids", ["5000"]),
    ("logprobs 21", {"prompt": "x", "logprobs": 21}, 400, "logprobs", ["20"]),
    ("prompt_logprobs 21", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", ["20"]),
    ("max_tokens 0 echoed n times", {"prompt": "x", "echo": True, "max_tokens": 0, "n": 2}, 400, "n", []),
    ("seed past 64 bits", {"prompt": "x", "seed": 1 << 64}, 400, "seed", []),
    ("wrong model", {"prompt": "x", "model": "gpt-4"}, 404, "model", ["gpt-4", MODEL]),
]


@pytest.mark.parametrize("body, status, param, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_completion_request(server, body, status, param, words):
    r = httpx.post(f"{server.v1}/completions", json={"model": MODEL, "max_tokens": 4, **body}, timeout=30)
    err = check_error(r, status, param, *words)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    good_request_succeeds(server.url)


def test_prompt_plus_max_tokens_over_max_model_len_names_both(server, tok):
    n = len(tok.encode(LONG_PROMPT))
    r = httpx.post(f"{server.v1}/completions", json={"prompt": LONG_PROMPT, "max_tokens": 200})
    check_error(r, 400, "max_tokens", str(n), "200", str(MAX_MODEL_LEN))
    # just fitting is fine
    r = httpx.post(f"{server.v1}/completions",
                   json={"prompt": LONG_PROMPT, "max_tokens": MAX_MODEL_LEN - n, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - n
    # a prompt alone over the limit, without max_tokens
    r = httpx.post(f"{server.v1}/completions", json={"prompt": [1] * (MAX_MODEL_LEN + 1), "max_tokens": None})
    check_error(r, 400, "prompt", str(MAX_MODEL_LEN + 1), str(MAX_MODEL_LEN))
    good_request_succeeds(server.url)


@pytest.mark.parametrize("content, why", [
    (b'{"prompt": "x", ', "truncated"),
    (b"\xff\xfe", "not UTF-8"),
    (b"", "empty"),
])
def test_malformed_json(server, content, why):
    r = httpx.post(f"{server.v1}/completions", content=content,
                   headers={"content-type": "application/json"})
    check_error(r, 400, None, "JSON")
    good_request_succeeds(server.url)


def test_a_json_body_that_is_not_an_object(server):
    r = httpx.post(f"{server.v1}/completions", json=["x"])
    check_error(r, 400, None, "object")


def test_body_over_the_size_limit(server):
    big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = httpx.post(f"{server.v1}/completions", content=big, headers={"content-type": "application/json"})
    check_error(r, 413, None, str(MAX_BODY_BYTES))
    good_request_succeeds(server.url)

    def chunks():  # no content-length: the limit holds while the body streams in
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    try:
        r = httpx.post(f"{server.v1}/completions", content=chunks(),
                       headers={"content-type": "application/json"}, timeout=30)
    except httpx.TransportError:  # the server answered and closed while the client still sent
        pass
    else:
        check_error(r, 413, None, str(MAX_BODY_BYTES))
    good_request_succeeds(server.url)


def test_unknown_route_and_method_use_the_error_shape(server):
    check_error(httpx.get(f"{server.v1}/nothing"), 404, None)
    check_error(httpx.get(f"{server.v1}/completions"), 405, None)


CHAT_CASES = [
    ("no messages", {"messages": []}, 400, "messages"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("message without role", {"messages": [{"content": "x"}]}, 400, "messages"),
    ("wrong model", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
]


@pytest.mark.parametrize("body, status, param", [c[1:] for c in CHAT_CASES], ids=[c[0] for c in CHAT_CASES])
def test_bad_chat_request(server, body, status, param):
    check_error(httpx.post(f"{server.v1}/chat/completions", json=body), status, param)


def test_the_openai_client_raises_its_typed_errors(server):
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0) as c:
        for kw, param in (({"prompt": ""}, "prompt"), ({"prompt": "x", "temperature": -1}, "temperature"),
                          ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "presence_penalty": 0.5},
                                                          "presence_penalty"),
                          ({"prompt": "x", "top_p": 0}, "top_p"),
                          ({"prompt": [1, 99999]}, "prompt"),
                          ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens")):
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model=MODEL, **{"max_tokens": 3, **kw})
            assert e.value.status_code == 400 and e.value.param == param, (kw, e.value.body)
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="not-this-one", prompt="x", max_tokens=3)
        assert e.value.status_code == 404 and e.value.code == "model_not_found"
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=3).usage.completion_tokens >= 1


# ------------------------------------------------------------------ API key
def test_api_key_guards_v1_only(tmp_path):
    with running_server(["--enforce-eager", "--max-num-seqs", "1", "--api-key", "s3cret"],
                        tmp_path / "log") as s:
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cre"}, {"Authorization": "Bearer S3CRET"}):
            for r in (httpx.get(f"{s.v1}/models", headers=headers),
                      httpx.post(f"{s.v1}/completions", json={"prompt": "x"}, headers=headers)):
                err = check_error(r, 401, None)
                assert err["type"] == "authentication_error"
        ok = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{s.v1}/models", headers=ok).status_code == 200
        with openai.OpenAI(base_url=s.v1, api_key="nope", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError) as e:
                c.models.list()
            assert e.value.status_code == 401
        with openai.OpenAI(base_url=s.v1, api_key="s3cret", max_retries=0) as c:
            assert c.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason


# ------------------------------------------------------------------ --max-waiting
def test_max_waiting_answers_429_with_retry_after(tmp_path):
    with running_server(["--enforce-eager", "--max-num-seqs", "1", "--max-waiting", "1"],
                        tmp_path / "log") as s:
        async def burst(k: int):
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*[
                    c.post(f"{s.v1}/completions",
                           json={"prompt": f"def f{i}(x):", "max_tokens": 16, "ignore_eos": True})
                    for i in range(k)])

        rs = asyncio.run(burst(8))
        codes = sorted(r.status_code for r in rs)
        assert set(codes) == {200, 429} and codes.count(429) >= 1, codes
        for r in rs:
            if r.status_code == 429:
                assert r.headers["retry-after"].isdigit()
                assert check_error(r, 429, None, "--max-waiting")["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 16
        good_request_succeeds(s.url)


# ------------------------------------------------------------------ graceful shutdown
def test_sigint_lets_a_running_stream_finish(tmp_path):
    """SIGINT lands after the stream's first chunk. New connections are refused while the stream is
    still being read (uvicorn closes its listener within a tick of the signal, however fast the
    tokens come); the stream runs to its end."""
    s = launch(["--enforce-eager", "--max-num-seqs", "2", "--shutdown-timeout", "30"], tmp_path / "log")
    refused = []

    def on_chunk(k: int):
        if k == 1:
            s.proc.send_signal(signal.SIGINT)
        elif not refused:
            try:
                httpx.get(f"{s.url}/health", timeout=5)
            except httpx.TransportError:
                refused.append(k)

    try:
        wait_healthy(s, 120)
        lines = stream_lines(s.url, 400, on_chunk)
        assert lines[-1] == "[DONE]"  # the whole stream, though SIGINT came after its first chunk
        reasons = [c["choices"][0]["finish_reason"] for c in lines[:-1]]
        assert reasons == [None] * (len(reasons) - 1) + ["length"]
        assert refused and refused[0] < len(lines), refused  # refused before the stream's end
        assert s.proc.wait(30) == 0
    finally:
        stop_server(s)


def test_sigterm_to_the_process_group_drains_and_exits_0(tmp_path):
    """A supervisor's stop (systemd's KillMode=control-group, `kill -TERM -PGID`) signals the engine
    process too: it leaves the stop to the front end, so a stream running at the signal ends whole
    and the server exits 0, as on a SIGTERM to the front end alone (not 1: "the engine stopped")."""
    s = launch(["--enforce-eager", "--max-num-seqs", "2", "--shutdown-timeout", "30"], tmp_path / "log",
               new_session=True)
    try:
        wait_healthy(s, 120)
        pgid = os.getpgid(s.proc.pid)
        assert pgid == s.proc.pid  # its own group: the signal reaches the server and nothing else
        lines = stream_lines(s.url, 200, lambda k: k == 1 and os.killpg(pgid, signal.SIGTERM))
        assert lines[-1] == "[DONE]", s.output()  # the whole stream, though the group got SIGTERM
        reasons = [c["choices"][0]["finish_reason"] for c in lines[:-1]]
        assert reasons == [None] * (len(reasons) - 1) + ["length"]
        assert s.proc.wait(30) == 0, s.output()
        assert "the engine stopped" not in s.output()
    finally:
        stop_server(s)


def test_sigint_aborts_a_stream_past_the_shutdown_timeout(tmp_path):
    s = launch(["--enforce-eager", "--max-num-seqs", "2", "--shutdown-timeout", "0.5"], tmp_path / "log")
    try:
        wait_healthy(s, 120)
        t0 = []
        lines = stream_lines(s.url, 1500, lambda k: k == 1 and (t0.append(time.monotonic()),
                                                                 s.proc.send_signal(signal.SIGINT)))
        # cut after the grace period: no [DONE], no finish reason (uvicorn cancels the response task
        # and logs it; the engine loop then aborts the request)
        assert lines and "[DONE]" not in lines
        assert all(c["choices"][0]["finish_reason"] is None for c in lines)
        assert s.proc.wait(30) == 0
        assert time.monotonic() - t0[0] < 10  # 0.5 s of grace, then the abort and the exit
    finally:
        stop_server(s)
