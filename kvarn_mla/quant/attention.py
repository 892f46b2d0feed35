"""Attention over a layer's stored streams: the torch path, and the reference of the fused Triton decode kernel.

Every family reduces to grouped-query attention of ``M`` query rows per kv head over one store: the key is one or
two streams side by side (dense K; or the MLA latent and RoPE key), the value is its own stream (dense V) or the
first key stream (the MLA latent). A stream is read through a `StreamView`: plain tensors, no runtime state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .folded import tile_scores, tile_values
from .hadamard import rotate
from .rtn import unpack
from .scheme import Axis, TileScheme
from .tile import QuantizedTile

# Elements of unpacked codes (and products) per block of a read, over all batch rows and heads: bounds the transient
# (16 MiB of float32). On a 2-core CPU, MHA at 8K decodes 1.3x faster with this bound than with 4M per head (whose
# blocks of ~130 MiB were allocated and page-faulted afresh at every step), and a quarter or twice of it is slower.
BLOCK_ELEMENTS = 1 << 22


class Layout:
    """Positions of a stream ``sink | tiles | tail``, from its ``sink_length``, ``num_tiles``, ``tail_length`` and
    ``scheme`` (shared by `StreamView` and the cache's runtime `kvarn_mla.store.Stream`)."""

    @property
    def tail_start(self) -> int:
        """Absolute position of the first tail token."""
        return self.sink_length + self.num_tiles * self.scheme.tile_size

    @property
    def length(self) -> int:
        return self.tail_start + self.tail_length


@dataclass(frozen=True)
class StreamView(Layout):
    """One stream's stored tensors, as attention reads them: positions ``sink | tiles | tail``.

    Attributes:
        scheme: How the tiles were quantized. A 16-bit stream has no sink and no tiles: every token is in ``tail``.
        dim: D, channels per head.
        dtype: The model dtype of ``sink`` and ``tail``.
        sink: ``[B, H, s, D]`` full-precision leading tokens, or None.
        tiles: Quantized tiles with leading shape ``[B, H, N]`` (fp16 metadata, in the Hadamard basis when
            ``scheme.hadamard``), or None.
        tail: ``[B, H, t, D]`` full-precision tokens after the tiles, or None.
    """

    scheme: TileScheme
    dim: int
    dtype: torch.dtype
    sink: torch.Tensor | None
    tiles: QuantizedTile | None
    tail: torch.Tensor | None

    @property
    def sink_length(self) -> int:
        return 0 if self.sink is None else self.sink.shape[2]

    @property
    def num_tiles(self) -> int:
        return 0 if self.tiles is None else self.tiles.codes.shape[2]

    @property
    def tail_length(self) -> int:
        return 0 if self.tail is None else self.tail.shape[2]


@dataclass
class Block:
    """A run of one stream's tokens, read once for both attention products (computed in float32: on CPUs without
    native bf16 matmuls, bf16 products made the MLA step 5x slower): full-precision ``tokens
    [B, H, n, D]``, or unpacked ``codes [B, H, k, G, D]`` float32 with float32 ``scale``/``zero``/
    ``gamma``; ``rotated`` tells whether it lives in the Hadamard basis."""

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
            return q @ self.tokens.float().transpose(-1, -2)
        return tile_scores(q, self.codes, self.scale, self.zero, self.gamma, self.axis)

    def values(self, p: torch.Tensor) -> torch.Tensor:
        """``p [B, H, M, n]`` float32 -> ``[B, H, M, D]`` float32 (in this block's basis)."""
        if self.tokens is not None:
            return p @ self.tokens.float()
        return tile_values(p, self.codes, self.scale, self.zero, self.gamma, self.axis)


def block_ranges(view: StreamView, rows: int) -> list[tuple[int, int]]:
    """Position ranges that split a stream for one read: the sink, runs of whole tiles (sized so an unpacked run
    stays under `BLOCK_ELEMENTS` with ``rows`` query rows), and the tail."""
    ranges = [(0, view.sink_length)] if view.sink_length else []
    dim, size = view.dim, view.scheme.tile_size
    lead = view.tiles.codes.shape[0] * view.tiles.codes.shape[1] if view.num_tiles else 1  # batch rows x heads
    step = max(1, BLOCK_ELEMENTS // (lead * (size * dim + rows * (dim + size))))
    for first in range(0, view.num_tiles, step):
        last = min(view.num_tiles, first + step)
        ranges.append((view.sink_length + first * size, view.sink_length + last * size))
    if view.tail_length:
        ranges.append((view.tail_start, view.length))
    return ranges


def read_block(view: StreamView, start: int, end: int) -> Block:
    """Tokens ``[start, end)`` of a stream; a range of whole tiles comes unpacked (once, for both products)."""
    if end <= view.sink_length:
        return Block(rotated=False, tokens=view.sink[:, :, start:end])
    if start >= view.tail_start:
        return Block(rotated=False, tokens=view.tail[:, :, start - view.tail_start : end - view.tail_start])
    size = view.scheme.tile_size
    first, last = (start - view.sink_length) // size, (end - view.sink_length) // size
    codes, scale, zero, gamma = (t[:, :, first:last] for t in view.tiles.parts())
    codes = unpack(codes, view.scheme.bits, view.dim).float()
    return Block(rotated=view.scheme.hadamard, codes=codes, scale=scale.float(), zero=zero.float(),
                 gamma=gamma.float(), axis=view.scheme.axis)


def attention_mask(
    q_len: int, kv_len: int, kv_start: torch.Tensor | None, batch: int, device: torch.device
) -> torch.Tensor | None:
    """``[B, 1, S, T]`` bool for prefix padding + causal queries, or None when every key is visible to every query.

    Query s (absolute position ``T - S + s``) sees keys ``kv_start[b] <= p <= T - S + s``.
    """
    if q_len == 1 and kv_start is None:
        return None
    positions = torch.arange(kv_len, device=device)
    mask = positions <= (torch.arange(q_len, device=device) + kv_len - q_len).unsqueeze(-1)  # [S, T]
    mask = mask.expand(batch, 1, q_len, kv_len)
    if kv_start is not None:
        mask = mask & (positions >= kv_start.to(device).view(batch, 1, 1, 1))
    return mask


def tiled_attention_reference(
    q: torch.Tensor,
    keys: Sequence[StreamView],
    values: StreamView | None,
    scaling: float,
    *,
    q_len: int = 1,
    kv_start: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of ``q`` over the streams' stored tokens, quantized tiles read with folded scales.

    One pass over position blocks (the sink, runs of tiles, the tail) with an online softmax, as the kernel does:
    each run of tiles is unpacked once for both products, and the transient stays bounded at any length.

    Args:
        q: ``[B, Hkv, M, sum(key dims)]`` query rows per kv head, ordered ``(head in group, query)`` so that row
            ``m`` is query ``m % q_len``; the key dims are concatenated in ``keys`` order.
        keys: One or two streams of length T.
        values: The value stream, or None for ``keys[0]`` (MLA: the latent is the value).
        scaling: Softmax scale.
        q_len: Queries per row group (1 for decode); query ``s`` sits at position ``T - q_len + s`` (causal).
        kv_start: Optional ``[B]`` int, the first valid key position of each row (left padding).
        mask: Optional explicit ``[B, 1, q_len, T]`` bool mask (True = attend), replacing the causal/padding one;
            for masks the kernel cannot express (DSA top-k).

    Returns:
        ``[B, Hkv, M, Dv]`` float32.
    """
    batch, heads, rows, _ = q.shape
    q = q.float()
    queries, offset = [], 0  # per key stream: (plain query, query in the stream's tile basis)
    for view in keys:
        part = q[..., offset : offset + view.dim]
        queries.append((part, rotate(part) if view.scheme.quantized and view.scheme.hadamard else part))
        offset += view.dim
    length = keys[0].length
    if mask is None:
        mask = attention_mask(q_len, length, kv_start, batch, q.device)
    value_view = keys[0] if values is None else values
    tiled = next((v for v in (*keys, value_view) if v.scheme.quantized), None)
    ranges = block_ranges(tiled, rows) if tiled is not None else [(0, length)]

    top = q.new_full((batch, heads, rows), float("-inf"))
    total = q.new_zeros(batch, heads, rows)
    plain = q.new_zeros(batch, heads, rows, value_view.dim)
    in_basis = torch.zeros_like(plain)  # values of rotated tiles, rotated back once at the end
    for start, end in ranges:
        blocks = [read_block(view, start, end) for view in keys]
        scores = sum(b.scores(rot if b.rotated else part) for b, (part, rot) in zip(blocks, queries)) * scaling
        if mask is not None:
            # The most negative float rather than -inf keeps a fully masked row (a padding query) finite,
            # as in transformers' eager attention.
            keep = mask[..., start:end].unsqueeze(2)  # [B, 1, 1, S, n]
            scores = scores.view(batch, heads, rows // q_len, q_len, -1).masked_fill(~keep, torch.finfo(q.dtype).min)
            scores = scores.view(batch, heads, rows, -1)
        new_top = torch.maximum(top, scores.amax(-1))
        decay = torch.exp(top - new_top)
        probs = torch.exp(scores - new_top.unsqueeze(-1))
        total = total * decay + probs.sum(-1)
        plain, in_basis = plain * decay.unsqueeze(-1), in_basis * decay.unsqueeze(-1)
        value_block = blocks[0] if values is None else read_block(values, start, end)
        if value_block.rotated:
            in_basis = in_basis + value_block.values(probs)
        else:
            plain = plain + value_block.values(probs)
        top = new_top
    return (plain + rotate(in_basis)) / total.unsqueeze(-1)
