"""/v1/completions through the official `openai` client against `fms-paged serve` on the default
model, on one rank and split over two (`--tensor-parallel-size 2`), each answer compared with an
independent reference in this process: `fms_paged.generate()` for the tokens, the tokenizer for
the text, the dense (SDPA) model's log-softmax for logprobs. Also the small routes (/tokenize,
/detokenize, /version, /v1/models) as vLLM shapes them."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

import fms_paged
from fms_paged import generate

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
           "Hello world, the end."]
MAX_TOKENS = 12
MODEL = "default_model"
# fp32 log-probabilities of the paged engine (cpp kernel, chunked prefill, paged K/V) against one
# dense SDPA forward: the same math in another order, so they differ by fp32 round-off of the
# logits (~1e-6 relative to logits of O(10)) carried through log_softmax; 1e-4 absolute leaves
# room for that and is far below any real difference (a wrong position or token: O(0.1..10))
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(serve, request):
    """The server on one rank, and split over two (`--tensor-parallel-size 2`: every test of this
    module against the same references)."""
    return serve("--enforce-eager", "--max-num-seqs", "4", "--tensor-parallel-size", request.param)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def greedy(paged_model, tok):
    """prompt text -> (prompt ids, greedy output ids of generate(), stopping at EOS)."""
    ids = [tok.encode(p) for p in PROMPTS]
    outs = generate(paged_model, ids, MAX_TOKENS)
    return {p: (i, o) for p, i, o in zip(PROMPTS, ids, outs)}


def text_of(tok, prompt_ids, out_ids) -> str:
    """The text `out_ids` add after the prompt (its leading space kept: see test_text.py)."""
    whole, head = tok.decode(prompt_ids + out_ids), tok.decode(prompt_ids)
    assert whole.startswith(head)
    return whole[len(head):]


def extra(obj, name):
    """A field outside OpenAI's schema (vLLM's extensions), as the client keeps it."""
    return (obj.model_extra or {}).get(name)


def finish_of(out_ids, eos: int) -> str:
    return "stop" if out_ids and out_ids[-1] == eos else "length"


# ------------------------------------------------------------------ greedy == generate()
def test_greedy_batch_of_text_prompts_equals_generate(client, greedy, tok):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.object == "text_completion" and r.model == MODEL
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    assert extra(r, "prompt_token_ids") == [greedy[p][0] for p in PROMPTS]
    for p, c in zip(PROMPTS, r.choices):
        ids, want = greedy[p]
        assert extra(c, "token_ids") == want, p
        assert c.text == text_of(tok, ids, want)
        assert c.finish_reason == finish_of(want, tok.eos_id)
    assert r.usage.prompt_tokens == sum(len(greedy[p][0]) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(len(greedy[p][1]) for p in PROMPTS)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("p", PROMPTS[:2])
def test_greedy_token_id_prompt_equals_generate(client, greedy, tok, p):
    ids, want = greedy[p]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True})
    (c,) = r.choices
    assert extra(r, "prompt_token_ids") == ids
    assert extra(c, "token_ids") == want
    assert c.text == text_of(tok, ids, want)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)


def test_token_id_prompts_in_a_batch_with_n(client, greedy):
    """A batch of id lists with n=2 (greedy: both completions alike): choice j * n + i."""
    ids = [greedy[p][0] for p in PROMPTS[:2]]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, n=2,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    got = [extra(c, "token_ids") for c in r.choices]
    assert got == [greedy[PROMPTS[0]][1]] * 2 + [greedy[PROMPTS[1]][1]] * 2


def test_echo_prepends_the_prompt(client, greedy, tok):
    p = PROMPTS[0]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert r.choices[0].text == p + text_of(tok, *greedy[p])


# ------------------------------------------------------------------ streams
def collect(stream) -> tuple[dict, dict, list]:
    """-> (text per choice index, finish reasons per index, usage chunks), checking the chunk shape."""
    texts, reasons, usage = {}, {}, []
    for chunk in stream:
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            usage.append((chunk.choices, chunk.usage))
            continue
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons.setdefault(c.index, []).append(c.finish_reason)
    return texts, reasons, usage


def test_stream_equals_the_whole_response_with_exact_usage(client, greedy, tok):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = collect(stream)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: [c.finish_reason] for c in whole.choices}  # exactly one each
    assert len(usage) == 1
    choices, u = usage[0]
    assert choices == []
    assert u.prompt_tokens == sum(len(greedy[p][0]) for p in PROMPTS)
    assert u.completion_tokens == sum(len(greedy[p][1]) for p in PROMPTS)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_stream_without_include_usage_has_no_usage_chunk(client):
    texts, reasons, usage = collect(client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=True))
    assert usage == [] and list(reasons) == [0]


def test_stream_token_ids_per_chunk_add_up(client, greedy):
    ids, want = greedy[PROMPTS[1]]
    got = []
    for chunk in client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"return_token_ids": True}):
        for c in chunk.choices:
            got += extra(c, "token_ids") or []
    assert got == want


def test_async_client_stream(server, greedy, tok):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0) as c:
            stream = await c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    assert asyncio.run(run()) == text_of(tok, *greedy[PROMPTS[2]])


# ------------------------------------------------------------------ sampling: n and seeds
def test_seeded_n3_is_reproducible_and_streams_by_index(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=1234, n=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    ids_a = [extra(c, "token_ids") for c in a.choices]
    assert all(len(t) == 8 for t in ids_a)
    # three draws of 8 tokens from the model's distribution at T=1: equal by chance with
    # negligible probability (and the seed fixes the outcome, so this cannot flake)
    assert len({tuple(t) for t in ids_a}) > 1
    assert ids_a == [extra(c, "token_ids") for c in b.choices]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    # completion i samples as the n=1 request with seed + i (SamplingParams.completion)
    one = client.completions.create(**{**kw, "n": 1, "seed": 1235})
    assert extra(one.choices[0], "token_ids") == ids_a[1]
    texts, reasons, _ = collect(client.completions.create(**kw, stream=True))
    assert texts == {c.index: c.text for c in a.choices}
    assert reasons == {0: ["length"], 1: ["length"], 2: ["length"]}


# ------------------------------------------------------------------ stop strings
def test_stop_strings_cut_where_openai_cuts(client, tok):
    p, n = PROMPTS[2], 24
    base = client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    full, ids = base.choices[0].text, extra(base.choices[0], "token_ids")
    assert base.choices[0].finish_reason == "length" and len(ids) == n
    # a stop string across the boundary of output tokens 5 and 6, from the text itself
    head = text_of(tok, tok.encode(p), ids[:6])
    stop = full[len(head) - 2 : len(head) + 2]
    assert len(stop) == 4 and stop.strip(), (full, head)
    want = full[: full.find(stop)]
    for stops in (stop, [stop], ["\x07never", stop]):  # a string, a list, with one that never occurs
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0, stop=stops,
                                      extra_body={"ignore_eos": True})
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop"), stops
    texts, reasons, usage = collect(client.completions.create(
        model=MODEL, prompt=p, max_tokens=n, temperature=0, stop=[stop], stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert texts == {0: want} and reasons == {0: ["stop"]}
    assert usage[0][1].completion_tokens <= n


def test_stop_string_that_never_occurs_finishes_by_length(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                  stop=["\x07\x07"], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6


def test_usage_reports_prefix_cache_hits(client, paged_model):
    """The second request with a prompt of 2+ pages finds its full pages cached (usage's
    prompt_tokens_details.cached_tokens, whole pages, never the whole prompt)."""
    page = paged_model.config.page_size
    prompt = "def cached(x):\n" + "    x = x + 1  # one more line of code\n" * 30
    first, second = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
                     for _ in range(2))
    n = first.usage.prompt_tokens
    assert n > 2 * page
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % page == 0 and 0 < cached < n and cached >= (n - 1) // page * page - page
    assert second.choices[0].text == first.choices[0].text


# ------------------------------------------------------------------ logprobs
def reference_logprobs(dense_model, prompt_ids, out_ids) -> torch.Tensor:
    """[len(out), V] fp32: log_softmax of one teacher-forced dense forward at the positions that
    predicted each output token."""
    x = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logits = dense_model(x)[0].float()  # [S, V]
    P = len(prompt_ids)
    return torch.log_softmax(logits[P - 1 : P - 1 + len(out_ids)], dim=-1)


@pytest.mark.parametrize("k", [0, 3])
def test_completion_logprobs_equal_the_dense_model(client, dense_model, tok, k):
    p = PROMPTS[1]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, logprobs=k,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    out = extra(c, "token_ids")
    ref = reference_logprobs(dense_model, tok.encode(p), out)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(out)
    got = torch.tensor(lp.token_logprobs)
    want = ref[torch.arange(len(out)), torch.tensor(out)]
    assert (got - want).abs().max().item() <= LOGPROB_ATOL
    assert (want == ref.max(-1).values).all()  # greedy: each token is the dense argmax too
    for j, top in enumerate(lp.top_logprobs):
        # the k most likely tokens and the chosen one (vLLM adds it; greedy: it is the first of them)
        # by value: how a token is named is test_completion_logprob_tokens_and_offsets_index_the_text's
        want_top = ref[j].topk(max(k, 1)).values.tolist()
        assert sorted(top.values(), reverse=True) == pytest.approx(want_top, abs=LOGPROB_ATOL), j


def test_completion_logprob_tokens_and_offsets_index_the_text(client, tok):
    """OpenAI's completions logprobs: `tokens[j]` is token j's text and `text_offset[j]` where it
    starts in the choice's text, so text[offset[j]:offset[j + 1]] == tokens[j]. The greedy output of
    this prompt has newlines, which the vocabulary spells as the byte token <0x0A>."""
    p = PROMPTS[1]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    out, lp = extra(c, "token_ids"), c.logprobs
    assert "\n" in c.text and c.text.isascii()
    ids = tok.encode(p)
    assert lp.text_offset == [len(text_of(tok, ids, out[:j])) for j in range(len(out))]
    assert lp.tokens == [text_of(tok, ids + out[:j], [t]) for j, t in enumerate(out)]
    assert "".join(lp.tokens) == c.text


def test_streamed_logprobs_equal_the_whole_response(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, lps, offsets = [], [], []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert lps == pytest.approx(whole.token_logprobs, abs=LOGPROB_ATOL)


def dense_prompt_logprobs(dense_model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V] fp32: row j predicts prompt token j + 1 (one dense forward)."""
    with torch.no_grad():
        return torch.log_softmax(dense_model(torch.tensor([ids]))[0, :-1].float(), dim=-1)


