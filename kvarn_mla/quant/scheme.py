"""`TileScheme`: how one stream is quantized, and the one place where its fields are validated.

`kvarn_mla.KVarNConfig` builds one scheme per stream (`KVarNConfig.scheme`) and validates its own fields with the
same checks; the quantizer (reference and kernel), `fake_quantize`, the cache's stores and the decode launcher receive
a validated scheme and never check its fields again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .rtn import packed_width

BITS = (2, 3, 4, 8, 16)  # 16 = keep the stream in the model dtype
TILE_SIZES = (64, 128)
AXES = ("channel", "token")
MAX_VARNORM_ITERS = 64
Axis = Literal["channel", "token"]


def check_int(name: str, value, allowed, what: str) -> None:
    """Raise unless ``value`` is an ``int`` (not a bool or a float) in ``allowed``; ``what`` describes ``allowed``."""
    if type(value) is not int or value not in allowed:
        raise ValueError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")


def check_bits(name: str, value) -> None:
    check_int(name, value, BITS, f"one of {BITS} (16 keeps the stream unquantized)")


def check_iters(name: str, value) -> None:
    check_int(name, value, range(MAX_VARNORM_ITERS + 1), f"an integer in [0, {MAX_VARNORM_ITERS}]")


def check_layout(tile_size, sink_tokens, hadamard) -> None:
    check_int("tile_size", tile_size, TILE_SIZES, f"one of {TILE_SIZES}")
    if type(sink_tokens) is not int or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an integer >= 0, got {sink_tokens!r}")
    if type(hadamard) is not bool:
        raise ValueError(f"hadamard must be True or False, got {hadamard!r}")


def quantizer_method(hadamard: bool, varnorm_iters: int) -> str:
    """``"kvarn"`` (normalized), ``"rotation"`` (QuaRot-style: rotated, not normalized) or ``"rtn"`` (KIVI-style)."""
    if varnorm_iters > 0:
        return "kvarn"
    return "rotation" if hadamard else "rtn"


@dataclass(frozen=True)
class TileScheme:
    """How one stream is quantized.

    Attributes:
        bits: 2, 3, 4, 8, or 16 (the stream stays in the model dtype; nothing below applies).
        axis: ``"channel"`` (keys, the MLA latent and RoPE key: each channel quantized over the tile's tokens) or
            ``"token"`` (values: each token over its channels).
        tile_size: G, tokens per quantized tile.
        sink_tokens: Leading tokens kept in the model dtype.
        varnorm_iters: Dual-axis variance-normalization iterations (0: off).
        hadamard: Rotate channels before normalizing.
    """

    bits: int
    axis: Axis
    tile_size: int = 128
    sink_tokens: int = 128
    varnorm_iters: int = 8
    hadamard: bool = True

    def __post_init__(self) -> None:
        check_bits("bits", self.bits)
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        check_layout(self.tile_size, self.sink_tokens, self.hadamard)
        check_iters("varnorm_iters", self.varnorm_iters)

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def method(self) -> str:
        return quantizer_method(self.hadamard, self.varnorm_iters) if self.quantized else "16-bit"

    def rows_cols(self, dim: int) -> tuple[int, int]:
        """(R, C) of a tile's RTN rows and normalization columns: ``(D, G)`` on the channel axis, else ``(G, D)``."""
        return (dim, self.tile_size) if self.axis == "channel" else (self.tile_size, dim)

    def tile_nbytes(self, dim: int) -> int:
        """Bytes of one quantized tile of one head: packed codes + scale + zero (fp16, per row) + gamma (fp16, per
        column)."""
        rows, cols = self.rows_cols(dim)
        return self.tile_size * packed_width(dim, self.bits) + 2 * (2 * rows + cols)
