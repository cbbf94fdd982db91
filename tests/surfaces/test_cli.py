"""`fms-paged` end to end, in a subprocess, on the embedded default model: generate and ppl on the
test device (`--device`); `info` on the CPU (it reports the CPU's kernel and KV space)."""

import json
import subprocess
import sys

import pytest

from fms_paged import generate, get_model, load_tokenizer
from fms_paged.device import default_page_size
from fms_paged.models import default_model_path


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "fms_paged.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_matches_python_api(device):
    prompt = "def fibonacci(n):"
    r = run("generate", "--prompt", prompt, "--max-new-tokens", "12", "--attn-impl", "sdpa",
            "--device", str(device))
    assert r.returncode == 0, r.stderr
    tok = load_tokenizer(default_model_path())
    ref = generate(get_model(device=device), [tok.encode(prompt)], 12)[0]
    assert r.stdout.rstrip("\n") == prompt + tok.decode(ref)


def test_generate_stream_paged_equals_dense(device):
    args = ["--prompt", "import os", "--max-new-tokens", "10", "--device", str(device), "--stream"]
    paged = run("generate", *args, "--attn-impl", "paged")
    dense = run("generate", *args, "--attn-impl", "sdpa")
    assert paged.returncode == 0 and dense.returncode == 0, paged.stderr + dense.stderr
    assert paged.stdout == dense.stdout and paged.stdout.startswith("import os")


def test_generate_prompt_ids_on_variant(device):
    r = run("generate", "--variant", "micro", "--prompt-ids", "1 2 3", "--max-new-tokens", "4",
            "--device", str(device))
    assert r.returncode == 0, r.stderr
    ref = generate(get_model(variant="micro", device=device), [[1, 2, 3]], 4)[0]
    assert r.stdout.split() == [str(t) for t in ref]
    compiled = run("generate", "--variant", "micro", "--prompt-ids", "1 2 3", "--max-new-tokens", "4",
                   "--device", str(device), "--compile")
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == r.stdout  # the compiled decode step gives the same tokens


def test_generate_quantized_matches_python_api():
    """--quantization / --quantization-group-size reach get_model: the CLI's tokens are those of the
    Python API's quantized model (CPU: ATen's CPU kernels)."""
    args = ["--variant", "micro", "--prompt-ids", "1 2 3", "--max-new-tokens", "4", "--device", "cpu"]
    r = run("generate", *args, "--quantization", "int4", "--quantization-group-size", "32")
    assert r.returncode == 0, r.stderr
    model = get_model(variant="micro", device="cpu", quantization="int4", quantization_group_size=32)
    assert r.stdout.split() == [str(t) for t in generate(model, [[1, 2, 3]], 4)[0]]


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_generate_a_family_checkpoint(family, hf_family, device):
    """`--model-path` of another family (a checkpoint without a tokenizer: token ids in and out) on
    the paged engine: transformers' greedy tokens."""
    import torch

    hf, path = hf_family(family)
    prompt = list(range(3, 43))  # past the 24-token window
    r = run("generate", "--model-path", str(path), "--prompt-ids", " ".join(map(str, prompt)),
            "--max-new-tokens", "8", "--device", str(device))
    assert r.returncode == 0, r.stderr
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):]
    assert r.stdout.split() == [str(t) for t in ref.tolist()]


def test_ppl_both_backends_agree(device):
    r = run("ppl", "--max-chars", "3000", "--device", str(device))
    assert r.returncode == 0, r.stderr
    ppl = {line.split()[0]: float(line.split()[2]) for line in r.stdout.splitlines()
           if " ppl " in line}
    assert set(ppl) == {"sdpa", "paged"}
    assert abs(ppl["paged"] - ppl["sdpa"]) / ppl["sdpa"] <= 1e-5
    assert 1 < ppl["sdpa"] < 4096


def test_ppl_of_a_saved_dataset_is_that_of_its_text_in_a_file(tmp_path, device):
    """`--dataset FOLDER` (saved with `save_to_disk` here: nothing downloads) scores its text column's
    rows joined by blank lines: the very numbers `--text-file` gives for that text."""
    datasets = pytest.importorskip("datasets")
    rows = [" = Robert Boulter = \n", "", " Robert Boulter is an English film , television and theatre "
            "actor .\n", " He had a guest @-@ starring role on the television series The Bill in 2000 .\n"]
    datasets.Dataset.from_dict({"content": rows}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "rows.txt").write_text("\n\n".join(rows), encoding="utf-8")
    common = ["ppl", "--max-chars", "3000", "--window", "32", "--device", str(device)]
    by_dataset = run(*common, "--dataset", str(tmp_path / "saved"), "--text-column", "content")
    by_file = run(*common, "--text-file", str(tmp_path / "rows.txt"))
    assert by_dataset.returncode == 0, by_dataset.stderr
    assert by_file.returncode == 0, by_file.stderr
    assert by_dataset.stdout == by_file.stdout and " ppl " in by_dataset.stdout
    missing = run("ppl", "--dataset", str(tmp_path / "saved"))  # the default column, "text"
    assert missing.returncode == 2
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "'text'" in lines[0] and "['content']" in lines[0], missing.stderr


def test_info_json():
    r = run("info", "--json", "--device", "cpu")  # the CPU's kernel (cpp) and KV space
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["device"] == "cpu" and "torch" in info
    from fms_paged.models.families import supported_architectures

    listed = " ".join(info["architectures"].values())
    assert all(a in listed for a in supported_architectures())  # every checkpoint class we load
    assert info["cpp_kernel_available"] and info["paged_kernel"].startswith("cpp")  # the CPU default
    pool = info["kv_pool"]  # the engine's pool: its KV space over K+V bytes of one page
    assert pool["num_pages"] == pool["kv_bytes"] // pool["page_bytes"]
    P = info["default_model"]["page_size"]
    assert P == default_page_size("cpu")
    assert pool["page_bytes"] == 2 * 4 * 2 * 32 * P * 4  # 4 layers, 2 kv heads, head_dim 32, fp32


def test_bench_help():
    r = run("bench", "--help")
    assert r.returncode == 0 and "--scenario" in r.stdout


@pytest.mark.parametrize("args, name", [
    (["generate", "--prompt", "x", "--max-new-tokens", "zero"], "--max-new-tokens"),
    (["generate", "--prompt", "x", "--attn-impl", "flash"], "--attn-impl"),
    (["generate", "--prompt-ids", "1 two", "--device", "cpu"], "--prompt-ids"),
    (["generate", "--max-new-tokens", "3"], "--prompt"),
    (["ppl", "--window", "-3"], "--window"),
    (["generate", "--prompt", "x", "--device", "tpu"], "device"),
    (["teleport"], "teleport"),
    (["bench", "--nlayers", "2"], "--nlayers"),  # only with --variant
    (["generate", "--variant", "micro", "--prompt-ids", "1", "--device", "cpu", "--quantization", "int4"],
     "does not divide"),  # int4's default group 128 > micro's width 64
])
def test_bad_arguments_exit_2_with_one_line(args, name):
    r = run(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0], r.stderr