@pytest.mark.parametrize("max_tokens", [1, 0])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_with_logprobs_scores_the_prompt(client, dense_model, tok, max_tokens, stream):
    """An evaluation harness's log-likelihood request (lm-evaluation-harness's local-completions:
    the prompt as token ids, echo, logprobs=1, max_tokens 1; or 0): the prompt's tokens open
    OpenAI's logprobs, token_logprobs[0] and top_logprobs[0] null, each prompt token's
    log-probability the dense model's, each top_logprobs entry holding the token's own; streamed,
    the first chunk carries them with the echoed text."""
    ids = tok.encode(PROMPTS[2])
    kw = dict(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    if stream:
        text, tokens, lps, tops = "", [], [], []
        for chunk in client.completions.create(**kw, stream=True):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    lps += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
    else:
        c = client.completions.create(**kw).choices[0]
        lp = c.logprobs
        text, tokens, lps, tops = c.text, lp.tokens, lp.token_logprobs, lp.top_logprobs
    n = len(ids)
    assert text.startswith(tok.decode(ids)) and len(tokens) == len(lps) == n + max_tokens
    assert lps[0] is None and tops[0] is None
    ref = dense_prompt_logprobs(dense_model, ids)
    want = ref[torch.arange(n - 1), torch.tensor(ids[1:])]
    assert (torch.tensor(lps[1:n]) - want).abs().max().item() <= LOGPROB_ATOL
    for j in range(1, n):  # its own log-probability among the alternatives; at least top-1
        assert lps[j] in tops[j].values() and len(tops[j]) in (1, 2)
        assert max(tops[j].values()) == pytest.approx(ref[j - 1].max().item(), abs=LOGPROB_ATOL)


def test_vllm_prompt_logprobs(client, dense_model, tok):
    """vLLM's `prompt_logprobs=k` on a completion: per choice, None for the first prompt token, then
    {token id: {logprob, rank, decoded_token}} for the top k and the prompt token itself."""
    p = PROMPTS[0]
    ids = tok.encode(p)
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = extra(r.choices[0], "prompt_logprobs")
    assert len(got) == len(ids) and got[0] is None
    ref = dense_prompt_logprobs(dense_model, ids)
    for j, t in enumerate(ids[1:]):
        entry = got[j + 1]
        assert str(t) in entry and len(entry) in (2, 3)
        own = entry[str(t)]
        assert own["logprob"] == pytest.approx(ref[j, t].item(), abs=LOGPROB_ATOL)
        assert own["rank"] == int((ref[j] > ref[j, t]).sum()) + 1
        top = sorted(entry.values(), key=lambda e: e["rank"])[:2]
        assert [e["rank"] for e in top] == [1, 2] or own["rank"] <= 2
        assert top[0]["logprob"] == pytest.approx(ref[j].max().item(), abs=LOGPROB_ATOL)


def test_no_logprobs_unless_asked(client):
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].logprobs is None


