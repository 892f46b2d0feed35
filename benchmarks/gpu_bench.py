"""CUDA part of bench_decode.py: the fused decode kernel vs bf16 baselines, per decode step of one layer.

GQA (32 query heads, 8 kv heads, 128; k4v2) against PyTorch SDPA (bf16, enable_gqa) and flash-attn when importable;
MLA (128 heads, latent 512 + RoPE 64; latent 4-bit, RoPE bf16) against SDPA on the absorbed problem and a bf16
Triton MLA decode of the same structure (`baselines.py`). Stores are filled with random codes and scales (timing
does not depend on the values). Reports µs per call, GB/s over the bytes actually read, and bf16 time / ours.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from baselines import mla_decode_bf16

from kvarn_mla.config import TileScheme
from kvarn_mla.kernels.decode import tiled_attention
from kvarn_mla.quant import QuantizedTile, StreamView, packed_width

H200_BANDWIDTH = 4.8e12  # bytes/s, the nominal HBM3e bandwidth


def random_view(
    scheme: TileScheme, heads: int, dim: int, batch: int, tokens: int, device: str = "cuda"
) -> StreamView:
    """A store of ``tokens`` bf16 tokens with random codes and scales, built without quantizing (timing does not
    depend on the values); a 16-bit scheme keeps every token in the tail."""
    def randn(n: int) -> torch.Tensor:
        return torch.randn(batch, heads, n, dim, device=device, dtype=torch.bfloat16)

    if not scheme.quantized:
        return StreamView(scheme, dim, torch.bfloat16, None, None, randn(tokens))
    sink, size = scheme.sink_tokens, scheme.tile_size
    count = (tokens - sink) // size
    rows, cols = scheme.rows_cols(dim)
    codes = torch.randint(0, 256, (batch, heads, count, size, packed_width(dim, scheme.bits)), device=device,
                          dtype=torch.uint8)
    scale, zero, gamma = ((torch.rand(batch, heads, count, width, device=device) * 0.1 + 0.01).half()
                          for width in (rows, rows, cols))
    return StreamView(scheme, dim, torch.bfloat16, randn(sink), QuantizedTile(codes, scale, zero, gamma),
                      randn(tokens - sink - count * size))


def nbytes(view: StreamView) -> int:
    parts = [view.sink, view.tail, *(view.tiles.parts() if view.tiles is not None else ())]
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def bench(fn) -> float:
    """Microseconds per call (median)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def run_gpu(contexts: list[int], out: Path) -> int:
    torch.manual_seed(0)
    rows = []
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    for batch in (1, 32):
        for tokens in contexts:
            # ---- GQA, Llama-3-8B attention ----
            keys = random_view(TileScheme(4, "channel"), 8, 128, batch, tokens)
            values = random_view(TileScheme(2, "token"), 8, 128, batch, tokens)
            q = torch.randn(batch, 8, 4, 128, device="cuda")
            ours = bench(lambda: tiled_attention(q, [keys], values, 128**-0.5))
            ours_bytes = nbytes(keys) + nbytes(values)
            k = torch.randn(batch, 8, tokens, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q16 = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
            sdpa = bench(lambda: F.scaled_dot_product_attention(q16, k, v, enable_gqa=True))
            dense_bytes = 2 * k.numel() * 2
            row = dict(family="gqa", batch=batch, context=tokens, kvarn_us=ours, kvarn_bytes=ours_bytes,
                       sdpa_bf16_us=sdpa, bf16_bytes=dense_bytes)
            if flash_attn_with_kvcache is not None:
                kc, vc, qf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), q16.transpose(1, 2)
                row["flash_attn_bf16_us"] = bench(lambda: flash_attn_with_kvcache(qf, kc, vc))
            rows.append(row)
            del keys, values, k, v
            # ---- MLA, DeepSeek-V3 attention (128 heads, 512 + 64) ----
            latent = random_view(TileScheme(4, "channel"), 1, 512, batch, tokens)
            rope = random_view(TileScheme(16, "channel"), 1, 64, batch, tokens)
            q = torch.randn(batch, 1, 128, 576, device="cuda")
            ours = bench(lambda: tiled_attention(q, [latent, rope], None, 192**-0.5))
            ours_bytes = nbytes(latent) + nbytes(rope)
            kv = torch.randn(batch, tokens, 576, device="cuda", dtype=torch.bfloat16)
            q16 = torch.randn(batch, 128, 576, device="cuda", dtype=torch.bfloat16)
            splits = max(1, min(64, 264 // batch))
            triton_bf16 = bench(lambda: mla_decode_bf16(q16, kv, 512, 192**-0.5, splits=splits))
            kv4 = kv.unsqueeze(1)
            sdpa = bench(lambda: F.scaled_dot_product_attention(q16.unsqueeze(2), kv4, kv4[..., :512], enable_gqa=True))
            rows.append(dict(family="mla", batch=batch, context=tokens, kvarn_us=ours, kvarn_bytes=ours_bytes,
                             sdpa_bf16_us=sdpa, bf16_bytes=kv.numel() * 2, triton_mla_bf16_us=triton_bf16))
            del latent, rope, kv
            torch.cuda.empty_cache()
            print(rows[-2], rows[-1], flush=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print("\n| family | batch | context | kvarn µs | kvarn GB/s (% of 4.8 TB/s) | best bf16 µs (which) | bf16 / kvarn |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gbs = r["kvarn_bytes"] / (r["kvarn_us"] * 1e-6) / 1e9
        baselines = {k[:-3]: r[k] for k in r if k.endswith("_us") and k != "kvarn_us"}
        name, best = min(baselines.items(), key=lambda kv: kv[1])
        print(f"| {r['family']} | {r['batch']} | {r['context']} | {r['kvarn_us']:.1f} | {gbs:.0f} "
              f"({gbs * 1e9 / H200_BANDWIDTH:.0%}) | {best:.1f} ({name}) | {best / r['kvarn_us']:.2f}x |")
    return 0
