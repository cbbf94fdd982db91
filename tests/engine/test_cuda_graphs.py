"""Decode steps replayed from CUDA graphs (`model_step.GraphedDecode`).

On the CPU the capture is replaced by a plain call over the same static buffers, which checks the
wrapper's own job: every step's inputs reach the buffers the recorded step reads (tokens, the decode
metadata and the positions derived from it), for every bucket, across requests that join and leave.
On CUDA (`gpu` marker, `--device cuda`) the real graphs are checked against the same engine without
them."""

import pytest
import torch

from fms_paged import get_model
from fms_paged.engine import Engine, SamplingParams
from fms_paged.engine.model_step import GraphedDecode


def call_capture(run, pool):
    """A stand-in for `capture_cuda_graph` on the CPU: 'replay' runs the step again over the static
    buffers and writes the result into the first call's output tensor, as a graph replay does."""
    out = run().clone()
    return (lambda: out.copy_(run())), out


def serve(eng: Engine, prompts, news) -> list[list[int]]:
    """Requests arriving over the first steps (the decode batch grows and shrinks through the
    buckets) -> each request's greedy tokens."""
    ids, pending = [], list(zip(prompts, news))
    outs: dict[int, list[int]] = {}
    while pending or eng.has_unfinished():
        if pending:
            p, n = pending.pop(0)
            ids.append(eng.add_request(p, SamplingParams(max_new_tokens=n)))
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [outs[i] for i in ids]


PROMPTS = [[5, 9, 13], list(range(3, 40)), [7] * 17, list(range(100, 121)), [42], list(range(60, 64))]
NEWS = [12, 6, 20, 9, 15, 3]


def test_graphed_decode_reads_every_input_from_its_static_buffers():
    model = get_model(variant="micro", device="cpu", seed=0, attn_impl="paged", page_size=16)
    kw = dict(max_num_seqs=4, num_pages=64, max_model_len=256, kernel="flex", compile=False,
              enable_prefix_caching=False)
    ref = Engine(model, **kw)
    want = serve(ref, PROMPTS, NEWS), serve(ref, PROMPTS[:1], [9])  # a batch, then a lone request
    eng = Engine(model, **kw)
    graphed = GraphedDecode(eng.runner._decode, capture=call_capture)
    eng.runner._decode = graphed
    assert (serve(eng, PROMPTS, NEWS), serve(eng, PROMPTS[:1], [9])) == want
    assert set(graphed.graphs) == set(eng.runner.buckets) == {1, 4}  # both buckets were replayed


def test_cuda_graphs_setting_is_checked():
    model = get_model(variant="micro", device="cpu", seed=0, attn_impl="paged", page_size=16)
    with pytest.raises(ValueError, match="cuda_graphs=1"):
        Engine(model, num_pages=32, max_model_len=256, cuda_graphs=1)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Engine(model, num_pages=32, max_model_len=256, cuda_graphs=True)
    assert not Engine(model, num_pages=32, max_model_len=256).runner.cuda_graphs  # "auto" on the CPU: off


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_give_the_tokens_of_the_plain_compiled_step(dtype, device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs: run with --device cuda")
    model = get_model(variant="micro", device=device, seed=0, attn_impl="paged", page_size=16, dtype=dtype)
    kw = dict(max_num_seqs=4, num_pages=64, max_model_len=256, compile=True, enable_prefix_caching=False)
    plain = Engine(model, cuda_graphs=False, **kw)
    graphed = Engine(model, cuda_graphs=True, **kw)
    assert graphed.runner.cuda_graphs and not plain.runner.cuda_graphs
    assert serve(graphed, PROMPTS, NEWS) == serve(plain, PROMPTS, NEWS)
    assert graphed.runner._decode.graphs  # the decode steps ran from graphs
