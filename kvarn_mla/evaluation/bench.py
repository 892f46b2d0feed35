"""`kvarn-mla bench`: decode and prefill time, memory, and store cost, patched vs stock, per attention family.

Models are 2 decoder layers with the attention widths of real checkpoints and random bf16 weights (the timing
does not depend on the values): DeepSeek-V2-Lite for MLA (16 heads, latent 512 + RoPE 64, nope 128, v 128),
Llama-3-8B for GQA (32/8 heads, head_dim 128) and Llama-2-7B for MHA (32/32 heads, head_dim 128). Decode is timed
on caches pre-filled with random states, so a 16K context does not need a 16K prefill first.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from ..cache import KVarNCache
from ..patch import patch, unpatch

FAMILIES = {
    # DeepSeek-V2-Lite attention, dense MLP of the same width as its dense layers, 2 layers.
    "mla": ("deepseek_v2", dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
                                kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                v_head_dim=128, intermediate_size=10944, first_k_dense_replace=2, vocab_size=1024,
                                max_position_embeddings=65536)),
    # Llama-3-8B attention, 2 layers.
    "gqa": ("llama", dict(hidden_size=4096, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=14336, vocab_size=1024, max_position_embeddings=65536)),
    # Llama-2-7B attention (one kv head per query head), 2 layers.
    "mha": ("llama", dict(hidden_size=4096, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32,
                          head_dim=128, intermediate_size=11008, vocab_size=1024, max_position_embeddings=65536)),
}


def build(family: str) -> torch.nn.Module:
    """The benchmark model of a family, random bf16 weights."""
    model_type, fields = FAMILIES[family]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=torch.bfloat16).eval()


def fill(cache, model, tokens: int, extra_tail: int = 0) -> None:
    """Put ``tokens`` random cached states in every layer (what a prefill would leave, without its cost).

    ``extra_tail`` more tokens are appended without quantizing them (pending tiles, for timing the store).
    """
    config = model.config
    if hasattr(config, "kv_lora_rank"):
        shapes = [(1, 1, tokens, config.kv_lora_rank), (1, 1, tokens, config.qk_rope_head_dim)]
    else:
        shapes = [(1, config.num_key_value_heads, tokens, config.head_dim)] * 2
    gen = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    for layer in cache.layers[: config.num_hidden_layers]:  # layer by layer: no forward pass is running
        key, value = (torch.randn(*shape, generator=gen).to(dtype) for shape in shapes)
        layer.update(key[:, :, : tokens - extra_tail], value[:, :, : tokens - extra_tail])
        if isinstance(cache, KVarNCache):
            layer.flush()
        if extra_tail:
            layer.update(key[:, :, tokens - extra_tail :], value[:, :, tokens - extra_tail :])


def _peak_reset() -> int | None:
    """Reset the resident-set high-water mark (Linux) and return the current RSS in bytes, or None."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status("VmRSS")
    except OSError:
        return None


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _timed(fn, repeats: int) -> tuple[float, float | None]:
    """Median ms of ``fn`` over ``repeats`` runs after a warm-up, and the peak extra resident memory (MiB)."""
    fn()
    times, peaks = [], []
    for _ in range(repeats):
        base = _peak_reset()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        if base is not None:
            peaks.append((_status("VmHWM") - base) / 2**20)
    return statistics.median(times), (max(peaks) if peaks else None)


class _AttentionTimer:
    """Adds up the wall time spent inside the model's attention modules (projections included)."""

    def __init__(self, model):
        self.total, self.handles = 0.0, []
        for layer in model.model.layers:
            self.handles.append(layer.self_attn.register_forward_pre_hook(self._start))
            self.handles.append(layer.self_attn.register_forward_hook(self._stop))

    def _start(self, module, args):
        self._t0 = time.perf_counter()

    def _stop(self, module, args, output):
        self.total += time.perf_counter() - self._t0

    def remove(self):
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def measure(model, family: str, tokens: int, steps: int, prefill: bool, preset: str = "k4v2") -> dict:
    """One row: decode ms/step (whole step and inside attention), step peak memory, cache bytes, prefill ms, and the
    store cost, stock vs patched."""
    row = {"family": family, "context": tokens}
    token = torch.tensor([[7]])
    for label in ("stock", preset):
        if label != "stock":
            patch(model, preset)
        cache = KVarNCache(model) if label != "stock" else DynamicCache(config=model.config)
        fill(cache, model, tokens)
        timer = _AttentionTimer(model)

        def step():  # each step appends a token; cropping it back keeps the context fixed
            model(token, cache=cache, use_cache=True)
            cache.crop(-1)

        step()
        timer.total = 0.0
        row[f"{label}_decode_ms"], row[f"{label}_step_peak_mib"] = _timed(step, steps)
        row[f"{label}_attention_ms"] = timer.total * 1e3 / (steps + 1)  # _timed runs one warm-up step too
        timer.remove()
        row[f"{label}_cache_mib"] = (cache.nbytes() if label != "stock" else
                                     sum(t.numel() * t.element_size() for layer in cache.layers
                                         for t in (layer.keys, layer.values))) / 2**20
        if prefill:
            ids = torch.randint(0, model.config.vocab_size, (1, tokens))
            row[f"{label}_prefill_ms"], row[f"{label}_prefill_peak_mib"] = _timed(
                lambda: model(ids, use_cache=True), 1)
        if label != "stock":
            # Store cost: quantizing one tile per layer, the work of every tile_size-th decode step.
            times = []
            for _ in range(2):  # the first flush warms up, the second is timed
                pending = KVarNCache(model)
                fill(pending, model, tokens + pending.config.tile_size, extra_tail=pending.config.tile_size)
                start = time.perf_counter()
                pending.flush()
                times.append((time.perf_counter() - start) * 1e3)
            row["store_ms_per_tile_all_layers"] = times[-1]
            row["store_fraction_of_decode"] = times[-1] / (pending.config.tile_size * row[f"{label}_decode_ms"])
            unpatch(model)
    row["decode_speedup"] = row["stock_decode_ms"] / row[f"{preset}_decode_ms"]
    row["attention_speedup"] = row["stock_attention_ms"] / row[f"{preset}_attention_ms"]
    return row


def run_bench(
    families: list[str], contexts: list[int], steps: int, out_dir: Path, prefill_up_to: int = 16384,
    name: str = "bench_cpu",
) -> list[dict]:
    """Measure every (family, context); write ``{name}.csv`` and ``{name}.json`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in families:
        model = build(family)
        for tokens in contexts:
            row = measure(model, family, tokens, steps, prefill=tokens <= prefill_up_to)
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with (out_dir / f"{name}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / f"{name}.json").write_text(json.dumps(rows, indent=1))
    return rows
