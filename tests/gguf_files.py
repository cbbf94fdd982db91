"""Tiny GGUF files written as llama.cpp's converter writes them (`write_gguf`), and the float64
reference of what they hold (`reference_model`), for the GGUF tests (tests/models/test_gguf.py,
the CLI's and the server's).

A file's tensors are random, in a tensor type: F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1
quantized by `gguf.quants.quantize`, Q4_K / Q5_K / Q6_K written as random blocks (gguf quantizes
none of them), under llama.cpp's names and metadata keys. What the file stores is the model: the
reference is the stored tensors dequantized and put back as the Hugging Face checkpoint they would have been
converted from (q/k rows un-permuted for the llama architectures, Gemma's norms stored as 1 + w
less 1), with a config.json written by hand, loaded by our safetensors loader in float64.
"""

from __future__ import annotations

import json

import gguf  # (the tests importing this module skip without it: pytest.importorskip("gguf") first)
import numpy as np
import torch
from safetensors.numpy import save_file

from fms_paged import get_model
from fms_paged.tokenizers import _gpt2_byte_decoder

Q = gguf.GGMLQuantizationType
H, HEADS, KV, D, FF, LAYERS = 256, 4, 2, 64, 512, 2  # K-quants' blocks are 256 wide
VOCAB = 260

# the HF config.json of each architecture's test model (what the GGUF metadata encodes)
BASE = dict(vocab_size=VOCAB, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
            num_hidden_layers=LAYERS, head_dim=D, intermediate_size=FF, rms_norm_eps=1e-5,
            rope_theta=10_000.0, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
CONFIGS = {
    "llama": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen2": dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1e6,
                  tie_word_embeddings=True),
    "qwen3": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "gemma2": dict(BASE, architectures=["Gemma2ForCausalLM"], model_type="gemma2", tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=D, sliding_window=8,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "full_attention"]),
    "gemma3": dict(BASE, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                   tie_word_embeddings=True,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=D, sliding_window=8,
                   rope_theta=1e6, rope_local_base_freq=10_000.0,
                   layer_types=["sliding_attention", "sliding_attention"]),
    "granite": dict(BASE, architectures=["GraniteForCausalLM"], model_type="granite",
                    embedding_multiplier=12.0,
                    attention_multiplier=0.05, residual_multiplier=0.3, logits_scaling=4.0),
}
GEMMA = ("gemma2", "gemma3")
# a Q4_K_M-like mix: embeddings Q6_K-ish (Q8_0), attention Q4_K, v and down Q6_K, up/gate Q5_K
MIXED = {"token_embd": Q.Q8_0, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K,
         "attn_output": Q.Q4_K, "ffn_gate": Q.Q5_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}


def hf_tensor_names(arch: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, HF name, HF shape) of each tensor of the arch's test model."""
    out = [("token_embd.weight", "model.embed_tokens.weight", (VOCAB, H)),
           ("output_norm.weight", "model.norm.weight", (H,))]
    if not CONFIGS[arch]["tie_word_embeddings"]:
        out.append(("output.weight", "lm_head.weight", (VOCAB, H)))
    for i in range(LAYERS):
        b, m = f"blk.{i}.", f"model.layers.{i}."
        out += [(b + "attn_norm.weight", m + "input_layernorm.weight", (H,)),
                (b + "attn_q.weight", m + "self_attn.q_proj.weight", (HEADS * D, H)),
                (b + "attn_k.weight", m + "self_attn.k_proj.weight", (KV * D, H)),
                (b + "attn_v.weight", m + "self_attn.v_proj.weight", (KV * D, H)),
                (b + "attn_output.weight", m + "self_attn.o_proj.weight", (H, HEADS * D)),
                (b + "ffn_gate.weight", m + "mlp.gate_proj.weight", (FF, H)),
                (b + "ffn_up.weight", m + "mlp.up_proj.weight", (FF, H)),
                (b + "ffn_down.weight", m + "mlp.down_proj.weight", (H, FF))]
        if arch == "qwen2":
            out += [(b + f"attn_{x}.bias", m + f"self_attn.{x}_proj.bias", (n * D,))
                    for x, n in (("q", HEADS), ("k", KV), ("v", KV))]
        if arch in ("qwen3", "gemma3"):
            out += [(b + f"attn_{x}_norm.weight", m + f"self_attn.{x}_norm.weight", (D,)) for x in "qk"]
        if arch in GEMMA:
            out += [(b + "post_attention_norm.weight", m + "post_attention_layernorm.weight", (H,)),
                    (b + "ffn_norm.weight", m + "pre_feedforward_layernorm.weight", (H,)),
                    (b + "post_ffw_norm.weight", m + "post_feedforward_layernorm.weight", (H,))]
        else:
            out.append((b + "ffn_norm.weight", m + "post_attention_layernorm.weight", (H,)))
    return out


def llamacpp_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's converter on llama q/k rows (HF's rotate-half halves ->
    interleaved pairs): a stored tensor back to the checkpoint's rows."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: eight 6-bit scales and mins [..., 8] -> the 12 bytes that hold them (sub-blocks 0-3
    in the low six bits of bytes j and j + 4, 4-7 in the nibbles of bytes 8-11 and the top two bits
    of bytes 0-7)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    out[..., 4:8] = m[..., :4] | (m[..., 4:] >> 4) << 6
    out[..., 8:12] = (sc[..., 4:] & 0x0F) | (m[..., 4:] & 0x0F) << 4
    return out


