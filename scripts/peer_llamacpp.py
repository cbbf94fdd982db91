"""llama.cpp CPU peer for the benchmarks: run token-id requests through llama.cpp and write JSON.

    make peer-llamacpp                   # .venv-llamacpp: llama-cpp-python 0.3.36 built for this CPU
    .venv-llamacpp/bin/python scripts/peer_llamacpp.py IN.json OUT.json

IN.json: {"model_path" (a Hugging Face LLaMA checkpoint directory: config.json + *.safetensors, with
or without a tokenizer), "requests": [{"prompt": [ids], "max_new_tokens"}], "dtype" ("float32" |
"bfloat16" | "float16"), "max_num_seqs", "max_num_batched_tokens", "repeats" (default 1)} and
optionally "kv_cache_dtype" (default: dtype).
OUT.json: tokens (per request, greedy ids), duration_s, output_tokens, output_tok_s (the median of
output_tok_s_runs over the timed runs), durations_s, ttft_s (per request, from its run's start),
start_s (process start, read from /proc/self/stat, to the first generated token of the first run:
interpreter, imports, model load and that run's prefill; the GGUF step below excluded, as gguf_s),
load_s (model + context), gguf_s, runs_agree, settings, llama_cpp_version, threads.

Settings, and why:
- GGUF: model_path goes through llama.cpp's own convert_hf_to_gguf.py (from the sdist that `make
  peer-llamacpp` keeps in .venv-llamacpp/src/, run as a subprocess) at --outtype f32 / bf16 / f16 =
  dtype, cached under .venv-llamacpp/gguf/ by (sha256 of the checkpoint's files, outtype, llama-cpp
  version); a conversion, like the lookup's hashing, is left out of start_s.
- Tokenizer: the converter needs one, and a checkpoint may have none (our random-weight models). Then
  it converts a copy of the directory (weights symlinked) with a made-up Llama-style BPE
  tokenizer.json (byte fallback, no merges: the converter's "llama_hf" path, which needs no
  pre-tokenizer hash that only real tokenizers have) of exactly vocab_size tokens: <unk> <s> </s>,
  the 256 byte tokens, then fillers. Prompts are token ids and outputs are ids, so only the
  vocabulary's size matters. A tokenizer.json the converter rejects gets the same treatment.
- Low-level API (llama_batch / llama_decode), continuous batching as llama.cpp's server does it: one
  context with n_seq_max = max_num_seqs sequence slots; each llama_decode takes one token per
  decoding sequence, then prompt tokens of the sequences still prefilling, up to n_batch =
  n_ubatch = max_num_batched_tokens (prompts chunked at that budget; logits only at each prompt's
  last token and the decode tokens); greedy argmax of each output row, EOS ignored, so every
  request makes exactly max_new_tokens. Requests beyond max_num_seqs wait for a free slot (its KV
  removed with llama_memory_seq_rm).
- KV cache: kv_unified = false (llama.h's default and the server's with an explicit -np): a stream
  per slot, each n_ctx_seq = the longest prompt + max_new_tokens, rounded up to 256 as llama.cpp
  pads it, n_ctx = n_seq_max * n_ctx_seq. Its dtype is the model's (llama.cpp's own default is
  f16), so each dtype compares like for like with an engine that keeps KV in the model's dtype.
  A bf16 KV cache is a slow path of llama.cpp's CPU flash attention (~3x slower on the default
  model's 62..1000-token prompts than f16 KV); "kv_cache_dtype": "float16" gives llama.cpp's default.
- Flash attention: llama.cpp's default (LLAMA_FLASH_ATTN_TYPE_AUTO: on where the backend has it;
  the CPU does); the log line that says what it chose goes to settings["log"].
- n_threads = n_threads_batch = the cores in our affinity mask; mmap as llama.cpp defaults;
  llama.cpp's own log is kept out of stderr (PEER_LLAMACPP_VERBOSE=1 prints it).
- repeats > 1: one untimed warm-up run of the same requests first (the KV cleared between runs).
"""

