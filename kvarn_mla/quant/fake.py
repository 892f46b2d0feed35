"""`fake_quantize`: a tensor through the cache's quantize-dequantize round trip, for studying KV statistics."""

from __future__ import annotations

import dataclasses

import torch

from .scheme import TileScheme
from .tile import dequantize_tile, store_tiles_reference

_SCHEME_FIELDS = tuple(f.name for f in dataclasses.fields(TileScheme) if f.name not in ("bits", "axis"))


def fake_quantize(x: torch.Tensor, bits: int | TileScheme, axis: str | None = None, **scheme_fields) -> torch.Tensor:
    """Quantize and dequantize ``x [..., T, D]`` tile by tile exactly as the cache stores it.

    The first ``sink_tokens`` and the trailing partial tile come back unchanged (the cache keeps them in full
    precision); every full tile in between is rotated, normalized, RTN-quantized with fp16 metadata, and restored.

    Args:
        x: ``[..., T, D]`` float tensor (e.g. one layer's keys ``[B, H, T, D]``).
        bits: 2, 3, 4, 8 (16 returns a copy of ``x``), or a whole `TileScheme` (then no other argument).
        axis: ``"channel"`` for keys and the MLA latent, ``"token"`` for values.
        **scheme_fields: ``tile_size``, ``sink_tokens``, ``varnorm_iters``, ``hadamard`` (defaults as in
            `KVarNConfig`).

    Returns:
        A tensor of ``x``'s shape and dtype.
    """
    if isinstance(bits, TileScheme):
        scheme = bits
    else:
        unknown = set(scheme_fields) - set(_SCHEME_FIELDS)
        if unknown:
            raise ValueError(f"fake_quantize takes the fields {_SCHEME_FIELDS}, got unknown {sorted(unknown)}")
        scheme = TileScheme(bits, axis, **scheme_fields)  # validates every field
    if x.dim() < 2 or not x.is_floating_point():
        raise ValueError(
            f"fake_quantize expects a float tensor [..., T, D], got shape={tuple(x.shape)} dtype={x.dtype}"
        )
    if not bool(torch.isfinite(x).all()):
        raise ValueError("fake_quantize input contains NaN or Inf")
    out = x.clone()
    tokens, dim = x.shape[-2:]
    sink, size = min(tokens, scheme.sink_tokens), scheme.tile_size
    count = (tokens - sink) // size if scheme.quantized and sink == scheme.sink_tokens else 0
    if count:
        tiles = x[..., sink : sink + count * size, :].reshape(-1, size, dim)
        restored = dequantize_tile(store_tiles_reference(tiles, scheme), scheme, dim)
        out[..., sink : sink + count * size, :] = restored.reshape(*x.shape[:-2], count * size, dim).to(x.dtype)
    return out
