"""Mistral: Llama with a sliding window on every layer (`sliding_window`; null: none, v0.2 on)."""

from fms_paged.models.families.base import MICRO, Family, refuse


def fields(cfg: dict) -> dict:
    refuse(cfg, "Mistral", attention_bias=False, mlp_bias=False)
    if cfg.get("layer_types") is not None:  # transformers names such checkpoints Ministral
        refuse(cfg, "Mistral", layer_types=None)
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window) if window is not None else None}


FAMILY = Family("mistral", ("MistralForCausalLM",), "mistral", fields,
                summary="sliding window on every layer",
                presets={"micro": {**MICRO, "family": "mistral", "sliding_window": 256},
                         # Mistral-7B-v0.1's shape
                         "7b": dict(family="mistral", src_vocab_size=32_000, emb_dim=4096, nheads=32,
                                    kvheads=8, nlayers=32, hidden_grow_factor=3.5, multiple_of=1,
                                    norm_eps=1e-5, max_expected_seq_len=32_768, sliding_window=4096)})
