"""`fms-paged` on a GGUF file, in a subprocess: `generate --model-path x.gguf` gives the float64
reference's greedy tokens (tests/gguf_files.py) on both backends and tokenizes text with the
file's own vocabulary; `info x.gguf` lists each layer's tensor formats."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("gguf")

from fms_paged import generate, load_tokenizer  # noqa: E402
from tests.gguf_files import MIXED, prompt_ids, reference_model, write_gguf  # noqa: E402


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "fms_paged.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """(a file with a tokenizer, the same weights in a file without one, the float64 reference)."""
    d = tmp_path_factory.mktemp("gguf")
    ref = write_gguf(d / "model.gguf", "llama", MIXED, tokenizer=True)
    bare = tmp_path_factory.mktemp("bare") / "model.gguf"
    write_gguf(bare, "llama", MIXED)  # (the same seed: the same weights)
    return d / "model.gguf", bare, reference_model(d, "llama", ref)


@pytest.mark.parametrize("impl", ["sdpa", "paged"])
def test_generate_gives_the_reference_tokens(gguf_file, impl):
    """A file without a tokenizer: token ids in and out."""
    _, path, reference = gguf_file
    prompt = prompt_ids(20)[0].tolist()
    r = run("generate", "--model-path", str(path), "--prompt-ids", " ".join(map(str, prompt)),
            "--max-new-tokens", "8", "--device", "cpu", "--attn-impl", impl)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(t) for t in generate(reference, [prompt], 8, eos_id=None)[0]]


def test_generate_text_with_the_files_tokenizer(gguf_file):
    path, _, reference = gguf_file
    tok = load_tokenizer(path)
    r = run("generate", "--model-path", str(path), "--prompt", "the cat", "--max-new-tokens", "6",
            "--device", "cpu")
    assert r.returncode == 0, r.stderr
    ids = tok.encode("the cat")
    want = generate(reference, [ids], 6, eos_id=tok.eos_id)[0]
    assert r.stdout.rstrip("\n") == "the cat" + tok.decode(want)


def test_info_lists_each_layers_formats(gguf_file):
    path, _, _ = gguf_file
    r = run("info", str(path), "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    model = json.loads(r.stdout)["model"]
    assert model["architecture"] == "llama"
    assert model["layer 1"].startswith("attn_norm F32, attn_q Q4_K, attn_k Q4_K, attn_v Q6_K, "
                                       "attn_output Q4_K, ffn_gate Q5_K")
    assert model["other"] == "token_embd Q8_0, output_norm F32, output Q6_K"