import ctypes
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path


def _process_age() -> float:
    """Seconds since this process started (/proc/self/stat starttime against CLOCK_BOOTTIME)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return age if 0 <= age < 3600 else 0.0
    except (OSError, ValueError, IndexError):
        return 0.0


T0_AGE, T0 = _process_age(), time.perf_counter()


def since_process_start(t: float) -> float:
    return T0_AGE + (t - T0)


OUTTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
GGML_TYPE = {"float32": 0, "float16": 1, "bfloat16": 30}  # ggml.h: GGML_TYPE_F32 / F16 / BF16
CKPT_FILES = ("config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "model.safetensors.index.json")


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


# ---- HF checkpoint -> GGUF (cached) ------------------------------------------------------------


def checkpoint_hash(model_dir: Path) -> str:
    h = hashlib.sha256()
    files = [model_dir / n for n in CKPT_FILES] + sorted(model_dir.glob("*.safetensors"))
    for p in files:
        if p.is_file():
            h.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()


def converter() -> Path:
    ver = version("llama_cpp_python")
    path = Path(sys.prefix, "src", f"llama_cpp_python-{ver}", "vendor", "llama.cpp", "convert_hf_to_gguf.py")
    if not path.is_file():
        sys.exit(f"peer_llamacpp: no {path}; run `make peer-llamacpp`")
    return path


def synthetic_tokenizer(dst: Path, vocab_size: int) -> None:
    """A Llama-style BPE tokenizer.json (byte fallback, no merges) with exactly vocab_size tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    specials = ["<unk>", "<s>", "</s>"]
    if vocab_size < len(specials) + 256:
        raise ValueError(f"vocab_size {vocab_size} < {len(specials) + 256}: no room for the byte tokens")
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"\u2581t{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    tok.save(str(dst / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "model_max_length": 1 << 30}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))


def _convert(src: Path, out: Path, outtype: str, log: Path) -> bool:
    cmd = [sys.executable, str(converter()), str(src), "--outfile", str(out), "--outtype", outtype]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    return rc == 0 and out.is_file()


def gguf_for(model_dir: Path, dtype: str) -> tuple[Path, dict]:
    """The cached GGUF of model_dir at dtype, converting it first if needed; a .gguf file itself
    as it is (a file quantized by llama.cpp's own tools: dtype then sets the KV cache's alone)."""
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        return model_dir, {"gguf": str(model_dir), "given": True}
    outtype = OUTTYPE[dtype]
    cache = Path(sys.prefix) / "gguf"
    cache.mkdir(parents=True, exist_ok=True)
    key = f"{checkpoint_hash(model_dir)[:20]}-{outtype}-{version('llama_cpp_python')}"
    out, meta_path = cache / f"{key}.gguf", cache / f"{key}.json"
    if out.is_file() and meta_path.is_file():
        return out, {**json.loads(meta_path.read_text()), "cached": True}
    has_tok = (model_dir / "tokenizer.model").is_file() or (model_dir / "tokenizer.json").is_file()
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tmp, tmp_out, log = Path(tmp), Path(tmp) / "out.gguf", cache / f"{key}.log"
        tokenizer = "checkpoint"
        if not (has_tok and _convert(model_dir, tmp_out, outtype, log)):
            staged = tmp / "ckpt"  # a copy with a tokenizer of our own, weights symlinked
            staged.mkdir()
            for p in model_dir.iterdir():
                if p.is_file() and not p.name.startswith("tokenizer") and p.name not in (
                        "special_tokens_map.json", "added_tokens.json"):
                    (staged / p.name).symlink_to(p.resolve())
            vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
            synthetic_tokenizer(staged, vocab_size)
            tokenizer = "synthetic (vocab_size tokens; the checkpoint has none the converter takes)"
            if not _convert(staged, tmp_out, outtype, log):
                tail = log.read_text()[-3000:]
                sys.exit(f"peer_llamacpp: convert_hf_to_gguf.py failed, see {log}:\n{tail}")
        meta = {"gguf": str(out), "outtype": outtype, "tokenizer": tokenizer, "source": str(model_dir)}
        shutil.move(str(tmp_out), out)
        meta_path.write_text(json.dumps(meta))
    return out, {**meta, "cached": False}


