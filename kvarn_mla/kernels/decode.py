"""Decode attention over a quantized tile store, one kernel for MHA, GQA and MLA, with split-KV.

A program serves ``BLOCK_M`` query rows of one kv head (all heads of a GQA group, or up to ``BLOCK_M`` MLA heads)
over one split of the sequence: split 0 is the full-precision sink, the last split the full-precision tail, and the
splits between share the quantized tiles. Each split writes a partial (normalized output, log-sum-exp); the merge
combines them, un-rotating the tile splits' values (tiles are stored in the Hadamard basis) on the way.

Quantized tiles are read with folded scales (see `kvarn_mla.quant.folded`): per tile the per-channel scales
multiply the query once, the codes enter ``tl.dot`` as small integers, and per-token scales multiply the scores.
A key has one or two segments (dense K; or MLA latent + RoPE key, the RoPE key quantized or full precision);
the value is its own token-axis stream (dense V) or the first key segment (the MLA latent), whose codes are then
unpacked once per block for both products.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..quant.attention import StreamView, padding_start, tiled_attention_reference
from ..quant.hadamard import rotate
from .common import check_triton_device, warn_once

NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": masked entries are zeroed explicitly, so no inf - inf NaNs


@triton.jit
def _load_codes(ptr, offs_n, offs_d, mask, P: tl.constexpr, BITS: tl.constexpr):
    # Codes [BLOCK_N, BLOCK_D] of token rows packed along channels (little-endian bit stream, P bytes per row).
    if BITS == 8:
        codes = tl.load(ptr + offs_n[:, None] * P + offs_d[None, :], mask=mask, other=0).to(tl.int32)
    elif BITS == 3:
        bit = offs_d * 3
        lo = tl.load(ptr + offs_n[:, None] * P + (bit // 8)[None, :], mask=mask, other=0).to(tl.int32)
        hi_ok = mask & ((bit // 8 + 1) < P)[None, :]
        hi = tl.load(ptr + offs_n[:, None] * P + (bit // 8 + 1)[None, :], mask=hi_ok, other=0).to(tl.int32)
        codes = ((lo | (hi << 8)) >> (bit % 8)[None, :]) & 7
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        byte = tl.load(ptr + offs_n[:, None] * P + (offs_d // PER_BYTE)[None, :], mask=mask, other=0).to(tl.int32)
        codes = (byte >> ((offs_d % PER_BYTE) * BITS)[None, :]) & ((1 << BITS) - 1)
    return codes


@triton.jit
def _softmax_step(scores, valid, m_i, l_i, acc):
    # Online softmax: fold a block of scores into (max, sum); returns the probabilities and the rescaled state.
    scores = tl.where(valid, scores, NEG)
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(valid, tl.exp(scores - m_new[:, None]), 0.0)
    return p, m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None]


@triton.jit
def _attend_fp(
    q1, q2, m_i, l_i, acc,
    k1_ptr, k2_ptr, v_ptr,  # [n, D1], [n, D2], [n, DV] rows of full-precision tokens (already offset)
    first_pos, count, start, q_pos, scaling,
    offs_m, offs_n, offs_d1, offs_d2, offs_dv,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, HAS_SEG2: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT: tl.constexpr,
):
    for n0 in range(0, count, BLOCK_N):
        rows = n0 + offs_n
        n_ok = rows < count
        k1 = tl.load(k1_ptr + rows[:, None] * D1 + offs_d1[None, :], mask=n_ok[:, None] & (offs_d1 < D1)[None, :],
                     other=0.0)
        scores = tl.dot(q1.to(DOT), tl.trans(k1.to(DOT)))
        if HAS_SEG2:
            k2 = tl.load(k2_ptr + rows[:, None] * D2 + offs_d2[None, :],
                         mask=n_ok[:, None] & (offs_d2 < D2)[None, :], other=0.0)
            scores += tl.dot(q2.to(DOT), tl.trans(k2.to(DOT)))
        pos = first_pos + rows
        valid = (n_ok & (pos >= start))[None, :] & (pos[None, :] <= q_pos[:, None])
        p, m_i, l_i, acc = _softmax_step(scores * scaling, valid, m_i, l_i, acc)
        v = tl.load(v_ptr + rows[:, None] * DV + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv < DV)[None, :],
                    other=0.0)
        acc += tl.dot(p.to(DOT), v.to(DOT))
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(
    # Queries [2, B, HKV, M, D1 + D2] float32: [0] plain (for full-precision tokens), [1] in the tiles' basis
    q_ptr, kv_start_ptr,
    # Segment 1 (dense K / MLA latent): sink, tail [.., n, D1]; codes [.., N, G, P1]; scale, zero [.., N, D1];
    # gamma [.., N, G]. *_sb, *_sh: batch and head strides.
    s1_ptr, s1_sb, s1_sh, t1_ptr, t1_sb, t1_sh, c1_ptr, c1_sb, c1_sh,
    a1_ptr, z1_ptr, a1_sb, a1_sh, g1_ptr, g1_sb, g1_sh,
    # Segment 2 (MLA RoPE key): full precision [.., T, D2] in s2 (SEG2 == 1), or tiled like segment 1 (SEG2 == 2)
    s2_ptr, s2_sb, s2_sh, t2_ptr, t2_sb, t2_sh, c2_ptr, c2_sb, c2_sh,
    a2_ptr, z2_ptr, a2_sb, a2_sh, g2_ptr, g2_sb, g2_sh,
    # Value (dense V, token axis): sink, tail [.., n, DV]; codes [.., N, G, PV]; scale, zero [.., N, G];
    # gamma [.., N, DV]
    sv_ptr, sv_sb, sv_sh, tv_ptr, tv_sb, tv_sh, cv_ptr, cv_sb, cv_sh,
    av_ptr, zv_ptr, av_sb, av_sh, gv_ptr, gv_sb, gv_sh,
    # Partial outputs [B, HKV, SPLITS, M, DV] and log-sum-exp [B, HKV, SPLITS, M], float32
    o_ptr, lse_ptr,
    # Sizes
    scaling, num_sink, num_tiles, num_tail, tiles_per_split, q_len,
    HKV: tl.constexpr, M: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, G: tl.constexpr,
    P1: tl.constexpr, P2: tl.constexpr, PV: tl.constexpr,
    BITS1: tl.constexpr, BITS2: tl.constexpr, BITSV: tl.constexpr, SEG2: tl.constexpr, VALUE_IS_SEG1: tl.constexpr,
    HAS_START: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, DOT: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    splits = tl.num_programs(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    DQ: tl.constexpr = D1 + D2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = tl.arange(0, BLOCK_D2)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M
    total = num_sink + num_tiles * G + num_tail
    q_pos = total - q_len + offs_m % q_len  # causal limit of each row
    start = 0
    if HAS_START:
        start = tl.load(kv_start_ptr + b)

    use_rotated = ((split > 0) & (split < splits - 1)).to(tl.int64)
    q_src = q_ptr + use_rotated * tl.num_programs(0) * M * DQ + pid_bh * M * DQ
    q1 = tl.load(q_src + offs_m[:, None] * DQ + offs_d1[None, :], mask=m_ok[:, None] & (offs_d1 < D1)[None, :],
                 other=0.0)
    q2 = tl.load(q_src + offs_m[:, None] * DQ + D1 + offs_d2[None, :],
                 mask=m_ok[:, None] & (offs_d2 < D2)[None, :], other=0.0)

    m_i = tl.full((BLOCK_M,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    HAS_SEG2: tl.constexpr = SEG2 > 0

    if split == 0:  # the sink, full precision
        k1 = s1_ptr + b * s1_sb + h * s1_sh
        k2 = s2_ptr + b * s2_sb + h * s2_sh  # a tiled segment's sink, or a full-precision one from position 0
        if VALUE_IS_SEG1:
            v = k1
        else:
            v = sv_ptr + b * sv_sb + h * sv_sh
        m_i, l_i, acc = _attend_fp(q1, q2, m_i, l_i, acc, k1, k2, v, 0, num_sink, start, q_pos, scaling,
                                   offs_m, offs_n, offs_d1, offs_d2, offs_dv, D1, D2, DV, HAS_SEG2, BLOCK_N, DOT)
    elif split == splits - 1:  # the tail, full precision
        first = num_sink + num_tiles * G
        k1 = t1_ptr + b * t1_sb + h * t1_sh
        if SEG2 == 2:
            k2 = t2_ptr + b * t2_sb + h * t2_sh
        else:
            k2 = s2_ptr + b * s2_sb + h * s2_sh + first * D2
        if VALUE_IS_SEG1:
            v = k1
        else:
            v = tv_ptr + b * tv_sb + h * tv_sh
        m_i, l_i, acc = _attend_fp(q1, q2, m_i, l_i, acc, k1, k2, v, first, num_tail, start, q_pos, scaling,
                                   offs_m, offs_n, offs_d1, offs_d2, offs_dv, D1, D2, DV, HAS_SEG2, BLOCK_N, DOT)
    else:  # quantized tiles [tile_begin, tile_end), in the rotated basis
        tile_begin = (split - 1) * tiles_per_split
        tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
        d1_ok = offs_d1 < D1
        d2_ok = offs_d2 < D2
        dv_ok = offs_dv < DV
        for tile in range(tile_begin, tile_end):
            tile64 = tile  # int32 is enough: offsets within one (batch, head) row of a stream
            # Per-channel scales fold into the query once per tile; per-token scales multiply the scores.
            a1 = tl.load(a1_ptr + b * a1_sb + h * a1_sh + tile64 * D1 + offs_d1, mask=d1_ok, other=0.0).to(tl.float32)
            z1 = tl.load(z1_ptr + b * a1_sb + h * a1_sh + tile64 * D1 + offs_d1, mask=d1_ok, other=0.0).to(tl.float32)
            q1a = (q1 * a1[None, :]).to(DOT)
            bias = tl.sum(q1 * z1[None, :], axis=1)
            if SEG2 == 2:
                a2 = tl.load(a2_ptr + b * a2_sb + h * a2_sh + tile64 * D2 + offs_d2, mask=d2_ok, other=0.0).to(tl.float32)
                z2 = tl.load(z2_ptr + b * a2_sb + h * a2_sh + tile64 * D2 + offs_d2, mask=d2_ok, other=0.0).to(tl.float32)
                q2a = (q2 * a2[None, :]).to(DOT)
                bias2 = tl.sum(q2 * z2[None, :], axis=1)
            if not VALUE_IS_SEG1:
                gv = tl.load(gv_ptr + b * gv_sb + h * gv_sh + tile64 * DV + offs_dv, mask=dv_ok, other=0.0).to(tl.float32)
            for n0 in range(0, G, BLOCK_N):
                rows = n0 + offs_n
                n_ok = rows < G
                pos = num_sink + tile * G + rows
                codes1 = _load_codes(c1_ptr + b * c1_sb + h * c1_sh + tile64 * G * P1, rows, offs_d1,
                                     n_ok[:, None] & d1_ok[None, :], P1, BITS1).to(DOT)
                g1 = tl.load(g1_ptr + b * g1_sb + h * g1_sh + tile64 * G + rows, mask=n_ok, other=0.0).to(tl.float32)
                scores = (tl.dot(q1a, tl.trans(codes1)) + bias[:, None]) * g1[None, :]
                if SEG2 == 2:
                    codes2 = _load_codes(c2_ptr + b * c2_sb + h * c2_sh + tile64 * G * P2, rows, offs_d2,
                                         n_ok[:, None] & d2_ok[None, :], P2, BITS2).to(DOT)
                    g2 = tl.load(g2_ptr + b * g2_sb + h * g2_sh + tile64 * G + rows, mask=n_ok, other=0.0).to(tl.float32)
                    scores += (tl.dot(q2a, tl.trans(codes2)) + bias2[:, None]) * g2[None, :]
                elif SEG2 == 1:
                    k2 = tl.load(s2_ptr + b * s2_sb + h * s2_sh + pos[:, None] * D2 + offs_d2[None, :],
                                 mask=n_ok[:, None] & d2_ok[None, :], other=0.0)
                    scores += tl.dot(q2.to(DOT), tl.trans(k2.to(DOT)))
                valid = (n_ok & (pos >= start))[None, :] & (pos[None, :] <= q_pos[:, None])
                p, m_i, l_i, acc = _softmax_step(scores * scaling, valid, m_i, l_i, acc)
                if VALUE_IS_SEG1:  # channel-axis latent: out_c = a_c * sum_t (p g)_t code + z_c * sum_t (p g)_t
                    pg = p * g1[None, :]
                    acc += a1[None, :] * tl.dot(pg.to(DOT), codes1) + z1[None, :] * tl.sum(pg, axis=1)[:, None]
                else:  # token-axis value: out_c = gv_c * (sum_t (p a)_t code + sum_t p_t z_t)
                    av = tl.load(av_ptr + b * av_sb + h * av_sh + tile64 * G + rows, mask=n_ok, other=0.0).to(tl.float32)
                    zv = tl.load(zv_ptr + b * av_sb + h * av_sh + tile64 * G + rows, mask=n_ok, other=0.0).to(tl.float32)
                    codes_v = _load_codes(cv_ptr + b * cv_sb + h * cv_sh + tile64 * G * PV, rows, offs_dv,
                                          n_ok[:, None] & dv_ok[None, :], PV, BITSV).to(DOT)
                    part = tl.dot((p * av[None, :]).to(DOT), codes_v) + tl.sum(p * zv[None, :], axis=1)[:, None]
                    acc += gv[None, :] * part

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    out_row = (pid_bh * splits + split) * M + offs_m
    tl.store(o_ptr + out_row[:, None] * DV + offs_dv[None, :], o, mask=m_ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(lse_ptr + out_row, lse, mask=m_ok)


# ---- launcher ----------------------------------------------------------------------------------------------------------
def _empty(device) -> tuple[torch.Tensor, int, int]:
    return torch.empty(1, device=device), 0, 0


def _bh(t: torch.Tensor | None, device) -> tuple[torch.Tensor, int, int]:
    """(tensor, batch stride, head stride); the dims after the head must be laid out contiguously."""
    if t is None or t.numel() == 0:
        return _empty(device)
    inner = t.shape[2:]
    expected = [1]
    for size in reversed(inner[1:]):
        expected.insert(0, expected[0] * size)
    assert list(t.stride()[2:]) == expected, f"store tensor {tuple(t.shape)} has strides {t.stride()}"
    return t, t.stride(0), t.stride(1)


def _segment(view: StreamView | None, device) -> tuple[list, int, int, int]:
    """A stream's kernel arguments (sink, tail, codes, scale, zero, gamma with their batch and head strides), its
    kind (0: absent, 1: full precision from position 0 in ``sink``'s slot, 2: tiled), bits and packed row width."""
    if view is None or not view.scheme.quantized:
        empty = [*_empty(device)] * 3 + [_empty(device)[0]] * 2 + [0, 0, *_empty(device)]
        return ([*_bh(view.tail, device), *empty[3:]], 1, 2, 1) if view is not None else (empty, 0, 2, 1)
    codes, scale, zero, gamma = view.tiles.parts() if view.num_tiles else (None,) * 4
    scale_t, a_sb, a_sh = _bh(scale, device)
    zero_t = zero if zero is not None and zero.numel() else scale_t
    args = [*_bh(view.sink, device), *_bh(view.tail, device), *_bh(codes, device), scale_t, zero_t, a_sb, a_sh,
            *_bh(gamma, device)]
    return args, 2, view.scheme.bits, codes.shape[-1] if codes is not None else 1


def kernel_supports(keys: Sequence[StreamView], values: StreamView | None) -> bool:
    """Whether `tiled_attention` covers this combination of streams."""
    first = keys[0].scheme
    if not 1 <= len(keys) <= 2 or not first.quantized or first.axis != "channel":
        return False
    if len(keys) == 2 and keys[1].scheme.axis != "channel":
        return False
    if values is None:
        return True
    return values.scheme.quantized and values.scheme.axis == "token" and len(keys) == 1 \
        and values.scheme.hadamard == first.hadamard and values.sink_length == keys[0].sink_length


def tiled_attention(
    q: torch.Tensor,
    keys: Sequence[StreamView],
    values: StreamView | None,
    scaling: float,
    *,
    q_len: int = 1,
    kv_start: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Fused attention over a quantized store: the contract of `kvarn_mla.quant.tiled_attention_reference`
    (``q [B, Hkv, M, sum(key dims)]`` -> ``[B, Hkv, M, Dv]`` float32) without an explicit mask, for a quantized
    channel-axis first key (dense K or the MLA latent), an optional second key of any width (the MLA RoPE key),
    and a quantized token-axis value stream or None (the latent is the value). ``num_splits`` splits share the
    quantized tiles (default: enough programs to fill the device)."""
    if not kernel_supports(keys, values):
        raise ValueError(
            "tiled_attention needs a quantized channel-axis first key stream, an optional second key stream, and "
            "a quantized token-axis value stream (or none: the first key is the value)"
        )
    check_triton_device(q.device)
    seg1 = keys[0]
    seg2 = keys[1] if len(keys) == 2 else None
    batch, kv_heads, rows, dq = q.shape
    d1 = seg1.dim
    d2 = seg2.dim if seg2 is not None else 0
    if dq != d1 + d2:
        raise ValueError(f"query width {dq} != key widths {d1} + {d2}")
    value_is_seg1 = values is None
    value = seg1 if value_is_seg1 else values
    dv = value.dim
    device = q.device
    q = q.float().contiguous()
    # Queries in the tiles' basis: each quantized, rotated segment gets its own Hadamard.
    qt = torch.cat([rotate(q[..., :d1]) if seg1.scheme.hadamard else q[..., :d1]]
                   + ([] if seg2 is None else [rotate(q[..., d1:]) if seg2.scheme.quantized and seg2.scheme.hadamard
                                               else q[..., d1:]]), -1)
    queries = torch.stack([q, qt]).contiguous()
    num_tiles = seg1.num_tiles
    if num_splits is None:
        target = 264 if device.type == "cuda" else 2
        num_splits = max(1, min(num_tiles, -(-target // max(1, batch * kv_heads))))
    num_splits = max(1, min(num_splits, max(num_tiles, 1)))
    tiles_per_split = max(1, -(-num_tiles // num_splits))
    splits = 2 + num_splits
    # Rows per program: a whole GQA group, or up to 32 MLA heads (a [BLOCK_M, 512] float32 accumulator must stay
    # in registers).
    block_m = min(64 if dv <= 128 else 32, max(16, triton.next_power_of_2(rows)))
    partial = torch.empty(batch, kv_heads, splits, rows, dv, dtype=torch.float32, device=device)
    lse = torch.empty(batch, kv_heads, splits, rows, dtype=torch.float32, device=device)
    start = kv_start.to(device=device, dtype=torch.int32).contiguous() if kv_start is not None else _empty(device)[0]

    seg1_args, _, bits1, p1 = _segment(seg1, device)
    seg2_args, seg2_kind, bits2, p2 = _segment(seg2, device)
    value_args, _, bitsv, pv = _segment(None if value_is_seg1 else value, device)
    dot = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(seg1.dtype, tl.float32)
    if device.type != "cuda":
        dot = tl.float32  # the interpreter computes dots in float32 anyway
    grid = (batch * kv_heads, splits, triton.cdiv(rows, block_m))
    _decode_kernel[grid](
        queries, start,
        *seg1_args, *seg2_args, *value_args,
        partial, lse,
        scaling, seg1.sink_length, num_tiles, seg1.tail_length, tiles_per_split, q_len,
        HKV=kv_heads, M=rows, D1=d1, D2=d2, DV=dv, G=seg1.scheme.tile_size, P1=p1, P2=p2, PV=pv,
        BITS1=bits1, BITS2=bits2, BITSV=bitsv, SEG2=seg2_kind, VALUE_IS_SEG1=value_is_seg1,
        HAS_START=kv_start is not None, BLOCK_M=block_m, BLOCK_N=32,
        BLOCK_D1=max(16, triton.next_power_of_2(d1)), BLOCK_D2=max(16, triton.next_power_of_2(max(d2, 1))),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), DOT=dot,
        num_warps=8 if d1 >= 256 else 4,
    )
    return merge_splits(partial, lse, value.scheme.hadamard)


def attend(q, keys, values, scaling: float, mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
    """The Triton backend's attention (see `kvarn_mla.backends.Backend`): the fused kernel for left padding +
    causal masks over a quantized first key stream; a mask it cannot express (the DSA indexer's top-k, custom 4D
    masks) or an unquantized first key runs on the torch path, with a warning."""
    kv_start, representable = padding_start(mask, q_len, keys[0].length)
    if representable and kernel_supports(keys, values):
        return tiled_attention(q, keys, values, scaling, q_len=q_len, kv_start=kv_start)
    reason = "this attention mask (e.g. DSA top-k)" if not representable else "these stream bit widths"
    warn_once(f"kvarn: the fused Triton kernel does not cover {reason}; this attention runs on the torch path")
    return tiled_attention_reference(q, keys, values, scaling, q_len=q_len, mask=mask)


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, rotated_tiles: bool) -> torch.Tensor:
    """Log-sum-exp merge of split partials ``[B, H, 2 + P, M, Dv]`` (sink, P tile splits, tail).

    Tile splits hold values in the Hadamard basis when ``rotated_tiles``; their weighted sum is rotated back once.
    """
    top = lse.amax(2, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp(lse - top)  # exp(-inf) = 0 for empty splits
    weight = weight / weight.sum(2, keepdim=True).clamp(min=torch.finfo(weight.dtype).tiny)
    weighted = partial * weight.unsqueeze(-1)
    tiles = weighted[:, :, 1:-1].sum(2)
    return weighted[:, :, 0] + weighted[:, :, -1] + (rotate(tiles) if rotated_tiles else tiles)
