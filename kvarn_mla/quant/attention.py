"""Attention over a layer's streams: the torch path, and the reference of the fused Triton decode kernel.

Every family reduces to grouped-query attention of ``M`` query rows per kv head over one store: the key is one or
two streams side by side (dense K; or the MLA latent and RoPE key), the value is its own stream (dense V) or the
first key stream (the MLA latent).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .hadamard import rotate
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
    """Softmax attention of ``q`` over the streams' stored tokens, quantized tiles read with folded scales.

    One pass over position blocks (the sink, runs of tiles, the tail) with an online softmax, as the kernel does:
    each run of tiles is unpacked once for both products, and the transient stays bounded at any length.

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
    batch, heads, rows, _ = q.shape
    q = q.float()
    queries, offset = [], 0  # per key stream: (plain query, query in the stream's tile basis)
    for stream in keys:
        part = q[..., offset : offset + stream.spec.dim]
        rotated = isinstance(stream, TiledStream) and stream.hadamard
        queries.append((part, rotate(part) if rotated else part))
        offset += stream.spec.dim
    length = keys[0].length
    if mask is None:
        mask = attention_mask(q_len, length, kv_start, batch, q.device)
    value_stream = keys[0] if values is None else values
    tiled = next((s for s in (*keys, value_stream) if isinstance(s, TiledStream)), None)
    ranges = tiled.block_ranges(rows) if tiled is not None else [(0, length)]

    top = q.new_full((batch, heads, rows), float("-inf"))
    total = q.new_zeros(batch, heads, rows)
    plain = q.new_zeros(batch, heads, rows, value_stream.spec.dim)
    in_basis = torch.zeros_like(plain)  # values of rotated tiles, rotated back once at the end
    for start, end in ranges:
        blocks = [stream.block(start, end) for stream in keys]
        scores = sum(b.scores(rot if b.rotated else part) for b, (part, rot) in zip(blocks, queries)) * scaling
        if mask is not None:
            # The most negative float rather than -inf keeps a fully masked row (a padding query) finite,
            # as in transformers' eager attention.
            keep = mask[..., start:end].unsqueeze(2)  # [B, 1, 1, S, n]
            scores = scores.view(batch, heads, rows // q_len, q_len, -1).masked_fill(~keep, torch.finfo(q.dtype).min)
            scores = scores.view(batch, heads, rows, -1)
        new_top = torch.maximum(top, scores.amax(-1))
        decay = torch.exp(top - new_top)
        probs = torch.exp(scores - new_top.unsqueeze(-1))
        total = total * decay + probs.sum(-1)
        plain, in_basis = plain * decay.unsqueeze(-1), in_basis * decay.unsqueeze(-1)
        value_block = blocks[0] if values is None else values.block(start, end)
        if value_block.rotated:
            in_basis = in_basis + value_block.values(probs)
        else:
            plain = plain + value_block.values(probs)
        top = new_top
    return (plain + rotate(in_basis)) / total.unsqueeze(-1)
