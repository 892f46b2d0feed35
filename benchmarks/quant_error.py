"""Reconstruction and attention-output error of KVarN vs rotation-only vs KIVI-style RTN on synthetic keys.

Keys get a few outlier channels (x20) and log-normal token magnitudes, the structure KVarN targets. Reports, per
method and bit width: the worst and median per-token relative error ||k - k^|| / ||k|| (the token-scale errors the
paper blames for accumulation), the overall relative error, and the relative error of a softmax-attention output
over the quantized keys (values exact).

    python benchmarks/quant_error.py > benchmarks/results/quant_error.md
"""

from __future__ import annotations

import torch

from kvarn_mla.config import TileScheme
from kvarn_mla.quant import dequantize_tile, quantize_tile

METHODS = {
    "kvarn": dict(hadamard=True, varnorm_iters=8),
    "rotation": dict(hadamard=True, varnorm_iters=0),
    "kivi": dict(hadamard=False, varnorm_iters=0),
}


def outlier_keys(tiles: int, size: int = 128, dim: int = 128, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tiles, size, dim, generator=gen)
    x[..., torch.randperm(dim, generator=gen)[:4]] *= 20.0
    return x * torch.exp(torch.randn(tiles, size, 1, generator=gen))


def main() -> None:
    torch.manual_seed(0)
    keys = outlier_keys(32)
    queries, values = torch.randn(32, 16, 128), torch.randn(32, 128, 128)
    scale = 128**-0.5
    exact = torch.softmax(queries @ keys.transpose(-1, -2) * scale, -1) @ values
    print("Synthetic keys: 32 tiles of 128 tokens x 128 channels, 4 outlier channels (x20), log-normal token norms;")
    print("16 queries per tile, exact values. Written by `python benchmarks/quant_error.py`.\n")
    print(
        "| bits | method | worst token rel. err | median token rel. err | overall rel. err "
        "| attention-output rel. err |"
    )
    print("|---|---|---|---|---|---|")
    for bits in (2, 3, 4, 8):
        for name, kwargs in METHODS.items():
            scheme = TileScheme(bits, "channel", **kwargs)
            restored = dequantize_tile(quantize_tile(keys, scheme).to_metadata_dtype(), scheme, 128)
            per_token = (restored - keys).norm(dim=-1) / keys.norm(dim=-1)
            attended = torch.softmax(queries @ restored.transpose(-1, -2) * scale, -1) @ values
            print(f"| {bits} | {name} | {per_token.max():.4f} | {per_token.median():.4f} | "
                  f"{(restored - keys).norm() / keys.norm():.4f} | {(attended - exact).norm() / exact.norm():.4f} |")


if __name__ == "__main__":
    main()
