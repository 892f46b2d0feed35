"""What every family adapter shares: the attention entry point registered with transformers, masks, fallbacks.

Adapters map a family's cache onto two streams (see `kvarn_mla.store`) and its queries and outputs onto
grouped-query attention over those streams (the backend's ``attend``). They never touch transformers' module globals:
everything they change lives on the attention module instances that `kvarn_mla.patch` hands them, and is undone by
`restore`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..backends import Backend
from ..config import KVarNConfig
from ..store import StreamSpec

BINDING_ATTR = "_kvarn"  # instance attribute set by `patch` on each attention module it takes over


@dataclass
class AttentionBinding:
    """Per attention module: which adapter serves it, with which config and backend (resolved once, by `patch`);
    ``cache`` is set for one forward call."""

    adapter: Adapter
    config: KVarNConfig
    backend: Backend
    fallback: str  # "sdpa", PADDED_SDPA or "eager": how full-precision attention runs (prefill, unquantized layers)
    kv_heads: int | None = None  # kv heads of this rank's shard under tensor parallelism, None: the config's
    cache: Any = field(default=None, repr=False)

    def layer(self, module: nn.Module):
        """The module's KVarN cache layer for this call, or None (no cache, or an unquantized layer)."""
        layers = getattr(self.cache, "layers", None)
        idx = getattr(module, "layer_idx", None)
        if layers is None or idx is None or idx >= len(layers):
            return None
        layer = layers[idx]
        return layer if getattr(layer, "is_kvarn", False) else None


def find_binding(model: nn.Module) -> AttentionBinding | None:
    """The binding `kvarn_mla.patch` left on the model's attention modules, or None if it is not patched."""
    return next((m.__dict__[BINDING_ATTR] for m in model.modules() if BINDING_ATTR in m.__dict__), None)


class Adapter:
    """One attention family. Subclasses define the streams, how to find and prepare modules, and the attention."""

    family: str = ""

    def stream_specs(self, text_config, config: KVarNConfig, kv_heads: int | None = None) -> tuple[StreamSpec, ...]:
        """The (key-slot, value-slot) streams of one full-attention layer; ``kv_heads`` overrides the config's
        (a tensor-parallel rank's share)."""
        raise NotImplementedError

    def local_kv_heads(self, module: nn.Module) -> int | None:
        """The kv heads this process computes for ``module`` when its projections are tensor-parallel shards,
        else None. Families whose cached streams are replicated across ranks (MLA) keep None."""
        return None

    def is_attention(self, module: nn.Module) -> bool:
        """Whether ``module`` is an attention module of this family that writes a cache layer."""
        raise NotImplementedError

    def prepare(self, module: nn.Module) -> None:
        """Per-instance changes needed before the attention function can serve ``module``."""

    def restore(self, module: nn.Module) -> None:
        """Undo `prepare` exactly."""

    def full_precision(self, module, query, key, value, mask, fallback: str, **kwargs) -> tuple[torch.Tensor, Any]:
        """Attention over the given (cache-layout) tensors as the unpatched model computes it:
        ``(out [B, S, H, Dv], weights or None)``."""
        raise NotImplementedError

    def quantized(self, module, query, layer, mask, scaling: float, backend: Backend) -> torch.Tensor:
        """Attention of ``query [B, H, S, D]`` over the layer's whole store (``backend.attend``): ``[B, S, H, Dv]``."""
        raise NotImplementedError


# ---- masks ---------------------------------------------------------------------------------------------------------
def to_bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A ``[B, 1, S, T]`` mask as bool (True = attend); additive float masks are converted."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, q_len, kv_len]`` bool: query i (absolute position kv_len - q_len + i) sees keys up to itself."""
    past = kv_len - q_len
    q_pos = torch.arange(q_len, device=device).unsqueeze(-1) + past
    return (torch.arange(kv_len, device=device) <= q_pos)[None, None]


