"""GPU benchmarks (the CUDA part of bench_decode.py, and `gpu_check.sh`'s steps): decode kernel speed, and
``generate`` of a patched tiny model eagerly and under ``torch.compile``.

``decode``: the fused decode kernel vs bf16 baselines, per decode step of one layer. GQA (32 query heads, 8 kv heads,
128; k4v2) against PyTorch SDPA (bf16, enable_gqa) and flash-attn when importable; MLA (128 heads, latent 512 +
RoPE 64; latent 4-bit, RoPE bf16) against SDPA on the absorbed problem and a bf16 Triton MLA decode of the same
structure (`baselines.py`). Stores are filled with random codes and scales (timing does not depend on the values).
Reports µs per call, GB/s over the bytes actually read, and bf16 time / ours.

``generate``: tiny random models of the real classes (deepseek_v3 at 512 + 64, llama GQA at head_dim 128; no
downloads), bf16, patched with the Triton backend; greedy ``generate`` eagerly, then with transformers' compiled
decoding (``compile_config``); prints ms per token of both, whether dynamo compiled any frame, how many graph
breaks it saw, and whether the tokens agree.

    python benchmarks/gpu_bench.py decode --out benchmarks/results/bench_decode_gpu.csv
    python benchmarks/gpu_bench.py generate
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from kvarn_mla.config import TileScheme  # noqa: E402
from kvarn_mla.quant import QuantizedTile, StreamView, packed_width  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
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
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def run_gpu(contexts: list[int], out: Path) -> int:
    from baselines import mla_decode_bf16

    from kvarn_mla.kernels.decode import tiled_attention

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
            torch.cuda.empty_cache()  # the previous context's tensors are freed as the names are rebound
            print(rows[-2], rows[-1], flush=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print("\n| family | batch | context | kvarn µs | kvarn GB/s (% of 4.8 TB/s) | best bf16 µs (which) "
          "| bf16 / kvarn |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gbs = r["kvarn_bytes"] / (r["kvarn_us"] * 1e-6) / 1e9
        baselines = {k[:-3]: r[k] for k in r if k.endswith("_us") and k != "kvarn_us"}
        name, best = min(baselines.items(), key=lambda kv: kv[1])
        print(f"| {r['family']} | {r['batch']} | {r['context']} | {r['kvarn_us']:.1f} | {gbs:.0f} "
              f"({gbs * 1e9 / H200_BANDWIDTH:.0%}) | {best:.1f} ({name}) | {best / r['kvarn_us']:.2f}x |")
    return 0


# ---- generate: eager vs compiled ------------------------------------------------------------------------------------
TINY = {
    "deepseek_v3": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16,
                        kv_lora_rank=512, q_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        vocab_size=512, intermediate_size=512, moe_intermediate_size=64, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        max_position_embeddings=4096),
    "llama": dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                  intermediate_size=1024, vocab_size=512, max_position_embeddings=4096),
}


def run_generate(model_types: list[str], prompt: int, new_tokens: int) -> int:
    """Greedy generate, eager then compiled, on each tiny model; returns 1 if any compiled run failed."""
    import dataclasses

    import torch._dynamo
    from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig

    import kvarn_mla
    from kvarn_mla.config import PRESETS

    failed = 0
    for model_type in model_types:
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **TINY[model_type])
        model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        kvarn_mla.patch(model, dataclasses.replace(PRESETS["k4v2"], backend="triton"))
        ids = torch.randint(1, config.vocab_size, (2, prompt), device="cuda")
        kwargs = dict(max_new_tokens=new_tokens, do_sample=False)

        def timed(**extra):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, **kwargs, **extra)
            torch.cuda.synchronize()
            return out, (time.perf_counter() - start) * 1e3 / new_tokens

        model.generate(ids, **kwargs)  # warm-up: Triton compiles the kernels
        eager, eager_ms = timed()
        print(f"{model_type}: eager generate {eager_ms:.2f} ms/token (batch 2, prompt {prompt})", flush=True)
        try:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compile_config = CompileConfig(fullgraph=False, mode="reduce-overhead")
            timed(compile_config=compile_config)  # warm-up: dynamo/inductor compile, CUDA graph capture
            compiled, compiled_ms = timed(compile_config=compile_config)
            frames = dict(torch._dynamo.utils.counters["frames"])
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            agree = float((compiled[:, prompt:] == eager[:, prompt:]).float().mean())
            print(f"{model_type}: compiled generate {compiled_ms:.2f} ms/token; dynamo frames {frames}, graph breaks "
                  f"{breaks}; tokens agreeing with eager {agree:.1%}", flush=True)
        except Exception as error:  # noqa: BLE001 - reported, and the exit status says so
            failed = 1
            print(f"{model_type}: compiled generate FAILED: {type(error).__name__}: {str(error)[:2000]}", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    decode = commands.add_parser("decode", help="decode kernel µs and GB/s vs bf16 baselines")
    decode.add_argument("--contexts", default="4096,16384,65536")
    decode.add_argument("--out", type=Path, default=RESULTS / "bench_decode_gpu.csv")
    generate = commands.add_parser("generate", help="patched tiny models: eager vs compiled generate")
    generate.add_argument("--models", default="deepseek_v3,llama")
    generate.add_argument("--prompt", type=int, default=700, help="prompt tokens (tiles of 128 after a 128 sink)")
    generate.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.command == "decode":
        return run_gpu([int(c) for c in args.contexts.split(",")], args.out)
    return run_generate(args.models.split(","), args.prompt, args.new_tokens)


if __name__ == "__main__":
    sys.exit(main())
