"""Store kernel: quantize a batch of KVarN tiles in one launch (rotate, normalize, RTN, pack, write scales).

One program quantizes one tile ``x [G, D]`` (token-major, any float dtype). The tile never has to fit in
registers: it is rotated chunk by chunk (``BLOCK_T`` tokens x all channels, a fast Walsh-Hadamard transform in
float64) into a float32 scratch copy, and every later pass streams that copy again. Per-channel vectors live in
registers, per-token vectors in a small float64 scratch. Arithmetic mirrors `kvarn_mla.quant.tile.quantize_tile`:
float64 statistics (one-pass unbiased std), float64 RTN with round-half-to-even, metadata rounded
float64 -> float32 -> float16, so the integer codes equal the reference's.

Why float64 (measured, `benchmarks/compile_report.py`): the kernel compiles to about 2-4k float64 instructions
(PTX), mostly the statistics passes and libdevice's exp/log; a tile is quantized once per ``G`` tokens, so at
half-rate float64 (H100/H200/A100) this is well under a microsecond per decoded token per model, and even at the
1/64 rate of consumer cards a small fraction of a decode step. In exchange the integer codes equal the float64
reference's exactly under Triton's interpreter (the tests), and a float32 kernel could not promise that. Compiled
for CUDA, exp/log are libdevice's, not the CPU's libm: they may differ in the last bit, which moves a level across a
rounding boundary for a tiny fraction of codes (a code off by one, never a wrong scale); the GPU tests allow that.

Registers: a chunk of ``_CHUNK_ELEMENTS`` float64 values (2048: 16 tokens at D = 128, 4 at 512) keeps every width
and bit width spill-free on sm_80 and sm_90; 4096 spilled at 8 bits (K/V d128: 255 registers, 120-136 B of stack).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..quant.hadamard import hadamard_block_size
from ..quant.rtn import SNAP_BITS, STEP_MIN, packed_width
from ..quant.scheme import TileScheme
from ..quant.tile import QuantizedTile
from ..quant.varnorm import LOG_SCALE_MAX, LOG_SCALE_MIN, SPREAD_FLOOR, STD_MAX, STD_MIN, TIE_SLACK
from .common import KernelLaunch, check_triton_device, device_capability, interpreter_enabled

_CHUNK_ELEMENTS = 2048  # float64 elements per chunk held in registers (see the module docstring)
# The reference's constants, as compile-time constants of the kernel (never re-typed here).
_TIE = tl.constexpr(TIE_SLACK)
_STD_MIN, _STD_MAX = tl.constexpr(STD_MIN), tl.constexpr(STD_MAX)
_LOG_MIN, _LOG_MAX = tl.constexpr(LOG_SCALE_MIN), tl.constexpr(LOG_SCALE_MAX)
_STEP_MIN = tl.constexpr(STEP_MIN)
_SNAP = tl.constexpr(float(2**SNAP_BITS))
_SPREAD_FLOOR = tl.constexpr(SPREAD_FLOOR)
# float64 exp/log: libdevice's __nv_exp/__nv_log when compiled for CUDA (tl.exp/tl.log lower to float32
# approximations there), numpy's under the interpreter, which has no libdevice.
_LIBDEVICE = tl.constexpr(not interpreter_enabled())


@triton.jit
def _exp64(x):
    if _LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log64(x):
    if _LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _fwht(x, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, LOG_HAD: tl.constexpr):
    # Butterflies (a + b, a - b) between channels i and i + h, for h = 1, 2, ..., 2^(LOG_HAD - 1): the Sylvester
    # Hadamard applied to each aligned block of 2^LOG_HAD channels (unscaled).
    for stage in tl.static_range(LOG_HAD):
        y = tl.reshape(x, (BLOCK_T, BLOCK_D // (2 << stage), 2, 1 << stage))
        a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (BLOCK_T, BLOCK_D))
    return x


@triton.jit
def _stats_pass(
    rot_ptr, tok_ptr, ch_log, valid_ptr,
    offs_t, offs_d, d_mask,
    G: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, HAS_MASK: tl.constexpr,
):
    # Unbiased std of y = x / (exp(token_log) exp(channel_log)) per channel (over valid tokens, returned) and per
    # token (over channels, written to tok_ptr + 2G), plus the spreads max/min of both.
    ch_sum = tl.zeros_like(ch_log)
    ch_sq = tl.zeros_like(ch_log)
    count = tl.sum(tl.zeros_like(ch_log), axis=0)
    tok_hi = tl.sum(tl.zeros_like(ch_log), axis=0)
    tok_lo = tok_hi + float("inf")
    inv_ch = _exp64(-ch_log)
    for t0 in range(0, G, BLOCK_T):
        rows = t0 + offs_t
        x = tl.load(rot_ptr + rows[:, None] * D + offs_d[None, :], mask=d_mask[None, :], other=0.0).to(tl.float64)
        inv_tok = _exp64(-tl.load(tok_ptr + rows))
        y = x * inv_tok[:, None] * inv_ch[None, :]
        if HAS_MASK:
            w = tl.load(valid_ptr + rows).to(tl.float64)
        else:
            w = tl.full((BLOCK_T,), 1.0, tl.float64)
        ch_sum += tl.sum(y * w[:, None], axis=0)
        ch_sq += tl.sum(y * y * w[:, None], axis=0)
        count += tl.sum(w, axis=0)
        t_sum = tl.sum(y, axis=1)
        t_var = (tl.sum(y * y, axis=1) - t_sum * t_sum / D) / tl.maximum(D - 1.0, 1.0)
        t_std = tl.sqrt(tl.maximum(t_var, 0.0))
        tl.store(tok_ptr + 2 * G + rows, t_std)
        tok_hi = tl.maximum(tok_hi, tl.max(tl.where(w > 0, t_std, 0.0), axis=0))
        tok_lo = tl.minimum(tok_lo, tl.min(tl.where(w > 0, t_std, float("inf")), axis=0))
    ch_var = (ch_sq - ch_sum * ch_sum / tl.maximum(count, 1.0)) / tl.maximum(count - 1.0, 1.0)
    ch_std = tl.sqrt(tl.maximum(ch_var, 0.0))
    ch_hi = tl.max(tl.where(d_mask, ch_std, 0.0), axis=0)
    ch_lo = tl.min(tl.where(d_mask, ch_std, float("inf")), axis=0)
    tok_lo = tl.where(count > 0, tok_lo, 1.0)
    spread = ch_hi / tl.maximum(ch_lo, _SPREAD_FLOOR) + tok_hi / tl.maximum(tok_lo, _SPREAD_FLOOR)
    return ch_std, spread


@triton.jit
def _update_tokens(tok_ptr, valid_ptr, offs_t, G: tl.constexpr, BLOCK_T: tl.constexpr, HAS_MASK: tl.constexpr):
    # token_log <- clip(token_log + log(clip(token_std)), LOG_MIN, LOG_MAX), padding tokens unchanged
    for t0 in range(0, G, BLOCK_T):
        rows = t0 + offs_t
        std = tl.minimum(tl.maximum(tl.load(tok_ptr + 2 * G + rows), _STD_MIN), _STD_MAX)
        step = _log64(std)
        if HAS_MASK:
            step = step * tl.load(valid_ptr + rows).to(tl.float64)
        log = tl.minimum(tl.maximum(tl.load(tok_ptr + rows) + step, _LOG_MIN), _LOG_MAX)
        tl.store(tok_ptr + rows, log)


@triton.jit
def _update_channels(ch_log, ch_std, d_mask):
    step = _log64(tl.minimum(tl.maximum(ch_std, _STD_MIN), _STD_MAX))
    return tl.where(d_mask, tl.minimum(tl.maximum(ch_log + step, _LOG_MIN), _LOG_MAX), 0.0)


@triton.jit
def _round_half_even(v):
    r = tl.floor(v + 0.5)
    is_tie = (r - v) == 0.5
    is_odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where(is_tie & is_odd, r - 1.0, r)


@triton.jit
def _store_kernel(
    # Pointers: input tiles [N, G, D] (contiguous), token validity [N, G] int8, scratch, outputs
    x_ptr, valid_ptr, rot_ptr, tok_ptr,
    codes_ptr, scale_ptr, zero_ptr, gamma_ptr,
    # Meta-parameters
    inv_sqrt_block,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    BITS: tl.constexpr, PACKED: tl.constexpr, AXIS_CHANNEL: tl.constexpr, ITERS: tl.constexpr,
    LOG_HAD: tl.constexpr, HAS_MASK: tl.constexpr,
):
    # Scratch per tile: rot [G, D] float32 (the rotated tile); tok [4, G] float64 = token log-scale, best token
    # log-scale, token std, spare. Outputs: codes [G, PACKED] uint8; scale/zero [R], gamma [C] float16 with
    # (R, C) = (D, G) for AXIS_CHANNEL (keys) and (G, D) otherwise (values).
    pid = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    x_ptr += pid * G * D
    rot_ptr += pid * G * D
    tok_ptr += pid * 4 * G
    valid_ptr += pid * G
    codes_ptr += pid * G * PACKED
    if AXIS_CHANNEL:
        scale_ptr += pid * D
        zero_ptr += pid * D
        gamma_ptr += pid * G
    else:
        scale_ptr += pid * G
        zero_ptr += pid * G
        gamma_ptr += pid * D

    # 1. Rotate (float64 butterflies, rounded to float32) into scratch; token log-scales start at 0.
    for t0 in range(0, G, BLOCK_T):
        rows = t0 + offs_t
        x = tl.load(x_ptr + rows[:, None] * D + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        if LOG_HAD > 0:
            x = _fwht(x.to(tl.float64), BLOCK_T, BLOCK_D, LOG_HAD) * inv_sqrt_block
        tl.store(rot_ptr + rows[:, None] * D + offs_d[None, :], x.to(tl.float32), mask=d_mask[None, :])
        tl.store(tok_ptr + rows, tl.zeros((BLOCK_T,), tl.float64))
        tl.store(tok_ptr + G + rows, tl.zeros((BLOCK_T,), tl.float64))

    # 2. Variance normalization: columns first, then rows; keep the iterate with the lowest imbalance.
    ch_log = tl.zeros((BLOCK_D,), tl.float64)
    best_ch = ch_log
    ch_std, best = _stats_pass(rot_ptr, tok_ptr, ch_log, valid_ptr, offs_t, offs_d, d_mask, G, D, BLOCK_T, HAS_MASK)
    for _ in range(ITERS):
        if AXIS_CHANNEL:  # columns are tokens
            _update_tokens(tok_ptr, valid_ptr, offs_t, G, BLOCK_T, HAS_MASK)
            ch_std, _s = _stats_pass(rot_ptr, tok_ptr, ch_log, valid_ptr, offs_t, offs_d, d_mask, G, D, BLOCK_T,
                                     HAS_MASK)
            ch_log = _update_channels(ch_log, ch_std, d_mask)
        else:  # columns are channels
            ch_log = _update_channels(ch_log, ch_std, d_mask)
            _c, _s = _stats_pass(rot_ptr, tok_ptr, ch_log, valid_ptr, offs_t, offs_d, d_mask, G, D, BLOCK_T, HAS_MASK)
            _update_tokens(tok_ptr, valid_ptr, offs_t, G, BLOCK_T, HAS_MASK)
        ch_std, score = _stats_pass(rot_ptr, tok_ptr, ch_log, valid_ptr, offs_t, offs_d, d_mask, G, D, BLOCK_T,
                                    HAS_MASK)
        if score <= best * (1.0 + _TIE):
            best = score
            best_ch = ch_log
            for t0 in range(0, G, BLOCK_T):
                tl.store(tok_ptr + G + t0 + offs_t, tl.load(tok_ptr + t0 + offs_t))

    # 3. Asymmetric min-max RTN per row of z = x / (token_scale * channel_scale), in float64.
    QMAX: tl.constexpr = (1 << BITS) - 1
    inv_ch = _exp64(-best_ch)
    if AXIS_CHANNEL:  # rows are channels: min/max over the valid tokens first
        lo = tl.full((BLOCK_D,), float("inf"), tl.float64)
        hi = tl.full((BLOCK_D,), float("-inf"), tl.float64)
        any_valid = tl.sum(tl.zeros((BLOCK_T,), tl.float64), axis=0)
        for t0 in range(0, G, BLOCK_T):
            rows = t0 + offs_t
            x = tl.load(rot_ptr + rows[:, None] * D + offs_d[None, :], mask=d_mask[None, :], other=0.0)
            z = x.to(tl.float64) * _exp64(-tl.load(tok_ptr + G + rows))[:, None] * inv_ch[None, :]
            if HAS_MASK:
                ok = tl.load(valid_ptr + rows) != 0
                any_valid += tl.sum(ok.to(tl.float64), axis=0)
                lo = tl.minimum(lo, tl.min(tl.where(ok[:, None], z, float("inf")), axis=0))
                hi = tl.maximum(hi, tl.max(tl.where(ok[:, None], z, float("-inf")), axis=0))
            else:
                any_valid += BLOCK_T
                lo = tl.minimum(lo, tl.min(z, axis=0))
                hi = tl.maximum(hi, tl.max(z, axis=0))
        lo = tl.where(any_valid > 0, lo, 0.0)
        hi = tl.where(any_valid > 0, hi, 0.0)
        step = tl.maximum((hi - lo) / QMAX, _STEP_MIN)
        row_scale = _exp64(best_ch)
        tl.store(scale_ptr + offs_d, (row_scale * step).to(tl.float32).to(tl.float16), mask=d_mask)
        tl.store(zero_ptr + offs_d, (row_scale * lo).to(tl.float32).to(tl.float16), mask=d_mask)
    else:  # columns are channels: their scale is gamma
        tl.store(gamma_ptr + offs_d, _exp64(best_ch).to(tl.float32).to(tl.float16), mask=d_mask)

    for t0 in range(0, G, BLOCK_T):
        rows = t0 + offs_t
        x = tl.load(rot_ptr + rows[:, None] * D + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        tok_log = tl.load(tok_ptr + G + rows)
        z = x.to(tl.float64) * _exp64(-tok_log)[:, None] * inv_ch[None, :]
        if AXIS_CHANNEL:
            v = (z - lo[None, :]) / step[None, :]
            tl.store(gamma_ptr + rows, _exp64(tok_log).to(tl.float32).to(tl.float16))
        else:  # rows are tokens: min/max over channels, within the chunk
            t_lo = tl.min(tl.where(d_mask[None, :], z, float("inf")), axis=1)
            t_hi = tl.max(tl.where(d_mask[None, :], z, float("-inf")), axis=1)
            t_step = tl.maximum((t_hi - t_lo) / QMAX, _STEP_MIN)
            v = (z - t_lo[:, None]) / t_step[:, None]
            row_scale = _exp64(tok_log)
            tl.store(scale_ptr + rows, (row_scale * t_step).to(tl.float32).to(tl.float16))
            tl.store(zero_ptr + rows, (row_scale * t_lo).to(tl.float32).to(tl.float16))
        v = _round_half_even(v * _SNAP) / _SNAP  # exact ties stay ties (see SNAP_BITS)
        codes = tl.minimum(tl.maximum(_round_half_even(v), 0.0), QMAX).to(tl.int32)
        codes = tl.where(d_mask[None, :], codes, 0)
        # 4. Pack along channels: a little-endian bit stream, code i at bits [i*BITS, (i+1)*BITS).
        if BITS == 3:
            groups = tl.reshape(codes, (BLOCK_T, BLOCK_D // 8, 8))
            word = tl.sum(groups << (tl.arange(0, 8) * 3)[None, None, :], axis=2)
            offs_g = tl.arange(0, BLOCK_D // 8)
            for k in tl.static_range(3):
                byte = ((word >> (8 * k)) & 255).to(tl.uint8)
                cols = 3 * offs_g + k
                tl.store(codes_ptr + rows[:, None] * PACKED + cols[None, :], byte, mask=cols[None, :] < PACKED)
        else:
            PER_BYTE: tl.constexpr = 8 // BITS
            groups = tl.reshape(codes, (BLOCK_T, BLOCK_D // PER_BYTE, PER_BYTE))
            byte = tl.sum(groups << (tl.arange(0, PER_BYTE) * BITS)[None, None, :], axis=2).to(tl.uint8)
            cols = tl.arange(0, BLOCK_D // PER_BYTE)
            tl.store(codes_ptr + rows[:, None] * PACKED + cols[None, :], byte, mask=cols[None, :] < PACKED)


def plan_store_tiles(
    x: torch.Tensor, scheme: TileScheme, token_valid: torch.Tensor | None = None, *,
    capability: tuple[int, int] | None = None,
) -> tuple[KernelLaunch, QuantizedTile]:
    """The launch `store_tiles` runs and the tiles it writes, prepared without launching anything (so that a
    compile check can compile it for any target from CPU tensors). Arguments as `store_tiles`; ``capability`` is
    the target's compute capability (None: the interpreter); every target gets the same blocks today."""
    if x.dim() != 3 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.shape[1] != scheme.tile_size:
        raise ValueError(f"x must be [N, {scheme.tile_size}, D] fp16/bf16/fp32, got shape={tuple(x.shape)} "
                         f"dtype={x.dtype}")
    if not scheme.quantized:
        raise ValueError(f"store_tiles quantizes: scheme.bits must be one of (2, 3, 4, 8), got {scheme.bits}")
    num, size, dim = x.shape
    x = x.contiguous()
    block_d = max(8, triton.next_power_of_2(dim))
    block_t = max(1, min(size, _CHUNK_ELEMENTS // block_d))
    packed = packed_width(dim, scheme.bits)
    rows, cols = scheme.rows_cols(dim)
    device = x.device
    codes = torch.empty(num, size, packed, dtype=torch.uint8, device=device)
    scale = torch.empty(num, rows, dtype=torch.float16, device=device)
    zero = torch.empty(num, rows, dtype=torch.float16, device=device)
    gamma = torch.empty(num, cols, dtype=torch.float16, device=device)
    rot = torch.empty(num, size, dim, dtype=torch.float32, device=device)
    tok = torch.empty(num, 4, size, dtype=torch.float64, device=device)
    valid = (torch.ones(num, size, dtype=torch.int8, device=device) if token_valid is None
             else token_valid.to(device=device, dtype=torch.int8).contiguous())
    had_block = hadamard_block_size(dim) if scheme.hadamard else 1
    launch = KernelLaunch(
        _store_kernel, (num,),
        (x, valid, rot, tok, codes, scale, zero, gamma, 1.0 / math.sqrt(had_block)),
        dict(G=size, D=dim, BLOCK_D=block_d, BLOCK_T=block_t, BITS=scheme.bits, PACKED=packed,
             AXIS_CHANNEL=scheme.axis == "channel", ITERS=scheme.varnorm_iters, LOG_HAD=had_block.bit_length() - 1,
             HAS_MASK=token_valid is not None, num_warps=8),
    )
    return launch, QuantizedTile(codes, scale, zero, gamma)


def store_tiles(x: torch.Tensor, scheme: TileScheme, token_valid: torch.Tensor | None = None) -> QuantizedTile:
    """Quantize tiles ``x [N, G, D]`` in one launch; same contract as `kvarn_mla.quant.store_tiles_reference`.

    Args:
        x: ``[N, G, D]`` fp16/bf16/fp32 tiles (made contiguous), ``G == scheme.tile_size``.
        scheme: A quantized `TileScheme` (bits, axis, normalization iterations, rotation).
        token_valid: Optional ``[N, G]`` bool, False for padding tokens.

    Returns:
        `QuantizedTile` with codes ``[N, G, packed_width(D, bits)]`` uint8 and float16 metadata.
    """
    check_triton_device(x.device)
    launch, tiles = plan_store_tiles(x, scheme, token_valid, capability=device_capability(x.device))
    if x.shape[0]:
        launch.run()
    return tiles


__all__ = ["plan_store_tiles", "store_tiles"]