def select_topk(mask: torch.Tensor | None, indices: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """Restrict a mask to the DSA indexer's top-k keys: ``indices [B, S, k]`` int positions in ``[0, kv_len)``."""
    if indices is None:
        return mask
    batch, q_len, _ = indices.shape
    chosen = torch.zeros(batch, q_len, kv_len, dtype=torch.bool, device=indices.device)
    chosen.scatter_(-1, indices.long(), True)
    base = causal_mask(q_len, kv_len, indices.device) if mask is None else mask
    return base & chosen.unsqueeze(1)


def token_validity(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``[B, T]`` bool, False at key positions no query may attend (padding); None when nothing is masked out."""
    if mask is None:
        return None
    return mask.any(dim=-2)[:, 0].expand(batch, -1)


# ---- full-precision attention ----------------------------------------------------------------------------------------
PADDED_SDPA = "sdpa_pad_v"  # the name `padded_sdpa_attention` is registered under (`kvarn_mla.patch`)


def padded_sdpa_attention(module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention with a value head narrower than the query's zero-padded to the query's width and
    the output cut back: ``(out [B, S, H, Dv], None)``, the same numbers as plain sdpa up to rounding.

    MLA's value head (``v_head_dim``) is narrower than its query/key head (``qk_nope_head_dim + qk_rope_head_dim``).
    torch's fused SDPA kernels take one head width, so with the widths apart SDPA runs its math path, which writes
    out the ``[B, H, S, T]`` scores: on the CPU about 6x slower per layer at 8,192 tokens, and 8 GiB per layer
    (8 heads, fp32) at 16,384. The value's zero columns add nothing to the columns kept.
    """
    width = value.shape[-1]
    if width < query.shape[-1]:
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out[..., :width], weights


def fallback_attention(module, query, key, value, mask, fallback: str, **kwargs) -> tuple[torch.Tensor, Any]:
    """transformers' own sdpa, `padded_sdpa_attention` or the model's eager attention (``fallback``: the implementation
    the unpatched model used), given a bool mask (or None for causal):
    ``(out [B, S, H, Dv], weights [B, H, S, T] from eager, None from sdpa)``."""
    if fallback == "eager":
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
        q_len, kv_len = query.shape[2], key.shape[2]
        bool_mask = causal_mask(q_len, kv_len, query.device) if mask is None else mask
        additive = torch.zeros(bool_mask.shape, dtype=query.dtype, device=query.device)
        mask = additive.masked_fill(~bool_mask, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, mask, **kwargs)
    if fallback == PADDED_SDPA:
        return padded_sdpa_attention(module, query, key, value, mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def kvarn_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function registered as ``"kvarn"`` with transformers' `AttentionInterface`.

    A prefill over an empty cache attends the prompt in full precision exactly as the unpatched model does; any
    later call (decode, a prefill chunk, speculative verification) attends the layer's store: sink and tail in full
    precision, quantized tiles through folded scales. Tiles that filled are quantized after the forward pass
    (`KVarNCache.flush`, called by a hook `patch` installs on the decoder). When the pass asks for attention
    weights (``output_attentions``), the model's eager attention runs instead, over the whole store dequantized
    (the same scores, written out).

    Args:
        module: The attention module (``layer_idx`` selects the cache layer).
        query: ``[B, H, S, D]``.
        key, value: What the module passed: new K/V ``[B, Hkv, S, D]``, or for MLA the new latent ``[B, 1, S, R]``
            and RoPE key ``[B, 1, S, dr]`` (`expand_kv` is bypassed).
        attention_mask: ``[B, 1, S, T]`` bool from the registered mask function, or None (causal).
        scaling: Softmax scale (``module.scaling``, yarn mscale included).
        **kwargs: ``indices`` (DSA top-k ``[B, S, k]``), ``sliding_window`` and whatever else the model passes.

    Returns:
        ``(out [B, S, H, Dv], attention weights [B, H, S, T] or None)``.
    """
    binding: AttentionBinding | None = module.__dict__.get(BINDING_ATTR)
    if binding is None:  # a module `patch` did not take over (e.g. a vision tower sharing the config)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scaling = module.scaling if scaling is None else scaling
    mask = to_bool_mask(attention_mask)
    indices = kwargs.pop("indices", None)
    layer = binding.layer(module)
    weights_wanted = getattr(binding.cache, "output_attentions", False)
    fallback = "eager" if weights_wanted else binding.fallback
    if layer is None or layer.length == layer.new_tokens:
        return binding.adapter.full_precision(module, query, key, value, select_topk(mask, indices, key.shape[2]),
                                              fallback, dropout=dropout, scaling=scaling, **kwargs)
    mask = select_topk(mask, indices, layer.length)
    if weights_wanted:
        return binding.adapter.full_precision(module, query, layer.keys, layer.values, mask, "eager",
                                              dropout=dropout, scaling=scaling, **kwargs)
    return binding.adapter.quantized(module, query, layer, mask, scaling, binding.backend), None
