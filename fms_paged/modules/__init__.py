from fms_paged.modules.attention import AttentionStep, MultiHeadAttention
from fms_paged.modules.feedforward import GatedLinearUnit, swiglu_hidden_dim
from fms_paged.modules.linear import LINEAR_IMPLS, Linear
from fms_paged.modules.norm import RMSNorm
from fms_paged.modules.positions import RotaryEmbedding, apply_rope, rope_inv_freq

__all__ = [
    "AttentionStep",
    "GatedLinearUnit",
    "LINEAR_IMPLS",
    "Linear",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rope",
    "rope_inv_freq",
    "swiglu_hidden_dim",
]
