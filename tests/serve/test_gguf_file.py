"""`fms-paged serve x.gguf`: a GGUF file (tests/gguf_files.py: a llama of Q4_K / Q5_K / Q6_K / Q8_0
tensors with a GPT-2 style vocabulary) served over HTTP gives the greedy tokens of the same file
loaded by `get_model` and run by dense `generate()` (the same quantized kernels, with the prompt
and each decode row as many rows a call, SDPA attention: no pages, no engine, no server),
tokenized by the file's own vocabulary; and their logits are the float64 reference's of the
dequantized weights within the quantized kernels' bound. (The tokens are not the float64
reference's: decode rows quantize their activations to int8, which on a random model can turn a
near tie.)"""

from __future__ import annotations

import openai
import pytest

pytest.importorskip("gguf")

import torch  # noqa: E402

from fms_paged import generate, get_model, load_tokenizer  # noqa: E402
from tests.gguf_files import MIXED, reference_model, rel_err, write_gguf  # noqa: E402

# the served model's logits against float64 of the dequantized weights: int8 activations on the
# decode rows (tests/models/test_gguf_blocks.py: MODEL_REL, measured 1.5-2.9% of the largest)
LOGITS_REL = 0.05


def test_serves_the_reference_tokens(serve, tmp_path):
    path = tmp_path / "tiny.gguf"
    reference = reference_model(tmp_path, "llama", write_gguf(path, "llama", MIXED, tokenizer=True))
    model = get_model(model_path=path, device="cpu")
    tok = load_tokenizer(path)
    server = serve(path, "--enforce-eager", "--max-num-seqs", "2")
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as client:
        for prompt in ("the cat", "hello there"):
            ids = tok.encode(prompt)
            want = generate(model, [ids], 6, eos_id=None)[0]
            with torch.inference_mode():
                seq = torch.tensor([ids + want])
                assert rel_err(model(seq)[0].double(), reference(seq)[0]) < LOGITS_REL
            out = client.completions.create(model="tiny.gguf", prompt=prompt, max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            # (ids, not text: random tokens end on part of a character, which the server holds back)
            assert out.model_extra["prompt_token_ids"] == ids
            assert out.choices[0].model_extra["token_ids"] == want
