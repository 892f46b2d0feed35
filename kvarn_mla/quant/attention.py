"""Attention over a layer's streams: the torch path, and the reference of the fused Triton decode kernel.

Every family reduces to grouped-query attention of ``M`` query rows per kv head over one store: the key is one or
two streams side by side (dense K; or the MLA latent and RoPE key), the value is its own stream (dense V) or the
first key stream (the MLA latent).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .store import DenseStream, TiledStream

Stream = TiledStream | DenseStream


def attention_mask(
    q_len: int, kv_len: int, kv_start: torch.Tensor | None, batch: int, device: torch.device
) -> torch.Tensor | None:
    """``[B, 1, S, T]`` bool for prefix padding + causal queries, or None when every key is visible to every query.

    Query s (absolute position ``T - S + s``) sees keys ``kv_start[b] <= p <= T - S + s``.
    """
    if q_len == 1 and kv_start is None:
        return None
    positions = torch.arange(kv_len, device=device)
    mask = positions <= (torch.arange(q_len, device=device) + kv_len - q_len).unsqueeze(-1)  # [S, T]
    mask = mask.expand(batch, 1, q_len, kv_len)
    if kv_start is not None:
        mask = mask & (positions >= kv_start.to(device).view(batch, 1, 1, 1))
    return mask


def tiled_attention_reference(
    q: torch.Tensor,
    keys: Sequence[Stream],
    values: Stream | None,
    scaling: float,
    *,
    q_len: int = 1,
    kv_start: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of ``q`` over the streams' stored tokens (quantized tiles read with folded scales).

    Args:
        q: ``[B, Hkv, M, sum(key dims)]`` query rows per kv head, ordered ``(head in group, query)`` so that row
            ``m`` is query ``m % q_len``; the key dims are concatenated in ``keys`` order.
        keys: One or two streams of length T.
        values: The value stream, or None for ``keys[0]`` (MLA: the latent is the value).
        scaling: Softmax scale.
        q_len: Queries per row group (1 for decode); query ``s`` sits at position ``T - q_len + s`` (causal).
        kv_start: Optional ``[B]`` int, the first valid key position of each row (left padding).
        mask: Optional explicit ``[B, 1, q_len, T]`` bool mask (True = attend), replacing the causal/padding one;
            for masks the kernel cannot express (DSA top-k).

    Returns:
        ``[B, Hkv, M, Dv]`` float32.
    """
    values = keys[0] if values is None else values
    batch, heads, rows, _ = q.shape
    q = q.float()
    scores, offset = None, 0
    for stream in keys:
        part = stream.scores(q[..., offset : offset + stream.spec.dim])
        scores = part if scores is None else scores + part
        offset += stream.spec.dim
    kv_len = scores.shape[-1]
    if mask is None:
        mask = attention_mask(q_len, kv_len, kv_start, batch, q.device)
    scores = (scores * scaling).view(batch, heads, rows // q_len, q_len, kv_len)
    if mask is not None:
        # The most negative float rather than -inf: a fully masked row (a padding query) stays finite, as in
        # transformers' eager attention.
        scores = scores.masked_fill(~mask.unsqueeze(2), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).view(batch, heads, rows, kv_len)
    return values.weighted_sum(probs)