# ------------------------------------------------------------------ chat without a template
def test_chat_on_a_model_without_a_template_says_how_to_give_one(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4)
    assert e.value.status_code == 400
    assert "--chat-template" in e.value.message
    assert e.value.param == "messages"


# ------------------------------------------------------------------ the small routes
def test_models(client, server):
    (m,) = client.models.list().data
    assert m.id == MODEL and m.object == "model" and m.owned_by == "fms_paged"
    raw = httpx.get(f"{server.v1}/models").json()
    assert raw["object"] == "list"
    assert raw["data"][0]["max_model_len"] == 2048  # the default model's max_position_embeddings
    assert raw["data"][0]["root"].endswith("default_model")


def test_version(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": fms_paged.__version__}


def test_tokenize_and_detokenize(server, tok):
    text = "def f(x):\n    return 'ü 日本'"
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()
    assert r == {"count": len(tok.encode(text)), "max_model_len": 2048, "tokens": tok.encode(text)}
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=False)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": tok.encode(text)})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    for body, param in (({"tokens": [1, tok.vocab_size]}, "tokens"), ({"tokens": "ab"}, "tokens"),
                        ({"prompt": 3}, "prompt")):
        route = "detokenize" if "tokens" in body else "tokenize"
        r = httpx.post(f"{server.url}/{route}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
