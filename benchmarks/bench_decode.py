"""Decode speed: patched vs stock models on CPU, and the fused kernel vs bf16 baselines on CUDA.

CPU (always; the torch path): ms per decode step of a 2-layer model with DeepSeek-V2-Lite attention (MLA, 16 heads,
latent 512 + RoPE 64, nope 128, v 128) and one with Llama-3-8B attention (GQA, 32/8 heads, 128), random bf16
weights, caches pre-filled with random states to 1K-16K tokens (no prefill is timed). Stock transformers re-expands
the whole MLA latent through ``kv_b_proj`` on every step; the patched model attends the quantized latent directly.

    python benchmarks/bench_decode.py --device cpu    # writes benchmarks/results/bench_decode_cpu.csv
    python benchmarks/bench_decode.py --device cuda   # kernel timings, benchmarks/results/bench_decode_gpu.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import kvarn_mla

RESULTS = Path(__file__).resolve().parent / "results"

MODELS = {
    # DeepSeek-V2-Lite attention widths, dense MLP (MoE routing is not what this measures), 2 layers.
    "mla": ("deepseek_v2", dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
                                kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                v_head_dim=128, intermediate_size=10944, first_k_dense_replace=2, vocab_size=1024,
                                max_position_embeddings=65536)),
    # Llama-3-8B attention widths, 2 layers.
    "gqa": ("llama", dict(hidden_size=4096, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=14336, vocab_size=1024, max_position_embeddings=65536)),
}


def build(family: str) -> torch.nn.Module:
    model_type, fields = MODELS[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=torch.bfloat16)
    return model.eval()


def fill(cache, model, tokens: int) -> None:
    """Put ``tokens`` random cached states in every layer (what a prefill would leave, without its cost)."""
    text = model.config
    if hasattr(text, "kv_lora_rank"):
        shapes = [(1, 1, tokens, text.kv_lora_rank), (1, 1, tokens, text.qk_rope_head_dim)]
    else:
        shapes = [(1, text.num_key_value_heads, tokens, text.head_dim)] * 2
    gen = torch.Generator().manual_seed(1)
    for layer in range(text.num_hidden_layers):
        key, value = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in shapes)
        cache.update(key, value, layer)
    if isinstance(cache, kvarn_mla.KVarNCache):
        cache.flush()


@torch.no_grad()
def decode_ms(model, cache, steps: int) -> tuple[float, float]:
    """Median wall time of one decode step (after one warm-up step), and of its attention calls alone."""
    token = torch.tensor([[7]])
    attention_time = [0.0]
    modules = [layer.self_attn for layer in model.model.layers]

    def before(module, args, kwargs):
        module._t0 = time.perf_counter()

    def after(module, args, kwargs, output):
        attention_time[0] += time.perf_counter() - module._t0

    hooks = [h for m in modules for h in (m.register_forward_pre_hook(before, with_kwargs=True),
                                          m.register_forward_hook(after, with_kwargs=True))]
    times, attention = [], []
    for step in range(steps + 1):
        attention_time[0] = 0.0
        start = time.perf_counter()
        model(token, cache=cache, use_cache=True)
        if step:
            times.append((time.perf_counter() - start) * 1e3)
            attention.append(attention_time[0] * 1e3)
    for hook in hooks:
        hook.remove()
    return statistics.median(times), statistics.median(attention)


def run_cpu(contexts: list[int], steps: int, out: Path) -> list[dict]:
    torch.set_num_threads(2)
    rows = []
    for family in ("mla", "gqa"):
        model = build(family)
        for tokens in contexts:
            stock_cache = DynamicCache(config=model.config)
            fill(stock_cache, model, tokens)
            stock, stock_attention = decode_ms(model, stock_cache, steps)
            stock_bytes = sum(t.numel() * t.element_size() for layer in stock_cache.layers
                              for t in (layer.keys, layer.values))
            kvarn_mla.patch(model, "k4v2")
            cache = kvarn_mla.KVarNCache(model)
            fill(cache, model, tokens)
            patched, patched_attention = decode_ms(model, cache, steps)
            kvarn_mla.unpatch(model)
            row = dict(family=family, context=tokens, stock_ms=round(stock, 2), kvarn_k4v2_ms=round(patched, 2),
                       speedup=round(stock / patched, 2), stock_attention_ms=round(stock_attention, 2),
                       kvarn_attention_ms=round(patched_attention, 2),
                       attention_speedup=round(stock_attention / patched_attention, 2),
                       stock_cache_bytes=stock_bytes, kvarn_cache_bytes=cache.nbytes())
            rows.append(row)
            print(row, flush=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--contexts", default="1024,4096,8192,16384")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    RESULTS.mkdir(exist_ok=True)
    if args.device == "cpu":
        rows = run_cpu(contexts, args.steps, RESULTS / "bench_decode_cpu.csv")
        print("\n| family | context | stock ms/step | k4v2 ms/step | speedup | attention: stock ms | k4v2 ms | speedup "
              "| stock cache MiB | k4v2 cache MiB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['family']} | {r['context']} | {r['stock_ms']} | {r['kvarn_k4v2_ms']} | {r['speedup']}x | "
                  f"{r['stock_attention_ms']} | {r['kvarn_attention_ms']} | {r['attention_speedup']}x | "
                  f"{r['stock_cache_bytes'] / 2**20:.1f} | {r['kvarn_cache_bytes'] / 2**20:.1f} |")
        return 0
    from gpu_bench import run_gpu  # CUDA only: kernels vs bf16 baselines

    return run_gpu(contexts if args.contexts != parser.get_default("contexts") else [4096, 16384, 65536],
                   RESULTS / "bench_decode_gpu.csv")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