def random_blocks(qtype, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks [rows, bytes per row] of values ~N-like(0, 0.05), centred (Q4_K, Q5_K,
    Q6_K; another type's blocks are random bytes, for refusals): Q4_K / Q5_K with d = dmin, scales
    sc in [1, 8] ([1, 4]) and mins m = sc times the quants' middle (7.5, 15.5), so that d sc q - dmin m
    spreads around 0; Q6_K with random int8 scales (its q - 32 is centred). Centred values keep the
    test models' activations and attention scores of a real model's size: offsets as large as the
    values would make the logits hinge on near ties no kernel's rounding can keep."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return raw.reshape(rows, -1)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin (fp16) first, then the scales
        top, mid = (8, 7.5) if qtype == Q.Q4_K else (4, 15.5)
        d = rng.uniform(1.5e-3, 3e-3, (rows, cols // block, 1)).astype(np.float16)
        raw[..., 0:4] = np.concatenate([d, d], axis=-1).view(np.uint8)
        sc = rng.integers(1, top + 1, (rows, cols // block, 8))
        raw[..., 4:16] = k_scale_bytes(sc, np.round(sc * mid))
    else:  # Q6_K: d (fp16) last
        d = rng.uniform(1e-5, 3e-5, (rows, cols // block, 1)).astype(np.float16)
        raw[..., 208:210] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def encode(values: np.ndarray, qtype) -> np.ndarray:
    """fp32 values -> what GGUFWriter stores for `qtype` (block types: bytes)."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


# Llama 3.1's (with head_dim 64 and theta 1e4, wavelengths of 6 to 46,000 positions: some kept, some
# blended, some slowed)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def llama3_divisors(scaling: dict, theta: float) -> np.ndarray:
    """What llama.cpp's converter stores as `rope_freqs` for Llama 3.1's RoPE scaling: per frequency,
    the factor its inverse frequency is divided by (transformers' llama3 rule, in float64)."""
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    wavelen = 2 * np.pi / inv
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid)).astype(np.float32)


def write_gguf(path, arch: str, kinds, seed: int = 0, tokenizer: bool = False,
               rope_scaling: dict | None = None) -> dict[str, np.ndarray]:
    """A GGUF file of the arch's test model, matrices in `kinds` (one type, or a GGUF base name ->
    type map); returns the HF-named, HF-layout dequantized tensors (the float64 reference)."""
    cfg = CONFIGS[arch]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"test-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(VOCAB)
    if arch in GEMMA:
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "granite":
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if tokenizer:  # a GPT-2 style byte-level vocabulary: every byte a token, a few merges
        # GPT-2's byte-level alphabet, byte by byte (the inverse of the library's decoder)
        byte_chars = [c for c, _ in sorted(_gpt2_byte_decoder().items(), key=lambda cb: cb[1])]
        tokens = byte_chars + ["Ġt", "he", "<|endoftext|>"]
        tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        control = [t.startswith("<") and len(t) > 1 for t in tokens]
        w.add_token_types([gguf.TokenType.CONTROL if c else gguf.TokenType.NORMAL for c in control])
        w.add_token_merges(["Ġ t", "h e"])
        eos = tokens.index("<|endoftext|>")
        w.add_bos_token_id(eos)
        w.add_eos_token_id(eos)
    ref: dict[str, np.ndarray] = {}
    for gname, hname, shape in hf_tensor_names(arch):
        base = gname.split(".")[-2]
        qtype = Q.F32 if len(shape) == 1 else (kinds if not isinstance(kinds, dict) else kinds[base])
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K):  # (no quantizer in gguf)
            raw = random_blocks(qtype, shape, rng)
        else:
            values = rng.normal(0, 0.05, shape).astype(np.float32)
            if len(shape) == 1 and "norm" in gname:
                values = rng.uniform(0.8, 1.2, shape).astype(np.float32)
            raw = encode(values, qtype)
        w.add_tensor(gname, raw, raw_dtype=qtype)
        if qtype == Q.Q3_K:  # (random bytes for a refusal: no reference)
            continue
        stored = gguf.quants.dequantize(raw, qtype).reshape(shape).astype(np.float64)
        if arch in ("llama", "granite") and base in ("attn_q", "attn_k"):  # stored permuted
            stored = llamacpp_unpermute(stored, HEADS if base == "attn_q" else KV)
        if arch in GEMMA and gname.endswith("norm.weight"):  # stored as 1 + w
            stored = stored - 1.0
        ref[hname] = stored
    if rope_scaling is not None:  # Llama 3.1: a tensor of divisors, not metadata
        w.add_tensor("rope_freqs.weight", llama3_divisors(rope_scaling, cfg["rope_theta"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref



def reference_model(tmp_path, arch: str, ref: dict[str, np.ndarray], **config):
    """The float64 reference: the dequantized tensors as an HF checkpoint, loaded in float64."""
    d = tmp_path / f"ref-{arch}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**CONFIGS[arch], **config}))
    save_file({k: v.astype(np.float32) for k, v in ref.items()}, str(d / "model.safetensors"))
    return get_model(model_path=d, device="cpu", dtype=torch.float64)


def prompt_ids(n: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


