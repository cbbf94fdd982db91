#!/usr/bin/env bash
# Build the image, then prove it works offline: with --network=none, run `fms-paged info` (its paged
# kernel must really compile), `fms-paged generate` on the embedded default model, and the image's
# default command (make bench-llama-paged, at a small scale through BENCH_ARGS), checking that each
# succeeds and that the benchmark wrote its results (and that the image holds no test tools, nor
# Triton beside a CPU torch); then `fms-paged serve --host 0.0.0.0` in a
# container, one completion through it from inside the container (no network), and its graceful
# stop (exit 0 on SIGTERM). Where no Docker daemon answers, it says so and
# exits 0 (skipped). DOCKER_IMAGE, DOCKER_BASE, DOCKER_CA_CERT and DOCKER_BUILD_ARGS pass through to
# `make docker`.
set -euo pipefail
cd "$(dirname "$0")/.."
docker=${DOCKER:-docker}
image=${DOCKER_IMAGE:-fms-paged}
smoke_args=${SMOKE_BENCH_ARGS:---scale 0.02 --new-tokens 8 --ppl-chars 2000}
if ! "$docker" info >/dev/null 2>&1; then
    echo "docker-smoke: SKIPPED: no Docker daemon answers ('$docker info' failed)"
    exit 0
fi
timed() {  # timed LABEL CMD...: run, print how long it took
    local label=$1 start=$SECONDS
    shift
    "$@"
    echo "docker-smoke: $label took $((SECONDS - start)) s"
}
fail() { echo "docker-smoke: FAILED: $*" >&2; exit 1; }

timed "make docker" make docker DOCKER="$docker" DOCKER_IMAGE="$image"
echo "docker-smoke: image $image is $("$docker" image inspect -f '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1 / 1e9}')"
user=$("$docker" run --rm --network=none "$image" id -un)
[ "$user" != root ] || fail "the image runs as root"
# the runtime image carries what running needs: no test tools, and no Triton beside a CPU torch
extra=$("$docker" run --rm --network=none "$image" python -c '
import importlib.util, torch
tools = ["pytest", "ruff", "lm_eval", "openai"] + (["triton"] if torch.version.cuda is None else [])
print(" ".join(m for m in tools if importlib.util.find_spec(m)))')
[ -z "$extra" ] || fail "the runtime image installs what running does not need: $extra"

info=$(timed "fms-paged info" "$docker" run --rm --network=none "$image" fms-paged info)
echo "$info"
grep -q "compiled_flex_available: True" <<<"$info" || fail "fms-paged info: the paged flex kernel does not compile"
grep -q "cpp_kernel_available: True" <<<"$info" || fail "fms-paged info: the CPU paged-attention kernel does not build"

out=$(timed "fms-paged generate" "$docker" run --rm --network=none "$image" \
      fms-paged generate --prompt "def fibonacci(n):" --max-new-tokens 24)
echo "$out"
grep -q "^def fibonacci(n):" <<<"$out" || fail "fms-paged generate printed no continuation"

name="fms-paged-smoke-$$"
trap '"$docker" rm -f "$name" >/dev/null 2>&1 || true' EXIT
timed "default command (make bench-llama-paged, BENCH_ARGS=$smoke_args)" \
    "$docker" run --name "$name" --network=none -e BENCH_ARGS="$smoke_args" "$image"
results=$(mktemp -d)
"$docker" cp "$name:/app/results/bench-llama-paged" "$results/"
for f in results.json results.csv results.md; do
    [ -s "$results/bench-llama-paged/$f" ] || fail "the benchmark wrote no $f"
done
ls "$results/bench-llama-paged"
rm -rf "$results"

sname="fms-paged-serve-$$"
trap '"$docker" rm -f "$name" "$sname" >/dev/null 2>&1 || true' EXIT
"$docker" run -d --name "$sname" --network=none "$image" fms-paged serve --host 0.0.0.0 --enforce-eager >/dev/null
reply=$(timed "fms-paged serve: one completion" "$docker" exec "$sname" python3 -c '
import json, time, urllib.request
for _ in range(120):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", method="POST",
    data=json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}).encode(),
    headers={"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"])')
echo "$reply"
[ -n "$reply" ] || fail "fms-paged serve answered no completion text"
"$docker" stop -t 30 "$sname" >/dev/null
code=$("$docker" wait "$sname")
[ "$code" = 0 ] || { "$docker" logs "$sname" | tail -20; fail "fms-paged serve exited $code on SIGTERM"; }
echo "docker-smoke: PASSED"
