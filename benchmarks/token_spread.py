"""Why KVarN and rotation-only quantize the bundled MLA's latent alike: its normalization never leaves the identity.

KVarN's log-scales are clipped to ``[-0.3, 10]`` (the published code; `kvarn_mla.quant.varnorm`): a row or column can
be divided by at most ``exp(10)`` but multiplied by at most ``exp(0.3) = 1.35``. The first column step adds
``ln σ_col``; for a stream whose entries have a std well below 0.74 every column clips to -0.3, then every row, and
the scales stay uniform: a uniform rescale, which asymmetric RTN undoes, so the codes are rotation-only's. The bundled
MLA caches its latent after an RMSNorm (``kv_a_layernorm``) whose entries are small; the dense models' keys (after
RoPE) are larger and do get normalized.

For each bundled model, on held-out code, per 128-token tile after the sink (rotated along the channels): the
median per-token std of the entries, the token-std spread ``max σ_t / min σ_t`` (1 is balanced), the share of tiles
whose normalization is not uniform (it changes the codes), and the relative error of the 2-bit per-channel round
trip with KVarN's normalization and without it (rotation-only), ``|x - Q(x)| / |x|`` over the tiles:

    python benchmarks/token_spread.py --tokens 2048 --out token_spread.md

(``benchmarks/results/three-recipes/token_spread.md`` is this table for the set bundled until 2026-12-07; it runs on
whichever checkpoints are bundled, so a new run goes next to the records of those.)
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kvarn_mla import reference_models
from kvarn_mla.evaluation.runner import default_text
from kvarn_mla.quant.fake import fake_quantize
from kvarn_mla.quant.hadamard import rotate
from kvarn_mla.quant.varnorm import variance_normalize

TILE = 128


def cached_streams(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, what the quantized cache would store on the key side: ``[heads, T, D]`` keys for a dense model
    (post-RoPE, as cached), ``[1, T, R]`` latents for MLA (the output of ``kv_a_layernorm``)."""
    captured: list[torch.Tensor] = []
    norms = [m for name, m in model.named_modules() if name.endswith("kv_a_layernorm")]
    hooks = [m.register_forward_hook(lambda mod, args, out: captured.append(out.detach()[0][None])) for m in norms]
    try:
        with torch.no_grad():
            out = model(ids, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    if norms:
        return captured
    return [layer.keys[0] for layer in out.past_key_values.layers]


def tile_stats(x: torch.Tensor, bits: int) -> dict[str, float]:
    """Median token-std spread per tile, and the relative round-trip errors with and without normalization."""
    tiles = rotate(x[:, TILE: TILE * (x.shape[1] // TILE)]).unflatten(1, (-1, TILE))  # [H, n, TILE, D]
    std = tiles.std(-1)
    spread = (std.amax(-1) / std.amin(-1)).flatten().tolist()
    # Keys and the latent are tiles [D, G] to the normalization (channels are its rows), as the store lays them out.
    row_scale, col_scale = variance_normalize(tiles.transpose(-1, -2).double(), 8)
    uniform = lambda scale: scale.amax(-1) / scale.amin(-1) < 1 + 1e-9  # noqa: E731
    active = ~(uniform(row_scale) & uniform(col_scale))
    body = x[:, : TILE * (x.shape[1] // TILE)].float()
    errors = {}
    for name, iters in (("kvarn", 8), ("rot", 0)):
        back = fake_quantize(body, bits, "channel", varnorm_iters=iters, sink_tokens=TILE, tile_size=TILE)
        errors[name] = float((body[:, TILE:] - back[:, TILE:]).norm() / body[:, TILE:].norm())
    return {"std": float(std.median()), "spread": statistics.median(spread), "active": float(active.float().mean()),
            **errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the markdown table here too")
    args = ap.parse_args()
    lines = [f"{args.tokens} held-out code tokens, {args.bits}-bit per-channel round trip, per layer "
             "(token-std spread: median over tiles and heads of max σ_t / min σ_t after rotation):", "",
             "| model | stream | layer | entry std | token-std spread | tiles normalized | error, KVarN "
             "| error, rotation-only |",
             "|---|---|---|---|---|---|---|---|"]
    for name in reference_models.NAMES:
        model, tokenizer = reference_models.load(name)
        streams = cached_streams(model, default_text(tokenizer, args.tokens))
        stream = "latent (after RMSNorm)" if name == "mla" else "keys (after RoPE)"
        for layer, x in enumerate(streams):
            s = tile_stats(x, args.bits)
            lines.append(f"| {name} | {stream} | {layer} | {s['std']:.3f} | {s['spread']:.2f} | {s['active']:.0%} | "
                         f"{s['kvarn']:.4f} | {s['rot']:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
