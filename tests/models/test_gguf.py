"""GGUF files (llama.cpp's format) loaded by `get_model(model_path="x.gguf")`.

Each test writes its own tiny file with `gguf.GGUFWriter` as llama.cpp's converter would
(tests/gguf_files.py: its tensor names, its q/k row permutation for the llama architecture, Gemma's
norms stored as 1 + w, its metadata keys), random weights in each tensor type. Two references:

- float64: the file's dequantized tensors, put back in Hugging Face's layout and names with a
  config.json written by hand, loaded by our safetensors loader in float64. Our fp32 model of
  the GGUF computes the same sums in a different precision: max |diff| <= 1e-4 * max |logit|
  (fp32 rounding over two layers of width 256: ~1e-6 relative per op).
- transformers: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, which dequantizes the
  same file (the architectures it reads: llama, qwen2, qwen3, gemma2, gemma3). 1e-3 relative, the
  issue's bound: both compute in fp32, in different orders (its softmax, our fused norms).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from fms_paged import Engine, SamplingParams, generate, get_model  # noqa: E402
from fms_paged.models.families import CheckpointError  # noqa: E402
from fms_paged.models.gguf import SUPPORTED_TYPES, find_gguf, load_gguf  # noqa: E402
from fms_paged.tokenizers import gguf_tokenizer, gguf_tokenizer_cache, load_tokenizer  # noqa: E402
from tests.gguf_files import (  # noqa: E402
    CONFIGS,
    GEMMA,
    LLAMA3_SCALING,
    MIXED,
    D,
    Q,
    prompt_ids,
    reference_model,
    rel_err,
    write_gguf,
)

REF_REL, HF_REL = 1e-4, 1e-3
TRANSFORMERS_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")  # the ones transformers reads


def check_against_references(tmp_path, arch: str, kinds, use_transformers: bool, seed: int = 0):
    file = tmp_path / f"{arch}.gguf"
    ref = write_gguf(file, arch, kinds, seed)
    # (dequantized: the 1e-4 / 1e-3 bounds are for 32-bit activations; the Q8_0 / Q4_0 kernel's own
    # int8 activations are checked against this same dequantized model in test_gguf_blocks.py)
    model = get_model(model_path=file, device="cpu", dtype=torch.float32, gguf_blocks=False)
    assert model.config.family == arch
    ids = prompt_ids()
    with torch.no_grad():
        got = model(ids)
        want = reference_model(tmp_path, arch, ref)(ids)
    assert rel_err(got, want) <= REF_REL
    if use_transformers:
        transformers = pytest.importorskip("transformers")
        # what transformers does not read from a GGUF (Gemma's softmax scale, Qwen3's head_dim): given
        extra = {"query_pre_attn_scalar": D} if arch in GEMMA else {"head_dim": D} if arch == "qwen3" else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name,
                                                               dtype=torch.float32, **extra).eval()
        with torch.no_grad():
            theirs = hf(ids).logits
        assert rel_err(got, theirs) <= HF_REL
    return model, file


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_each_tensor_type_matches_references(qtype, tmp_path):
    """Every matrix of a llama model in one type: the float64 reference and transformers."""
    check_against_references(tmp_path, "llama", Q[qtype], use_transformers=True)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_each_architecture_matches_references(arch, tmp_path):
    """A Q4_K_M-like mix of types, on each architecture: its names, its q/k rows (permuted for
    llama and granite only), Gemma's 1 + w norms, soft-caps, windows, biases, q/k norms."""
    check_against_references(tmp_path, arch, MIXED, use_transformers=arch in TRANSFORMERS_ARCHS)


def test_llama31_rope_scaling_from_its_rope_freqs_tensor(tmp_path):
    """Llama 3.1's RoPE scaling, which llama.cpp stores as a `rope_freqs` tensor of divisors: read
    back as the llama3 rule's parameters, the float64 reference with that rope_scaling in its
    config.json."""
    file = tmp_path / "llama31.gguf"
    ref = write_gguf(file, "llama", Q.Q8_0, rope_scaling=LLAMA3_SCALING)
    model = get_model(model_path=file, device="cpu", dtype=torch.float32, gguf_blocks=False)
    assert model.config.rope_scaling == LLAMA3_SCALING
    ids = prompt_ids(40)
    reference = reference_model(tmp_path, "llama", ref, rope_scaling=LLAMA3_SCALING)
    with torch.no_grad():
        assert rel_err(model(ids), reference(ids)) <= REF_REL


def test_quantized_types_stay_close_to_the_weights_quantized():
    """gguf's own Q8_0 / Q4_0 round trip (the dequantizer both references share): within half a
    step of each block's scale (Q8_0: max|w|/127), plus the scale's own fp16 rounding (2^-11
    relative) times the largest code (127): 0.57 steps. Q4_0 (max|w|/8 a step) maps the block's
    extreme to -8 and clips the other sign's at +7: one step, plus fp16's share (8 * 2^-11)."""
    w = np.random.default_rng(0).normal(0, 0.05, (8, 256)).astype(np.float32)
    blocks = np.abs(w.reshape(8, 8, 32)).max(-1, keepdims=True)
    for qtype, step, bound in ((Q.Q8_0, blocks / 127, 0.57), (Q.Q4_0, blocks / 8, 1.01)):
        back = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(8, 8, 32)
        assert (np.abs(back - w.reshape(8, 8, 32)) <= step * bound).all(), qtype


