"""Attention products over quantized tiles with folded scales: no dequantized tile is ever formed.

For a channel-axis tile (per-channel ``scale``/``zero``, per-token ``gamma``)::

    score_t = gamma_t * ( sum_c (q_c * scale_c) * code[t, c] + sum_c q_c * zero_c )
    out_c   = scale_c * sum_t (p_t * gamma_t) * code[t, c] + zero_c * sum_t p_t * gamma_t

and for a token-axis tile (per-token ``scale``/``zero``, per-channel ``gamma``)::

    score_t = scale_t * sum_c (q_c * gamma_c) * code[t, c] + zero_t * sum_c q_c * gamma_c
    out_c   = gamma_c * ( sum_t (p_t * scale_t) * code[t, c] + sum_t p_t * zero_t )

so per tile the scales multiply the (few) queries or probabilities once, and the inner products run over the raw
integer codes. These are the torch references of the fused Triton decode kernel; `kvarn_mla.quant.attention` reads a
stream through them in blocks of tiles, so the transient memory stays bounded whatever the context length.
"""

from __future__ import annotations

import torch

from .scheme import Axis


def tile_scores(q: torch.Tensor, codes: torch.Tensor, scale, zero, gamma, axis: Axis) -> torch.Tensor:
    """Scores of ``q [B, H, M, D]`` (float32) against unpacked tiles ``codes [B, H, n, G, D]``.

    The code products run in the codes' dtype (the torch path unpacks them to float32);
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
