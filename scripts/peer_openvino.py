"""OpenVINO GenAI CPU peer for the serving benchmark: run token-id requests through its
ContinuousBatchingPipeline and write JSON.

    make peer-openvino                   # .venv-openvino: openvino-genai 2026.4.1.0 + optimum-intel 2.2.0
    .venv-openvino/bin/python scripts/peer_openvino.py IN.json OUT.json

IN.json: {"model_path" (a Hugging Face LLaMA checkpoint: config.json + *.safetensors), "requests":
[{"prompt": [ids], "max_new_tokens"}], "dtype" ("float32" | "bfloat16" | "float16"), "max_num_seqs",
"max_num_batched_tokens", "repeats"} and optionally "kv_space_gib" (KV cache, whole GiB; default:
what the requests need, at least 1) and "model_cache" (default false: OpenVINO's CACHE_DIR).
OUT.json: tokens (greedy ids per request), duration_s and ttft_s (the median run), output_tokens,
output_tok_s (median of the timed runs), output_tok_s_runs, durations_s, tokens_equal_runs,
start_s, load_s, warmup_s, prepare_s, ir_cached, settings, openvino_version, threads.

Settings, and why:
- The checkpoint goes to OpenVINO IR through optimum-intel's own exporter (`optimum-cli export
  openvino --task text-generation-with-past`, a subprocess), cached under <this venv>/ir/ by
  (sha256 of config.json + safetensors, weight format): fp32 for float32 and bfloat16 (the exporter
  has no bf16; the CPU plugin casts the fp32 weights once, at compile), fp16 for float16.
- Tokenizer: prompts and outputs are token ids, so only the vocabulary size matters. The exporter
  reads a copy of the checkpoint (links to its config and weights) holding a byte-level BPE
  tokenizer.json made here with exactly vocab_size tokens (256 bytes, pairs of them, <|endoftext|>),
  whatever the checkpoint ships: none (random-weight models) or a sentencepiece tokenizer.model
  (which the exporter could only read with the sentencepiece package).
- Precision: INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION (+ KEY_/VALUE_CACHE_PRECISION) are
  the dtype's (f32 | bf16 | f16): the CPU plugin's defaults are bf16 compute on AVX512-BF16/AMX
  CPUs and a u8-quantised KV cache. DYNAMIC_QUANTIZATION_GROUP_SIZE=0: no int8 activations.
  float16 runs only where the plugin lists FP16 in OPTIMIZATION_CAPABILITIES (AMX-FP16 CPUs; on
  an AVX512-BF16 EPYC it silently computes in bf16), else the script refuses: OUT.json {"error"}, exit 2.
- INFERENCE_NUM_THREADS = the cores in our affinity mask; one stream (the CPU plugin's default).
- SchedulerConfig: max_num_seqs / max_num_batched_tokens as given, dynamic_split_fuse (its
  default: chunked prefill mixed with decodes, as vLLM), prefix caching off, cache_size as above.
- Requests: add_request(id, ov.Tensor of the prompt ids, GenerationConfig) then step() until done;
  greedy (do_sample=False) with ignore_eos, so each makes exactly max_new_tokens.
- Runs: the first is a warm-up (untimed) unless repeats is 1; `repeats` timed runs, the median
  (by output tok/s) reported. start_s: from this process's start (/proc/self/stat) to the first
  generated token of the first run, less prepare_s (hashing the checkpoint, and exporting it when
  the IR is not cached yet): imports, compile/load (load_s) and the prefill are in it.
- No CACHE_DIR unless model_cache is true (then <this venv>/ov-cache): on the CPU a cached blob
  holds a copy of the weights, which a start reads back (and hashes the model to find), while without
  it the plugin compiles in well under a second, mapping the IR's weights as they are (fp32): with it
  SmolLM2's start was 0.2-0.5 s slower, warm or cold, on a 2-core EPYC.
"""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time


