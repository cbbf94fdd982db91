"""/v1/chat/completions on a tiny checkpoint built here: a random-weight `transformers`
LlamaForCausalLM, a byte-level BPE tokenizer.json trained on a few sentences, and a ChatML chat
template (with `bos_token`) in tokenizer_config.json. The prompt ids must be what `transformers`
makes of the same conversation (`apply_chat_template(..., tokenize=True)`), the tokens what
`generate()` makes of those ids, the log-probabilities the dense model's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from fms_paged import generate, get_model, load_tokenizer
from tests.conftest import make_hf_llama

NAME = "tiny-chat"
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{{ bos_token }}{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ["You are a helpful assistant.", "Hello there, how are you today?", "The quick brown fox jumps.",
          "Tell me about the weather in Zürich and 日本.", "def f(x):\n    return x + 1\n"]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello there!"},
            {"role": "assistant", "content": "Hi. How are you?"},
            {"role": "user", "content": "Tell me about Zürich, 日本 and the fox."}]
LOGPROB_ATOL = 1e-4  # fp32 paged vs dense round-off (see test_completions.py)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / NAME
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    # weights large enough that the next-token distribution is peaked (greedy without near-ties)
    hf = make_hf_llama(seed=0, vocab_size=tok.get_vocab_size(), bos_token_id=bos, eos_token_id=eos,
                       initializer_range=0.3)
    hf.save_pretrained(d, safe_serialization=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.fixture(scope="module")
def hf_tok(checkpoint):
    return PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", chat_template=CHATML)


def hf_chat_ids(hf_tok, messages, add_generation_prompt=True) -> list[int]:
    out = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def server(serve, checkpoint):
    return serve(checkpoint, "--enforce-eager", "--max-num-seqs", "2")


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as c:
        yield c


def test_tokenize_messages_equals_transformers(server, hf_tok):
    want = hf_chat_ids(hf_tok, MESSAGES)
    assert want[0] == hf_tok.bos_token_id and want.count(hf_tok.convert_tokens_to_ids("<|im_start|>")) == 5
    r = httpx.post(f"{server.url}/tokenize", json={"model": NAME, "messages": MESSAGES}).json()
    assert r["tokens"] == want and r["count"] == len(want)
    r = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    assert r.json()["tokens"] == hf_chat_ids(hf_tok, MESSAGES, add_generation_prompt=False)


def test_content_parts_are_joined_text(server, hf_tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                          {"type": "text", "text": "fox"}]}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": parts}).json()
    assert r["tokens"] == hf_chat_ids(hf_tok, [{"role": "user", "content": "Hello\nfox"}])
    image = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "image_url", "image_url": {"url": "http://x"}}]}]
    r = httpx.post(f"{server.v1}/chat/completions", json={"messages": image})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]"


def test_greedy_chat_equals_generate_on_the_template_ids(client, checkpoint, hf_tok):
    ids = hf_chat_ids(hf_tok, MESSAGES)
    paged = get_model(model_path=checkpoint, attn_impl="paged", device="cpu")
    (want,) = generate(paged, [ids], 10)
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.object == "chat.completion" and r.model == NAME
    (c,) = r.choices
    assert r.model_extra["prompt_token_ids"] == ids
    assert c.model_extra["token_ids"] == want
    assert c.message.role == "assistant"
    tok = load_tokenizer(checkpoint)
    whole, head = tok.decode(ids + want), tok.decode(ids)
    assert c.message.content == whole[len(head):]
    assert c.finish_reason == ("stop" if want[-1] == hf_tok.eos_token_id else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))


def test_chat_stream_equals_the_whole_response(client):
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and not first.delta.content
    body = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == whole.choices[0].message.content
    reasons = [ch.choices[0].finish_reason for ch in body if ch.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def token_bytes(hf_tok, token_id: int) -> bytes:
    """A byte-level BPE token's bytes (the inverse of GPT-2's byte -> printable-character map, as
    transformers spells it: an independent reference for the server's own map)."""
    decode = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decode[c] for c in hf_tok.convert_ids_to_tokens(token_id))


def test_chat_logprobs_equal_the_dense_model(client, checkpoint, hf_tok):
    ids = hf_chat_ids(hf_tok, MESSAGES)
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    out = c.model_extra["token_ids"]
    dense = get_model(model_path=checkpoint, attn_impl="sdpa", device="cpu")
    with torch.no_grad():
        ref = torch.log_softmax(dense(torch.tensor([ids + out]))[0].float(), -1)[len(ids) - 1 : -1]
    content = c.logprobs.content
    assert len(content) == len(out)
    special = set(hf_tok.all_special_ids)
    for j, (t, e) in enumerate(zip(out, content)):
        assert abs(e.logprob - ref[j, t].item()) <= LOGPROB_ATOL
        vals, idx = ref[j].topk(2)
        assert [a.logprob for a in e.top_logprobs] == pytest.approx(vals.tolist(), abs=LOGPROB_ATOL)
        if t not in special:  # OpenAI: `bytes` are the token's UTF-8 bytes, to be combined into text
            assert bytes(e.bytes) == token_bytes(hf_tok, t), (j, e.token, e.bytes)
        for a, i in zip(e.top_logprobs, idx.tolist()):
            if i not in special:
                assert bytes(a.bytes) == token_bytes(hf_tok, i)


def test_chat_n2_seeded_is_reproducible(client):
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=5, n=2)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in a.choices}


def test_logprob_tokens_of_a_byte_level_vocabulary_are_text(client, hf_tok):
    """A token that is whole characters is listed as those characters (a newline as "\\n", not as
    the vocabulary's printable stand-in "Ċ"), in completions and chat alike."""
    r = client.completions.create(model=NAME, prompt="Hello there,\nhow", max_tokens=12, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    named = 0
    for t, s in zip(c.model_extra["token_ids"], c.logprobs.tokens):
        try:
            want = token_bytes(hf_tok, t).decode("utf-8")
        except (UnicodeDecodeError, KeyError):  # part of a character, or a special token
            continue
        assert s == want, (t, s, want)
        named += 1
    assert named >= 3  # (the random model also samples bytes that are parts of characters)
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                       logprobs=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    for t, e in zip(r.choices[0].model_extra["token_ids"], r.choices[0].logprobs.content):
        try:
            want = token_bytes(hf_tok, t).decode("utf-8")
        except (UnicodeDecodeError, KeyError):
            continue
        assert e.token == want, (t, e.token, want)
