"""`fms-paged serve x.gguf`: a GGUF file (tests/gguf_files.py: a llama of Q4_K / Q5_K / Q6_K / Q8_0
tensors with a GPT-2 style vocabulary) served over HTTP gives the float64 reference's greedy
tokens, tokenized by the file's own vocabulary."""

from __future__ import annotations

import openai
import pytest

pytest.importorskip("gguf")

from fms_paged import generate, load_tokenizer  # noqa: E402
from tests.gguf_files import MIXED, reference_model, write_gguf  # noqa: E402


def test_serves_the_reference_tokens(serve, tmp_path):
    path = tmp_path / "tiny.gguf"
    reference = reference_model(tmp_path, "llama", write_gguf(path, "llama", MIXED, tokenizer=True))
    tok = load_tokenizer(path)
    server = serve(path, "--enforce-eager", "--max-num-seqs", "2")
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as client:
        for prompt in ("the cat", "hello there"):
            ids = tok.encode(prompt)
            want = generate(reference, [ids], 6, eos_id=None)[0]
            out = client.completions.create(model="tiny.gguf", prompt=prompt, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            # (ids, not text: random tokens end on part of a character, which the server holds back)
            assert out.model_extra["prompt_token_ids"] == ids
            assert out.choices[0].model_extra["token_ids"] == want
