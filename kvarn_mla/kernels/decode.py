"""Decode attention over a quantized tile store, with split-KV: one kernel for MHA/GQA, one for MLA.

A program serves a block of query rows of one kv head (all heads of a GQA group, or a block of MLA heads) over one
split of the sequence: split 0 is the full-precision sink, the last split the full-precision tail, and the splits
between share the quantized tiles. Each split writes a partial (normalized output, log-sum-exp); the merge combines
them, un-rotating the tile splits' values (tiles are stored in the Hadamard basis) on the way.

Which keys a query row sees: left padding + causal (``kv_start``), or an explicit ``[B, 1, S, T]`` bool mask read
by the kernel (any mask: DSA top-k included). Whether there is one is a compile-time flag decided by the arguments'
presence, never by their values, so a launch makes no host synchronization.

Dense (`_dense_decode_kernel`): tiles are read with folded scales (see `kvarn_mla.quant.folded`): per tile the key's
per-channel scales multiply the query once, the codes enter ``tl.dot`` as small integers, and per-token scales
multiply the scores; the token-axis value's per-token scales multiply the probabilities.

MLA (`_mla_decode_kernel`): the latent (``kv_lora_rank`` wide, 512 in DeepSeek) is key and value. A program covers
``BLOCK_M`` heads and ``V_CHUNKS`` chunks of ``BLOCK_C`` value channels, each chunk its own float32 accumulator
``[BLOCK_M, BLOCK_C]``; the scores run over the latent in the same chunks. Per block of tokens, each chunk of codes
is unpacked into keys ``scale_c * code + zero_c`` in the dot precision for the score, then unpacked again (from
L1) for the value product, so no ``[tokens, 512]`` temporary and no ``[heads, 512]`` query is ever held in
registers: at 128 heads x (512 + 64), 64-head blocks keep 128 accumulator registers a thread over 8 warps and do
not spill. The per-token gamma multiplies the scores and the probabilities. On devices with less shared memory or
when asked, ``V_CHUNKS`` < chunks of the latent splits the value over programs, which then recompute the scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quant.attention import StreamView, tiled_attention_reference
from ..quant.hadamard import rotate
from .common import KernelLaunch, check_triton_device, device_capability, warn_once

NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": masked entries are zeroed explicitly, so no inf - inf NaNs


@triton.jit
def _load_codes(ptr, offs_n, offs_d, mask, P: tl.constexpr, BITS: tl.constexpr):
    # Codes [BLOCK_N, BLOCK_D] int32 of token rows packed along channels (little-endian bit stream, P bytes a row).
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
def _online_softmax(scores, valid, m_i, l_i):
    # Fold a block of scores [BLOCK_M, BLOCK_N] into the running (max, sum) [BLOCK_M]; returns the probabilities,
    # the factor the accumulators are rescaled by, and the new state.
    scores = tl.where(valid, scores, NEG)
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(valid, tl.exp(scores - m_new[:, None]), 0.0)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _visible(pos, n_ok, q_pos, start, mask_rows, mask_st, HAS_MASK: tl.constexpr):
    # [BLOCK_M, BLOCK_N]: which (row, token) pairs attend. An explicit mask's entries (mask_rows: [BLOCK_M] pointers
    # to each row's query mask), or left padding + causal (q_pos [BLOCK_M]: each row's last visible position).
    if HAS_MASK:
        keep = tl.load(mask_rows[:, None] + pos[None, :] * mask_st, mask=n_ok[None, :], other=0)
        return keep != 0
    else:
        return (n_ok & (pos >= start))[None, :] & (pos[None, :] <= q_pos[:, None])


@triton.jit
def _store_partial(o_ptr, lse_ptr, acc, m_i, l_i, out_row, offs_c, m_ok, DV: tl.constexpr, WRITE_LSE):
    # Partial output rows [BLOCK_M, BLOCK_C] (columns offs_c of DV) normalized, and their log-sum-exp [BLOCK_M].
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + out_row[:, None] * DV + offs_c[None, :], o, mask=m_ok[:, None] & (offs_c < DV)[None, :])
    if WRITE_LSE:
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + out_row, lse, mask=m_ok)


# ---- dense: MHA / GQA ---------------------------------------------------------------------------------------------
@triton.jit
def _dense_fp(
    q, m_i, l_i, acc,
    k_ptr, v_ptr,  # [n, D], [n, DV] rows of full-precision tokens of this (batch, head), from position first_pos
    first_pos, count, start, q_pos, mask_rows, mask_st, scaling,
    offs_n, offs_d, offs_dv,
    D: tl.constexpr, DV: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
):
    for n0 in range(0, count, BLOCK_N):
        rows = n0 + offs_n
        n_ok = rows < count
        k = tl.load(k_ptr + rows[:, None] * D + offs_d[None, :], mask=n_ok[:, None] & (offs_d < D)[None, :],
                    other=0.0)
        scores = tl.dot(q.to(DOT), tl.trans(k.to(DOT)))  # [BLOCK_M, BLOCK_N]
        valid = _visible(first_pos + rows, n_ok, q_pos, start, mask_rows, mask_st, HAS_MASK)
        p, alpha, m_i, l_i = _online_softmax(scores * scaling, valid, m_i, l_i)
        v = tl.load(v_ptr + rows[:, None] * DV + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv < DV)[None, :],
                    other=0.0)
        acc = tl.dot(p.to(DOT), v.to(DOT), acc * alpha[:, None])  # [BLOCK_M, BLOCK_DV]
    return m_i, l_i, acc


@triton.jit
def _dense_decode_kernel(
    # Queries [2, B, HKV, M, D] float32: [0] plain (for full-precision tokens), [1] in the tiles' basis;
    # kv_start [B] int32 (HAS_START); mask [B, 1, S, T] (HAS_MASK) with batch, query and key strides
    q_ptr, kv_start_ptr, mask_ptr, mask_sb, mask_ss, mask_st,
    # Key (channel axis): sink, tail [.., n, D]; codes [.., N, G, PK]; scale, zero [.., N, D]; gamma [.., N, G].
    # *_sb, *_sh: batch and head strides.
    sk_ptr, sk_sb, sk_sh, tk_ptr, tk_sb, tk_sh, ck_ptr, ck_sb, ck_sh,
    ak_ptr, zk_ptr, ak_sb, ak_sh, gk_ptr, gk_sb, gk_sh,
    # Value (token axis): sink, tail [.., n, DV]; codes [.., N, G, PV]; scale, zero [.., N, G]; gamma [.., N, DV]
    sv_ptr, sv_sb, sv_sh, tv_ptr, tv_sb, tv_sh, cv_ptr, cv_sb, cv_sh,
    av_ptr, zv_ptr, av_sb, av_sh, gv_ptr, gv_sb, gv_sh,
    # Partial outputs [B, HKV, SPLITS, M, DV] and log-sum-exp [B, HKV, SPLITS, M], float32
    o_ptr, lse_ptr,
    scaling, num_sink, num_tiles, num_tail, tiles_per_split, q_len,
    HKV: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, G: tl.constexpr,
    PK: tl.constexpr, PV: tl.constexpr, BITSK: tl.constexpr, BITSV: tl.constexpr,
    HAS_START: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    splits = tl.num_programs(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    total = num_sink + num_tiles * G + num_tail
    q_pos = total - q_len + offs_m % q_len  # [BLOCK_M] causal limit of each row
    start = 0
    if HAS_START:
        start = tl.load(kv_start_ptr + b)
    mask_rows = mask_ptr + b * mask_sb + (offs_m % q_len) * mask_ss  # [BLOCK_M] (used when HAS_MASK)

    use_rotated = ((split > 0) & (split < splits - 1)).to(tl.int64)
    q_src = q_ptr + use_rotated * tl.num_programs(0) * M * D + pid_bh * M * D
    q = tl.load(q_src + offs_m[:, None] * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full((BLOCK_M,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)

    if split == 0:  # the sink, full precision
        m_i, l_i, acc = _dense_fp(q, m_i, l_i, acc, sk_ptr + b * sk_sb + h * sk_sh, sv_ptr + b * sv_sb + h * sv_sh,
                                  0, num_sink, start, q_pos, mask_rows, mask_st, scaling, offs_n, offs_d, offs_dv,
                                  D, DV, HAS_MASK, BLOCK_N, DOT)
    elif split == splits - 1:  # the tail, full precision
        m_i, l_i, acc = _dense_fp(q, m_i, l_i, acc, tk_ptr + b * tk_sb + h * tk_sh, tv_ptr + b * tv_sb + h * tv_sh,
                                  num_sink + num_tiles * G, num_tail, start, q_pos, mask_rows, mask_st, scaling,
                                  offs_n, offs_d, offs_dv, D, DV, HAS_MASK, BLOCK_N, DOT)
    else:  # quantized tiles [tile_begin, tile_end), in the rotated basis
        tile_begin = (split - 1) * tiles_per_split
        tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
        ak = ak_ptr + b * ak_sb + h * ak_sh
        zk = zk_ptr + b * ak_sb + h * ak_sh
        ck = ck_ptr + b * ck_sb + h * ck_sh
        gk = gk_ptr + b * gk_sb + h * gk_sh
        cv = cv_ptr + b * cv_sb + h * cv_sh
        av = av_ptr + b * av_sb + h * av_sh
        zv = zv_ptr + b * av_sb + h * av_sh
        gv_base = gv_ptr + b * gv_sb + h * gv_sh
        all_rows = offs_n < BLOCK_N  # every row of a tile is a token
        for tile in range(tile_begin, tile_end):
            # Per-channel key scales fold into the query once per tile; per-token scales multiply the scores.
            a = tl.load(ak + tile * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
            z = tl.load(zk + tile * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            qa = (q * a[None, :]).to(DOT)  # [BLOCK_M, BLOCK_D]
            bias = tl.sum(q * z[None, :], axis=1)  # [BLOCK_M]
            gv = tl.load(gv_base + tile * DV + offs_dv, mask=dv_ok, other=0.0).to(tl.float32)  # [BLOCK_DV]
            for n0 in range(0, G, BLOCK_N):
                rows = n0 + offs_n  # [BLOCK_N] rows within the tile
                codes = _load_codes(ck + tile * G * PK, rows, offs_d, d_ok[None, :], PK, BITSK).to(DOT)
                g = tl.load(gk + tile * G + rows).to(tl.float32)
                scores = (tl.dot(qa, tl.trans(codes)) + bias[:, None]) * g[None, :]
                valid = _visible(num_sink + tile * G + rows, all_rows, q_pos, start, mask_rows, mask_st, HAS_MASK)
                p, alpha, m_i, l_i = _online_softmax(scores * scaling, valid, m_i, l_i)
                # token-axis value: out_c = gv_c * (sum_t (p a)_t code + sum_t p_t z_t)
                a_v = tl.load(av + tile * G + rows).to(tl.float32)
                z_v = tl.load(zv + tile * G + rows).to(tl.float32)
                codes_v = _load_codes(cv + tile * G * PV, rows, offs_dv, dv_ok[None, :], PV, BITSV).to(DOT)
                part = tl.dot((p * a_v[None, :]).to(DOT), codes_v) + tl.sum(p * z_v[None, :], axis=1)[:, None]
                acc = acc * alpha[:, None] + gv[None, :] * part

    out_row = (pid_bh * splits + split) * M + offs_m
    _store_partial(o_ptr, lse_ptr, acc, m_i, l_i, out_row, offs_dv, m_ok, DV, True)


# ---- MLA: the latent is key and value ------------------------------------------------------------------------------
@triton.jit
def _latent_chunk(ptr, scale_ptr, zero_ptr, rows, n_ok, offs, D: tl.constexpr, P: tl.constexpr,
                  BITS: tl.constexpr, QUANT: tl.constexpr, DOT: tl.constexpr):
    # Keys [BLOCK_N, BLOCK_C] (channels offs of D) of token rows in the dot precision: full-precision rows
    # [n, D] at ptr, or a channel-axis tile's codes unpacked as scale_c * code + zero_c (gamma stays out).
    d_ok = offs < D
    if QUANT:
        codes = _load_codes(ptr, rows, offs, d_ok[None, :], P, BITS)
        scale = tl.load(scale_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_C]
        zero = tl.load(zero_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)
        return (codes.to(tl.float32) * scale[None, :] + zero[None, :]).to(DOT)
    else:
        return tl.load(ptr + rows[:, None] * D + offs[None, :], mask=n_ok[:, None] & d_ok[None, :],
                       other=0.0).to(DOT)


@triton.jit
def _q_shift(n0, RELOAD_Q: tl.constexpr):
    # 0, as an offset the compiler cannot prove constant over the key loop when RELOAD_Q: the query is then read
    # (from L1) where each product uses it instead of being hoisted out of the loop into registers.
    if RELOAD_Q:
        return tl.minimum(n0, 0)
    else:
        return 0


@triton.jit
def _mla_block(
    acc0, acc1, acc2, acc3, m_i, l_i,
    q_src, q_shift, valid, scaling,
    k1, a1, z1, g1, rows, n_ok,  # latent: rows (QUANT1: a tile's codes, scale, zero, gamma) and rows in it
    k2, a2, z2, g2, rows2,  # RoPE key: rows (KIND2 1) or a tile (KIND2 2), and rows in it
    offs_m, m_ok, offs_c, offs_d2, v0,
    D1: tl.constexpr, D2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, BITS1: tl.constexpr,
    BITS2: tl.constexpr, QUANT1: tl.constexpr, KIND2: tl.constexpr, K_CHUNKS: tl.constexpr,
    V_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, DOT: tl.constexpr,
):
    # One block of BLOCK_N tokens: scores over the latent chunk by chunk (+ the RoPE key), the online softmax, and
    # the probabilities times this program's V_CHUNKS value chunks, each into its accumulator [BLOCK_M, BLOCK_C].
    DQ: tl.constexpr = D1 + D2
    scores = tl.zeros((offs_m.shape[0], rows.shape[0]), tl.float32)
    for j in tl.static_range(K_CHUNKS):
        offs = j * BLOCK_C + offs_c
        q = tl.load(q_src + q_shift + offs_m[:, None] * DQ + offs[None, :], mask=m_ok[:, None] & (offs < D1)[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_C], in the dot precision already
        k = _latent_chunk(k1, a1, z1, rows, n_ok, offs, D1, P1, BITS1, QUANT1, DOT)
        scores = tl.dot(q, tl.trans(k), scores)
    if QUANT1:
        gamma1 = tl.load(g1 + rows).to(tl.float32)  # [BLOCK_N]
        scores = scores * gamma1[None, :]
    if KIND2 > 0:
        q2 = tl.load(q_src + q_shift + offs_m[:, None] * DQ + D1 + offs_d2[None, :],
                     mask=m_ok[:, None] & (offs_d2 < D2)[None, :], other=0.0)
        k = _latent_chunk(k2, a2, z2, rows2, n_ok, offs_d2, D2, P2, BITS2, KIND2 == 2, DOT)
        if KIND2 == 2:
            gamma2 = tl.load(g2 + rows2).to(tl.float32)
            scores += tl.dot(q2, tl.trans(k)) * gamma2[None, :]
        else:
            scores = tl.dot(q2, tl.trans(k), scores)
    p, alpha, m_i, l_i = _online_softmax(scores * scaling, valid, m_i, l_i)
    if QUANT1:
        p = p * gamma1[None, :]
    p = p.to(DOT)
    # The value chunks [BLOCK_N, BLOCK_C], unpacked again (the codes are an L1 hit).
    acc0 = tl.dot(p, _latent_chunk(k1, a1, z1, rows, n_ok, v0 + offs_c, D1, P1, BITS1, QUANT1, DOT),
                  acc0 * alpha[:, None])
    if V_CHUNKS > 1:
        acc1 = tl.dot(p, _latent_chunk(k1, a1, z1, rows, n_ok, v0 + BLOCK_C + offs_c, D1, P1, BITS1, QUANT1, DOT),
                      acc1 * alpha[:, None])
    if V_CHUNKS > 2:
        acc2 = tl.dot(p, _latent_chunk(k1, a1, z1, rows, n_ok, v0 + 2 * BLOCK_C + offs_c, D1, P1, BITS1, QUANT1,
                                       DOT), acc2 * alpha[:, None])
    if V_CHUNKS > 3:
        acc3 = tl.dot(p, _latent_chunk(k1, a1, z1, rows, n_ok, v0 + 3 * BLOCK_C + offs_c, D1, P1, BITS1, QUANT1,
                                       DOT), acc3 * alpha[:, None])
    return acc0, acc1, acc2, acc3, m_i, l_i


@triton.jit
def _mla_decode_kernel(
    # Queries [2, B, HKV, M, D1 + D2] in the dot precision: [0] plain (for full-precision tokens), [1] in the
    # tiles' basis; kv_start [B] int32 (HAS_START); mask [B, 1, S, T] (HAS_MASK) with batch, query and key strides
    q_ptr, kv_start_ptr, mask_ptr, mask_sb, mask_ss, mask_st,
    # Segment 1 (the latent; key and value): sink, tail [.., n, D1]; codes [.., N, G, P1]; scale, zero
    # [.., N, D1]; gamma [.., N, G]. *_sb, *_sh: batch and head strides.
    s1_ptr, s1_sb, s1_sh, t1_ptr, t1_sb, t1_sh, c1_ptr, c1_sb, c1_sh,
    a1_ptr, z1_ptr, a1_sb, a1_sh, g1_ptr, g1_sb, g1_sh,
    # Segment 2 (the RoPE key): full precision [.., T, D2] in s2 (SEG2 == 1), or tiled like segment 1 (SEG2 == 2)
    s2_ptr, s2_sb, s2_sh, t2_ptr, t2_sb, t2_sh, c2_ptr, c2_sb, c2_sh,
    a2_ptr, z2_ptr, a2_sb, a2_sh, g2_ptr, g2_sb, g2_sh,
    # Partial outputs [B, HKV, SPLITS, M, D1] and log-sum-exp [B, HKV, SPLITS, M], float32
    o_ptr, lse_ptr,
    scaling, num_sink, num_tiles, num_tail, tiles_per_split, q_len,
    HKV: tl.constexpr, M: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, G: tl.constexpr,
    P1: tl.constexpr, P2: tl.constexpr, BITS1: tl.constexpr, BITS2: tl.constexpr, SEG2: tl.constexpr,
    HAS_START: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr, K_CHUNKS: tl.constexpr, V_CHUNKS: tl.constexpr, BLOCK_D2: tl.constexpr,
    RELOAD_Q: tl.constexpr, DOT: tl.constexpr,
):
    # Grid: (B * HKV, SPLITS, head blocks * value blocks); value block j covers channels
    # [j * V_CHUNKS * BLOCK_C, (j + 1) * V_CHUNKS * BLOCK_C) of the latent.
    pid_bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    V_BLOCKS: tl.constexpr = K_CHUNKS // V_CHUNKS
    pid_m = tl.program_id(2) // V_BLOCKS
    pid_v = tl.program_id(2) % V_BLOCKS
    splits = tl.num_programs(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    DQ: tl.constexpr = D1 + D2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d2 = tl.arange(0, BLOCK_D2)
    v0 = pid_v * (V_CHUNKS * BLOCK_C)
    m_ok = offs_m < M
    total = num_sink + num_tiles * G + num_tail
    q_pos = total - q_len + offs_m % q_len  # [BLOCK_M] causal limit of each row
    start = 0
    if HAS_START:
        start = tl.load(kv_start_ptr + b)
    mask_rows = mask_ptr + b * mask_sb + (offs_m % q_len) * mask_ss  # [BLOCK_M] (used when HAS_MASK)
    use_rotated = ((split > 0) & (split < splits - 1)).to(tl.int64)
    q_src = q_ptr + use_rotated * tl.num_programs(0) * M * DQ + pid_bh * M * DQ
    KIND2_FP: tl.constexpr = 1 if SEG2 > 0 else 0  # the RoPE key of the sink and tail is full precision

    m_i = tl.full((BLOCK_M,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc0 = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)

    if split == 0:  # the sink, full precision
        k1 = s1_ptr + b * s1_sb + h * s1_sh
        k2 = s2_ptr + b * s2_sb + h * s2_sh  # a tiled segment's sink, or a full-precision one from position 0
        for n0 in range(0, num_sink, BLOCK_N):
            rows = n0 + offs_n
            n_ok = rows < num_sink
            valid = _visible(rows, n_ok, q_pos, start, mask_rows, mask_st, HAS_MASK)
            acc0, acc1, acc2, acc3, m_i, l_i = _mla_block(
                acc0, acc1, acc2, acc3, m_i, l_i, q_src, _q_shift(n0, RELOAD_Q), valid, scaling,
                k1, k1, k1, k1, rows, n_ok, k2, k2, k2, k2, rows, offs_m, m_ok, offs_c, offs_d2, v0,
                D1, D2, P1, P2, BITS1, BITS2, False, KIND2_FP, K_CHUNKS, V_CHUNKS, BLOCK_C, DOT)
    elif split == splits - 1:  # the tail, full precision
        first = num_sink + num_tiles * G
        k1 = t1_ptr + b * t1_sb + h * t1_sh
        if SEG2 == 2:
            k2 = t2_ptr + b * t2_sb + h * t2_sh
        else:
            k2 = s2_ptr + b * s2_sb + h * s2_sh + first * D2
        for n0 in range(0, num_tail, BLOCK_N):
            rows = n0 + offs_n
            n_ok = rows < num_tail
            valid = _visible(first + rows, n_ok, q_pos, start, mask_rows, mask_st, HAS_MASK)
            acc0, acc1, acc2, acc3, m_i, l_i = _mla_block(
                acc0, acc1, acc2, acc3, m_i, l_i, q_src, _q_shift(n0, RELOAD_Q), valid, scaling,
                k1, k1, k1, k1, rows, n_ok, k2, k2, k2, k2, rows, offs_m, m_ok, offs_c, offs_d2, v0,
                D1, D2, P1, P2, BITS1, BITS2, False, KIND2_FP, K_CHUNKS, V_CHUNKS, BLOCK_C, DOT)
    else:  # quantized tiles [tile_begin, tile_end), in the rotated basis: one loop over their tokens
        tile_begin = (split - 1) * tiles_per_split
        tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
        c1 = c1_ptr + b * c1_sb + h * c1_sh
        a1 = a1_ptr + b * a1_sb + h * a1_sh
        z1 = z1_ptr + b * a1_sb + h * a1_sh
        g1 = g1_ptr + b * g1_sb + h * g1_sh
        c2 = c2_ptr + b * c2_sb + h * c2_sh
        a2 = a2_ptr + b * a2_sb + h * a2_sh
        z2 = z2_ptr + b * a2_sb + h * a2_sh
        g2 = g2_ptr + b * g2_sb + h * g2_sh
        s2 = s2_ptr + b * s2_sb + h * s2_sh
        n_ok = offs_n < BLOCK_N  # every row of a tile is a token
        for n0 in range(tile_begin * G, tile_end * G, BLOCK_N):  # BLOCK_N divides G
            tile = n0 // G
            rows = n0 % G + offs_n  # [BLOCK_N] rows within the tile
            pos = num_sink + n0 + offs_n
            valid = _visible(pos, n_ok, q_pos, start, mask_rows, mask_st, HAS_MASK)
            if SEG2 == 2:
                acc0, acc1, acc2, acc3, m_i, l_i = _mla_block(
                    acc0, acc1, acc2, acc3, m_i, l_i, q_src, _q_shift(n0, RELOAD_Q), valid, scaling,
                    c1 + tile * G * P1, a1 + tile * D1, z1 + tile * D1, g1 + tile * G, rows, n_ok,
                    c2 + tile * G * P2, a2 + tile * D2, z2 + tile * D2, g2 + tile * G, rows,
                    offs_m, m_ok, offs_c, offs_d2, v0,
                    D1, D2, P1, P2, BITS1, BITS2, True, 2, K_CHUNKS, V_CHUNKS, BLOCK_C, DOT)
            else:  # a full-precision RoPE key (SEG2 == 1) is read at the tokens' positions, or there is none
                acc0, acc1, acc2, acc3, m_i, l_i = _mla_block(
                    acc0, acc1, acc2, acc3, m_i, l_i, q_src, _q_shift(n0, RELOAD_Q), valid, scaling,
                    c1 + tile * G * P1, a1 + tile * D1, z1 + tile * D1, g1 + tile * G, rows, n_ok,
                    s2, s2, s2, s2, pos, offs_m, m_ok, offs_c, offs_d2, v0,
                    D1, D2, P1, P2, BITS1, BITS2, True, SEG2, K_CHUNKS, V_CHUNKS, BLOCK_C, DOT)

    out_row = (pid_bh * splits + split) * M + offs_m
    _store_partial(o_ptr, lse_ptr, acc0, m_i, l_i, out_row, v0 + offs_c, m_ok, D1, pid_v == 0)
    if V_CHUNKS > 1:
        _store_partial(o_ptr, lse_ptr, acc1, m_i, l_i, out_row, v0 + BLOCK_C + offs_c, m_ok, D1, False)
    if V_CHUNKS > 2:
        _store_partial(o_ptr, lse_ptr, acc2, m_i, l_i, out_row, v0 + 2 * BLOCK_C + offs_c, m_ok, D1, False)
    if V_CHUNKS > 3:
        _store_partial(o_ptr, lse_ptr, acc3, m_i, l_i, out_row, v0 + 3 * BLOCK_C + offs_c, m_ok, D1, False)


# ---- launcher ----------------------------------------------------------------------------------------------------
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
    if list(t.stride()[2:]) != expected:
        raise ValueError(f"store tensor {tuple(t.shape)} has strides {t.stride()}: the dims after the head must be "
                         "contiguous")
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


@dataclass(frozen=True)
class DecodeConfig:
    """Block sizes and launch options of one decode launch.

    Attributes:
        block_m: Query rows per program (heads of a GQA group, or MLA heads).
        block_n: Tokens per step of the key loop (divides the tile size).
        block_c: MLA: latent channels per chunk (the score's and the value's); dense: 0.
        v_chunks: MLA: value chunks per program (1 to 4); fewer than the latent's chunks splits the value over
            programs, which recompute the scores. Dense: 0.
        num_warps: Warps per program.
        num_stages: Software-pipelining depth of the key loop.
    """

    block_m: int
    block_n: int
    block_c: int
    v_chunks: int
    num_warps: int
    num_stages: int


def decode_config(rows: int, key_dim: int, value_dim: int, dtype: torch.dtype, mla: bool,
                  capability: tuple[int, int] | None, masked: bool = False) -> DecodeConfig:
    """The decode launch's configuration for ``rows`` query rows per kv head on a device of compute ``capability``
    (None: Triton's interpreter, configured like sm_90 so that the tests run the same blocks).

    Dense: a whole GQA group (up to 64 rows at head_dim <= 128), 4 warps. MLA: 32-head blocks over 8 warps and
    128-channel chunks, the whole latent value in one program (four float32 accumulators ``[32, 128]``: 64
    registers a thread), the key loop not pipelined (its loads are unpacked in registers before any product;
    two stages double the shared memory and spill). Measured with ``benchmarks/compile_report.py``: at 128 heads x
    (512 + 64) 180 registers and 48 KB of shared memory on sm_90 and sm_80, where 64-head blocks spill (255
    registers, the query and four ``[64, 128]`` accumulators). Devices with at most 99 KB of shared memory per block
    (sm_86, sm_89, sm_120) get the same blocks, which fit (`benchmarks/results/compile_sm86.md`); ``capability``
    is the hook for a target that needs others. 16-head blocks for float32 stores (TF32 dots, 4-byte operands) and
    for launches with an explicit mask (``masked``), which spill at 32 on sm_90 (660 and 36 B); an 8-bit latent
    still spills 68/100 B on sm_90 and 40/40 B on sm_86 (none on sm_80), see `benchmarks/results/compile_sm*.md`.
    """
    block_m = max(16, triton.next_power_of_2(rows))
    if not mla:
        return DecodeConfig(min(block_m, 64 if value_dim <= 128 else 32), 32, 0, 0, 8 if key_dim >= 256 else 4, 2)
    width = triton.next_power_of_2(key_dim)
    block_c = min(128, max(16, width))
    block_m = min(block_m, 16 if masked or dtype not in (torch.float16, torch.bfloat16) else 32)
    v_chunks = min(4, width // block_c)  # a latent wider than 512 splits the value over programs
    return DecodeConfig(block_m, 32, block_c, v_chunks, 8 if block_m * width >= 8192 else 4, 1)


@dataclass
class DecodePlan:
    """A prepared decode launch and where it writes: partials ``[B, Hkv, 2 + splits, M, Dv]`` and their
    log-sum-exp ``[B, Hkv, 2 + splits, M]`` (float32), merged by `merge_splits`."""

    launch: KernelLaunch
    partial: torch.Tensor
    lse: torch.Tensor
    rotated_tiles: bool
    config: DecodeConfig


_DOT = {torch.float16: (tl.float16, torch.float16), torch.bfloat16: (tl.bfloat16, torch.bfloat16)}


def plan_tiled_attention(
    q: torch.Tensor,
    keys: Sequence[StreamView],
    values: StreamView | None,
    scaling: float,
    *,
    q_len: int = 1,
    kv_start: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    num_splits: int | None = None,
    capability: tuple[int, int] | None,
    config: DecodeConfig | None = None,
) -> DecodePlan:
    """The launch `tiled_attention` runs, configured for a device of compute ``capability`` (None: the interpreter).

    Builds the arguments without launching anything, so that a compile check can compile the launch of any target
    from CPU tensors. Arguments as `tiled_attention`; ``config`` replaces `decode_config`'s choice (tests use it to
    run several head and value blocks on small shapes).
    """
    if not kernel_supports(keys, values):
        raise ValueError(
            "tiled_attention needs a quantized channel-axis first key stream, an optional second key stream, and "
            "a quantized token-axis value stream (or none: the first key is the value)"
        )
    seg1 = keys[0]
    seg2 = keys[1] if len(keys) == 2 else None
    batch, kv_heads, rows, dq = q.shape
    d1 = seg1.dim
    d2 = seg2.dim if seg2 is not None else 0
    if dq != d1 + d2:
        raise ValueError(f"query width {dq} != key widths {d1} + {d2}")
    if rows % q_len:
        raise ValueError(f"query rows per kv head ({rows}) must be a multiple of q_len ({q_len})")
    length = seg1.sink_length + seg1.num_tiles * seg1.scheme.tile_size + seg1.tail_length
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != q_len
                             or mask.shape[-1] != length or mask.shape[0] not in (1, batch)):
        raise ValueError(f"mask must be [B, 1, q_len, T] = [{batch}, 1, {q_len}, {length}], got {tuple(mask.shape)}")
    mla = values is None
    value = seg1 if mla else values
    dv = value.dim
    device = q.device
    config = config or decode_config(rows, d1, dv, seg1.dtype, mla, capability, masked=mask is not None)
    dot, q_dtype = _DOT.get(seg1.dtype, (tl.float32, torch.float32))
    if capability is None:
        dot, q_dtype = tl.float32, torch.float32  # the interpreter computes dots in float32 anyway
    q = q.float()
    # Queries in the tiles' basis: each quantized, rotated segment gets its own Hadamard. MLA reads them in the dot
    # precision; dense folds the key scales into them per tile, in float32.
    qt = torch.cat([rotate(q[..., :d1]) if seg1.scheme.hadamard else q[..., :d1]]
                   + ([] if seg2 is None else [rotate(q[..., d1:]) if seg2.scheme.quantized and seg2.scheme.hadamard
                                               else q[..., d1:]]), -1)
    queries = torch.stack([q, qt]).to(q_dtype if mla else torch.float32).contiguous()
    num_tiles = seg1.num_tiles
    width = triton.next_power_of_2(d1)
    value_blocks = width // config.block_c // config.v_chunks if mla else 1
    head_blocks = triton.cdiv(rows, config.block_m) * value_blocks
    if num_splits is None:  # enough programs for two waves over the device's multiprocessors
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        num_splits = -(-target // max(1, batch * kv_heads * head_blocks))
    num_splits = max(1, min(num_splits, max(num_tiles, 1)))
    tiles_per_split = max(1, -(-num_tiles // num_splits))
    splits = 2 + num_splits
    partial = torch.empty(batch, kv_heads, splits, rows, dv, dtype=torch.float32, device=device)
    lse = torch.empty(batch, kv_heads, splits, rows, dtype=torch.float32, device=device)
    start = kv_start.to(device=device, dtype=torch.int32).contiguous() if kv_start is not None else _empty(device)[0]
    if mask is not None:  # bool -> uint8 is a view; a broadcast batch reads row 0
        mask_args = (mask.view(torch.uint8), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2),
                     mask.stride(3))
    else:
        mask_args = (_empty(device)[0], 0, 0, 0)

    seg1_args, _, bits1, p1 = _segment(seg1, device)
    seg2_args, seg2_kind, bits2, p2 = _segment(seg2, device)
    grid = (batch * kv_heads, splits, head_blocks)
    sizes = (scaling, seg1.sink_length, num_tiles, seg1.tail_length, tiles_per_split, q_len)
    options = dict(HAS_START=kv_start is not None, HAS_MASK=mask is not None, BLOCK_M=config.block_m,
                   BLOCK_N=config.block_n, DOT=dot, num_warps=config.num_warps, num_stages=config.num_stages)
    if mla:
        launch = KernelLaunch(
            _mla_decode_kernel, grid, (queries, start, *mask_args, *seg1_args, *seg2_args, partial, lse, *sizes),
            dict(options, HKV=kv_heads, M=rows, D1=d1, D2=d2, G=seg1.scheme.tile_size, P1=p1, P2=p2, BITS1=bits1,
                 BITS2=bits2, SEG2=seg2_kind, BLOCK_C=config.block_c, K_CHUNKS=width // config.block_c,
                 V_CHUNKS=config.v_chunks, RELOAD_Q=True, BLOCK_D2=max(16, triton.next_power_of_2(max(d2, 1)))))
    else:
        value_args, _, bitsv, pv = _segment(value, device)
        launch = KernelLaunch(
            _dense_decode_kernel, grid, (queries, start, *mask_args, *seg1_args, *value_args, partial, lse, *sizes),
            dict(options, HKV=kv_heads, M=rows, D=d1, DV=dv, G=seg1.scheme.tile_size, PK=p1, PV=pv, BITSK=bits1,
                 BITSV=bitsv, BLOCK_D=max(16, triton.next_power_of_2(d1)),
                 BLOCK_DV=max(16, triton.next_power_of_2(dv))))
    return DecodePlan(launch, partial, lse, value.scheme.hadamard, config)


def tiled_attention(
    q: torch.Tensor,
    keys: Sequence[StreamView],
    values: StreamView | None,
    scaling: float,
    *,
    q_len: int = 1,
    kv_start: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Fused attention over a quantized store: the contract of `kvarn_mla.quant.tiled_attention_reference`
    (``q [B, Hkv, M, sum(key dims)]`` -> ``[B, Hkv, M, Dv]`` float32) for a quantized channel-axis first key (dense
    K or the MLA latent), an optional second key of any width (the MLA RoPE key), and a quantized token-axis value
    stream or None (the latent is the value). No host synchronization: the launch depends on shapes only.

    Args:
        q: ``[B, Hkv, M, D1 (+ D2)]`` query rows per kv head, ordered ``(head, query)``; row ``m`` is query
            ``m % q_len``.
        keys: The first key stream (quantized, channel axis) and optionally the MLA RoPE key.
        values: The token-axis value stream, or None (MLA: the latent is the value).
        scaling: Softmax scale.
        q_len: Queries per row group; query ``s`` sits at position ``T - q_len + s`` (causal).
        kv_start: Optional ``[B]`` int, the first valid key position of each row (left padding).
        mask: Optional ``[B, 1, q_len, T]`` bool (True = attend), replacing the causal/padding one (and
            ``kv_start``). A query row that sees no key gets zeros.
        num_splits: Splits that share the quantized tiles (default: two waves of programs over the device).
    """
    check_triton_device(q.device)
    plan = plan_tiled_attention(q, keys, values, scaling, q_len=q_len, kv_start=kv_start, mask=mask,
                                num_splits=num_splits, capability=device_capability(q.device))
    plan.launch.run()
    return merge_splits(plan.partial, plan.lse, plan.rotated_tiles)


def attend(q, keys, values, scaling: float, mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
    """The Triton backend's attention (see `kvarn_mla.backends.Backend`): the fused kernel reads the mask as given
    (left padding, causal, the DSA indexer's top-k alike), so nothing here looks at tensor values; stream bit widths
    the kernel does not cover run on the torch path, with a warning."""
    if kernel_supports(keys, values):
        return tiled_attention(q, keys, values, scaling, q_len=q_len, mask=mask)
    warn_once("kvarn: the fused Triton kernel does not cover these stream bit widths; this attention runs on the "
              "torch path")
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
