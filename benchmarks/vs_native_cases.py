"""`make bench-native`'s cases, shared by the driver (`vs_native`) and its report (`vs_native_report`):
the peers and how they run, the engine's dtypes and lookahead, the one-request workload and the targets.
"""

from __future__ import annotations

from benchmarks import REPO_ROOT

PEERS = {  # name -> (python, script, the dtypes it runs, what its jobs add)
    # llama.cpp keeps its own default KV cache type (f16) at every weight dtype: its CPU flash
    # attention has no fast bf16 path (a bf16 cache ran the default-model workload ~3x slower)
    "llama.cpp": (
        REPO_ROOT / ".venv-llamacpp" / "bin" / "python",
        REPO_ROOT / "scripts" / "peer_llamacpp.py",
        ("float32", "bfloat16", "float16"),
        {"kv_cache_dtype": "float16"},
    ),
    "OpenVINO GenAI": (
        REPO_ROOT / ".venv-openvino" / "bin" / "python",
        REPO_ROOT / "scripts" / "peer_openvino.py",
        ("float32", "bfloat16"),
        {},
    ),
}
ENGINE = "fms_paged"
ENGINE_DTYPES = ("bfloat16", "float16", "float32")
# the targets (issue: ahead of the native CPU engines): output tok/s against the best peer at its
# best dtype on each workload; one request's decode against the read roofline; start-up seconds
PEER_RATIO, ROOFLINE_SHARE, COLD_START_S, WARM_START_S = 1.0, 0.8, 10.0, 3.0
# the engine's lookahead decode steps in these runs (`Engine(decode_steps=...)`): its default,
# "auto" (up to 8 greedy steps in one call, as many as fit in 50 ms of decoding); an int (--decode-steps
# 8, or 1: a token per engine step) fixes them
DECODE_STEPS = "auto"
ONE_REQUEST = "SmolLM2-135M shape, 1 prompt of 64, 64 new"
