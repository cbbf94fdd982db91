"""Writes the notebooks from the cell sources below (outputs stripped). Run after editing a cell:
`python notebooks/make_notebooks.py`; the test suite executes every notebook top to bottom."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

QUICKSTART = [
    new_markdown_cell(
        "# Quickstart: dense vs paged\n\nLoad the project's embedded default model (a small LLaMA "
        "trained on the Python standard library, Hugging Face format), generate with the dense "
        "backend (`attn_impl=\"sdpa\"`) and the paged backend (`attn_impl=\"paged\"`), and check the "
        "greedy tokens are identical. (Both compute the same logits up to fp32 round-off, ~1e-6: "
        "greedy decoding can only differ where the two best logits tie to that precision, "
        "which these prompts do not.)"
    ),
    new_code_cell(
        "import torch\n"
        "from fms_paged import generate, get_model, load_tokenizer\n"
        "from fms_paged.models import default_model_path\n\n"
        "tok = load_tokenizer(default_model_path())\n"
        "dense = get_model(attn_impl=\"sdpa\", device=\"cpu\")\n"
        "paged = get_model(attn_impl=\"paged\", device=\"cpu\")\n"
        "print(dense.config)"
    ),
    new_code_cell(
        "prompts = [\"def fibonacci(n):\", \"import os\\n\\n\\ndef \", \"    return self.\"]\n"
        "ids = [tok.encode(p) for p in prompts]\n"
        "out_dense = generate(dense, ids, max_new_tokens=48)\n"
        "out_paged = generate(paged, ids, max_new_tokens=48)\n"
        "assert out_dense == out_paged, \"paged and dense disagree\"\n"
        "for p, o in zip(prompts, out_paged):\n"
        "    print(\"=\" * 60)\n"
        "    print(p + tok.decode(o))"
    ),
    new_markdown_cell("Sampling is opt-in and seeded:"),
    new_code_cell(
        "a = generate(paged, ids[:1], 32, temperature=0.8, top_p=0.95, seed=0)\n"
        "b = generate(paged, ids[:1], 32, temperature=0.8, top_p=0.95, seed=0)\n"
        "assert a == b\n"
        "print(prompts[0] + tok.decode(a[0]))"
    ),
    new_markdown_cell(
        "## Continuous batching\n\nThe `Engine` admits requests as pages free up, prefills long "
        "prompts in chunks beside running decodes and preempts (then recomputes) instead of failing "
        "when the pool runs dry. Here a pool of 40 pages (624 tokens) serves 12 requests; the "
        "greedy tokens are still the dense backend's."
    ),
    new_code_cell(
        "from fms_paged import Engine, SamplingParams\n\n"
        "engine = Engine(paged, max_num_seqs=6, max_num_batched_tokens=128, num_pages=40, compile=False,\n"
        "                max_model_len=256)  # the pool must hold one request of max_model_len\n"
        "texts = [prompts[i % 3] for i in range(12)]\n"
        "rids = [engine.add_request(tok.encode(t), SamplingParams(max_new_tokens=40, ignore_eos=True))\n"
        "        for t in texts]\n"
        "got = {r: [] for r in rids}\n"
        "usage = []\n"
        "while engine.has_unfinished():\n"
        "    for out in engine.step():\n"
        "        got[out.request_id] += out.new_token_ids\n"
        "    usage.append(engine.metrics()[\"kv_pages_used\"])\n"
        "m = engine.metrics()\n"
        "print(f\"{m['steps']} steps, {m['preemptions']} preemptions, \"\n"
        "      f\"peak {max(usage)} of {m['kv_pages_total']} pages in use\")\n"
        "ref = generate(dense, [tok.encode(t) for t in texts], 40, eos_id=None)\n"
        "assert [got[r] for r in rids] == ref"
    ),
    new_markdown_cell(
        "## Inside IBM Foundation Model Stack\n\nWith `ibm-fms` installed (`pip install "
        "'fms_paged[fms]'`), FMS loads the same checkpoint as its own LLaMA, and our paged "
        "FlexAttention runs inside it as the registered attention op `\"paged_flex\"`, driven by "
        "FMS's own `generate`. The tokens equal FMS's default attention (`sdpa_causal`); the same "
        "FMS model can also be served by the `Engine` (`Engine(fms_model, ...)`)."
    ),
    new_code_cell(
        "from fms.models import get_model as fms_get_model\n"
        "from fms.utils.generation import generate as fms_generate, pad_input_ids\n"
        "from fms_paged.integrations.fms import PagedFMSCache\n\n"
        "fms_model = fms_get_model(\"hf_pretrained\", model_path=str(default_model_path()),\n"
        "                          device_type=\"cpu\", data_type=torch.float32).eval()\n"
        "batch = [torch.tensor(i) for i in ids]\n"
        "cache = PagedFMSCache(fms_model, max_batch=4, max_seq_len=256)\n"
        "with torch.no_grad():\n"
        "    x, extra = cache.pad_input_ids(batch)  # extra: attn_name=\"paged_flex\", position_ids\n"
        "    paged_out = fms_generate(fms_model, x, max_new_tokens=32, use_cache=True, do_sample=False,\n"
        "                             extra_kwargs=extra,\n"
        "                             prepare_model_inputs_hook=cache.prepare_model_inputs_hook)\n"
        "    x, extra = pad_input_ids(batch)  # FMS's default attention, for reference\n"
        "    sdpa_out = fms_generate(fms_model, x, max_new_tokens=32, use_cache=True, do_sample=False,\n"
        "                            extra_kwargs=extra)\n"
        "assert torch.equal(paged_out, sdpa_out)\n"
        "print(prompts[0] + tok.decode(paged_out[0, x.shape[1]:].tolist()))"
    ),
]

PAGE_MANAGER = [
    new_markdown_cell(
        "# The page manager, live\n\nA pool of fixed-size pages; each sequence has a row in the page "
        "table mapping its logical pages to physical ones. RESERVE takes pages, ASSIGN writes K/V "
        "into their slots, FORK shares pages (copy-on-write for the partial last page), ERASE "
        "returns them."
    ),
    new_code_cell(
        "import matplotlib\n"
        "matplotlib.use(\"Agg\")\n"
        "import matplotlib.pyplot as plt\n"
        "import numpy as np\n"
        "import torch\n"
        "from fms_paged.kv import PageManager\n\n"
        "P = 4\n"
        "pm = PageManager(num_pages=24, page_size=P, max_seqs=4, max_seq_len=32)\n"
        "k_pool = torch.zeros(1, 1, 24 * P, 1)\n"
        "v_pool = torch.zeros_like(k_pool)\n"
        "pm.reserve([0, 1], [10, 5])\n"
        "for s in (0, 1):\n"
        "    n = pm.length(s)\n"
        "    vals = torch.full((n, 1, 1), float(s + 1))\n"
        "    pm.assign([s] * n, list(range(n)), vals, vals, k_pool, v_pool)\n"
        "print(\"page table:\\n\", pm.page_table)\n"
        "print(\"free pages:\", pm.num_free_pages, \"utilization:\", round(pm.utilization, 3))"
    ),
    new_code_cell(
        "pm.fork(0, 2)  # seq 2 shares seq 0's pages\n"
        "print(\"shared pages:\", sorted(set(pm.pages_of(0)) & set(pm.pages_of(2))))\n"
        "copies = pm.reserve([2], [11])  # grows into the shared partial page -> private copy\n"
        "print(\"copy-on-write (src, dst):\", copies)\n"
        "pm.apply_copies(copies, k_pool, v_pool)\n"
        "pm.assign([2], [10], torch.full((1, 1, 1), 3.0), torch.full((1, 1, 1), 3.0), k_pool, v_pool)\n"
        "print(\"seq 0 pages\", pm.pages_of(0), \"seq 2 pages\", pm.pages_of(2))\n"
        "k, v, lens = pm.gather([0, 2], k_pool, v_pool)\n"
        "print(\"seq 0 sees\", k[0, 0, : lens[0], 0].tolist())\n"
        "print(\"seq 2 sees\", k[1, 0, : lens[1], 0].tolist())"
    ),
    new_code_cell(
        "def show(pm, title):\n"
        "    owner = np.full(pm.num_pages, -1)\n"
        "    for s in pm.live_seqs:\n"
        "        for p in pm.pages_of(s):\n"
        "            owner[p] = s if owner[p] == -1 else 9  # 9 = shared\n"
        "    fig, ax = plt.subplots(1, 2, figsize=(10, 2.5))\n"
        "    ax[0].imshow(owner[None], cmap=\"tab10\", vmin=-1, vmax=9, aspect=\"auto\")\n"
        "    ax[0].set_title(title + \": pool (colour = owning seq, grey = free)\")\n"
        "    ax[0].set_yticks([])\n"
        "    ax[1].imshow(pm.page_table.numpy(), cmap=\"viridis\", aspect=\"auto\")\n"
        "    ax[1].set_title(\"block tables (rows = seqs, value = physical page)\")\n"
        "    plt.show()\n\n"
        "show(pm, \"after fork + copy-on-write\")\n"
        "pm.erase([0])\n"
        "show(pm, \"after ERASE of seq 0\")\n"
        "print(\"free pages:\", pm.num_free_pages)"
    ),
    new_markdown_cell(
        "## Fragmentation under a mixed workload\n\nA dense cache preallocates `max_len` slots per "
        "sequence; the pool holds `ceil(len / P)` pages. Bytes held vs needed for 64 requests with "
        "lengths spread over 50..4000 tokens (7B-shaped KV: 32 layers x 32 heads x 128 x fp16):"
    ),
    new_code_cell(
        "from fms_paged.kv.budget import page_bytes\n\n"
        "rng = np.random.default_rng(0)\n"
        "lengths = rng.integers(50, 4000, 64)\n"
        "tok_bytes = page_bytes(32, 32, 128, 1, torch.float16)\n"
        "needed = lengths.sum() * tok_bytes\n"
        "dense = len(lengths) * 4096 * tok_bytes\n"
        "rows = []\n"
        "for P in (16, 64, 256):\n"
        "    held = (-(-lengths // P)).sum() * P * tok_bytes\n"
        "    rows.append((f\"paged P={P}\", held))\n"
        "rows.insert(0, (\"dense (max_len 4096)\", dense))\n"
        "for name, held in rows:\n"
        "    print(f\"{name:22s} held {held / 2**30:7.2f} GiB  waste {100 * (held - needed) / held:5.1f}%\")\n"
        "plt.bar([r[0] for r in rows], [r[1] / 2**30 for r in rows])\n"
        "plt.axhline(needed / 2**30, color=\"k\", ls=\"--\", label=\"needed\")\n"
        "plt.ylabel(\"KV GiB held\"); plt.legend(); plt.show()"
    ),
]

BENCHMARKS = [
    new_markdown_cell(
        "# Benchmarks: no cache, dense cache, paged cache\n\nRuns a small benchmark of the default model "
        "in this notebook (the same code as `make bench-llama-paged`, at a tiny scale so it takes a "
        "minute on a laptop CPU), then shows its plots and reads latency, KV memory and perplexity from "
        "its `results.json`. To look at a full run instead, set `RESULTS` to its folder (e.g. "
        "`Path(\"results/bench-llama-paged\")`)."
    ),
    new_code_cell(
        "import json, os, tempfile\n"
        "from pathlib import Path\n\n"
        "from fms_paged.bench.cli import main as bench\n\n"
        "RESULTS = Path(os.environ.get(\"FMS_PAGED_RESULTS\", tempfile.mkdtemp())) / \"notebook\"\n"
        "if not (RESULTS / \"results.json\").exists():\n"
        "    bench([\"--attn-impl\", \"all\", \"--scenario\", \"single,mixed\", \"--scale\", \"0.02\",\n"
        "           \"--new-tokens\", \"8\", \"--ppl-chars\", \"2000\", \"--device\", \"cpu\",\n"
        "           \"--out\", str(RESULTS)])\n"
        "results = json.loads((RESULTS / \"results.json\").read_text())\n"
        "print(sorted(results))"
    ),
    new_code_cell(
        "from IPython.display import Image, display\n\n"
        "for png in (\"latency_vs_length.png\", \"memory_vs_length.png\"):\n"
        "    display(Image(filename=str(RESULTS / png)))"
    ),
    new_code_cell(
        "# the mixed batches: KV bytes each cache holds against those its tokens need, and decode speed\n"
        "for r in results[\"runs\"]:\n"
        "    if r[\"scenario\"] == \"mixed\":\n"
        "        kv = r[\"kv\"]\n"
        "        print(f\"{r['length']:5d} {r['attn_impl']:9s} \"\n"
        "              f\"KV held {kv['kv_bytes_held'] / 2**20:6.2f} MiB, \"\n"
        "              f\"needed {kv['kv_bytes_needed'] / 2**20:6.2f} MiB, \"\n"
        "              f\"{r['per_token']['p50_ms']:7.2f} ms per decode step\")"
    ),
    new_code_cell(
        "ppl = results[\"perplexity\"]\n"
        "print(json.dumps(ppl, indent=1)[:800])"
    ),
]


def write(name: str, cells) -> None:
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    write("01_quickstart.ipynb", QUICKSTART)
    write("02_page_manager.ipynb", PAGE_MANAGER)
    write("03_benchmarks.ipynb", BENCHMARKS)
