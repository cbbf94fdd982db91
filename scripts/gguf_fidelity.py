"""GGUF fidelity on a real model: the embedded default model (a trained 4-layer LLaMA) converted by
llama.cpp's own convert_hf_to_gguf.py and quantized by llama.cpp's own quantizer, then loaded by us.

    make peer-llamacpp      # .venv-llamacpp: llama-cpp-python and the llama.cpp sources it vendors
    .venv/bin/python scripts/gguf_fidelity.py [--out results/gguf-fidelity]

Per file type (F32, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0), on one prompt of real text: our logits
(fp32) against transformers' GGUF loader on the same file (both dequantize, then compute in fp32),
against the Hugging Face checkpoint in float64 (what quantization costs), and against llama.cpp's
own logits on the same file (it computes with an f16 KV cache and, for block types, int8 activations
in its dot products); greedy tokens (32) against the checkpoint's; our tokenizer built from the
file's vocabulary against llama.cpp's tokenization. Writes OUT/gguf_fidelity.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from fms_paged import generate, get_model, load_tokenizer
from fms_paged.models import default_model_path

LLAMACPP_PY = Path(".venv-llamacpp/bin/python")
TYPES = ("f32", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")
TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"

# run in .venv-llamacpp: quantize the F32 file to each block type, then each file's logits and the
# tokenization of TEXT by llama.cpp
_LLAMACPP = r"""
import ctypes, json, sys
import numpy as np, llama_cpp
work, types, text = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
ids = np.load(f"{work}/ids.npy").tolist()
for name in types:
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}", None)
    if name in ("f32", "bf16"):
        continue
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    assert llama_cpp.llama_model_quantize(f"{work}/f32.gguf".encode(), f"{work}/{name}.gguf".encode(),
                                          ctypes.byref(p)) == 0, name
out = {}
for name in types:
    m = llama_cpp.Llama(f"{work}/{name}.gguf", logits_all=True, verbose=False, n_ctx=512, n_threads=2)
    if name == "f32":
        out["tokens"] = m.tokenize(text.encode())
    m.eval(ids)
    np.save(f"{work}/llamacpp-{name}.npy", np.array(m.scores[: len(ids)], dtype=np.float32))
print(json.dumps(out))
"""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/gguf-fidelity"))
    args = ap.parse_args()
    if not LLAMACPP_PY.exists():
        print("gguf_fidelity: needs .venv-llamacpp (make peer-llamacpp)", file=sys.stderr)
        return 2
    vendored = "llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"
    convert = next(Path(".venv-llamacpp/src").glob(vendored))
    work = Path(tempfile.mkdtemp(prefix="gguf-fidelity-"))
    src = default_model_path()
    tok = load_tokenizer(src)
    ids = tok.encode(TEXT)
    np.save(work / "ids.npy", np.array(ids))
    for outtype in ("f32", "bf16"):
        subprocess.run([str(LLAMACPP_PY), str(convert), str(src), "--outtype", outtype, "--outfile",
                        str(work / f"{outtype}.gguf")], check=True, capture_output=True)
    done = subprocess.run([str(LLAMACPP_PY), "-c", _LLAMACPP, str(work), json.dumps(TYPES), TEXT], check=True,
                          capture_output=True, text=True)
    llamacpp = json.loads(done.stdout.strip().splitlines()[-1])

    checkpoint = get_model(model_path=src, device="cpu", dtype=torch.float64)
    x = torch.tensor([ids])
    with torch.no_grad():
        base = checkpoint(x)[0]
    want = generate(checkpoint, [ids], 32, eos_id=None)[0]
    rows = []
    for name in TYPES:
        file = work / f"{name}.gguf"
        t0 = time.perf_counter()
        # (dequantized: the comparison with transformers is for 32-bit activations; the Q8_0 / Q4_0
        # kernel's own int8 activations: scripts/gguf_blocks_ppl.py)
        ours_model = get_model(model_path=file, device="cpu", dtype=torch.float32, gguf_blocks=False)
        load_s = time.perf_counter() - t0
        theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(work), gguf_file=file.name, dtype=torch.float32).eval()
        with torch.no_grad():
            ours, theirs = ours_model(x)[0], theirs_model(x).logits[0]
        lc = torch.from_numpy(np.load(work / f"llamacpp-{name}.npy"))
        got = generate(ours_model, [ids], 32, eos_id=None)[0]
        rows.append({"type": name.upper(), "bytes": file.stat().st_size, "load_s": round(load_s, 3),
                     "rel_vs_transformers": rel(ours, theirs), "rel_vs_checkpoint_fp64": rel(ours, base),
                     "rel_vs_llamacpp": rel(ours, lc),
                     "argmax_equal_llamacpp": float((ours.argmax(-1) == lc.argmax(-1)).double().mean()),
                     "greedy_equal_checkpoint": sum(a == b for a, b in zip(got, want)) / len(want)})
    gguf_tok = load_tokenizer(work / "f32.gguf")
    result = {"prompt_tokens": len(ids), "rows": rows,
              "tokenizer_equal_llamacpp": gguf_tok.encode(TEXT) == llamacpp["tokens"],
              "tokenizer_equal_checkpoint": gguf_tok.encode(TEXT) == ids}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gguf_fidelity.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| file type | size (MB) | load (s) | ours vs transformers | ours vs checkpoint fp64 "
             "| ours vs llama.cpp | argmax = llama.cpp's | greedy 32 = checkpoint's |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['type']} | {r['bytes'] / 1e6:.1f} | {r['load_s']:.2f} "
                     f"| {r['rel_vs_transformers']:.1e} | {r['rel_vs_checkpoint_fp64']:.1e} "
                     f"| {r['rel_vs_llamacpp']:.1e} "
                     f"| {r['argmax_equal_llamacpp']:.0%} | {r['greedy_equal_checkpoint']:.0%} |")
    lines.append(f"\ntokenizer from the file = llama.cpp's tokens: {result['tokenizer_equal_llamacpp']}; "
                 f"= the checkpoint's sentencepiece: {result['tokenizer_equal_checkpoint']}")
    (args.out / "gguf_fidelity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
