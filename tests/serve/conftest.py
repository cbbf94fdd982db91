"""Fixtures of the server tests: `fms-paged serve` started as a subprocess on a free loopback port
(as vLLM's tests start `vllm serve`), the default model's tokenizer and its dense / paged twins in
the test process (the references), and a Prometheus scrape helper.

Every server is stopped with SIGINT at teardown and must exit 0 (graceful shutdown). Requests go to
127.0.0.1 only. The servers run on the CPU whatever the test device: the references they are compared
with are CPU models in this process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fms_paged import get_model, load_tokenizer
from fms_paged.models import default_model_path

START_TIMEOUT_S = 120.0  # an eager server is up in ~2 s; a loaded 2-core machine may take longer
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: Path  # the server's stdout + stderr

    def output(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


def wait_healthy(server: Server, timeout: float, on_status=None) -> None:
    """Poll /health until 200; `on_status(code)` sees every answer (None: connection refused)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            code = httpx.get(f"{server.url}/health", timeout=2.0).status_code
        except httpx.TransportError:
            code = None
        if on_status is not None:
            on_status(code)
        if code == 200:
            return
        if server.proc.poll() is not None:
            pytest.fail(f"the server exited with {server.proc.returncode} before /health said 200; "
                        f"its output:\n{server.output()}")
        if time.monotonic() > deadline:
            stop_server(server, check=False)
            pytest.fail(f"/health did not say 200 within {timeout:.0f} s (last: {code}); the "
                        f"server's output:\n{server.output()}")
        time.sleep(0.05)


def launch(args: list[str], log: Path, env: dict | None = None, new_session: bool = False) -> Server:
    """`python -m fms_paged.cli serve ARGS --port P` on the CPU, not waited for. `new_session`: in a
    process group of its own (its pid is the group's id), as a supervisor starts a service."""
    port = free_port()
    cmd = [sys.executable, "-m", "fms_paged.cli", "serve", "--device", "cpu", *map(str, args),
           "--port", str(port)]
    out = open(log, "wb")  # a file, not a pipe: a chatty server never blocks on a full pipe
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=new_session)
    out.close()
    return Server(f"http://127.0.0.1:{port}", proc, log)


def stop_server(server: Server, check: bool = True) -> None:
    """SIGINT, then the exit code must be 0 within STOP_TIMEOUT_S (graceful shutdown)."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
    try:
        rc = server.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        if check:
            pytest.fail(f"the server did not exit within {STOP_TIMEOUT_S:.0f} s of SIGINT; its "
                        f"output:\n{server.output()}")
        return
    if check:
        assert rc == 0, f"the server exited with {rc} on SIGINT; its output:\n{server.output()}"


@contextlib.contextmanager
def running_server(args: list[str], log: Path, env: dict | None = None,
                   timeout: float = START_TIMEOUT_S) -> Iterator[Server]:
    server = launch(args, log, env)
    try:
        wait_healthy(server, timeout)
        yield server
    finally:
        stop_server(server, check=sys.exc_info()[0] is None)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`serve(*args)` -> a running `Server` (up until the module's tests are done)."""
    with contextlib.ExitStack() as stack:
        def start(*args, env: dict | None = None, timeout: float = START_TIMEOUT_S) -> Server:
            log = tmp_path_factory.mktemp("server") / "server.log"
            return stack.enter_context(running_server(list(args), log, env, timeout))

        yield start


# ------------------------------------------------------------------ references in this process
@pytest.fixture(scope="session")
def tok():
    """The default model's tokenizer (sentencepiece, with byte fallback)."""
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def paged_model():
    return get_model(attn_impl="paged", device="cpu")


@pytest.fixture(scope="session")
def dense_model():
    return get_model(attn_impl="sdpa", device="cpu")


# ------------------------------------------------------------------ metrics
def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: {(sample name, sorted labels but model_name): value}."""
    r = httpx.get(f"{url}/metrics", timeout=5.0)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    """One sample of a `scrape` (0 when absent: a labelled counter appears at its first increment)."""
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_idle(url: str, timeout: float = 5.0, until=None) -> tuple[dict, float]:
    """Poll /metrics until no request runs or waits, no KV page is held (cached prefix pages count as
    free) and `until(scrape)` holds. -> (the scrape, seconds it took)."""
    t0 = time.monotonic()
    while True:
        m = scrape(url)
        idle = (metric(m, "fms_paged:num_requests_running") == 0
                and metric(m, "fms_paged:num_requests_waiting") == 0
                and metric(m, "fms_paged:kv_cache_usage_perc") == 0)
        if idle and (until is None or until(m)):
            return m, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            shown = {k: v for k, v in m.items()
                     if any(w in k[0] for w in ("num_requests", "kv_cache", "success"))}
            pytest.fail(f"the server is not idle within {timeout} s: {shown}")
        time.sleep(0.02)


def stream_lines(url: str, max_tokens: int, on_chunk=None) -> list[dict | str]:
    """The data of a completion stream's events; `on_chunk(k)` after the k-th (from 1)."""
    body = {"prompt": "def f(x):", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    out = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
                if on_chunk is not None:
                    on_chunk(len(out))
    except httpx.TransportError:  # the server closed the connection at the end of its grace period
        pass
    return out
