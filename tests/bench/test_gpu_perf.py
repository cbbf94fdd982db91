"""`make gpu-check` stage 4 (`scripts.gpu_check.perf`): its roofline arithmetic against figures
worked out by hand from the `micro` config, its helpers, and the CPU dry run (`tiny`) end to end:
every section with finite figures that agree with the workload sent, the targets listed, the
markdown's tables, an HF peer in its own process."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fms_paged.bench import environment
from fms_paged.bench.latency import final_lengths
from fms_paged.models import get_model
from scripts.gpu_check import perf as gpu_perf

CPU = torch.device("cpu")
SECTIONS = ("engine_decode", "decode_blocks", "decode_vs_dense", "mixed_batch", "chat", "serving")

# gpu-check's CPU dry run: on a GPU, `make gpu-check` runs the stages themselves
pytestmark = pytest.mark.usefixtures("cpu_only")


def test_bytes_per_step_of_micro_by_hand():
    model = gpu_perf.build_model(CPU, "micro", torch.float32)
    c = model.config
    # the figures below assume micro's shape: vocab 256, width 64, 4 query heads of 16 over 2 KV
    # heads, 2 layers, SwiGLU hidden 128, an LM head of its own
    assert (c.src_vocab_size, c.emb_dim, c.nheads, c.kvheads, c.head_dim, c.nlayers, c.hidden_dim,
            c.tie_heads) == (256, 64, 4, 2, 16, 2, 128, False)
    D, KV, F = 64, 2 * 16, 128
    layer = D + (D * D + D * KV + D * KV + D * D) + D + 3 * D * F  # 2 norms, q k v o, wg w1 w2
    weights = 4 * (2 * layer + D + 256 * D)  # fp32: the layers, the final norm, the LM head
    assert gpu_perf.weights_read(model) == weights == 361_728  # the embedding table is not read
    assert environment.weight_bytes(model) == weights + 4 * 256 * D
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, 16 wide, 4 bytes
    assert environment.kv_bytes_per_token(c, torch.float32) == per_token == 512
    assert gpu_perf.step_bytes(weights, per_token, 100) == 361_728 + 51_200
    assert gpu_perf.roofline_tok_s(10.0, 412_928) == pytest.approx(24_217.297, abs=1e-3)  # 10 GB/s
    bf16 = gpu_perf.build_model(CPU, "micro", torch.bfloat16)
    assert gpu_perf.weights_read(bf16) == weights // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_build_model_gives_get_models_weights(dtype):
    ours = gpu_perf.build_model(CPU, "micro", dtype, seed=3)
    ref = get_model(variant="micro", attn_impl="paged", device="cpu", dtype=dtype, seed=3)
    assert ours.config == ref.config and ours.config.page_size == 64  # the CPU's default page
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert p.device == CPU and p.dtype == dtype, name
        assert torch.equal(p, theirs[name]), name
    for (name, b), (_, rb) in zip(ours.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, rb), name


@pytest.mark.parametrize("contexts, new, steps, msg, turns", [
    ((128, 2048, 8000), 32, [128, 1888, 5920], 972, 8), ((32, 256, 1000), 8, [32, 216, 736], 244, 4)])
def test_the_ladder_and_the_chat_end_holding_the_same(contexts, new, steps, msg, turns):
    # the ladder: turn k starts decoding at contexts[k]: its message and the reply token fed back
    # fill the cache from the previous turn's end (context + new - 1 tokens) up to it
    ladder = gpu_perf.ladder_plan(list(contexts), new)
    assert ladder["turns"] == steps and ladder["prompt_lengths"] == steps[:1]
    assert steps[1] == contexts[1] - (contexts[0] + new - 1) - 1
    chat = gpu_perf.chat_plan(contexts[-1], turns, new)
    assert chat["turns"] == [msg] * turns and chat["prompt_lengths"] == [msg]
    single = {"prompt_lengths": [contexts[-1]], "new_tokens": new}  # one prompt of the longest context
    assert final_lengths(ladder) == final_lengths(chat) == final_lengths(single) == [chat["length"]]
    with pytest.raises(ValueError, match="must grow"):
        gpu_perf.ladder_plan([100, 120], 32)


def test_targets_and_errors_of_a_partial_result():
    res = {"engine_decode": {"rows": [{"cuda_graphs": True, "roofline_share": 0.8},
                                      {"cuda_graphs": True, "roofline_share": 0.69},
                                      {"cuda_graphs": False, "roofline_share": 0.1}]},
           "decode_vs_dense": {"rows": [{"paged_over_dense": 1.0}, {"paged_over_dense": None,
                                                                    "runs": {"sdpa": {"error": "OOM"}}}]},
           "mixed_batch": {"paged_over_dense_tok_s": 2.0,
                           "rows": [{"backend": "sdpa"}, {"backend": "paged", "kv_held_over_needed": 1.01}]}}
    got = {t["name"].split(" (")[0]: (t["value"], t["met"]) for t in gpu_perf.targets(res)}
    assert got == {"batch-1 decode / roofline": (0.69, False),  # the default (first) setting's lowest
                   "paged / dense decode ms per token": (None, False),  # a context did not run
                   "mixed batch, paged / dense tokens/s": (2.0, True),
                   "mixed batch, paged KV held / needed": (1.01, True)}
    assert gpu_perf.errors(res) == ["decode_vs_dense/rows[1]/runs/sdpa: OOM"]


def test_a_measurement_that_raises_is_recorded_and_the_rest_runs(monkeypatch):
    model = gpu_perf.build_model(CPU, "micro", torch.float32)
    real = gpu_perf.run_plan

    def run_plan(model, impl, plan, **kw):
        if impl == "sdpa":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real(model, impl, plan, **kw)

    monkeypatch.setattr(gpu_perf, "run_plan", run_plan)
    res = gpu_perf.mixed_batch(model, dict(gpu_perf.SIZES[True], mixed=(8, 40, 3)), lambda line: None)
    paged, dense = res["rows"]
    assert dense == {"backend": "sdpa",
                     "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 GiB"}
    assert paged["backend"] == "paged" and paged["tokens_per_s"] > 0 and res["paged_over_dense_tok_s"] is None


@pytest.fixture(scope="module")
def tiny():
    lines: list[str] = []
    res = gpu_perf.run(CPU, True, lines.append)
    return res, lines, gpu_perf.markdown(res)


def _finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in xs)


def test_tiny_run_is_complete_and_consistent(tiny):
    res, lines, _ = tiny
    size = gpu_perf.SIZES[True]
    assert res["passed"] and res["errors"] == [], res["errors"]
    assert set(res["section_s"]) == set(SECTIONS) and json.loads(json.dumps(res))["passed"]
    m = res["model"]
    assert (m["variant"], m["dtype"], m["page_size"]) == ("micro", "float32", 64)
    assert m["read_bandwidth_gbs"] > 0
    assert [t["name"] for t in res["targets"]] == [t["name"] for t in gpu_perf.targets({})]
    assert all(_finite(t["value"]) and isinstance(t["met"], bool) for t in res["targets"])

    dec = res["engine_decode"]
    assert [r["context"] for r in dec["rows"]] == list(size["contexts"])
    for r in dec["rows"]:
        assert _finite(r["ms_per_token"], r["ttft_ms"]) and r["ms_per_token"] > 0
        assert r["step_bytes"] == dec["weights_read_bytes"] + dec["kv_bytes_per_token"] * (
            r["context"] + size["new_tokens"] / 2)
        assert r["roofline_tok_s"] == pytest.approx(m["read_bandwidth_gbs"] * 1e9 / r["step_bytes"])
        assert r["roofline_share"] == pytest.approx(r["tokens_per_s"] / r["roofline_tok_s"])

    blocks = res["decode_blocks"]["rows"]  # both forms of the decode BlockMask: SDPA's result
    assert [r["context"] for r in blocks] == list(size["contexts"])
    for r in blocks:
        assert r["full_error"] < 1e-5 and r["partial_error"] < 1e-5, r
        assert _finite(r["full_us"], r["partial_us"], r["full_bandwidth_share"], r["partial_bandwidth_share"])

    vs, chat = res["decode_vs_dense"], res["chat"]
    assert [r["context"] for r in vs["rows"]] == list(size["contexts"])  # the ladder's turns
    msg = chat["message"]  # turn k of the chat holds k messages and k - 1 replies of `new` tokens
    assert [r["context"] for r in chat["rows"]] == [k * msg + (k - 1) * size["new_tokens"]
                                                    for k in range(1, size["chat_turns"] + 1)]
    for r in vs["rows"] + chat["rows"]:
        assert _finite(r["paged_ms"], r["sdpa_ms"], r["paged_ttft_ms"], r["sdpa_ttft_ms"])
        assert r["paged_over_dense"] == pytest.approx(r["paged_ms"] / r["sdpa_ms"])
    assert vs["paged"]["kernel"] == chat["paged"]["kernel"] == "cpp" and vs["sdpa"]["kernel"] == "sdpa"

    mixed, per_token = res["mixed_batch"], 2 * 2 * 2 * 16 * 4  # micro, fp32
    finals = [p + size["new_tokens"] - 1 for p in mixed["prompt_lengths"]]
    assert len(finals) == 16 and mixed["prompt_lengths"][::15] == [31, 500]
    paged, dense = (next(r for r in mixed["rows"] if r["backend"] == b) for b in ("paged", "sdpa"))
    for r in (paged, dense):
        assert _finite(r["ttft_ms"], r["ms_per_token_p50"], r["tokens_per_s"], r["peak_bytes"])
        assert r["kv_bytes_needed"] == sum(finals) * per_token
    assert paged["kv_bytes_held"] == sum(-(-n // 64) * 64 for n in finals) * per_token  # whole pages
    assert dense["kv_bytes_held"] == 16 * (max(finals) + 1) * per_token  # a row of the longest each
    assert mixed["paged_over_dense_tok_s"] == pytest.approx(paged["tokens_per_s"] / dense["tokens_per_s"])

    engine, hf = res["serving"]["rows"]
    assert (engine["system"], hf["system"]) == ("engine", "HF generate_batch")
    assert hf["output_tokens"] == size["serve_requests"] * size["serve_new"]  # HF made every token
    assert _finite(engine["output_tok_s"], hf["output_tok_s"]) and hf["transformers"]
    assert engine["over_hf"] == pytest.approx(engine["output_tok_s"] / hf["output_tok_s"])

    perf = [ln for ln in lines if ln.startswith("[perf]")]
    assert len(perf) == len(lines) == 1 + 3 + 3 + 3 + 2 + 4 + 2 + 1  # the model, one per measurement, the end


def test_tiny_markdown_has_every_table(tiny):
    res, _, md = tiny
    assert md.startswith("## Benchmarks (tiny dry run): ") and "passed" in md.splitlines()[0]
    assert res["environment"]["device_name"] in md
    for header in ("| target | value | wanted | met |", "| cuda_graphs | context | ms/token p50 |",
                   "| turn | context | dense TTFT ms | paged TTFT ms | dense ms/token p50 |",
                   "| backend | TTFT ms |", "| system | output tok/s | engine / HF |",
                   "| context | pool pages | full blocks us |"):
        assert header in md, header
    assert md.count("\n### ") == len(SECTIONS) and "| HF generate_batch |" in md and "| sdpa |" in md
    assert "wall time (s):" in md and "- error:" not in md


def test_an_interrupt_keeps_the_sections_done(monkeypatch):
    """The driver interrupts a stage past its budget (SIGINT): the sections measured so far are
    reported, the interrupted one says so, and the rest are not started."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_perf, "decode_vs_dense", interrupted)
    res = gpu_perf.run(CPU, True, lambda line: None)
    assert "rows" in res["engine_decode"] and "rows" in res["mixed_batch"]  # done before it
    assert res["decode_vs_dense"] == {"error": "interrupted: the stage's budget ran out"}
    assert "chat" not in res and "serving" not in res and not res["passed"]