# pages of the pool (the null page included): fewer than three requests of three pages hold, in
# one slice of every layer (Llama), or in a full and a sliding slice (Gemma 2)
POOL = {"llama": 8, "gemma2": 12}


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_paged_and_engine_give_the_dense_tokens(arch, tmp_path):
    """The paged model (the CPU kernel) of the dequantized weights gives the greedy tokens of the
    float64 reference; the Engine, on the file's blocks (the default: the qgemv kernel, int8
    activations, whose tokens may part from float64's at a near tie; its fidelity is
    test_gguf_blocks.py's), gives the paged blocks model's own tokens. The engine: three requests of
    30-31 tokens sharing a 16-token prefix (one page: prefix hits on Llama), 12 new tokens each (a
    third page), a pool too small for all three at their end (preemption), prefill chunks of 32
    tokens."""
    file = tmp_path / f"{arch}.gguf"
    ref = write_gguf(file, arch, MIXED)
    reference = reference_model(tmp_path, arch, ref)
    prefix = prompt_ids(16, 9)[0].tolist()
    prompts = [prefix + prompt_ids(14 + i % 2, i)[0].tolist() for i in range(3)]
    want = [generate(reference, [p], 12, eos_id=None)[0] for p in prompts]
    dequantized = get_model(model_path=file, device="cpu", dtype=torch.float32, attn_impl="paged",
                            page_size=16, gguf_blocks=False)
    assert generate(dequantized, prompts, 12, eos_id=None) == want
    paged = get_model(model_path=file, device="cpu", dtype=torch.float32, attn_impl="paged", page_size=16)
    want = generate(paged, prompts, 12, eos_id=None)
    eng = Engine(paged, max_num_seqs=3, max_num_batched_tokens=32, num_pages=POOL[arch], max_model_len=64,
                 compile=False, kernel="cpp")
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
    got: dict[int, list[int]] = {}
    for out in eng.stream():
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[i] for i in ids] == want
    m = eng.metrics()
    assert m["finished_requests"] == 3 and m["preemptions"] > 0, m
    # (Gemma 2's sliding layers have released the prefix's pages behind their 8-token window by the
    # time a preempted request comes back: no hit)
    assert (m["prefix_cache_hits"] > 0) == (arch == "llama"), m


def test_directory_with_one_gguf_and_default_dtype(tmp_path):
    """A directory holding one .gguf loads it; a file of block types loads in fp32, one of BF16
    matrices in bf16; two files in a directory are refused, naming them."""
    write_gguf(tmp_path / "a.gguf", "qwen3", Q.Q8_0)
    assert get_model(model_path=tmp_path, device="cpu").dtype == torch.float32
    write_gguf(tmp_path / "b.gguf", "qwen3", Q.BF16)
    assert get_model(model_path=tmp_path / "b.gguf", device="cpu").dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match=r"2 \.gguf files.*a\.gguf"):
        find_gguf(tmp_path)


def test_unsupported_type_is_refused_by_name(tmp_path):
    file = tmp_path / "q3_k.gguf"
    write_gguf(file, "llama", {**MIXED, "ffn_up": Q.Q3_K})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*Q3_K.*supported: F32, F16, BF16"):
        load_gguf(file)


def test_truncated_or_corrupt_file_names_the_tensor(tmp_path):
    file = tmp_path / "cut.gguf"
    write_gguf(file, "llama", MIXED)
    data = file.read_bytes()
    file.write_bytes(data[:-1000])  # the last tensor written is cut short
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.1\.ffn_norm\.weight'.*truncated"):
        get_model(model_path=file, device="cpu")
    file.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        get_model(model_path=file, device="cpu")


def test_tokenizer_from_the_file_matches_transformers(tmp_path):
    """`load_tokenizer(x.gguf)` encodes as transformers' tokenizer built from the same file, and
    the CLI's generate runs on the file."""
    transformers = pytest.importorskip("transformers")
    file = tmp_path / "tok.gguf"
    write_gguf(file, "llama", Q.Q8_0, tokenizer=True)
    tok = load_tokenizer(file)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    for text in ("the cat", "héllo, world!", " the the"):
        assert tok.encode(text) == theirs(text)["input_ids"]
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_id == theirs.eos_token_id == 258


def test_the_files_tokenizer_is_built_once_and_read_from_the_cache(tmp_path, monkeypatch):
    """The tokenizer built from a GGUF file is kept under $FMS_PAGED_CACHE_DIR/tokenizers and read
    from there the next time (transformers is not asked again), encoding as transformers does; a
    damaged entry is built again; a file rewritten in place (another modification time) gets an
    entry of its own."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("FMS_PAGED_CACHE_DIR", str(tmp_path / "cache"))
    file = tmp_path / "tok.gguf"
    write_gguf(file, "llama", Q.Q8_0, tokenizer=True)
    entry = gguf_tokenizer_cache(file)
    assert entry.parent == tmp_path / "cache" / "tokenizers" and not entry.exists()
    first = gguf_tokenizer(file)
    assert (entry / "tokenizer.json").is_file()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    with monkeypatch.context() as m:
        calls = []
        m.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a))
        again = gguf_tokenizer(file)  # (from the cache: the stand-in would return None)
        assert calls == []
    texts = ("the cat", "héllo, world!", " the the")
    for text in texts:
        assert again.encode(text) == first.encode(text) == theirs(text)["input_ids"]
    assert (again.bos_id, again.eos_id) == (first.bos_id, first.eos_id) == (theirs.bos_token_id, 258)
    (entry / "tokenizer.json").write_text("{")  # damaged: built again
    rebuilt = gguf_tokenizer(file)
    assert [rebuilt.encode(t) for t in texts] == [first.encode(t) for t in texts]
    assert json.loads((entry / "tokenizer.json").read_text())  # whole again
    os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))
    assert gguf_tokenizer_cache(file) != entry
