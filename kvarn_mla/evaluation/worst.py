"""The paper's worst-vectors diagnostic: how much of the output error do the few worst-quantized vectors cause?

A context is cached in 16 bits, then every cached vector (one head's key, value, latent or RoPE-key row of one
token) is replaced by its quantize-dequantize round trip (`kvarn_mla.fake_quantize`, exactly as the cache stores
it). The KL of the next-token distributions over the following tokens is measured against the 16-bit cache, then
again after restoring the k% vectors with the largest error (per layer and stream) to their exact values. Each
vector's squared error splits into a magnitude part ``(|x| - |x^|)^2`` and a direction part ``2|x||x^|(1 - cos)``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..adapters import layer_specs
from ..quant.fake import fake_quantize
from .accumulation import kl_divergence
from .methods import Method


def _fill(model, tensors: list[tuple[torch.Tensor, torch.Tensor] | None], reference: DynamicCache) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for index, (layer, pair) in enumerate(zip(reference.layers, tensors)):
        keys, values = pair if pair is not None else (layer.keys, layer.values)
        cache.update(keys.clone(), values.clone(), index)
    return cache


def error_split(exact: torch.Tensor, restored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude and direction parts of ``|x - x^|^2`` per vector (last axis): they sum to the squared error."""
    norm, norm_hat = exact.norm(dim=-1), restored.norm(dim=-1)
    cosine = (exact * restored).sum(-1) / (norm * norm_hat).clamp(min=1e-30)
    return (norm - norm_hat).square(), 2 * norm * norm_hat * (1 - cosine)


@torch.no_grad()
def worst_vectors(model, ids: torch.Tensor, method: Method, context: int, fractions=(0.01, 0.05, 0.10)) -> dict:
    """Run the diagnostic on ``ids [1, T]``: cache ``ids[:, :context]``, score the remaining tokens.

    Returns:
        ``kl`` with every vector quantized; per fraction ``k``: ``kl`` after restoring the worst ``k`` of the
        vectors, ``kl_explained`` (share of the KL removed), ``error_share`` (share of the total squared error those
        vectors hold), and the magnitude share of their error; and the magnitude share over all vectors.
    """
    if method.kind != "kvarn":
        raise ValueError(f"worst-vectors needs a KVarN method (it re-quantizes the cache itself), got {method.name!r}")
    config = method.config
    specs = layer_specs(model.config, config)
    reference = DynamicCache(config=model.config)
    model(ids[:, :context], cache=reference, use_cache=True)
    query = ids[:, context:]
    reference_logits = model(query, cache=_fill(model, [None] * len(reference.layers), reference)).logits

    quantized, errors, splits = [], [], []
    for layer in reference.layers:
        if layer.keys is None or layer.keys.shape[2] != context:  # an unquantized (sliding) layer
            quantized.append(None)
            continue
        pair = tuple(fake_quantize(x, s.scheme) for x, s in zip((layer.keys, layer.values), specs))
        quantized.append(pair)
        for exact, restored in zip((layer.keys, layer.values), pair):
            errors.append((restored - exact).float().square().sum(-1))  # [B, H, T]
            splits.append(error_split(exact.float(), restored.float()))
    quantized_logits = model(query, cache=_fill(model, quantized, reference)).logits
    full_kl = float(kl_divergence(reference_logits, quantized_logits).mean())
    total_error = sum(float(e.sum()) for e in errors)
    magnitude_all = sum(float(m.sum()) for m, _ in splits)
    result = {"kl": full_kl, "magnitude_share": magnitude_all / max(total_error, 1e-30), "fractions": {}}
    for fraction in fractions:
        repaired, held, magnitude, slot = [], 0.0, 0.0, 0
        for layer, pair in zip(reference.layers, quantized):
            if pair is None:
                repaired.append(None)
                continue
            fixed = []
            for exact, restored in zip((layer.keys, layer.values), pair):
                error = errors[slot]
                count = max(1, round(fraction * error.numel()))
                worst = error.flatten().topk(count).indices
                take = torch.zeros(error.numel(), dtype=torch.bool, device=error.device)
                take[worst] = True
                take = take.view_as(error).unsqueeze(-1)
                fixed.append(torch.where(take, exact, restored))
                held += float(error.flatten()[worst].sum())
                magnitude += float(splits[slot][0].flatten()[worst].sum())
                slot += 1
            repaired.append(tuple(fixed))
        kl = float(kl_divergence(reference_logits, model(query, cache=_fill(model, repaired, reference)).logits).mean())
        result["fractions"][f"{fraction:g}"] = {
            "kl": kl,
            "kl_explained": 1 - kl / full_kl if full_kl > 0 else 0.0,
            "error_share": held / max(total_error, 1e-30),
            "magnitude_share": magnitude / max(held, 1e-30),
        }
    return result
