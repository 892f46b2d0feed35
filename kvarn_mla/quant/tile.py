"""The KVarN tile: rotate, variance-normalize, RTN, pack, and the matching dequantization.

A tile is ``G`` consecutive tokens of one head's stream, ``x [G, D]``, always stored token-major (``codes [G, D]``
packed along channels). What differs between keys and values is the quantization axis:

* ``axis="channel"`` (keys, the MLA latent and RoPE key): rows are channels, each quantized over the G tokens.
  ``scale``/``zero`` are per channel ``[D]``, ``gamma`` per token ``[G]``.
* ``axis="token"`` (values): rows are tokens, each quantized over the D channels.
  ``scale``/``zero`` are per token ``[G]``, ``gamma`` per channel ``[D]``.

Either way the (rotated) tile is reconstructed as ``x̂ = (code * scale_row + zero_row) * gamma_col``: the RTN step
and minimum absorb the row normalization scale, ``gamma`` is the column normalization scale.

Precision, shared with the store kernel so that integer codes match exactly: the rotation is computed in float64
and rounded to float32 (the kernel's scratch precision); normalization and RTN run in float64; metadata is rounded
float64 -> float32 (-> float16 when stored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hadamard import hadamard_matrix, rotate
from .rtn import pack, quantize_rows, unpack
from .scheme import TileScheme
from .varnorm import variance_normalize

METADATA_DTYPE = torch.float16  # scale, zero and gamma as stored in the cache
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass
class QuantizedTile:
    """Quantized tiles with any leading batch shape ``[...]``.

    Attributes:
        codes: ``[..., G, packed_width(D, bits)]`` uint8, token-major codes packed along channels.
        scale: ``[..., R]`` per-row RTN step times the row normalization scale (R = D for channel axis, G for token).
        zero: ``[..., R]`` per-row minimum times the row normalization scale.
        gamma: ``[..., C]`` per-column normalization scale (C = G for channel axis, D for token).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    gamma: torch.Tensor

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.zero, self.gamma

    def to_metadata_dtype(self) -> QuantizedTile:
        return QuantizedTile(self.codes, *(t.to(METADATA_DTYPE) for t in (self.scale, self.zero, self.gamma)))


def quantize_tile(x: torch.Tensor, scheme: TileScheme, token_valid: torch.Tensor | None = None) -> QuantizedTile:
    """Quantize tiles ``x [..., G, D]`` with KVarN (float32 metadata; see `QuantizedTile`).

    Args:
        x: ``[..., G, D]`` tiles of any float dtype.
        scheme: A quantized `TileScheme` (bits, axis, normalization iterations, rotation).
        token_valid: Optional ``[..., G]`` bool, False for padding tokens, which are left out of every statistic.

    Returns:
        The quantized tiles, metadata in float32.
    """
    xr = rotate_for_quantization(x) if scheme.hadamard else x.float()
    channel = scheme.axis == "channel"
    rows = xr.double().transpose(-1, -2) if channel else xr.double()  # [..., R, C]
    row_valid, col_valid = (None, token_valid) if channel else (token_valid, None)
    row_scale, col_scale = variance_normalize(rows, scheme.varnorm_iters, row_valid, col_valid)
    z = rows / (row_scale.unsqueeze(-1) * col_scale.unsqueeze(-2))
    codes, step, lo = quantize_rows(z, scheme.bits, col_valid)
    codes = codes.transpose(-1, -2) if channel else codes  # token-major [..., G, D]
    metadata = (t.float() for t in (row_scale * step, row_scale * lo, col_scale))
    return QuantizedTile(pack(codes, scheme.bits), *metadata)


def store_tiles_reference(
    x: torch.Tensor, scheme: TileScheme, token_valid: torch.Tensor | None = None
) -> QuantizedTile:
    """Tiles as the cache stores them (float16 metadata): the reference of `kvarn_mla.kernels.store.store_tiles`."""
    return quantize_tile(x, scheme, token_valid).to_metadata_dtype()


def rotate_for_quantization(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` computed in float64, rounded to float32: ``[..., D]`` -> ``[..., D]`` float32."""
    h = hadamard_matrix(x.shape[-1], x.device, torch.float64)
    return (x.double() @ h).float()


def metadata_overflow(tile: QuantizedTile) -> float | None:
    """The largest metadata magnitude if it does not fit fp16 (or is not finite), else None."""
    if tile.scale.numel() == 0:
        return None
    largest = max(float(t.float().abs().amax()) for t in (tile.scale, tile.zero, tile.gamma))
    return largest if not largest <= _FP16_MAX else None


def dequantize_tile(tile: QuantizedTile, scheme: TileScheme, dim: int) -> torch.Tensor:
    """Reconstruct ``[..., G, D]`` float32 tiles, un-rotated back to the model's channel basis (``scheme.hadamard``)."""
    codes = unpack(tile.codes, scheme.bits, dim).float()  # [..., G, D]
    scale, zero, gamma = (t.float() for t in (tile.scale, tile.zero, tile.gamma))
    if scheme.axis == "channel":
        x = (codes * scale.unsqueeze(-2) + zero.unsqueeze(-2)) * gamma.unsqueeze(-1)
    else:
        x = (codes * scale.unsqueeze(-1) + zero.unsqueeze(-1)) * gamma.unsqueeze(-2)
    return rotate(x) if scheme.hadamard else x