def _process_age_s() -> float:
    """Seconds since this process started (field 22 of /proc/self/stat: clock ticks after boot)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")


T_PROCESS = time.perf_counter() - _process_age_s()  # the process's start on the perf_counter clock

HINTS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
WEIGHT_FORMAT = {"float32": "fp32", "bfloat16": "fp32", "float16": "fp16"}
CAPABILITY = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}
WEIGHT_FILES = (".safetensors", ".safetensors.index.json")


def checkpoint_hash(path: str) -> str:
    """sha256 over config.json and the weight files (names and contents)."""
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(path) if n == "config.json" or n.endswith(WEIGHT_FILES))
    for name in names:
        h.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def write_tokenizer(dst: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json with exactly vocab_size tokens: the 256 byte symbols, then
    merges of two of them, then (past 65,792) fillers no text maps to, and last a special
    <|endoftext|> (OpenVINO's tokenizer converter wants merges and a special token). Only its size
    matters: prompts are token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    size = vocab_size - 1  # the special token takes the last id
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())[:size]
    vocab = {s: i for i, s in enumerate(symbols)}
    pairs = ((a, b) for a in symbols for b in symbols)
    merges = [next(pairs) for _ in range(min(size - len(vocab), len(symbols) ** 2))]
    vocab.update({a + b: len(symbols) + i for i, (a, b) in enumerate(merges)})
    vocab.update({f"<|id_{i}|>": i for i in range(len(vocab), size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    assert tok.get_vocab_size() == vocab_size
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
                   "eos_token": "<|endoftext|>"}, f)


def export_ir(model_path: str, weight_format: str, ir_root: str) -> tuple[str, bool]:
    """The cached IR directory for this checkpoint and weight format -> (dir, was it cached)."""
    import openvino

    key = f"{checkpoint_hash(model_path)[:20]}-{weight_format}-ov{openvino.__version__.split('-')[0]}"
    out = os.path.join(ir_root, key)
    if os.path.exists(os.path.join(out, "openvino_model.xml")):
        return out, True
    os.makedirs(ir_root, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ir_root, prefix=".export-") as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        for name in os.listdir(model_path):  # config and weights only: our tokenizer, not theirs
            if name in ("config.json", "generation_config.json") or name.endswith(WEIGHT_FILES):
                os.symlink(os.path.abspath(os.path.join(model_path, name)), os.path.join(src, name))
        with open(os.path.join(model_path, "config.json")) as f:
            write_tokenizer(src, int(json.load(f)["vocab_size"]))
        cli = os.path.join(os.path.dirname(sys.executable), "optimum-cli")
        cmd = [cli, "export", "openvino", "--model", src, "--task", "text-generation-with-past",
               "--weight-format", weight_format, os.path.join(tmp, "ir")]
        log = os.path.join(tmp, "ir", "export.log")
        os.makedirs(os.path.dirname(log))
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0 or not os.path.exists(os.path.join(tmp, "ir", "openvino_model.xml")):
            with open(log) as f:
                sys.stderr.write(f.read()[-4000:])
            raise RuntimeError(f"optimum-cli export failed (exit {rc}): {' '.join(cmd)}")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(os.path.join(tmp, "ir"), out)
    return out, False


def kv_bytes_per_token(model_path: str, elem_bytes: int) -> int:
    with open(os.path.join(model_path, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * elem_bytes


def run_requests(pipe, reqs: list[dict], gcs: list, first_id: int, ov, np) -> dict:
    """All requests added at once, then step() until none is left -> tokens, duration, TTFTs."""
    n = len(reqs)
    tokens: list[list[int]] = [[] for _ in range(n)]
    first: list[float | None] = [None] * n
    t0 = time.perf_counter()
    handles = [pipe.add_request(first_id + i, ov.Tensor(np.asarray([r["prompt"]], dtype=np.int64)), gcs[i])
               for i, r in enumerate(reqs)]

    def drain(now: float) -> None:
        for i, h in enumerate(handles):
            if h.can_read():
                for out in h.read().values():
                    tokens[i].extend(out.generated_ids)
                if first[i] is None and tokens[i]:
                    first[i] = now

    while pipe.has_non_finished_requests():
        pipe.step()
        drain(time.perf_counter())
    t1 = time.perf_counter()
    drain(t1)
    for i, r in enumerate(reqs):
        if len(tokens[i]) != int(r["max_new_tokens"]):
            raise RuntimeError(f"request {i}: {len(tokens[i])} tokens, expected {r['max_new_tokens']}")
    return {"tokens": tokens, "t0": t0, "duration_s": t1 - t0, "ttft_s": [f - t0 for f in first],
            "first_token": min(first)}


def main(in_path: str, out_path: str) -> int:
    with open(in_path) as f:
        cfg = json.load(f)
    dtype = cfg.get("dtype", "float32")
    if dtype not in HINTS:
        raise ValueError(f"dtype {dtype!r}; expected one of {sorted(HINTS)}")
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    caps = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    if CAPABILITY[dtype] not in caps:
        err = f"the OpenVINO CPU plugin does not run {dtype} here (capabilities {caps}): it would fall back"
        with open(out_path, "w") as f:
            json.dump({"error": err, "openvino_version": ov.__version__}, f, indent=1)
        print(f"peer_openvino: {err}", file=sys.stderr)
        return 2

    t = time.perf_counter()
    model_path, weight_format = cfg["model_path"], WEIGHT_FORMAT[dtype]
    ir_dir, ir_cached = export_ir(model_path, weight_format, os.path.join(sys.prefix, "ir"))
    prepare_s = time.perf_counter() - t

    reqs = cfg["requests"]
    threads = len(os.sched_getaffinity(0))
    hint = HINTS[dtype]
    props: dict = {
        "INFERENCE_PRECISION_HINT": hint,
        "KV_CACHE_PRECISION": hint,
        "KEY_CACHE_PRECISION": hint,
        "VALUE_CACHE_PRECISION": hint,
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
        "INFERENCE_NUM_THREADS": threads,
    }
    if cfg.get("model_cache", False):
        props["CACHE_DIR"] = os.path.join(sys.prefix, "ov-cache")
    kv_tokens = sum(len(r["prompt"]) + int(r["max_new_tokens"]) for r in reqs)
    need_gib = kv_tokens * kv_bytes_per_token(model_path, 4 if hint == "f32" else 2) * 1.25 / 2**30
    sched = ov_genai.SchedulerConfig()
    sched.max_num_seqs = int(cfg["max_num_seqs"])
    sched.max_num_batched_tokens = int(cfg["max_num_batched_tokens"])
    sched.cache_size = max(1, math.ceil(float(cfg.get("kv_space_gib") or need_gib)))  # GiB
    sched.enable_prefix_caching = False  # dynamic_split_fuse: its default (True)

    t = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(ir_dir, sched, "CPU", props)
    load_s = time.perf_counter() - t

    gcs = []
    for r in reqs:
        gc = ov_genai.GenerationConfig()
        gc.max_new_tokens = int(r["max_new_tokens"])
        gc.do_sample = False
        gc.ignore_eos = True
        gcs.append(gc)

    repeats = int(cfg.get("repeats", 1))
    next_id, runs, warmup_s = 0, [], None
    first_run = None
    if repeats > 1:  # warm-up: the same workload, untimed
        first_run = run_requests(pipe, reqs, gcs, next_id, ov, np)
        next_id += len(reqs)
        warmup_s = first_run["duration_s"]
    for _ in range(repeats):
        run = run_requests(pipe, reqs, gcs, next_id, ov, np)
        next_id += len(reqs)
        run["output_tok_s"] = sum(map(len, run["tokens"])) / run["duration_s"]
        runs.append(run)
        first_run = first_run or run
    start_s = first_run["first_token"] - T_PROCESS - prepare_s

    mid = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    n_out = sum(map(len, mid["tokens"]))
    settings = {
        "device": "CPU",
        "ir_dir": ir_dir,
        "weight_format": weight_format,
        "properties": props,
        "scheduler": {k: getattr(sched, k) for k in ("max_num_seqs", "max_num_batched_tokens", "cache_size",
                                                     "dynamic_split_fuse", "enable_prefix_caching")},
        "optimization_capabilities": list(caps),
        "openvino_genai_version": ov_genai.__version__,
    }
    result = {
        "tokens": mid["tokens"],
        "duration_s": mid["duration_s"],
        "output_tokens": n_out,
        "output_tok_s": mid["output_tok_s"],
        "output_tok_s_runs": [r["output_tok_s"] for r in runs],
        "durations_s": [r["duration_s"] for r in runs],
        "tokens_equal_runs": all(r["tokens"] == runs[0]["tokens"] for r in runs),
        "ttft_s": mid["ttft_s"],
        "start_s": start_s,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "prepare_s": prepare_s,
        "ir_cached": ir_cached,
        "settings": settings,
        "openvino_version": ov.__version__,
        "threads": threads,
        "mode": "offline",
    }
    if len(reqs) == 1:  # one request: its process's read bandwidth, beside its decode rate
        from peer_bandwidth import read_bandwidth_gbs

        result["process_read_gbs"] = read_bandwidth_gbs()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"peer_openvino: {n_out} tokens in {mid['duration_s']:.3f}s ({mid['output_tok_s']:.1f} tok/s, "
        f"median of {len(runs)}: {', '.join(f'{x:.1f}' for x in result['output_tok_s_runs'])}), "
        f"start {start_s:.1f}s (load {load_s:.1f}s), "
        f"IR {'cached' if ir_cached else 'exported'} in {prepare_s:.1f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: .venv-openvino/bin/python scripts/peer_openvino.py IN.json OUT.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))
