"""`fms-paged serve --tensor-parallel-size 2` under faults: a rank killed or hung takes the server
down with a non-zero exit and the cause in its log, within a bounded time; SIGTERM stops every
rank. And the ranks started by torchrun (as across hosts), rank 0 serving. (The server's own
openai-client tests run against two ranks in test_completions.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fms_paged import generate
from tests.serve.conftest import Server, free_port, launch, stop_server, stream_lines, wait_healthy

DEATH_S = 30.0  # the bound: the rank's exit is seen at once (a watcher on its process), 1 s polling
ARGS = ["--enforce-eager", "--max-num-seqs", "2", "--tensor-parallel-size", "2", "--log-level", "info"]


def rank_pids(server) -> dict[int, int]:
    """{rank: pid} of the ranks the engine spawned, from the server's log."""
    found = re.findall(r"tensor-parallel rank (\d+) of \d+ started \(pid (\d+)\)", server.output(100_000))
    return {int(r): int(p) for r, p in found}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def two_rank_server(tmp_path, env: dict | None = None, new_session: bool = False):
    """A 2-rank server, healthy -> (it, {rank: pid} of its spawned ranks)."""
    server = launch(ARGS, tmp_path / "server.log", env, new_session=new_session)
    wait_healthy(server, 120)
    pids = rank_pids(server)
    assert set(pids) == {1}, server.output()
    return server, pids


def test_a_killed_rank_takes_the_server_down_with_its_cause(tmp_path):
    server, pids = two_rank_server(tmp_path)
    try:
        r = httpx.post(f"{server.v1}/completions", json={"prompt": "def add(a, b):", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        try:
            rc = server.proc.wait(DEATH_S)
        except Exception:
            pytest.fail(f"the server still ran {DEATH_S:.0f} s after rank 1 was killed:\n{server.output()}")
        took = time.monotonic() - t0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    log = server.output()
    assert rc != 0, log
    assert f"tensor-parallel rank 1 (pid {pids[1]}) exited with code -9" in log, log
    assert took < DEATH_S


def test_sigterm_to_the_process_group_drains_and_stops_every_rank(tmp_path):
    """A supervisor's stop (systemd's KillMode=control-group, `kill -TERM -PGID`) reaches every
    process of the server, the spawned rank too: the rank leaves the stop to rank 0, so a stream
    running at the signal ends whole, the server exits 0 (not 1: "rank 1 exited"), and the rank is
    gone with it."""
    server, pids = two_rank_server(tmp_path, new_session=True)
    try:
        pgid = os.getpgid(server.proc.pid)
        assert pgid == server.proc.pid and os.getpgid(pids[1]) == pgid  # the signal reaches the rank
        lines = stream_lines(server.url, 64, lambda k: k == 1 and os.killpg(pgid, signal.SIGTERM))
        assert lines[-1] == "[DONE]", server.output()
        assert lines[-2]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(30) == 0, server.output()
        assert wait_gone(pids[1], 30), f"rank 1 (pid {pids[1]}) outlived the server:\n{server.output()}"
    finally:
        stop_server(server, check=False)


def test_a_hung_rank_takes_the_server_down_after_the_collective_timeout(tmp_path):
    """Rank 1 stopped (SIGSTOP: alive, silent): the next step's collective gives up after
    FMS_PAGED_TP_TIMEOUT_S and the server exits non-zero, saying so."""
    server, pids = two_rank_server(tmp_path, env={"FMS_PAGED_TP_TIMEOUT_S": "5"})
    try:
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(httpx.HTTPError):  # the request's engine dies under it
            r = httpx.post(f"{server.v1}/completions", json={"prompt": "def add(a, b):", "max_tokens": 4},
                           timeout=DEATH_S)
            r.raise_for_status()
        rc = server.proc.wait(DEATH_S)
        took = time.monotonic() - t0
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    log = server.output()
    assert rc != 0 and took < DEATH_S, log
    assert "the engine stopped" in log and "imed out" in log, log


def processes_with(arg: str) -> list[int]:
    """Pids whose command line holds `arg` (Linux /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if arg.encode() in cmd:
                pids.append(int(d.name))
    return pids


def test_torchrun_ranks_serve_with_rank_0_and_stop_together(tmp_path, paged_model, tok):
    """`torchrun --nproc-per-node 2 -m fms_paged.cli serve` (as on several hosts, one rank each):
    rank 0 serves, rank 1 follows it; greedy tokens equal `generate`'s on the whole model; SIGTERM
    to torchrun stops both ranks and the engine process."""
    port = free_port()
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", "2", "-m", "fms_paged.cli", "serve", "--device", "cpu",
                                 "--enforce-eager", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_healthy(server, 120)
        ids = tok.encode("def add(a, b):")
        want = generate(paged_model, [ids], 8, eos_id=None)[0]
        r = httpx.post(f"{server.v1}/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True, "return_token_ids": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want, server.output()
        assert "tensor-parallel rank 1 following rank 0" in server.output()
        assert len(processes_with(str(port))) >= 3  # torchrun, its 2 ranks (and rank 0's engine process)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while processes_with(str(port)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not processes_with(str(port)), server.output()
    finally:
        for pid in processes_with(str(port)):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
