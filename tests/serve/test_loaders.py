"""`fms-paged serve --loader`: the model built by IBM FMS (`--loader fms`) and served through our
paged attention op gives, over HTTP, the tokens our own model gives (the default model: a LLaMA
both load); "auto" picks ours for a family we load and FMS's for a decoder only FMS loads."""

from __future__ import annotations

import json

import openai
import pytest

from fms_paged import generate
from fms_paged.models.families import CheckpointError
from fms_paged.models.loaders import choose_loader

pytest.importorskip("fms", reason="ibm-fms is not installed (pip install 'fms_paged[fms]')")


def test_fms_loader_serves_our_tokens(serve, paged_model, tok):
    server = serve("--loader", "fms", "--enforce-eager", "--max-num-seqs", "2")
    prompts = ["def add(a, b):", "import os\nimport sys\n"]
    ids = [tok.encode(p) for p in prompts]
    want = generate(paged_model, ids, 10, eos_id=None)
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as client:
        for p, i, w in zip(prompts, ids, want):
            out = client.completions.create(model="default_model", prompt=p, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
            whole, head = tok.decode(i + w), tok.decode(i)
            assert out.choices[0].text == whole[len(head):]
            assert out.usage.completion_tokens == 10


def test_auto_picks_our_families_else_fms(tmp_path):
    from fms_paged.models import default_model_path

    assert choose_loader(default_model_path()) == "ours"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTBigCodeForCausalLM"],
                                                      "model_type": "gpt_bigcode"}))
    assert choose_loader(tmp_path) == "fms"
    assert choose_loader(tmp_path, "fms") == "fms"
    with pytest.raises(ValueError, match="loader='vllm'"):
        choose_loader(tmp_path, "vllm")
    with pytest.raises(CheckpointError, match="GPTBigCodeForCausalLM"):
        from fms_paged.models.loaders import load_for_engine

        load_for_engine(tmp_path, "ours", "cpu")
