"""Attention products over quantized tiles with folded scales: no dequantized tile is ever formed.

For a channel-axis tile (per-channel ``scale``/``zero``, per-token ``gamma``)::

    score_t = gamma_t * ( sum_c (q_c * scale_c) * code[t, c] + sum_c q_c * zero_c )
    out_c   = scale_c * sum_t (p_t * gamma_t) * code[t, c] + zero_c * sum_t p_t * gamma_t

and for a token-axis tile (per-token ``scale``/``zero``, per-channel ``gamma``)::

    score_t = scale_t * sum_c (q_c * gamma_c) * code[t, c] + zero_t * sum_c q_c * gamma_c
    out_c   = gamma_c * ( sum_t (p_t * scale_t) * code[t, c] + sum_t p_t * zero_t )

so per tile the scales multiply the (few) queries or probabilities once, and the inner products run over the raw
integer codes. These are the torch references of the fused Triton decode kernel. Tiles are processed in chunks,
so the transient memory is bounded whatever the context length.
"""

from __future__ import annotations

import torch

from .rtn import unpack
from .tile import Axis, QuantizedTile

CHUNK_ELEMENTS = 1 << 22  # float32 elements of transient per chunk (16 MiB)


def _chunks(num_tiles: int, per_tile: int):
    step = max(1, CHUNK_ELEMENTS // max(per_tile, 1))
    for start in range(0, num_tiles, step):
        yield start, min(num_tiles, start + step)


def _slice(tiles: QuantizedTile, start: int, end: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[:, :, start:end] for t in (tiles.codes, tiles.scale, tiles.zero, tiles.gamma))


def tile_scores(q: torch.Tensor, codes: torch.Tensor, scale, zero, gamma, axis: Axis) -> torch.Tensor:
    """Scores of ``q [B, H, M, D]`` (float32) against unpacked tiles ``codes [B, H, n, G, D]``.

    The codes' dtype is the compute precision of the code products (float32, or bfloat16 for bfloat16 models);
    scales are float32 and so is the result, ``[B, H, M, n * G]``.
    """
    batch, heads, rows, _ = q.shape
    if axis == "channel":
        qa = (q.unsqueeze(2) * scale.unsqueeze(3)).to(codes.dtype)  # [B, H, n, M, D]
        dots = torch.einsum("bhnmd,bhntd->bhmnt", qa, codes).float()
        bias = torch.einsum("bhmd,bhnd->bhmn", q, zero).unsqueeze(-1)
        out = (dots + bias) * gamma.unsqueeze(2)
    else:
        qg = q.unsqueeze(2) * gamma.unsqueeze(3)  # [B, H, n, M, D]
        dots = torch.einsum("bhnmd,bhntd->bhmnt", qg.to(codes.dtype), codes).float()
        out = dots * scale.unsqueeze(2) + qg.sum(-1).transpose(2, 3).unsqueeze(-1) * zero.unsqueeze(2)
    return out.reshape(batch, heads, rows, -1)


def tile_values(p: torch.Tensor, codes: torch.Tensor, scale, zero, gamma, axis: Axis) -> torch.Tensor:
    """Probability-weighted sum ``[B, H, M, D]`` (float32, tiles' basis) of unpacked tiles ``codes [B, H, n, G, D]``
    with weights ``p [B, H, M, n * G]`` (float32)."""
    batch, heads, rows, _ = p.shape
    count, size = codes.shape[2:4]
    p = p.reshape(batch, heads, rows, count, size)
    if axis == "channel":
        pg = p * gamma.unsqueeze(2)  # [B, H, M, n, G]
        weighted = torch.einsum("bhmnt,bhntd->bhmnd", pg.to(codes.dtype), codes).float()
        return torch.einsum("bhmnd,bhnd->bhmd", weighted, scale) + torch.einsum("bhmn,bhnd->bhmd", pg.sum(-1), zero)
    weighted = torch.einsum("bhmnt,bhntd->bhmnd", (p * scale.unsqueeze(2)).to(codes.dtype), codes).float()
    weighted = weighted + (p * zero.unsqueeze(2)).sum(-1, keepdim=True)
    return torch.einsum("bhmnd,bhnd->bhmd", weighted, gamma)


def _unpacked(tiles: QuantizedTile, start: int, end: int, bits: int, dim: int):
    packed, scale, zero, gamma = _slice(tiles, start, end)
    return unpack(packed, bits, dim).float(), scale.float(), zero.float(), gamma.float()


def folded_scores(q: torch.Tensor, tiles: QuantizedTile, bits: int, axis: Axis, dim: int) -> torch.Tensor:
    """Dot products of queries with every token of quantized tiles, float32 throughout.

    Args:
        q: ``[B, H, M, D]`` float32 queries (M = query rows per kv head), in the tiles' (rotated) basis.
        tiles: Tiles with leading shape ``[B, H, N]``.
        bits, axis, dim: How the tiles were quantized, and D.

    Returns:
        ``[B, H, M, N * G]`` float32 scores, tokens in order.
    """
    num_tiles, tile_size = tiles.codes.shape[2], tiles.codes.shape[3]
    parts = [tile_scores(q, *_unpacked(tiles, start, end, bits, dim), axis)
             for start, end in _chunks(num_tiles, tile_size * dim + q.shape[2] * (dim + tile_size))]
    return torch.cat(parts, -1) if parts else q.new_zeros(q.shape[:-1] + (0,))


def folded_values(p: torch.Tensor, tiles: QuantizedTile, bits: int, axis: Axis, dim: int) -> torch.Tensor:
    """Probability-weighted sum of the tokens of quantized tiles, float32 throughout.

    Args:
        p: ``[B, H, M, N * G]`` float32 attention weights for the tiles' tokens.
        tiles: Tiles with leading shape ``[B, H, N]``.
        bits, axis, dim: How the tiles were quantized, and D.

    Returns:
        ``[B, H, M, D]`` float32, in the tiles' (rotated) basis.
    """
    num_tiles, tile_size = tiles.codes.shape[2], tiles.codes.shape[3]
    out = p.new_zeros(p.shape[:-1] + (dim,))
    for start, end in _chunks(num_tiles, tile_size * dim + p.shape[2] * (dim + tile_size)):
        chunk = p[..., start * tile_size : end * tile_size]
        out += tile_values(chunk, *_unpacked(tiles, start, end, bits, dim), axis)
    return out
