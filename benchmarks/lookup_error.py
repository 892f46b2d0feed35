"""Attention error of the lookups into a freshly quantized tile, on a reference model's real keys.

On the long-chain reasoning items almost every quantized first miss falls in the first 32 tokens after a tile is
quantized: the row being written looks ~18 tokens back, into the tile that has just left the 16-bit tail. This
script measures, per layer and key quantizer, what those lookups see: the queries of the 32 positions after each
tile boundary attend over their whole causal context, with every full tile quantized (keys only, per channel over
the tile's tokens, as the cache stores them; values exact), against the same attention over exact keys.

Per layer and method it reports the total-variation distance between the two attention distributions (mean over
query heads and positions, and its 99th percentile: the rare large errors behind a miss), the RMS error of the
attention logits on the freshest tile, and the part of that squared error each RoPE frequency band carries
(quarters of the rotary pairs, fastest first), as ``sum_c (scale q_c (k_c - k^_c))^2`` over the band's channels
(cross terms left out): which channels' error the lookup sees under each quantizer. ``rot-band`` is a what-if, not
a library method: rotation-only with the Hadamard mixing channels only within each RoPE band.

    python benchmarks/lookup_error.py --model gqa --text reasoning --items 8
    python benchmarks/lookup_error.py --model gqa --text retrieval
    python benchmarks/lookup_error.py --model benchmarks/models/states/v5-gqa \
        --first-misses benchmarks/results/three-recipes/accuracy/gqa-reasoning-tf.jsonl   # the records' checkpoint

``--first-misses RECORDS`` only tabulates where the teacher-forced first misses of a ``reasoning-tf`` record file
fall: how many tokens the 16-bit tail held when the missed token was predicted (items right at 16 bits only).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvarn_mla.config import QUANTIZERS, KVarNConfig
from kvarn_mla.evaluation import reasoning
from kvarn_mla.evaluation.runner import load_model
from kvarn_mla.evaluation.sweep import retrieval_text
from kvarn_mla.quant import dequantize_tile, hadamard_matrix, quantize_tile

WINDOW = 32  # query positions after each tile boundary: where the long-chain first misses fall
BANDS = 4  # RoPE frequency bands (quarters of the rotary pairs)
# key quantizers compared: the library's KIVI-style, rotation-only and KVarN, and a what-if that is not in the library:
# rotation-only with the Hadamard applied within each RoPE band (`band_rotation`) instead of across all channels
FAMILIES = ("kivi", "rot", "kvarn", "rot-band")


def capture(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE ``(queries [H, T, D], keys [KV, T, D])`` of every layer of a Llama-family ``model`` on ``ids``
    ``[1, T]``, recomputed from the attention inputs (the model instance gets pre-hooks, removed on return)."""
    captured, handles = [], []

    def hook(attention, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        shape = (*hidden.shape[:-1], -1, attention.head_dim)
        q = attention.q_proj(hidden).view(shape).transpose(1, 2)
        k = attention.k_proj(hidden).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        captured.append((q[0].float(), k[0].float()))

    for layer in model.model.layers:
        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def band_rotation(dim: int) -> torch.Tensor:
    """``[dim, dim]`` orthonormal rotation that mixes channels only within a RoPE frequency band: the channels of
    each ``BANDS``-th of the rotary pairs (pair ``i`` is channels ``i`` and ``i + dim/2``) through one Hadamard."""
    half, width = dim // 2, dim // 2 // BANDS
    rotation = torch.zeros(dim, dim)
    block = hadamard_matrix(2 * width)
    for band in range(BANDS):
        channels = torch.cat([torch.arange(band * width, (band + 1) * width)] * 2)
        channels[width:] += half
        rotation[channels[:, None], channels[None, :]] = block
    return rotation


def quantized_keys(keys: torch.Tensor, config: KVarNConfig, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """``keys [KV, T, D]`` with every full tile after the sink replaced by its quantize-dequantize round trip; with
    ``rotation`` (orthonormal ``[D, D]``), keys are rotated by it before and back after."""
    if rotation is not None:
        return quantized_keys(keys @ rotation, config) @ rotation.T
    scheme = config.scheme("key")
    start, size = config.sink_tokens, config.tile_size
    tiles = (keys.shape[1] - start) // size
    body = keys[:, start:start + tiles * size].reshape(-1, size, keys.shape[-1])
    restored = dequantize_tile(quantize_tile(body, scheme).to_metadata_dtype(), scheme, size)
    out = keys.clone()
    out[:, start:start + tiles * size] = restored.reshape(keys.shape[0], tiles * size, -1)
    return out


def lookup_error(queries: torch.Tensor, keys: torch.Tensor, restored: torch.Tensor, scale: float,
                 sink: int, size: int) -> dict[str, float | list[float]]:
    """Errors of the attention of the ``WINDOW`` positions after each tile boundary (``queries [H, T, D]``, exact
    ``keys`` and ``restored`` keys ``[KV, T, D]``; query head ``h`` reads key head ``h // (H // KV)``)."""
    heads, length, dim = queries.shape
    group = heads // keys.shape[0]
    keys, restored = keys.repeat_interleave(group, 0), restored.repeat_interleave(group, 0)
    band_of = (torch.arange(dim) % (dim // 2)) // (dim // 2 // BANDS)  # rotary pair i and i + D/2 share a frequency
    tvs, logit_sq, bands, fresh_count = [], 0.0, torch.zeros(BANDS), 0
    for boundary in range(sink + size, length, size):  # the tile [boundary - size, boundary) has just been quantized
        for p in range(boundary, min(boundary + WINDOW, length)):
            visible = torch.arange(p + 1)
            quantized_end = sink + (p + 1 - sink) // size * size  # full tiles up to p are quantized
            k = torch.where((visible < quantized_end)[None, :, None], restored[:, :p + 1], keys[:, :p + 1])
            exact = torch.softmax(torch.einsum("hd,htd->ht", queries[:, p], keys[:, :p + 1]) * scale, -1)
            approx = torch.softmax(torch.einsum("hd,htd->ht", queries[:, p], k) * scale, -1)
            tvs.append(0.5 * (exact - approx).abs().sum(-1))
            fresh = slice(boundary - size, boundary)
            error = restored[:, fresh] - keys[:, fresh]  # [H, size, D]
            logit_sq += (torch.einsum("hd,htd->ht", queries[:, p], error) * scale).pow(2).sum().item()
            weighted = (queries[:, p, None, :] ** 2 * error**2).sum((0, 1)) * scale**2  # [D]
            bands += torch.zeros(BANDS).index_add_(0, band_of, weighted)
            fresh_count += heads * size
    tvs = torch.cat(tvs)
    return {"tv": tvs.mean().item(), "tv_p99": tvs.quantile(0.99).item(),
            "logit_rms": (logit_sq / fresh_count) ** 0.5, "bands": (bands / fresh_count).tolist()}


def texts(tokenizer, model, kind: str, items: int, tokens: int) -> list[torch.Tensor]:
    """The ``[1, T]`` texts: the longest of the first held-out long-chain items written out (prompt and target), or
    one held-out retrieval item of ``tokens`` tokens."""
    if kind == "retrieval":
        return [retrieval_text(tokenizer, tokens)]
    task = reasoning.task_of(model.config)
    written = [tokenizer(i.prompt + i.target, add_special_tokens=False).input_ids
               for i in reasoning.held_out_items(200, task=task)]
    longest = sorted(written, key=len, reverse=True)[:items]
    return [torch.tensor([ids]) for ids in longest]


def first_miss_table(records: Path, model, tokenizer, bins: int = 8) -> str:
    """Markdown: per quantized method, its first misses on items the 16-bit cache gets right, by the number of
    tokens in the 16-bit tail when the missed token was predicted (``bins`` bins over a tile)."""
    task = reasoning.task_of(model.config)
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    wanted = {row["id"] for row in rows}
    prompt = {f"reasoning-{i.index}": len(tokenizer(i.prompt, add_special_tokens=False).input_ids)
              for i in reasoning.held_out_items(len(wanted), task=task)}
    right = {row["id"] for row in rows if row["method"] in ("fp32", "bf16", "fp16") and row["exact"]}
    sink, size = KVarNConfig().sink_tokens, KVarNConfig().tile_size
    width = size // bins
    misses = defaultdict(Counter)
    for row in rows:
        if row["id"] in right and not row["exact"] and row["first_miss"] is not None:
            cached = prompt[row["id"]] + row["first_miss"]  # tokens in the cache when the missed one is predicted
            misses[row["method"]][(cached - sink) % size // width] += 1
    head = " | ".join(f"{b * width}-{b * width + width - 1}" for b in range(bins))
    lines = [f"| method | first misses | tail tokens: {head} |", "|---|---|" + "---|" * bins]
    for method, counts in sorted(misses.items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"| `{method}` | {sum(counts.values())} | " + " | ".join(str(counts[b]) for b in range(bins))
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gqa", help="a bundled Llama-family model (gqa, mha) or a directory")
    parser.add_argument("--text", choices=("reasoning", "retrieval"), default="reasoning")
    parser.add_argument("--items", type=int, default=8, help="reasoning: the longest of the first 200 items")
    parser.add_argument("--tokens", type=int, default=2048, help="retrieval: item length")
    parser.add_argument("--bits", default="2,3,4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--first-misses", type=Path, metavar="RECORDS",
                        help="only tabulate the first misses of a reasoning-tf .jsonl by tail fill")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, torch.float32)
    if args.first_misses:
        print(first_miss_table(args.first_misses, model, tokenizer))
        return 0
    scale = model.model.layers[0].self_attn.scaling
    results = defaultdict(lambda: defaultdict(list))  # (bits, method) -> layer -> per-text errors
    lengths = []
    for ids in texts(tokenizer, model, args.text, args.items, args.tokens):
        lengths.append(ids.shape[1])
        for layer, (queries, keys) in enumerate(capture(model, ids)):
            for bits in (int(b) for b in args.bits.split(",")):
                for family in FAMILIES:
                    rotation = band_rotation(keys.shape[-1]) if family == "rot-band" else None
                    config = KVarNConfig(key_bits=bits, **QUANTIZERS["kivi" if rotation is not None else family])
                    restored = quantized_keys(keys, config, rotation)
                    results[(bits, family)][layer].append(
                        lookup_error(queries, keys, restored, scale, config.sink_tokens, config.tile_size))
    print(f"Model `{args.model}`, {args.text} text: {len(lengths)} text(s) of {min(lengths)}-{max(lengths)} tokens; "
          f"queries at the {WINDOW} positions after each tile boundary; keys quantized, values exact.\n")
    print("| bits | keys | layer | attention TV, mean | p99 | fresh-tile logit RMS | "
          "squared logit error by RoPE band, fast → slow |")
    print("|---|---|---|---|---|---|---|")
    for (bits, family), layers in results.items():
        for layer, runs in layers.items():
            tv = sum(r["tv"] for r in runs) / len(runs)
            p99 = sum(r["tv_p99"] for r in runs) / len(runs)
            rms = sum(r["logit_rms"] for r in runs) / len(runs)
            share = torch.tensor([r["bands"] for r in runs]).mean(0)
            print(f"| {bits} | {family} | {layer} | {tv:.4f} | {p99:.3f} | {rms:.4f} | "
                  + " / ".join(f"{s:.4f}" for s in share.tolist()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
