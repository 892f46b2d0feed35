"""MHA and GQA: K and V streams per kv head; query heads grouped onto their kv head (MHA is group size 1)."""

from __future__ import annotations

import torch
from torch import nn

from ..backends import Backend
from ..config import KVarNConfig
from ..store import StreamSpec
from .base import Adapter, fallback_attention


def head_dim(text_config) -> int:
    """Per-head width, from ``head_dim`` or ``hidden_size / num_attention_heads``."""
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


class DenseAdapter(Adapter):
    family = "dense"

    def stream_specs(self, text_config, config: KVarNConfig, kv_heads: int | None = None) -> tuple[StreamSpec, ...]:
        kv_heads = kv_heads or getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        dim = head_dim(text_config)
        return (
            StreamSpec("key", kv_heads, dim, config.scheme("key")),
            StreamSpec("value", kv_heads, dim, config.scheme("value")),
        )

    def local_kv_heads(self, module: nn.Module) -> int | None:
        weight = module.k_proj.weight
        if not hasattr(weight, "to_local"):  # not a tensor-parallel shard (DTensor)
            return None
        return weight.to_local().shape[0] // module.head_dim

    def is_attention(self, module: nn.Module) -> bool:
        return all(hasattr(module, name) for name in ("layer_idx", "q_proj", "k_proj", "v_proj", "o_proj"))

    def full_precision(self, module, query, key, value, mask, fallback: str, **kwargs) -> tuple:
        return fallback_attention(module, query, key, value, mask, fallback, **kwargs)

    def quantized(self, module, query, layer, mask, scaling: float, backend: Backend) -> torch.Tensor:
        keys, values = (stream.view() for stream in layer.streams[:2])
        batch, q_heads, q_len, dim = query.shape
        kv_heads = layer.specs[0].num_heads
        # Query heads [i*group, (i+1)*group) share kv head i (as in repeat_kv): rows ordered (head, query).
        q = query.reshape(batch, kv_heads, q_heads // kv_heads * q_len, dim)
        out = backend.attend(q, [keys], values, scaling, mask, q_len)
        return out.view(batch, q_heads, q_len, -1).transpose(1, 2).to(query.dtype)
