"""Shared fixtures: the device the suite runs on (`--device`), tiny random Hugging Face LLaMA
checkpoints built in the test (no network), the no-host-sync dispatch mode.

`--device` (default: $FMS_PAGED_TEST_DEVICE, else cpu) sets the `device` fixture, which every test
of device-generic code builds its models, backends and tensors on. Tests of CPU-only code (the cpp
kernel, the packed CPU linear, the CPU KV space) keep the CPU and say so. On CUDA, FlexAttention's
eager fallback and Dynamo's recompile-limit fallback raise instead of warning, so that a slow path
taken silently fails the run; and gpu-marked tests are expected to run (pass `-m "not slow and not
docker"`: the default addopts deselect `gpu`).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fms_paged import native
from fms_paged.kv.kernels import choose_kernel, flex_unavailable_reason
from fms_paged.native import gemm

DEVICE_ENV = "FMS_PAGED_TEST_DEVICE"
# a model whose C++ kernels are still compiling waits for them here (a user's first start computes
# with torch's operations meanwhile): every test's model takes one path, whatever the kernel cache
# held when the suite started (tests/engine: the start that does not wait, simulated)
os.environ["FMS_PAGED_WAIT_FOR_BUILDS"] = "1"
_DEVICE = pytest.StashKey[torch.device]()


@contextlib.contextmanager
def gemm_kind(kind: str):
    """The operators take `kind`'s GEMM past the GEMV's rows inside ("packed": oneDNN's on packed
    copies; "own": the GEMM kernel on the plain weights), the configured one again after: what a
    test of one path pins, whichever this CPU takes by default (`gemm.default_gemm`)."""
    was = gemm.GEMM
    gemm.GEMM = kind
    native.configure()
    try:
        yield
    finally:
        gemm.GEMM = was
        native.configure()


def pytest_addoption(parser):
    parser.addoption(
        "--device", default=os.environ.get(DEVICE_ENV) or "cpu",
        help=f"torch device of the device-generic tests: cpu, cuda, cuda:N or mps (default: "
             f"${DEVICE_ENV}, else cpu). A device that is not there is a usage error. With CUDA, "
             "select the gpu-marked tests too: -m 'not slow and not docker'.")
    parser.addoption(
        "--device-tests-only", action="store_true",
        help="run only the tests whose results depend on --device (those that take the `device` "
             "fixture) and the gpu-marked ones: what a GPU run adds to the CPU suite (make gpu-check)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--device-tests-only"):
        return
    keep, drop = [], []
    for item in items:
        on_device = "device" in getattr(item, "fixturenames", ()) or item.get_closest_marker("gpu")
        (keep if on_device else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _parse_device(name: str) -> torch.device:
    """The `--device` value as a torch.device, or a usage error saying why it cannot be used here."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise pytest.UsageError(f"--device {name!r} is not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError(
                f"--device {name!r} (or ${DEVICE_ENV}) asks for CUDA, but torch {torch.__version__} "
                "sees no CUDA device here (torch.cuda.is_available() is False); run with --device cpu")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise pytest.UsageError(f"--device {name!r}: only {torch.cuda.device_count()} CUDA devices here")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise pytest.UsageError(f"--device {name!r} asks for MPS, but MPS is not available here")
        return dev
    if dev.type != "cpu":
        raise pytest.UsageError(f"--device {name!r}: expected cpu, cuda, cuda:N or mps")
    return dev


def pytest_configure(config):
    dev = _parse_device(config.getoption("--device"))
    config.stash[_DEVICE] = dev
    if dev.type == "cuda":
        # FlexAttention run eagerly on CUDA (a missed torch.compile) is a slow path that only warns:
        # fail instead. The pyproject ignores this warning for the CPU; a later ini line wins.
        config.addinivalue_line(
            "filterwarnings", "error:flex_attention called without torch.compile:UserWarning")
        # Past the recompile limit Dynamo silently runs the code eagerly: raise instead (torch < 2.6
        # named the setting fail_on_cache_limit_hit)
        import torch._dynamo.config as dynamo_config

        for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, True)
                break


def pytest_report_header(config):
    dev = config.stash.get(_DEVICE, None)
    if dev is None:
        return None
    line = f"fms_paged test device: {dev} (--device / ${DEVICE_ENV})"
    if dev.type != "cpu" and "not gpu" in (config.option.markexpr or ""):
        line += "; gpu-marked tests are deselected by -m: pass -m 'not slow and not docker' to run them"
    return line


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    """The device of the device-generic tests (`--device`); session-scoped, so module fixtures that
    build models can take it too."""
    return pytestconfig.stash[_DEVICE]


@pytest.fixture(scope="module")
def cpu_only(device) -> None:
    """Skips a module off the CPU (`pytestmark = pytest.mark.usefixtures("cpu_only")`): for tests
    whose subject is CPU-only, or that a GPU run covers otherwise."""
    if device.type != "cpu":
        pytest.skip(f"CPU-only tests (the test device is {device})")


