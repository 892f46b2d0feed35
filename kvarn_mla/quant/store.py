"""Per-stream token storage: a full-precision stream, and the KVarN tiled stream (sink | quantized tiles | tail).

A layer of the cache holds two streams (dense: K and V; MLA: the latent ``c_kv`` and the RoPE key ``k_pe``). Each
stream stores ``[B, H, T, D]`` tokens and answers the two attention products over all of them, ``scores(q)`` and
``weighted_sum(p)``, without ever building a dequantized copy of its tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .folded import tile_scores, tile_values
from .rtn import packed_width, unpack
from .tile import (
    METADATA_DTYPE,
    Axis,
    QuantizedTile,
    check_axis,
    dequantize_tile,
    metadata_overflow,
    store_tiles_reference,
)

GROWTH = 1.25  # spare capacity on reallocation: appends copy each stored element O(1/(GROWTH-1)) times in total
BLOCK_ELEMENTS = 1 << 22  # elements of unpacked codes and products per block of a read (bounds the transient)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the products with codes and full-precision tokens: bfloat16 stays bfloat16 (fast, and what
    the model itself computes in), everything else runs in float32. Softmax and accumulation are float32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


@dataclass
class Block:
    """A run of one stream's tokens, read once for both attention products.

    Either full-precision ``tokens [B, H, n, D]``, or unpacked ``codes [B, H, k, G, D]`` (compute precision) with
    their float32 ``scale``/``zero``/``gamma``; ``rotated`` tells whether it lives in the Hadamard basis.
    """

    rotated: bool
    tokens: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    gamma: torch.Tensor | None = None
    axis: Axis = "channel"

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """``q [B, H, M, D]`` float32 (in this block's basis) -> ``[B, H, M, n]`` float32."""
        if self.tokens is not None:
            dtype = compute_dtype(self.tokens.dtype)
            return (q.to(dtype) @ self.tokens.to(dtype).transpose(-1, -2)).float()
        return tile_scores(q, self.codes, self.scale, self.zero, self.gamma, self.axis)

    def values(self, p: torch.Tensor) -> torch.Tensor:
        """``p [B, H, M, n]`` float32 -> ``[B, H, M, D]`` float32 (in this block's basis)."""
        if self.tokens is not None:
            dtype = compute_dtype(self.tokens.dtype)
            return (p.to(dtype) @ self.tokens.to(dtype)).float()
        return tile_values(p, self.codes, self.scale, self.zero, self.gamma, self.axis)


@dataclass(frozen=True)
class StreamSpec:
    """What one stream of a layer holds.

    Attributes:
        name: ``"key"``, ``"value"``, ``"latent"``, ``"rope"`` or ``"indexer"``.
        num_heads: H, kv heads of the stream (1 for the MLA streams).
        dim: D, channels per head.
        bits: 2, 3, 4, 8, or 16 for full precision.
        axis: ``"channel"`` (keys, MLA) or ``"token"`` (values).
    """

    name: str
    num_heads: int
    dim: int
    bits: int
    axis: Axis

    def __post_init__(self) -> None:
        check_axis(self.axis)

    def tile_nbytes(self, tile_size: int) -> int:
        """Bytes of one quantized tile of one head: codes + scale + zero (fp16, per row) + gamma (fp16, per column)."""
        rows, cols = (self.dim, tile_size) if self.axis == "channel" else (tile_size, self.dim)
        return tile_size * packed_width(self.dim, self.bits) + 2 * (2 * rows + cols)


def _contiguous_copy(x: torch.Tensor) -> torch.Tensor:
    # Models hand over transposed views ([B, S, H, D] memory seen as [B, H, S, D]); the store keeps its own
    # token-major copy, the layout the kernels read.
    return x.clone(memory_format=torch.contiguous_format)


class GrowableTensor:
    """A tensor that grows along dim 2 (``[B, H, n, ...]``) into spare capacity, so appends stay amortized O(1)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.length = 0

    @property
    def data(self) -> torch.Tensor | None:
        return None if self._buffer is None else self._buffer[:, :, : self.length]

    def append(self, x: torch.Tensor) -> None:
        needed = self.length + x.shape[2]
        if self._buffer is None or needed > self._buffer.shape[2]:
            capacity = max(needed, int(self.length * GROWTH) + 1)
            buffer = x.new_empty(x.shape[:2] + (capacity,) + x.shape[3:])
            if self.length:
                buffer[:, :, : self.length] = self.data
            self._buffer = buffer
        self._buffer[:, :, self.length : needed] = x
        self.length = needed

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def map_batch(self, fn) -> None:
        """Replace the storage by ``fn(live data)`` along the batch axis (beam reorder, batch selection)."""
        if self._buffer is not None:
            self._buffer = fn(self.data).contiguous()

    def nbytes(self) -> int:
        data = self.data
        return 0 if data is None else data.numel() * data.element_size()

    def allocated_nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()


class DenseStream:
    """A stream kept entirely in the model dtype (bits = 16), e.g. the exact MLA RoPE key or the DSA indexer keys."""

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.reset()

    def reset(self) -> None:
        self.tokens = GrowableTensor()

    @property
    def length(self) -> int:
        return self.tokens.length

    @property
    def batch_size(self) -> int | None:
        data = self.tokens.data
        return None if data is None else data.shape[0]

    def append(self, x: torch.Tensor) -> None:
        """Append ``x [B, H, S, D]``."""
        self.tokens.append(x)

    def flush(self, token_valid: torch.Tensor | None = None, quantize=None) -> None:
        """Nothing to quantize."""

    def pending_tiles(self) -> int:
        return 0

    def full(self) -> torch.Tensor:
        """All tokens, ``[B, H, T, D]`` in the model dtype (a view, no copy)."""
        return self.tokens.data

    def block(self, start: int, end: int) -> Block:
        """Tokens ``[start, end)`` for the attention products."""
        return Block(rotated=False, tokens=self.tokens.data[:, :, start:end])

    def crop(self, length: int) -> None:
        self.tokens.truncate(length)

    def map_batch(self, fn) -> None:
        self.tokens.map_batch(fn)

    def nbytes(self) -> int:
        return self.tokens.nbytes()

    def allocated_nbytes(self) -> int:
        return self.tokens.allocated_nbytes()


class TiledStream:
    """A KVarN-quantized stream: ``sink`` (full precision) | ``tiles`` (quantized) | ``tail`` (full precision).

    New tokens fill the sink first, then go to the tail. `flush` quantizes every full tile at the front of the tail
    (once; a tile is never re-quantized unless `crop` cuts into it). Quantized tiles are stored rotated (when
    ``hadamard``); the sink and tail hold the model's tokens unchanged.
    """

    def __init__(self, spec: StreamSpec, tile_size: int, sink_tokens: int, varnorm_iters: int, hadamard: bool):
        if spec.bits >= 16:
            raise ValueError(f"a TiledStream quantizes; use DenseStream for bits={spec.bits}")
        self.spec = spec
        self.tile_size = tile_size
        self.sink_tokens = sink_tokens
        self.varnorm_iters = varnorm_iters
        self.hadamard = hadamard
        self.reset()

    def reset(self) -> None:
        self.sink: torch.Tensor | None = None  # [B, H, <=sink_tokens, D]
        self.tail: torch.Tensor | None = None  # [B, H, t, D]
        self.dtype: torch.dtype | None = None  # the model dtype of sink and tail
        self._codes, self._scale, self._zero, self._gamma = (GrowableTensor() for _ in range(4))
        self._tile_stores = (self._codes, self._scale, self._zero, self._gamma)

    # ---- sizes -------------------------------------------------------------------------------------------------
    @property
    def num_tiles(self) -> int:
        return self._codes.length

    @property
    def sink_length(self) -> int:
        return 0 if self.sink is None else self.sink.shape[2]

    @property
    def tail_length(self) -> int:
        return 0 if self.tail is None else self.tail.shape[2]

    @property
    def tail_start(self) -> int:
        """Absolute position of the first tail token."""
        return self.sink_length + self.num_tiles * self.tile_size

    @property
    def length(self) -> int:
        return self.tail_start + self.tail_length

    @property
    def batch_size(self) -> int | None:
        for t in (self.sink, self.tail, self._codes.data):
            if t is not None:
                return t.shape[0]
        return None

    @property
    def tiles(self) -> QuantizedTile:
        """The quantized tiles, leading shape ``[B, H, N]`` (views of the storage)."""
        return QuantizedTile(self._codes.data, self._scale.data, self._zero.data, self._gamma.data)

    def pending_tiles(self) -> int:
        """Full tiles waiting in the tail for `flush`."""
        return self.tail_length // self.tile_size if self.sink_length >= self.sink_tokens else 0

    # ---- writes ------------------------------------------------------------------------------------------------
    def append(self, x: torch.Tensor) -> None:
        """Append ``x [B, H, S, D]`` (model dtype) to the sink, then the tail; quantization waits for `flush`."""
        self.dtype = x.dtype
        room = self.sink_tokens - self.sink_length
        if room > 0:
            head, x = x[:, :, :room], x[:, :, room:]
            self.sink = _contiguous_copy(head if self.sink is None else torch.cat([self.sink, head], 2))
        if x.shape[2]:
            self.tail = _contiguous_copy(x if self.tail is None else torch.cat([self.tail, x], 2))

    def flush(self, token_valid: torch.Tensor | None = None, quantize=store_tiles_reference) -> None:
        """Quantize every full tile at the front of the tail (see `flush_streams`)."""
        flush_streams([self], token_valid, quantize)

    def pending(self, token_valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The full tiles waiting in the tail, flattened: ``x [B*H*n, G, D]`` and validity ``[B*H*n, G]`` or None.

        Args:
            token_valid: Optional ``[B, T]`` bool over absolute positions (T >= this stream's length); False marks
                padding, which is left out of the tiles' statistics.
        """
        count = self.pending_tiles()
        batch, heads, _, dim = self.tail.shape
        size = count * self.tile_size
        x = self.tail[:, :, :size].reshape(batch * heads * count, self.tile_size, dim)
        if token_valid is None:
            return x, None
        valid = token_valid[:, self.tail_start : self.tail_start + size].reshape(batch, 1, count, self.tile_size)
        return x, valid.expand(batch, heads, count, self.tile_size).reshape(-1, self.tile_size)

    def commit(self, tile: QuantizedTile) -> None:
        """Store the quantized pending tiles (leading dim ``B*H*n``, fp16 metadata) and drop them from the tail."""
        batch, heads = self.tail.shape[:2]
        count = self.pending_tiles()
        for store, part in zip(self._tile_stores, tile.parts()):
            store.append(part.reshape(batch, heads, count, *part.shape[1:]))
        self.tail = _contiguous_copy(self.tail[:, :, count * self.tile_size :])

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens. A tile the cut falls inside goes back to the tail, dequantized."""
        if length >= self.length:
            return
        if length >= self.tail_start:
            self.tail = _contiguous_copy(self.tail[:, :, : length - self.tail_start])
            return
        if length == 0:
            self.reset()
            return
        if length <= self.sink_length:
            self.sink = _contiguous_copy(self.sink[:, :, :length])
            self.tail = None
            for store in self._tile_stores:
                store.truncate(0)
            return
        keep, cut = divmod(length - self.sink_length, self.tile_size)
        partial = None
        if cut:
            tile = QuantizedTile(*(t[:, :, keep] for t in self.tiles.parts()))
            restored = dequantize_tile(tile, self.spec.bits, self.spec.axis, self.spec.dim, hadamard=self.hadamard)
            partial = restored[:, :, :cut].to(self.dtype)
        for store in self._tile_stores:
            store.truncate(keep)
        self.tail = partial

    def map_batch(self, fn) -> None:
        """Apply ``fn`` along the batch axis of every tensor (beam reorder, batch selection)."""
        if self.sink is not None:
            self.sink = fn(self.sink).contiguous()
        if self.tail is not None:
            self.tail = fn(self.tail).contiguous()
        for store in self._tile_stores:
            store.map_batch(fn)

    # ---- reads -------------------------------------------------------------------------------------------------
    def block_ranges(self, rows: int) -> list[tuple[int, int]]:
        """Position ranges that split the stream for one read: the sink, runs of whole tiles (sized so an
        unpacked run stays under `BLOCK_ELEMENTS` with ``rows`` query rows), and the tail."""
        ranges = [(0, self.sink_length)] if self.sink_length else []
        dim, size = self.spec.dim, self.tile_size
        step = max(1, BLOCK_ELEMENTS // (size * dim + rows * (dim + size)))
        for first in range(0, self.num_tiles, step):
            ranges.append((self.sink_length + first * size, self.sink_length + min(self.num_tiles, first + step) * size))
        if self.tail_length:
            ranges.append((self.tail_start, self.length))
        return ranges

    def block(self, start: int, end: int) -> Block:
        """Tokens ``[start, end)`` for the attention products; a range of whole tiles comes unpacked (once)."""
        if end <= self.sink_length:
            return Block(rotated=False, tokens=self.sink[:, :, start:end])
        if start >= self.tail_start:
            return Block(rotated=False, tokens=self.tail[:, :, start - self.tail_start : end - self.tail_start])
        first, last = (start - self.sink_length) // self.tile_size, (end - self.sink_length) // self.tile_size
        assert self.sink_length + first * self.tile_size == start and last <= self.num_tiles, (start, end)
        codes, scale, zero, gamma = (t[:, :, first:last] for t in self.tiles.parts())
        codes = unpack(codes, self.spec.bits, self.spec.dim).to(compute_dtype(self.dtype))
        return Block(rotated=self.hadamard, codes=codes, scale=scale.float(), zero=zero.float(),
                     gamma=gamma.float(), axis=self.spec.axis)

    def dequantized(self) -> torch.Tensor:
        """Every token as the attention sees it, ``[B, H, T, D]`` float32 (for tests and `fake_quantize` only)."""
        parts = [] if self.sink is None else [self.sink.float()]
        if self.num_tiles:
            tiles = dequantize_tile(self.tiles, self.spec.bits, self.spec.axis, self.spec.dim, hadamard=self.hadamard)
            parts.append(tiles.flatten(2, 3))
        if self.tail is not None:
            parts.append(self.tail.float())
        return torch.cat(parts, 2)

    # ---- bytes -------------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of everything stored: sink, tail, codes and fp16 metadata (spare capacity excluded)."""
        fp = sum(t.numel() * t.element_size() for t in (self.sink, self.tail) if t is not None)
        return fp + sum(s.nbytes() for s in self._tile_stores)

    def allocated_nbytes(self) -> int:
        """`nbytes` plus the spare capacity reserved for future tiles."""
        fp = sum(t.numel() * t.element_size() for t in (self.sink, self.tail) if t is not None)
        return fp + sum(s.allocated_nbytes() for s in self._tile_stores)


def make_stream(spec: StreamSpec, tile_size: int, sink_tokens: int, varnorm_iters: int, hadamard: bool):
    """A `DenseStream` for 16-bit specs, a `TiledStream` otherwise."""
    if spec.bits >= 16:
        return DenseStream(spec)
    return TiledStream(spec, tile_size, sink_tokens, varnorm_iters, hadamard)


__all__ = ["StreamSpec", "DenseStream", "TiledStream", "GrowableTensor", "flush_streams", "make_stream", "METADATA_DTYPE"]


@torch.no_grad()
def flush_streams(
    streams: list[TiledStream], token_valid: torch.Tensor | None = None, quantize=store_tiles_reference
) -> None:
    """Quantize the full pending tiles of several streams of one spec (e.g. the keys of every layer) in one call.

    Args:
        streams: Tiled streams sharing bits, axis, width and tile size.
        token_valid: Optional ``[B, T]`` bool over absolute positions; False marks padding, which is left out of
            the tile statistics.
        quantize: `store_tiles_reference` or the Triton `store_tiles` (same signature).

    Raises:
        ValueError: if a tile's metadata overflows fp16 (|values| beyond ~1e9); no stream is changed then.
    """
    streams = [s for s in streams if s.pending_tiles()]
    if not streams:
        return
    spec, first = streams[0].spec, streams[0]
    parts = [s.pending(token_valid) for s in streams]
    x = torch.cat([p[0] for p in parts])
    valid = None
    if any(p[1] is not None for p in parts):
        valid = torch.cat([p[1] if p[1] is not None else torch.ones(p[0].shape[:2], dtype=torch.bool,
                                                                     device=x.device) for p in parts])
        valid = None if bool(valid.all()) else valid
    tile = quantize(x, spec.bits, spec.axis, varnorm_iters=first.varnorm_iters, hadamard=first.hadamard,
                    token_valid=valid)
    largest = metadata_overflow(tile)
    if largest is not None:
        raise ValueError(
            f"kvarn: {spec.name} values too large to quantize with fp16 scales (metadata magnitude {largest:.3g} "
            "is not finite in fp16); the cache was left unchanged"
        )
    offset = 0
    for stream, (chunk, _) in zip(streams, parts):
        count = chunk.shape[0]
        stream.commit(QuantizedTile(*(t[offset : offset + count] for t in tile.parts())))
        offset += count
