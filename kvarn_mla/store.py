"""The cache's runtime stores: growable buffers and the per-stream ``sink | tiles | tail`` layout.

A cache layer holds two streams (dense: K and V; MLA: the latent ``c_kv`` and the RoPE key ``k_pe``), each storing
``[B, H, T, D]`` tokens. This module owns appends, tile commits, crops and batch reordering; the quantization and the
attention math are the pure reference in `kvarn_mla.quant` (or a backend's kernels), which read a stream through its
`Stream.view`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import STREAMS
from .quant.attention import Layout, StreamView
from .quant.scheme import Axis, TileScheme
from .quant.tile import QuantizedTile, dequantize_tile, metadata_overflow

GROWTH = 1.25  # spare capacity on reallocation: appends copy each stored element O(1/(GROWTH-1)) times in total


@dataclass(frozen=True)
class StreamSpec:
    """What one stream of a layer holds.

    Attributes:
        name: ``"key"``, ``"value"``, ``"latent"``, ``"rope"`` or ``"indexer"``.
        num_heads: H, kv heads of the stream (1 for the MLA streams).
        dim: D, channels per head.
        scheme: How it is quantized (``scheme.bits == 16``: kept in the model dtype).
    """

    name: str
    num_heads: int
    dim: int
    scheme: TileScheme

    @property
    def bits(self) -> int:
        return self.scheme.bits

    @property
    def axis(self) -> Axis:
        return self.scheme.axis

    def tile_nbytes(self) -> int:
        """Bytes of one quantized tile of one head (see `TileScheme.tile_nbytes`)."""
        return self.scheme.tile_nbytes(self.dim)


class GrowableTensor:
    """A tensor that grows along dim 2 (``[B, H, n, ...]``) into spare capacity, so appends stay amortized O(1)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self.length = 0

    @property
    def data(self) -> torch.Tensor | None:
        """The live entries ``[B, H, length, ...]`` (a view), or None before the first append."""
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

    def drop_front(self, count: int) -> None:
        """Remove the first ``count`` entries, moving the rest to the front of the buffer."""
        rest = self.length - count
        if rest > 0:
            self._buffer[:, :, :rest] = self._buffer[:, :, count : self.length].clone()
        self.length = max(rest, 0)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace the storage by ``fn(live data)`` along the batch axis (beam reorder, batch selection)."""
        if self._buffer is not None:
            self._buffer = fn(self.data).contiguous()

    def nbytes(self) -> int:
        data = self.data
        return 0 if data is None else data.numel() * data.element_size()

    def allocated_nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()


class Stream(Layout):
    """One stream: ``sink`` (full precision) | ``tiles`` (quantized) | ``tail`` (full precision), ``[B, H, T, D]``.

    New tokens fill the sink first, then the tail. `commit` replaces the full tiles at the front of the tail by their
    quantized form (a tile is quantized once, unless `crop` cuts into it). A 16-bit stream has no sink and never
    quantizes: every token stays in the tail. Quantized tiles are stored rotated when the scheme rotates; the sink
    and tail hold the model's tokens unchanged.
    """

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.scheme = spec.scheme
        self.reset()

    def reset(self) -> None:
        self._sink, self._tail = GrowableTensor(), GrowableTensor()
        self._tiles = tuple(GrowableTensor() for _ in range(4))  # codes, scale, zero, gamma
        self.dtype: torch.dtype | None = None  # the model dtype of sink and tail

    # ---- sizes -------------------------------------------------------------------------------------------------
    @property
    def sink_length(self) -> int:
        return self._sink.length

    @property
    def num_tiles(self) -> int:
        return self._tiles[0].length

    @property
    def tail_length(self) -> int:
        return self._tail.length

    def _some_data(self) -> torch.Tensor | None:
        return next((s.data for s in (self._tail, self._sink, self._tiles[0]) if s.data is not None), None)

    @property
    def batch_size(self) -> int | None:
        data = self._some_data()
        return None if data is None else data.shape[0]

    @property
    def device(self) -> torch.device | None:
        data = self._some_data()
        return None if data is None else data.device

    @property
    def tiles(self) -> QuantizedTile:
        """The quantized tiles, leading shape ``[B, H, N]`` (views of the storage)."""
        return QuantizedTile(*(store.data for store in self._tiles))

    def view(self) -> StreamView:
        """The stored tensors (views, no copy) for attention."""
        return StreamView(self.scheme, self.spec.dim, self.dtype, self._sink.data,
                          self.tiles if self.num_tiles else None, self._tail.data)

    def full(self) -> torch.Tensor | None:
        """Every token of a 16-bit stream, ``[B, H, T, D]`` in the model dtype (a view)."""
        assert not self.scheme.quantized, "full() reads 16-bit streams"
        return self._tail.data

    def pending_tiles(self) -> int:
        """Full tiles waiting in the tail to be quantized."""
        if not self.scheme.quantized or self.sink_length < self.scheme.sink_tokens:
            return 0
        return self.tail_length // self.scheme.tile_size

    # ---- writes ------------------------------------------------------------------------------------------------
    def append(self, x: torch.Tensor) -> None:
        """Append ``x [B, H, S, D]`` (model dtype) to the sink, then the tail; quantization waits for a flush."""
        self.dtype = x.dtype
        room = self.scheme.sink_tokens - self.sink_length if self.scheme.quantized else 0
        if room > 0:
            self._sink.append(x[:, :, :room])
            x = x[:, :, room:]
        if x.shape[2]:
            self._tail.append(x)

    def pending(self, token_valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The full tiles waiting in the tail, flattened: ``x [B*H*n, G, D]`` and validity ``[B*H*n, G]`` or None.

        Args:
            token_valid: Optional ``[B, T]`` bool over absolute positions (T >= this stream's length); False marks
                padding, which is left out of the tiles' statistics.
        """
        count, size = self.pending_tiles(), self.scheme.tile_size
        tail = self._tail.data
        batch, heads, _, dim = tail.shape
        x = tail[:, :, : count * size].reshape(batch * heads * count, size, dim)
        if token_valid is None:
            return x, None
        valid = token_valid[:, self.tail_start : self.tail_start + count * size].reshape(batch, 1, count, size)
        return x, valid.expand(batch, heads, count, size).reshape(-1, size)

    def commit(self, tile: QuantizedTile) -> None:
        """Store the quantized pending tiles (leading dim ``B*H*n``, fp16 metadata) and drop them from the tail."""
        batch, heads = self._tail.data.shape[:2]
        count = self.pending_tiles()
        for store, part in zip(self._tiles, tile.parts()):
            store.append(part.reshape(batch, heads, count, *part.shape[1:]))
        self._tail.drop_front(count * self.scheme.tile_size)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens. A tile the cut falls inside goes back to the tail, dequantized."""
        if length >= self.length:
            return
        if length >= self.tail_start:
            self._tail.truncate(length - self.tail_start)
            return
        if length == 0:
            self.reset()
            return
        partial = None
        if length <= self.sink_length:
            self._sink.truncate(length)
            keep = 0
        else:
            keep, cut = divmod(length - self.sink_length, self.scheme.tile_size)
            if cut:
                tile = QuantizedTile(*(t[:, :, keep] for t in self.tiles.parts()))
                partial = dequantize_tile(tile, self.scheme, self.spec.dim)[:, :, :cut].to(self.dtype)
        for store in self._tiles:
            store.truncate(keep)
        self._tail.truncate(0)
        if partial is not None:
            self._tail.append(partial)

    def mark(self) -> tuple:
        """What `rollback` needs to undo every later `append` (not a `commit`, `crop` or `map_batch`)."""
        return self._sink.length, self._tail.length, self.num_tiles, self.dtype

    def appended_since(self, mark: tuple) -> list[torch.Tensor]:
        """The tokens appended since ``mark`` was taken: the sink's and the tail's new parts (views)."""
        return [store.data[:, :, start:] for store, start in ((self._sink, mark[0]), (self._tail, mark[1]))
                if store.length > start]

    def rollback(self, mark: tuple) -> None:
        """Drop the tokens appended since ``mark`` was taken."""
        sink, tail, tiles, self.dtype = mark
        assert self.num_tiles == tiles, "a rollback cannot undo quantized tiles"
        self._sink.truncate(sink)
        self._tail.truncate(tail)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` along the batch axis of every stored tensor (beam reorder, batch selection)."""
        for store in (self._sink, self._tail, *self._tiles):
            store.map_batch(fn)

    # ---- reads and bytes ---------------------------------------------------------------------------------------
    def dequantized(self) -> torch.Tensor:
        """Every token as attention sees it, ``[B, H, T, D]`` float32."""
        parts = [t.float() for t in (self._sink.data,) if t is not None]
        if self.num_tiles:
            parts.append(dequantize_tile(self.tiles, self.scheme, self.spec.dim).flatten(2, 3))
        if self._tail.data is not None:
            parts.append(self._tail.data.float())
        return torch.cat(parts, 2)

    def nbytes(self) -> int:
        """Bytes of everything stored: sink, tail, codes and fp16 metadata (spare capacity excluded)."""
        return sum(store.nbytes() for store in (self._sink, self._tail, *self._tiles))

    def allocated_nbytes(self) -> int:
        """`nbytes` plus the spare capacity reserved for future tokens and tiles."""
        return sum(store.allocated_nbytes() for store in (self._sink, self._tail, *self._tiles))


