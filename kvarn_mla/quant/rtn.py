"""Asymmetric min-max round-to-nearest per row, and bit packing.

Packing layout (the kernels must match it bit for bit): the codes of one row form a little-endian bit stream,
code ``i`` occupying bits ``[i*b, (i+1)*b)``. For 2/4/8 bits that is "``8/b`` codes per byte, lowest bits first"
(4-bit: the low nibble holds the even index); 3-bit codes pack 8 codes into 3 bytes. Rows are padded with zero
codes to a multiple of 8 codes, so a packed row always has ``ceil(n/8) * b`` bytes.
"""

from __future__ import annotations

import torch

STEP_MIN = 1e-10  # floor on the quantization step: constant rows quantize to code 0 exactly
# Before rounding, ``(z - lo) / step`` is snapped to a grid of 2^-SNAP_BITS: an exact tie (a value on a half-integer,
# common with coarse bf16/fp16 inputs) then rounds the same in every implementation, although the kernel's float64
# arithmetic (another reduction order, exp(-log) for 1/exp(log)) lands a few ulps to either side of it.
SNAP_BITS = 32


def quantize_rows(
    z: torch.Tensor, bits: int, col_valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max RTN of each row of ``z``.

    ``code = clamp(round(snap((z - lo) / step)), 0, 2^b - 1)`` with ``lo``/``hi`` the row min/max over valid
    columns, ``step = max((hi - lo) / (2^b - 1), 1e-10)``, ``snap`` rounding to the grid of 2^-32 (`SNAP_BITS`);
    ``torch.round`` rounds half to even.

    Args:
        z: ``[..., R, C]`` float64 (the reference's precision; float32 works).
        bits: Code width, 2..8.
        col_valid: Optional ``[..., C]`` bool; False columns do not count toward min/max (their codes are clamped).

    Returns:
        ``(codes [..., R, C] uint8, step [..., R], lo [..., R])``, step and lo in ``z.dtype``.
    """
    qmax = (1 << bits) - 1
    if col_valid is None:
        lo, hi = z.amin(-1), z.amax(-1)
    else:
        valid = col_valid.unsqueeze(-2)
        lo = z.masked_fill(~valid, float("inf")).amin(-1)
        hi = z.masked_fill(~valid, float("-inf")).amax(-1)
        empty = ~col_valid.any(-1, keepdim=True)
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    step = ((hi - lo) / qmax).clamp(min=STEP_MIN)
    levels = (z - lo.unsqueeze(-1)) / step.unsqueeze(-1)
    levels = torch.round(levels * 2.0**SNAP_BITS) / 2.0**SNAP_BITS
    codes = torch.round(levels).clamp(0, qmax).to(torch.uint8)
    return codes, step, lo


def packed_width(n: int, bits: int) -> int:
    """Bytes of one packed row of ``n`` codes."""
    return (n + 7) // 8 * bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[..., n]`` uint8 codes (< 2^bits) into ``[..., packed_width(n, bits)]`` uint8."""
    n = codes.shape[-1]
    pad = (-n) % 8
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    if bits == 8:
        return codes.contiguous()
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
        grouped = codes.view(*codes.shape[:-1], -1, per_byte) << shifts
        return _or_reduce(grouped)
    # General width (3 bits): 8 codes -> one (8*bits)-bit little-endian word -> `bits` bytes.
    groups = codes.view(*codes.shape[:-1], -1, 8).to(torch.int64)
    word = (groups << torch.arange(0, 8 * bits, bits, device=codes.device)).sum(-1, keepdim=True)
    out = (word >> torch.arange(0, 8 * bits, 8, device=codes.device)) & 0xFF
    return out.to(torch.uint8).flatten(-2)


def _or_reduce(grouped: torch.Tensor) -> torch.Tensor:
    out = grouped[..., 0]
    for i in range(1, grouped.shape[-1]):
        out = out | grouped[..., i]
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack`: ``[..., packed_width(n, bits)]`` uint8 -> ``[..., n]`` uint8 codes."""
    if bits == 8:
        return packed[..., :n]
    if 8 % bits == 0:
        # one scalar shift per code slot of a byte: on CPU several times faster than broadcasting a tensor of shifts
        mask = (1 << bits) - 1
        planes = [(packed >> shift) & mask if shift else packed & mask for shift in range(0, 8, bits)]
        return torch.stack(planes, -1).flatten(-2)[..., :n]
    groups = packed.view(*packed.shape[:-1], -1, bits).to(torch.int64)
    word = (groups << torch.arange(0, 8 * bits, 8, device=packed.device)).sum(-1, keepdim=True)
    codes = (word >> torch.arange(0, 8 * bits, bits, device=packed.device)) & ((1 << bits) - 1)
    return codes.to(torch.uint8).flatten(-2)[..., :n]
