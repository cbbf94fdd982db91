"""One rank of the tensor-parallel test (`torchrun ... fms_tp_worker.py CKPT OUT`): FMS loads the
checkpoint with `distributed_strategy="tp"` (gloo), then FMS's generate runs with sdpa_causal and
with our "paged_flex" op, and our `Engine` over the same split model (rank 0 drives it, the others
`run_worker`); each rank writes its tokens, page table and the pool slots in use."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fms.models import get_model
from fms.utils.generation import generate, pad_input_ids

from fms_paged import Engine, SamplingParams
from fms_paged.engine.tensor_parallel import run_worker
from fms_paged.integrations.fms import PagedFMSCache


def main(ckpt: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = get_model("hf_pretrained", model_path=ckpt, device_type="cpu", data_type=torch.float32,
                      distributed_strategy="tp").eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.src_vocab_size, (n,), generator=g) for n in (5, 17, 40)]
    new = 16
    with torch.no_grad():
        ids, extra = pad_input_ids(prompts)
        sdpa = generate(model, ids, max_new_tokens=new, use_cache=True, do_sample=False,
                        extra_kwargs=extra)
        cache = PagedFMSCache(model, max_batch=4, max_seq_len=128, kernel="gather")
        ids, extra = cache.pad_input_ids(prompts)
        paged = generate(model, ids, max_new_tokens=new, use_cache=True, do_sample=False,
                         extra_kwargs=extra, prepare_model_inputs_hook=cache.prepare_model_inputs_hook)
    # our Engine over FMS's split: rank 0 drives it, the other ranks follow (seeded sampling too)
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=32, num_pages=40, max_model_len=128,
                    compile=False)
    engine_tokens = None
    if rank == 0:
        params = [SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=t, seed=i)
                  for i, t in enumerate((0.0, 0.9, 0.0))]
        ids_of = {engine.add_request(p.tolist(), sp): i for i, (p, sp) in enumerate(zip(prompts, params))}
        engine_tokens = [[] for _ in prompts]
        for o in engine.stream():
            engine_tokens[ids_of[o.request_id]] += o.new_token_ids
        engine.shutdown(result=engine_tokens)
    else:
        engine_tokens = run_worker(engine)
        engine.shutdown()
    pm = cache.backend.pm
    pages = sorted(p for s in range(len(prompts)) for p in pm.pages_of(s))
    slots = (torch.tensor(pages)[:, None] * pm.page_size + torch.arange(pm.page_size)).flatten()
    pools = [(k[:, :, slots].clone(), v[:, :, slots].clone()) for k, v in cache.pools]
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save(pools, Path(out) / f"rank{rank}.pt")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "world": world,
        "kvheads": cache.model.config.kvheads,
        "tokens": paged[:, -new:].tolist(),
        "sdpa_tokens": sdpa[:, -new:].tolist(),
        "engine_tokens": engine_tokens,
        "page_table": [pm.pages_of(s) for s in range(len(prompts))],
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
