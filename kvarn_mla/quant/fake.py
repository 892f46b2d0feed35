"""`fake_quantize`: a tensor through the cache's quantize-dequantize round trip, for studying KV statistics."""

from __future__ import annotations

import torch

from ..config import KVarNConfig
from .store import StreamSpec, TiledStream
from .tile import check_axis

_TILE_FIELDS = ("tile_size", "sink_tokens", "varnorm_iters", "hadamard")


def fake_quantize(x: torch.Tensor, bits: int, axis: str, **config_fields) -> torch.Tensor:
    """Quantize and dequantize ``x [..., T, D]`` tile by tile exactly as the cache stores it.

    The first ``sink_tokens`` and the trailing partial tile come back unchanged (the cache keeps them in full
    precision); every full tile in between is rotated, normalized, RTN-quantized with fp16 metadata, and restored.

    Args:
        x: ``[..., T, D]`` float tensor (e.g. one layer's keys ``[B, H, T, D]``).
        bits: 2, 3, 4, 8 (16 returns ``x``).
        axis: ``"channel"`` for keys and the MLA latent, ``"token"`` for values.
        **config_fields: `KVarNConfig` fields ``tile_size``, ``sink_tokens``, ``varnorm_iters``, ``hadamard``
            (defaults as in `KVarNConfig`).

    Returns:
        A tensor of ``x``'s shape and dtype.
    """
    check_axis(axis)
    unknown = set(config_fields) - set(_TILE_FIELDS)
    if unknown:
        raise ValueError(f"fake_quantize takes config fields {_TILE_FIELDS}, got unknown {sorted(unknown)}")
    config = KVarNConfig(key_bits=bits, **config_fields)  # validates bits and the fields
    if x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"fake_quantize expects a float tensor [..., T, D], got shape={tuple(x.shape)} dtype={x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("fake_quantize input contains NaN or Inf")
    if bits == 16:
        return x.clone()
    tokens, dim = x.shape[-2:]
    stream = TiledStream(
        StreamSpec("x", 1, dim, bits, axis), config.tile_size, config.sink_tokens, config.varnorm_iters, config.hadamard
    )
    stream.append(x.reshape(-1, 1, tokens, dim))
    stream.flush()
    return stream.dequantized().to(x.dtype).reshape(x.shape)
