#!/usr/bin/env python
"""Train the project's embedded default model: a SentencePiece tokenizer + a small LLaMA, on the
running interpreter's own standard library source (offline on any machine with Python).

    python scripts/make_default_model.py                 # the committed model (~12 min, 2 CPU cores)
    python scripts/make_default_model.py --tiny --steps 3 --out /tmp/m   # a seconds-long smoke run
    python scripts/make_default_model.py --draft --out results/draft-model  # a draft for it (~5 min)

--draft trains a smaller model (2 layers of 128) the same way on the same data, with the committed
model's tokenizer copied, not retrained (--tokenizer-from): the same token ids, so that it can propose
tokens for that model in speculative decoding (`Engine(speculative={"method": "draft_model", ...})`).

Deterministic given --seed and --steps (fixed data order, fixed init, fixed step count; the optional
--minutes is a safety stop that breaks that promise if it triggers). Writes, in Hugging Face LLaMA
format, into --out: config.json, model.safetensors, tokenizer.model, tokenizer_config.json, plus README.md
(model card), card.json (machine-readable card) and loss_curve.png. Only weights and a tokenizer
trained from the stdlib are written; no stdlib text is copied.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fms_paged.bench.perplexity import heldout_perplexity
from fms_paged.data.stdlib_corpus import HELDOUT_MODULUS, MAX_FILE_BYTES, stdlib_dir, stdlib_files
from fms_paged.generation import generate
from fms_paged.models.hf import save_hf_llama
from fms_paged.models.llama import LLaMA, LLaMAConfig
from fms_paged.models.registry import DEFAULT_MODEL_DIR, get_model
from fms_paged.tokenizers import load_tokenizer

TOKENIZER_CONFIG = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                    "unk_token": "<unk>"}

SAMPLE_PROMPT = "def fibonacci(n):"
TEST_SLICE_CHARS = 8_000  # the held-out slice tests/models/test_default_model.py recomputes
# Measured on an otherwise idle 2-core machine: ~2.6 steps/s of 8x256 tokens, so 1800 steps + tokenizer +
# evaluation take ~12 minutes (15 at most). Fixed here (not by wall clock) for determinism.
DEFAULT_STEPS = 1800

# The committed model: 4.33M parameters (17.3 MB in fp32).
FULL = dict(
    model=dict(emb_dim=256, nheads=8, kvheads=2, nlayers=4, hidden_grow_factor=2.0, multiple_of=32,
               max_expected_seq_len=2048),
    seq_len=256, batch_size=8, train_chars=None, tokenizer_chars=4_000_000, eval_chars=200_000,
    eval_every=20, sample_tokens=64,
)
# --draft: a draft for the committed model (speculative decoding), its tokenizer copied; one decode step
# reads ~1/4 of the committed model's weights (0.82M of its 3.28M parameters past the embedding: 2
# layers of 128 and a 4096 x 128 head: 0.11 ms a decode step against its 0.31-0.36 on one thread).
# Measured with --threads 1 on the 2-core machine beside other jobs (load average ~4): 2.4 steps/s,
# 1500 steps + evaluation in 10.5 minutes; 2 threads on that loaded machine ran 3.5x slower.
DRAFT = dict(
    model=dict(emb_dim=128, nheads=4, kvheads=2, nlayers=2, hidden_grow_factor=2.0, multiple_of=32,
               max_expected_seq_len=2048),
    seq_len=256, batch_size=8, train_chars=None, tokenizer_chars=None, eval_chars=50_000,
    eval_every=20, sample_tokens=64, steps=1500,
)
# --tiny: a few seconds end to end, for the determinism test.
TINY = dict(
    model=dict(emb_dim=32, nheads=2, kvheads=1, nlayers=1, hidden_grow_factor=2.0, multiple_of=16,
               max_expected_seq_len=256),
    seq_len=32, batch_size=4, train_chars=200_000, tokenizer_chars=100_000, eval_chars=4_000,
    eval_every=0, sample_tokens=8,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: the embedded default model's; --draft: "
                        "results/draft-model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (default {DEFAULT_STEPS}; --tiny: 3)")
    p.add_argument("--minutes", type=float, default=None,
                   help="wall-clock safety stop (breaks determinism if it triggers; default none)")
    p.add_argument("--vocab-size", type=int, default=None, help="default 4096 (--tiny: 400)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 5%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2, help="torch / sentencepiece threads")
    p.add_argument("--eval-chars", type=int, default=None, help="held-out chars for the card's ppl")
    p.add_argument("--tiny", action="store_true", help="tiny model on a small slice (smoke/determinism)")
    p.add_argument("--draft", action="store_true",
                   help="a draft model for speculative decoding: smaller, the tokenizer of --tokenizer-from "
                        f"copied (default {DRAFT['steps']} steps)")
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="copy tokenizer.model and tokenizer_config.json from this model directory instead of "
                        "training a tokenizer (default with --draft: the embedded default model)")
    p.add_argument("--no-plot", action="store_true", help="skip loss_curve.png")
    args = p.parse_args(argv)
    if args.draft and args.tiny:
        p.error("--draft and --tiny are two presets; pass one")
    if args.draft and args.tokenizer_from is None:
        args.tokenizer_from = DEFAULT_MODEL_DIR
    if args.out is None:
        args.out = Path("results/draft-model") if args.draft else DEFAULT_MODEL_DIR
    return args


# ---------------------------------------------------------------- data + tokenizer


def _shuffled_by_hash(paths: list[Path], root: Path) -> list[Path]:
    """A machine-independent fixed order mixing packages (for the tokenizer sample)."""
    return sorted(paths, key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())


def train_tokenizer(files: list[Path], root: Path, out_dir: Path, vocab_size: int, max_chars: int,
                    threads: int) -> Path:
    """SentencePiece BPE on a fixed sample (`max_chars` of the train files in hash order).

    Code-friendly settings: identity normalization, whitespace kept (indent runs become pieces),
    no dummy prefix, byte fallback (so "\\n" and any rare char are exact byte tokens); decode(encode(x))
    == x for any text.
    """
    import sentencepiece as spm

    sample, total = [], 0
    for path in _shuffled_by_hash(files, root):
        text = path.read_text(encoding="utf-8", errors="replace")
        sample.append(text)
        total += len(text)
        if total >= max_chars:
            break
    lines = [ln for ln in "\n".join(sample)[:max_chars].split("\n") if ln.strip()]
    model_file = out_dir / "tokenizer.model"
    proto = io.BytesIO()  # trained from an iterator into memory: no temp paths recorded in the model
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=proto, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        allow_whitespace_only_pieces=True, split_digits=True, max_sentence_length=16384,
        input_sentence_size=0, shuffle_input_sentence=False, num_threads=threads, minloglevel=2,
    )
    model_file.write_bytes(proto.getvalue())
    # the model is trained with a BOS before each file: its prompts get one (transformers reads the
    # flag; without it a sentencepiece-only checkpoint gets none)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    return model_file


def copy_tokenizer(src: Path, out_dir: Path) -> Path:
    """The tokenizer of the model in `src` (tokenizer.model, tokenizer_config.json) copied into
    `out_dir`, byte for byte: a model trained on it shares `src`'s token ids (a draft for it)."""
    for name in ("tokenizer.model", "tokenizer_config.json"):
        if not (src / name).is_file():
            raise FileNotFoundError(f"--tokenizer-from {src}: no {name} there; expected a model directory "
                                    "with a sentencepiece tokenizer (as this script writes)")
        if (src / name).resolve() != (out_dir / name).resolve():
            (out_dir / name).write_bytes((src / name).read_bytes())
    return out_dir / "tokenizer.model"