def production_kernel(device: torch.device) -> str:
    """The paged kernel "auto" picks on `device` for the tests' fp32 models (head dim 16, pages of
    16): cpp on the CPU, flex on CUDA, gather where neither runs."""
    return choose_kernel("auto", device, 16, head_dim=16, dtype=torch.float32).name


@pytest.fixture(scope="session")
def paged_kernel(device) -> str:
    """`production_kernel` of the test device (the kernel tests use where the kernel is not their subject)."""
    return production_kernel(device)


@pytest.fixture(scope="session")
def require_kernel(device):
    """`require_kernel(kernel, page_size)`: skip the test where `kernel` cannot run on the test
    device: cpp off the CPU (it is a CPU kernel), flex on CUDA with pages that are not whole Triton
    tiles (multiples of 16). On the CPU nothing is skipped: a kernel that should run there and cannot
    fails the test."""

    def check(kernel: str, page_size: int = 16) -> None:
        if device.type == "cpu":
            return
        if kernel == "cpp":
            pytest.skip(f"the cpp kernel runs on the CPU only (test device: {device})")
        if kernel == "flex":
            reason = flex_unavailable_reason(device, page_size)
            if reason is not None:
                pytest.skip(f"compiled flex_attention cannot run on {device} here: {reason}")

    return check

HF_CONFIGS = {
    # (a) plain multi-head attention
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    # (b) grouped-query attention 4:1
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    # (c) llama3 RoPE: large theta + frequency scaling
    "llama3": dict(
        num_attention_heads=4, num_key_value_heads=1, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
}


def make_hf_llama(seed: int = 0, **overrides):
    """A random-weight transformers LlamaForCausalLM (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    # HF inits norms to ones; randomise them so the norm weights are actually tested
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: (hf_model, checkpoint_dir) saved with save_pretrained (safetensors). The HF model is
    the reference and stays on the CPU in fp32 whatever the test device: compare after `.cpu()`."""

    def build(name: str = "gqa", max_shard_size: str | None = None, **overrides):
        cfg = dict(HF_CONFIGS.get(name, {}))
        cfg.update(overrides)
        model = make_hf_llama(**cfg)
        path = tmp_path / name
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, safe_serialization=True, **kwargs)
        return model, path

    return build


# One small random-weight checkpoint per family we load, made with transformers' own config and
# model classes: 3 layers, head_dim 16 (the cpp kernel's multiple), a window of FAMILY_WINDOW
# tokens on the sliding layers (every layer for Mistral; some for Qwen2/3, Gemma 2/3), a small
# attention soft-cap for Gemma 2 (so that it bends the scores of a random model), Granite's four
# multipliers at their published sizes.
FAMILY_WINDOW = 24
HF_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=FAMILY_WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=FAMILY_WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=16, use_sliding_window=True, sliding_window=FAMILY_WINDOW, max_window_layers=2)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.22,
                     logits_scaling=8.0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=FAMILY_WINDOW,
                    attn_logit_softcapping=2.0, final_logit_softcapping=5.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=FAMILY_WINDOW,
                    sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 8.0},
                    tie_word_embeddings=True)),
}


def make_hf_family(family: str, seed: int = 0, **overrides):
    """A random-weight transformers model of `family` (fp32, eval mode, eager attention: the
    reference that applies windows and soft-caps as written). Norms and biases are randomised so
    that they are tested too (Gemma's norms scale by 1 + w: around 0)."""
    import transformers

    config_cls, model_cls, kw = HF_FAMILIES[family]
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**base, **kw, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if family.startswith("gemma") else p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="session")
def hf_family(tmp_path_factory):
    """Factory: family -> (hf_model, checkpoint_dir), made once per session (save_pretrained,
    safetensors). The HF model stays on the CPU in fp32."""
    made = {}

    def build(family: str):
        if family not in made:
            model = make_hf_family(family)
            path = tmp_path_factory.mktemp(f"hf_{family}")
            model.save_pretrained(path, safe_serialization=True)
            made[family] = (model, path)
        return made[family]

    return build


@pytest.fixture
def hf_greedy():
    """HF `generate` on a batch of mixed-length prompts (left-padded, as HF batches): new tokens."""

    def run(hf, prompts, max_new_tokens):
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, width:].tolist()

    return run


class NoHostSync(TorchDispatchMode):
    """Fails on every aten op that reads device memory back to the host.

    On CPU, `.tolist()` / `.numpy()` and boolean-mask indexing do not dispatch a sync op, so the
    hot path is also run on `device="meta"` (no data at all: any read-back raises there) and
    boolean indices (a hidden `nonzero` on CUDA) are refused here.
    """

    BANNED = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.seen.append(name)
        if name in self.BANNED or "_local_scalar" in name:
            raise AssertionError(f"host sync: aten.{name}")
        if name.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args
            if isinstance(a, (list, tuple))
            for i in a
        ):
            raise AssertionError(f"host sync: aten.{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_host_sync():
    """The `NoHostSync` dispatch mode (a class: `with no_host_sync() as mode: ...`)."""
    return NoHostSync
