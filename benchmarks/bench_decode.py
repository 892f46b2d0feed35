"""Decode speed: patched vs stock models on CPU, and the fused kernel vs bf16 baselines on CUDA.

CPU (always; the torch path): ms per decode step of 2-layer models with DeepSeek-V2-Lite attention (MLA) and
Llama-3-8B attention (GQA), random bf16 weights, caches pre-filled with random states to 1K-16K tokens (no prefill
is timed); the step time and the time inside the attention modules. The models and the measurement live in
`kvarn_mla.evaluation.bench` (also behind `kvarn-mla bench`, which adds prefill, memory and store cost).

    python benchmarks/bench_decode.py --device cpu    # writes benchmarks/results/bench_decode_cpu.csv
    python benchmarks/bench_decode.py --device cuda   # kernel timings, benchmarks/results/bench_decode_gpu.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--contexts", default=None, help="default: 1024,4096,8192,16384 (CPU); 4096,16384,65536 (CUDA)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_bench import run_gpu

        contexts = [int(c) for c in (args.contexts or "4096,16384,65536").split(",")]
        return run_gpu(contexts, RESULTS / "bench_decode_gpu.csv")
    from kvarn_mla.evaluation.bench import run_bench

    torch.set_num_threads(2)
    contexts = [int(c) for c in (args.contexts or "1024,4096,8192,16384").split(",")]
    rows = run_bench(["mla", "gqa"], contexts, args.steps, RESULTS, prefill_up_to=0, name="bench_decode_cpu")
    print("\n| family | context | stock ms/step | k4v2 ms/step | speedup | attention: stock ms | k4v2 ms | speedup "
          "| stock cache MiB | k4v2 cache MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['context']} | {r['stock_decode_ms']:.1f} | {r['k4v2_decode_ms']:.1f} | "
              f"{r['decode_speedup']:.2f}x | {r['stock_attention_ms']:.1f} | {r['k4v2_attention_ms']:.1f} | "
              f"{r['attention_speedup']:.2f}x | {r['stock_cache_mib']:.1f} | {r['k4v2_cache_mib']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
