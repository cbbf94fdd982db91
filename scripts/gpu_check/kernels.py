"""`make gpu-check`, stage 3: the compiled engine runs the kernels it should, and never recompiles.

- Kernel pick: an engine's decode steps run under `torch.profiler`, and the names of the kernels
  they launch are read back. On CUDA the decode attention must be FlexAttention's decoding kernel:
  inductor is watched while it lowers the decode graph (its `_use_flex_decoding` choice between the
  decoding template and the main flex template is recorded) and the profiled step must launch a
  Triton template kernel (`triton_tem_*`). On the CPU it must be the project's C++ kernel
  (`fms_paged::paged_attention`) for fp32. Falling back to eager flex (a Python loop of small ops,
  the failure of vLLM issue 27178) fails both: no template kernel, and the warning is an error here.
- Recompiles: after `Engine.warmup()`, 500 steps of requests joining and leaving (prefill chunks
  beside decodes, decode batches shrinking through the buckets) run with Dynamo's
  `error_on_recompile` and must compile no new graph (`unique_graphs` unchanged).
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fms_paged import get_model
from fms_paged.bench.report import table
from fms_paged.engine import Engine, SamplingParams

EAGER_FLEX_WARNING = "flex_attention called without torch.compile"


def model_for(device: torch.device, tiny: bool) -> torch.nn.Module:
    """A 2-layer paged LLaMA with Llama-3-8B's attention shape (32 query heads, 8 KV heads of 128)
    in bf16 on CUDA; the `micro` variant in fp32 on the CPU or with `tiny`."""
    if tiny or device.type != "cuda":
        return get_model(variant="micro", device=device, attn_impl="paged", seed=0)
    return get_model(variant="3-8b", device=device, attn_impl="paged", dtype=torch.bfloat16, seed=0,
                     nlayers=2, src_vocab_size=4096, page_size=16)


@contextlib.contextmanager
def flex_decoding_choices() -> Iterator[list[bool]]:
    """Records inductor's choice, at each flex_attention it lowers, of the decoding template (True)
    over the main flex template (False). Empty where inductor lowers no flex (the CPU's cpp kernel)."""
    choices: list[bool] = []
    try:
        from torch._inductor.kernel.flex import flex_attention as lowering
    except ImportError:  # a torch whose inductor lays out flex elsewhere: nothing recorded
        lowering = None
    original = getattr(lowering, "_use_flex_decoding", None)
    if original is None:
        yield choices
        return

    def watched(*args, **kwargs):
        choices.append(bool(original(*args, **kwargs)))
        return choices[-1]

    lowering._use_flex_decoding = watched
    try:
        yield choices
    finally:
        lowering._use_flex_decoding = original


def kernel_names(fn: Callable[[], Any], device: torch.device) -> list[str]:
    """Names of the device kernels (CUDA) or operators (CPU) that `fn` runs, by total time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    if device.type == "cuda":
        events = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    return [e.key for e in sorted(events, key=lambda e: -e.self_device_time_total
                                  if device.type == "cuda" else -e.self_cpu_time_total)]


def _submit(eng: Engine, rng: random.Random, longest: int) -> int:
    prompt = [rng.randrange(3, eng.vocab_size) for _ in range(rng.randint(1, longest))]
    return eng.add_request(prompt, SamplingParams(max_new_tokens=rng.randint(2, 30), ignore_eos=True))


def check_kernel_pick(model: torch.nn.Module, log: Callable[[str], None]) -> dict[str, Any]:
    """Warm an engine up while watching inductor, then profile three pure decode steps (without
    CUDA graphs, whose replays the profiler may not name kernel by kernel; the recompile check and
    the benchmarks run with them)."""
    device = model.device
    eng = Engine(model, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, num_pages=160,
                 cuda_graphs=False)
    with flex_decoding_choices() as choices:
        eng.warmup(progress=False)
    rng = random.Random(0)
    for _ in range(4):
        _submit(eng, rng, 100)
    eng.step()
    while eng.scheduler.waiting or any(r.num_computed < len(r.prompt) for r in eng.scheduler.running):
        eng.step()  # until every prompt is in: the next steps are pure decodes

    names = kernel_names(lambda: [eng.step() for _ in range(3)], device)
    list(eng.stream())
    if device.type == "cuda":
        want = "FlexAttention's decoding template (inductor chose it, and a triton_tem_ kernel ran)"
        ok = any(choices) and any(n.startswith("triton_tem") for n in names)
    else:  # the CPU's kernel, in every dtype: inside the one-call forward or the fused decode layers
        # (or alone, compiled)
        ops = ("fms_paged::decoder_logits", "fms_paged::decoder_stack", "fms_paged::paged_attention")
        want = f"the C++ kernel: {', '.join(ops[:-1])} or {ops[-1]}"
        ok = eng.backend.kernel.name == "cpp" and bool(set(ops) & set(names))
    log(f"[kernels] decode on {device.type} ({eng.backend.kernel}, cuda_graphs={eng.runner.cuda_graphs}): "
        f"{'ok' if ok else 'WRONG'}; top kernels {names[:4]}")
    return {"name": "decode kernel", "kernel": eng.backend.kernel.name, "cuda_graphs": eng.runner.cuda_graphs,
            "expected": want, "flex_decoding_choices": choices, "top_kernels": names[:12], "passed": ok}


def check_recompiles(model: torch.nn.Module, steps: int, log: Callable[[str], None]) -> dict[str, Any]:
    """After warmup(), `steps` engine steps of mixed prefill and decode compile no new graph."""
    from torch._dynamo.utils import counters

    eng = Engine(model, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, num_pages=300)
    t0 = time.perf_counter()
    eng.warmup(progress=False)
    warm = time.perf_counter() - t0
    rng, finished, error = random.Random(1), 0, None
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(6):
        _submit(eng, rng, 120)
    t0 = time.perf_counter()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(steps):
                if rng.random() < 0.2:
                    _submit(eng, rng, 120)
                finished += sum(o.finished for o in eng.step())
    except Exception as e:  # a recompile (error_on_recompile) or a failure of the step
        error = f"{type(e).__name__}: {e}"[:500]
    new_graphs = counters["stats"]["unique_graphs"] - graphs
    ok = error is None and new_graphs == 0
    log(f"[kernels] {steps} engine steps after warm-up ({warm:.0f} s): {new_graphs} new graphs, "
        f"{finished} requests finished{', ' + error if error else ''}")
    return {"name": f"recompiles over {steps} steps", "steps": steps, "new_graphs": new_graphs,
            "finished": finished, "warmup_s": warm, "steps_s": time.perf_counter() - t0,
            "error": error, "passed": ok}


def run(device: torch.device, tiny: bool, log: Callable[[str], None] = print, *,
        deadline_s: float | None = None) -> dict[str, Any]:
    """Stage 3 -> {"passed", "checks"}; a check that raises, or that would start past `deadline_s`
    (seconds from now), is recorded as failed."""
    t0, model = time.perf_counter(), model_for(device, tiny)
    checks = []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=EAGER_FLEX_WARNING)
        for name, check in (("decode kernel", lambda: check_kernel_pick(model, log)),
                            ("recompiles", lambda: check_recompiles(model, 500, log))):
            if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                checks.append({"name": name, "passed": False, "error": f"not run: past {deadline_s:.0f} s"})
                continue
            try:
                checks.append(check())
            except KeyboardInterrupt:  # the driver's budget ran out: keep what was checked
                checks.append({"name": name, "passed": False,
                               "error": "interrupted: the stage's budget ran out"})
                break
            except Exception as e:
                checks.append({"name": name, "passed": False, "error": f"{type(e).__name__}: {e}"[:500]})
                log(f"[kernels] failed: {checks[-1]['error']}")
    return {"passed": all(c["passed"] for c in checks), "checks": checks,
            "model": {"layers": model.config.nlayers, "heads": model.config.nheads,
                      "kv_heads": model.config.kvheads, "head_dim": model.config.head_dim,
                      "dtype": str(model.dtype).removeprefix("torch.")}}


def markdown(result: dict[str, Any]) -> str:
    rows = [{"check": c["name"], "ok": c["passed"],
             "detail": c.get("error") or c.get("expected") or
             f"{c.get('new_graphs')} new graphs, {c.get('finished')} requests finished"}
            for c in result["checks"]]
    m = result["model"]
    return ("## Kernels and recompiles\n\n"
            f"Model: {m['layers']} layers, {m['heads']}/{m['kv_heads']} heads of {m['head_dim']}, "
            f"{m['dtype']}.\n\n" + table(rows, [("check", "check", ""), ("passed", "ok", ""),
                                                 ("detail", "detail", "")]))