def encode_files(tok: Any, files: list[Path], max_chars: int | None) -> tuple[np.ndarray, int]:
    """One token stream: [BOS] + tokens of each file, in listing order -> (ids int32 [N], files used)."""
    ids: list[int] = []
    total = 0
    n = 0
    for path in files:
        n += 1
        text = path.read_text(encoding="utf-8", errors="replace")
        ids.extend([tok.bos_id, *tok.encode(text, add_special_tokens=False)])
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    return np.asarray(ids, dtype=np.int32), n


# ---------------------------------------------------------------- training


def lr_at(step: int, steps: int, warmup: int, lr: float, min_ratio: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    # starts: [B] -> x, y: [B, seq_len] (y is x shifted by one)
    idx = starts[:, None] + torch.arange(seq_len + 1)  # [B, L+1]
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def train(model: LLaMA, data: torch.Tensor, heldout: torch.Tensor, args: argparse.Namespace, preset: dict,
          seed: int) -> dict[str, Any]:
    from tqdm import tqdm

    B, L, steps = args.batch_size, args.seq_len, args.steps
    warmup = args.warmup if args.warmup is not None else max(1, steps // 20)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(seed)  # the data order: fixed by the seed alone
    # fixed held-out batch for the curve: [E, L+1] evenly spaced windows
    n_eval = min(8, max(1, (len(heldout) - 1) // (L + 1)))
    eval_starts = torch.linspace(0, len(heldout) - L - 2, n_eval).long()
    history: dict[str, list] = {"step": [], "loss": [], "eval_step": [], "eval_loss": []}

    def eval_loss() -> float:
        model.eval()
        with torch.inference_mode():
            x, y = batch_at(heldout, eval_starts, L)
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item()
        model.train()
        return loss

    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="train", dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        starts = torch.randint(0, len(data) - L - 1, (B,), generator=gen)
        x, y = batch_at(data, starts, L)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, warmup, args.lr, args.min_lr_ratio)
        logits = model(x)  # [B, L, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history["step"].append(step)
        history["loss"].append(loss.item())
        if preset["eval_every"] and ((step + 1) % preset["eval_every"] == 0 or step + 1 == steps):
            history["eval_step"].append(step)
            history["eval_loss"].append(eval_loss())
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{group['lr']:.2e}")
        if args.minutes is not None and time.perf_counter() - t0 > args.minutes * 60:
            print(f"--minutes={args.minutes} reached after {step + 1} steps: stopping early "
                  "(this run is not reproducible by --steps alone)", file=sys.stderr)
            break
    model.eval()
    history["seconds"] = time.perf_counter() - t0
    history["steps_done"] = len(history["step"])
    history["warmup"] = warmup
    return history


def plot_curve(history: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, loss = np.asarray(history["step"]) + 1, np.asarray(history["loss"])
    k = max(1, len(loss) // 50)
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8, label="train loss (per step)")
    ax.plot(steps[k - 1:], smooth, color="tab:blue", lw=1.8, label=f"train loss ({k}-step mean)")
    if history["eval_step"]:
        ax.plot(np.asarray(history["eval_step"]) + 1, history["eval_loss"], "o-", color="tab:orange",
                ms=3, label="held-out loss (fixed 8 windows)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------- card


def write_card(out: Path, card: dict) -> None:
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    ev, tr, m, s, c = card["eval"], card["training"], card["model"], card["sample"], card["corpus"]
    rows = [
        ("architecture", f"LLaMA: {m['nlayers']} layers, width {m['emb_dim']}, {m['nheads']} heads / "
                         f"{m['kvheads']} KV heads (GQA), SwiGLU {m['hidden_dim']}, RoPE, untied head"),
        ("parameters", f"{m['params']:,} ({m['file_mb']:.1f} MB safetensors, {m['dtype']})"),
        ("tokenizer", f"SentencePiece BPE, vocab {m['vocab_size']}, byte fallback, identity "
                      "normalization, whitespace kept; " + (
                          f"copied from {card['tokenizer']['copied_from']}"
                          if card["tokenizer"]["copied_from"]
                          else f"trained on {card['tokenizer']['sample_chars']:,} chars of the train split")),
        ("training", f"{tr['steps']} AdamW steps x {tr['batch_size']} x {tr['seq_len']} tokens "
                     f"({tr['tokens_seen'] / 1e6:.2f}M tokens), lr {tr['lr']} cosine to "
                     f"{tr['lr'] * tr['min_lr_ratio']:g}, warmup {tr['warmup']}, seed {tr['seed']}"),
        ("wall time", f"{tr['seconds'] / 60:.1f} min of training on {tr['machine']}"),
        ("final train loss", f"{tr['final_train_loss']:.3f} nats/token (mean of the last 50 steps)"),
    ]
    table = "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    draft = card["preset"] == "draft"
    intro = (f"""# fms_paged draft model

A smaller LLaMA ({m['params'] / 1e6:.2f}M parameters) trained from scratch by
`scripts/make_default_model.py --draft` as the default model was, on the same data, with the default
model's tokenizer ({card['tokenizer']['copied_from']}) copied: the same token ids, so that it drafts for
that model in speculative decoding (`Engine(speculative={{"method": "draft_model", "model": <this
directory>, "num_speculative_tokens": 4}})`).""" if draft else f"""# fms_paged default model

A small LLaMA ({m['params'] / 1e6:.2f}M parameters) and a SentencePiece tokenizer, trained from scratch
by `scripts/make_default_model.py` so that perplexity, generation and benchmarks give meaningful numbers
offline.""")
    readme = f"""{intro} It is stored in Hugging Face LLaMA format (`config.json`, `model.safetensors` in
{m['dtype']}, `tokenizer.model`) and loads with {"`fms_paged.get_model(model_path=...)`" if draft else
"`fms_paged.get_model()` (the default when no model is named)"} or
`transformers.LlamaForCausalLM.from_pretrained` on this directory. It is a toy: it knows
Python-stdlib-flavoured code and nothing else.

## Corpus
CPython {card['python_version_full']} standard library source (`*.py` under
`sysconfig.get_paths()["stdlib"]`) of the interpreter that trained it; no text is committed, only the
weights and tokenizer trained from it. Excluded: `site-packages`, `test/`, `tests/`,
`idlelib/idle_test`, `lib2to3/tests`, files > {MAX_FILE_BYTES // 1000} KB.
Split by file: `sha1(relative_path) % {HELDOUT_MODULUS} == 0` -> held-out
(`fms_paged.data.stdlib_corpus`). Train: {c['train_files']} files ({c['train_tokens']:,} tokens,
{c['train_files_used']} files encoded); held-out: {c['heldout_files']} files.

## Model and training
{table}

![loss curve](loss_curve.png)

## Held-out perplexity
**{ev['heldout_ppl']:.2f}** (uniform baseline = vocab size = {m['vocab_size']}) over {ev['tokens']:,}
predicted tokens.

Recipe: `fms_paged.bench.perplexity.heldout_perplexity(model, tokenizer, max_chars={ev['max_chars']},
window={ev['window']})`: the first {ev['max_chars']:,} characters of the held-out files (sorted by
relative path, joined by a blank line), encoded without BOS, cut into non-overlapping windows of
{ev['window']} tokens, each scored from its own start, through the KV cache, attn_impl="sdpa", fp32.
On the first {ev['test_slice_chars']:,} characters (the slice the test suite recomputes):
{ev['heldout_ppl_test_slice']:.2f}. Figures depend on the Python minor version ({card['python_version']}),
whose stdlib the held-out files come from.

## Greedy sample
`generate(model, [tokenizer.encode({s['prompt']!r})], max_new_tokens={s['max_new_tokens']})`, greedy, decoded
with the prompt:

```python
{s['text']}
```

## Use and reproduce
```python
from fms_paged import generate, get_model, load_tokenizer
from fms_paged.models.registry import DEFAULT_MODEL_DIR
model, tok = get_model(), load_tokenizer(DEFAULT_MODEL_DIR)
```
Rebuild with `python scripts/make_default_model.py{' --draft' if draft else ''} --seed {tr['seed']}
--steps {tr['steps']} --threads {tr['threads']}`.
Deterministic given seed and steps on the same torch build and thread count ({tr['threads']}); other CPUs
may differ in float round-off. The numbers above are in `card.json`; the tests
(`tests/models/test_default_model.py`) recompute the held-out perplexity of the test slice, compare with
`transformers`, and replay the greedy sample.
"""
    (out / "README.md").write_text(readme)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    preset = TINY if args.tiny else DRAFT if args.draft else FULL
    if args.steps is None:
        args.steps = 3 if args.tiny else preset.get("steps", DEFAULT_STEPS)
    args.batch_size = args.batch_size or preset["batch_size"]
    args.seq_len = args.seq_len or preset["seq_len"]
    eval_chars = args.eval_chars or preset["eval_chars"]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    root = stdlib_dir()
    train_files, heldout_files = stdlib_files("train"), stdlib_files("heldout")
    print(f"corpus: {root} ({len(train_files)} train / {len(heldout_files)} held-out files)")
    tok_chars = preset["tokenizer_chars"]
    if args.tokenizer_from is not None:  # the same token ids as that model's
        tok = load_tokenizer(copy_tokenizer(args.tokenizer_from, out))
        if args.vocab_size not in (None, tok.vocab_size):
            raise ValueError(f"--vocab-size {args.vocab_size}; the tokenizer of --tokenizer-from "
                             f"{args.tokenizer_from} has {tok.vocab_size}")
        args.vocab_size = tok.vocab_size
    else:
        args.vocab_size = args.vocab_size or (400 if args.tiny else 4096)
        model_file = train_tokenizer(train_files, root, out, args.vocab_size, tok_chars, args.threads)
        tok = load_tokenizer(model_file)
        assert tok.vocab_size == args.vocab_size, (tok.vocab_size, args.vocab_size)
    data_np, files_used = encode_files(tok, train_files, preset["train_chars"])
    heldout_np, _ = encode_files(tok, heldout_files, 200_000)
    data, heldout = torch.from_numpy(data_np), torch.from_numpy(heldout_np)
    print(f"tokenizer: vocab {tok.vocab_size}; train stream {len(data):,} tokens from {files_used} files "
          f"({time.perf_counter() - t_start:.0f}s)")

    config = LLaMAConfig(src_vocab_size=args.vocab_size, tie_heads=False, bos_token_id=1, eos_token_id=2,
                         **preset["model"])
    torch.manual_seed(args.seed)
    model = LLaMA(config)
    model.reset_parameters()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters, hidden_dim {config.hidden_dim}; {args.steps} steps of "
          f"{args.batch_size}x{args.seq_len}")
    history = train(model, data, heldout, args, preset, args.seed)

    save_hf_llama(model, out, dtype=torch.float32)
    # reload through the same loader users' checkpoints go through
    loaded = get_model(model_path=out, device="cpu", dtype=torch.float32)
    tok = load_tokenizer(out)
    result = heldout_perplexity(loaded, tok, max_chars=eval_chars, window=min(256, args.seq_len))
    slice_chars = min(TEST_SLICE_CHARS, eval_chars)
    result_slice = heldout_perplexity(loaded, tok, max_chars=slice_chars, window=min(256, args.seq_len))
    prompt = tok.encode(SAMPLE_PROMPT)
    new = generate(loaded, [prompt], max_new_tokens=preset["sample_tokens"])[0]
    text = tok.decode(prompt + new)
    print(f"held-out ppl {result['ppl']:.3f} over {result['tokens']} tokens; sample:\n{text}")

    tail = history["loss"][-50:]
    card = {
        "python_version": f"{sys.version_info.major}.{sys.version_info.minor}",
        "python_version_full": platform.python_version(),
        "corpus": {"source": "CPython standard library *.py",
                   "split_rule": f"sha1(relpath) % {HELDOUT_MODULUS} == 0 -> heldout",
                   "train_files": len(train_files), "heldout_files": len(heldout_files),
                   "train_files_used": files_used, "train_tokens": int(len(data))},
        "preset": "tiny" if args.tiny else "draft" if args.draft else "default",
        "tokenizer": {"type": "sentencepiece-bpe", "vocab_size": args.vocab_size,
                      "sample_chars": None if args.tokenizer_from else tok_chars,
                      "copied_from": str(args.tokenizer_from) if args.tokenizer_from else None},
        "model": {"params": params, "vocab_size": args.vocab_size, "emb_dim": config.emb_dim,
                  "nheads": config.nheads, "kvheads": config.kvheads, "nlayers": config.nlayers,
                  "hidden_dim": config.hidden_dim, "dtype": "float32",
                  "file_mb": (out / "model.safetensors").stat().st_size / 1e6},
        "training": {"steps": history["steps_done"], "batch_size": args.batch_size,
                     "seq_len": args.seq_len,
                     "tokens_seen": history["steps_done"] * args.batch_size * args.seq_len,
                     "lr": args.lr, "min_lr_ratio": args.min_lr_ratio, "warmup": history["warmup"],
                     "weight_decay": args.weight_decay, "seed": args.seed, "seconds": history["seconds"],
                     "machine": f"{args.threads} CPU threads, torch {torch.__version__}",
                     "threads": args.threads,
                     "final_train_loss": float(np.mean(tail)),
                     "final_heldout_loss_fixed_batch": (history["eval_loss"] or [None])[-1]},
        "eval": {"heldout_ppl": result["ppl"], "nll": result["nll"], "tokens": result["tokens"],
                 "max_chars": eval_chars, "window": result["window"], "attn_impl": "sdpa",
                 "use_cache": True,
                 "encode_bos": False, "uniform_baseline": args.vocab_size,
                 "test_slice_chars": slice_chars, "heldout_ppl_test_slice": result_slice["ppl"],
                 "test_slice_tokens": result_slice["tokens"]},
        "sample": {"prompt": SAMPLE_PROMPT, "max_new_tokens": preset["sample_tokens"], "greedy": True,
                   "prompt_ids": prompt, "completion_ids": new, "text": text},
    }
    write_card(out, card)
    if not args.no_plot:
        plot_curve(history, out / "loss_curve.png",
                   f"{'draft' if args.draft else 'default'} model: {params / 1e6:.2f}M params, "
                   f"{history['steps_done']} steps")
    print(f"wrote {out} in {(time.perf_counter() - t_start) / 60:.1f} min")
    return card


if __name__ == "__main__":
    main()
