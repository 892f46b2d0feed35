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


def folded_scores(q: torch.Tensor, tiles: QuantizedTile, bits: int, axis: Axis, dim: int) -> torch.Tensor:
    """Dot products of queries with every token of quantized tiles.

    Args:
        q: ``[B, H, M, D]`` float32 queries (M = query rows per kv head), in the tiles' (rotated) basis.
        tiles: Tiles with leading shape ``[B, H, N]``.
        bits, axis, dim: How the tiles were quantized, and D.

    Returns:
        ``[B, H, M, N * G]`` float32 scores, tokens in order.
    """
    batch, heads, rows, _ = q.shape
    num_tiles, tile_size = tiles.codes.shape[2], tiles.codes.shape[3]
    out = q.new_empty(batch, heads, rows, num_tiles, tile_size)
    for start, end in _chunks(num_tiles, tile_size * dim + rows * (dim + tile_size)):
        packed, scale, zero, gamma = (t.float() if t.is_floating_point() else t for t in _slice(tiles, start, end))
        codes = unpack(packed, bits, dim).float()  # [B, H, n, G, D]
        if axis == "channel":
            dots = torch.einsum("bhnmd,bhntd->bhmnt", q.unsqueeze(2) * scale.unsqueeze(3), codes)
            bias = torch.einsum("bhmd,bhnd->bhmn", q, zero).unsqueeze(-1)
            out[:, :, :, start:end] = (dots + bias) * gamma.unsqueeze(2)
        else:
            qg = q.unsqueeze(2) * gamma.unsqueeze(3)  # [B, H, n, M, D]
            dots = torch.einsum("bhnmd,bhntd->bhmnt", qg, codes)
            out[:, :, :, start:end] = dots * scale.unsqueeze(2) + qg.sum(-1).transpose(2, 3).unsqueeze(-1) * zero.unsqueeze(2)
    return out.view(batch, heads, rows, num_tiles * tile_size)


def folded_values(p: torch.Tensor, tiles: QuantizedTile, bits: int, axis: Axis, dim: int) -> torch.Tensor:
    """Probability-weighted sum of the tokens of quantized tiles.

    Args:
        p: ``[B, H, M, N * G]`` float32 attention weights for the tiles' tokens.
        tiles: Tiles with leading shape ``[B, H, N]``.
        bits, axis, dim: How the tiles were quantized, and D.

    Returns:
        ``[B, H, M, D]`` float32, in the tiles' (rotated) basis.
    """
    batch, heads, rows, _ = p.shape
    num_tiles, tile_size = tiles.codes.shape[2], tiles.codes.shape[3]
    p = p.view(batch, heads, rows, num_tiles, tile_size)
    out = p.new_zeros(batch, heads, rows, dim)
    for start, end in _chunks(num_tiles, tile_size * dim + rows * (dim + tile_size)):
        packed, scale, zero, gamma = (t.float() if t.is_floating_point() else t for t in _slice(tiles, start, end))
        codes = unpack(packed, bits, dim).float()  # [B, H, n, G, D]
        pc = p[:, :, :, start:end]  # [B, H, M, n, G]
        if axis == "channel":
            pg = pc * gamma.unsqueeze(2)
            out += torch.einsum("bhmnt,bhntd,bhnd->bhmd", pg, codes, scale)
            out += torch.einsum("bhmn,bhnd->bhmd", pg.sum(-1), zero)
        else:
            weighted = torch.einsum("bhmnt,bhntd->bhmnd", pc * scale.unsqueeze(2), codes)
            weighted += (pc * zero.unsqueeze(2)).sum(-1, keepdim=True)
            out += torch.einsum("bhmnd,bhnd->bhmd", weighted, gamma)
    return out