@torch.no_grad()
def quantize_pending(
    streams: list[Stream], store: Callable, token_valid: torch.Tensor | None = None
) -> Callable[[], None] | None:
    """Quantize the full pending tiles of several streams of one scheme and device (e.g. the keys of every layer)
    in one store call, and return the commit that stores them; None when nothing is pending. Nothing is changed
    before the commit runs, so several groups can be quantized and checked before any of them is stored.

    Args:
        streams: Streams sharing scheme, width and device.
        store: The backend's tile quantizer, ``store(x [N, G, D], scheme, token_valid) -> QuantizedTile``.
        token_valid: Optional ``[B, T]`` bool over absolute positions; False marks padding, which is left out of
            the tile statistics.

    Raises:
        ValueError: if a tile's metadata does not fit fp16 (values beyond about 6e4 after the rotation).
    """
    streams = [s for s in streams if s.pending_tiles()]
    if not streams:
        return None
    parts = [s.pending(token_valid) for s in streams]
    x = torch.cat([p[0] for p in parts])
    valid = None
    if any(p[1] is not None for p in parts):
        valid = torch.cat([p[1] if p[1] is not None else torch.ones(p[0].shape[:2], dtype=torch.bool,
                                                                     device=x.device) for p in parts])
        valid = None if bool(valid.all()) else valid
    tile = store(x, streams[0].scheme, None if valid is None else valid.to(x.device))
    largest = metadata_overflow(tile)
    if largest is not None:
        name = streams[0].spec.name
        raise ValueError(
            f"kvarn: {name} values too large for the tile scales, which are stored in fp16 (a tile's scale "
            f"magnitude would be {largest:.3g}; fp16 holds up to 65504): the cache was left unchanged. Keep this "
            f"stream in the model dtype ({STREAMS[name][0] if name in STREAMS else name + ' bits'}=16) for such a model"
        )

    def commit() -> None:
        offset = 0
        for stream, (chunk, _) in zip(streams, parts):
            count = chunk.shape[0]
            stream.commit(QuantizedTile(*(t[offset : offset + count] for t in tile.parts())))
            offset += count

    return commit


def flush_streams(streams: list[Stream], store: Callable, token_valid: torch.Tensor | None = None) -> None:
    """`quantize_pending` and commit at once."""
    commit = quantize_pending(streams, store, token_valid)
    if commit is not None:
        commit()


__all__ = ["GrowableTensor", "Stream", "StreamSpec", "flush_streams", "quantize_pending"]