# ---- llama.cpp: load, then continuous batching over llama_decode ---------------------------------


class Peer:
    def __init__(self, gguf: Path, cfg: dict, n_ctx_seq: int):
        import llama_cpp as L

        self.L, self.log = L, []

        @L.llama_log_callback
        def on_log(level, text, user_data):
            s = text.decode("utf-8", "replace")
            self.log.append(s)
            if os.environ.get("PEER_LLAMACPP_VERBOSE"):
                print(s, end="", file=sys.stderr)

        self._on_log = on_log  # keep the callback alive
        L.llama_log_set(on_log, ctypes.c_void_p(0))
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed: {''.join(self.log[-5:])}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_seq_max = int(cfg["max_num_seqs"])
        self.n_batch = int(cfg["max_num_batched_tokens"])
        if self.n_batch < self.n_seq_max:
            raise ValueError("max_num_batched_tokens < max_num_seqs: a step must fit every decode")
        kv = GGML_TYPE[cfg.get("kv_cache_dtype") or cfg.get("dtype", "float32")]
        self.threads = len(_cores())
        cp = L.llama_context_default_params()
        cp.n_ctx = self.n_seq_max * n_ctx_seq
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_seq_max = self.n_seq_max
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.type_k = cp.type_v = kv
        cp.kv_unified = False
        cp.no_perf = True
        self.ctx_params = {k: getattr(cp, k) for k in (
            "n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch",
            "flash_attn_type", "type_k", "type_v", "kv_unified", "offload_kqv")}
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed: {''.join(self.log[-5:])}")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)

    def run(self, reqs: list[dict]) -> dict:
        """All requests to completion; tokens, duration, per-request TTFT, first-token time."""
        import numpy as np

        L, b, n_batch = self.L, self.batch, self.n_batch
        L.llama_memory_clear(self.mem, True)
        waiting = list(range(len(reqs)))[::-1]
        free = list(range(self.n_seq_max))[::-1]
        tokens: list[list[int]] = [[] for _ in reqs]
        ttft: list[float | None] = [None] * len(reqs)
        running: dict[int, dict] = {}  # slot -> {"i", "done" (prompt tokens in the KV), "last"}
        first_token_at = None
        t0 = time.perf_counter()
        while waiting or running:
            while waiting and free:
                i = waiting.pop()
                if int(reqs[i]["max_new_tokens"]) > 0:
                    running[free.pop()] = {"i": i, "done": 0, "last": None}
            n, rows = 0, []  # rows: (batch index, slot) of the outputs to read
            for slot, st in running.items():  # decodes first: one token per sequence
                if st["last"] is not None:
                    pos = len(reqs[st["i"]]["prompt"]) + len(tokens[st["i"]]) - 1
                    self._add(n, st["last"], pos, slot, True)
                    rows.append((n, slot))
                    n += 1
            for slot, st in running.items():  # then prompt chunks, up to n_batch tokens
                prompt = reqs[st["i"]]["prompt"]
                if st["last"] is not None or n >= n_batch:
                    continue
                k = min(len(prompt) - st["done"], n_batch - n)
                for j in range(st["done"], st["done"] + k):
                    self._add(n, prompt[j], j, slot, j == len(prompt) - 1)
                    n += 1
                st["done"] += k
                if st["done"] == len(prompt):
                    rows.append((n - 1, slot))
            if n == 0:
                break
            b.n_tokens = n
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}: {''.join(self.log[-5:])}")
            now = time.perf_counter()
            for idx, slot in rows:
                logits = L.llama_get_logits_ith(self.ctx, idx)
                tok = int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())
                st = running[slot]
                i = st["i"]
                tokens[i].append(tok)
                if ttft[i] is None:
                    ttft[i] = now - t0
                    first_token_at = first_token_at or now
                st["last"] = tok
                if len(tokens[i]) >= int(reqs[i]["max_new_tokens"]):
                    del running[slot]
                    L.llama_memory_seq_rm(self.mem, slot, -1, -1)
                    free.append(slot)
        return {"tokens": tokens, "duration": time.perf_counter() - t0, "ttft": ttft, "first": first_token_at}

    def _add(self, n: int, tok: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        b.token[n] = tok
        b.pos[n] = pos
        b.n_seq_id[n] = 1
        b.seq_id[n][0] = seq
        b.logits[n] = logits


def main(in_path: str, out_path: str) -> None:
    with open(in_path) as f:
        cfg = json.load(f)
    reqs = cfg["requests"]
    dtype = cfg.get("dtype", "float32")
    if dtype not in OUTTYPE:
        sys.exit(f"peer_llamacpp: dtype {dtype!r}; expected one of {sorted(OUTTYPE)}")
    t = time.perf_counter()
    gguf, gguf_meta = gguf_for(Path(cfg["model_path"]).resolve(), dtype)
    gguf_s = time.perf_counter() - t

    t = time.perf_counter()
    import llama_cpp

    longest = max((len(r["prompt"]) + int(r["max_new_tokens"]) for r in reqs), default=1)
    peer = Peer(gguf, cfg, n_ctx_seq=-(-longest // 256) * 256)
    load_s = time.perf_counter() - t

    repeats = max(1, int(cfg.get("repeats", 1)))
    runs, first = [], None
    for k in range(repeats + (repeats > 1)):
        r = peer.run(reqs)
        first = first or r["first"]
        if repeats == 1 or k > 0:
            runs.append(r)
    n_out = sum(len(x) for x in runs[0]["tokens"])
    rates = [n_out / r["duration"] for r in runs]
    duration = statistics.median(r["duration"] for r in runs)
    median = min(runs, key=lambda r: abs(r["duration"] - duration))  # its tokens and TTFTs
    fa = [s.strip() for s in peer.log if "flash_attn" in s or "n_ctx_seq" in s or "auto_fa" in s
          or "Flash Attention" in s]
    result = {
        "tokens": median["tokens"],
        "duration_s": duration,
        "durations_s": [r["duration"] for r in runs],
        "output_tokens": n_out,
        "output_tok_s": statistics.median(rates),
        "output_tok_s_runs": rates,
        "ttft_s": median["ttft"],
        "start_s": since_process_start(first) - gguf_s if first else None,
        "load_s": load_s,
        "gguf_s": gguf_s,
        "runs_agree": all(r["tokens"] == runs[0]["tokens"] for r in runs),
        "llama_cpp_version": llama_cpp.__version__,
        "threads": peer.threads,
        "settings": {
            "dtype": dtype,
            "kv_cache_dtype": cfg.get("kv_cache_dtype") or dtype,
            "repeats": repeats,
            "warmup_run": repeats > 1,
            "context_params": peer.ctx_params,
            "cores": _cores(),
            "gguf": gguf_meta,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            "log": fa,
        },
    }
    if len(reqs) == 1:  # one request: its process's read bandwidth, beside its decode rate
        from peer_bandwidth import read_bandwidth_gbs

        result["process_read_gbs"] = read_bandwidth_gbs()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"peer_llamacpp: {n_out} tokens in {duration:.3f}s ({result['output_tok_s']:.1f} tok/s), "
        f"load {load_s:.2f}s, start {result['start_s']:.2f}s, gguf {gguf_s:.1f}s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: .venv-llamacpp/bin/python scripts/peer_llamacpp.py IN.json OUT.json")
    main(sys.argv[1], sys.argv[2])
