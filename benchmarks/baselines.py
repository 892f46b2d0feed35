"""bf16 baseline for the GPU decode benchmark: a Triton MLA decode of the same structure as the fused kernel.

Same split-KV layout (programs over (batch, head block, split), online softmax, log-sum-exp merge), but the cache
is the plain bf16 ``[c_kv | k_pe]`` rows (576 wide) and the value is the latent, so the only difference from
`kvarn_mla.kernels.decode` is what is read: 1152 bytes per token instead of the quantized tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)


@triton.jit
def _mla_bf16_kernel(
    q_ptr, kv_ptr, o_ptr, lse_ptr,  # q [B, H, R + P]; kv [B, T, R + P]; o [B, S, H, R]; lse [B, S, H]
    scaling, tokens, tokens_per_split,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, P)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    q_row = q_ptr + b * H * (R + P) + offs_h[:, None] * (R + P)
    q_lat = tl.load(q_row + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    q_pe = tl.load(q_row + R + offs_p[None, :], mask=h_ok[:, None], other=0.0)
    m_i = tl.full((BLOCK_H,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, R), tl.float32)
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, tokens)
    for n0 in range(begin, end, BLOCK_N):
        rows = n0 + offs_n
        ok = rows < end
        kv_row = kv_ptr + b * tokens * (R + P) + rows[:, None] * (R + P)
        latent = tl.load(kv_row + offs_r[None, :], mask=ok[:, None], other=0.0)
        rope = tl.load(kv_row + R + offs_p[None, :], mask=ok[:, None], other=0.0)
        scores = (tl.dot(q_lat, tl.trans(latent)) + tl.dot(q_pe, tl.trans(rope))) * scaling
        scores = tl.where(ok[None, :], scores, NEG)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(ok[None, :], tl.exp(scores - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
    row = (b * splits + split) * H + offs_h
    tl.store(o_ptr + row[:, None] * R + offs_r[None, :], out, mask=h_ok[:, None])
    tl.store(lse_ptr + row, lse, mask=h_ok)


def mla_decode_bf16(q: torch.Tensor, kv: torch.Tensor, rank: int, scaling: float, splits: int = 1) -> torch.Tensor:
    """Absorbed MLA decode over a bf16 cache: ``q [B, H, R + P]``, ``kv [B, T, R + P]`` -> ``[B, H, R]`` float32."""
    batch, heads, width = q.shape
    tokens = kv.shape[1]
    rope = width - rank
    per_split = triton.cdiv(tokens, splits)
    partial = torch.empty(batch, splits, heads, rank, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch, splits, heads, device=q.device, dtype=torch.float32)
    block_h = 16
    _mla_bf16_kernel[(batch, triton.cdiv(heads, block_h), splits)](
        q, kv, partial, lse, scaling, tokens, per_split,
        H=heads, R=rank, P=rope, BLOCK_H=block_h, BLOCK_N=32, num_warps=8,
    )
    weight = torch.softmax(lse, dim=1).nan_to_num(0.0)
    return (partial * weight.unsqueeze(-1)).sum(1)
