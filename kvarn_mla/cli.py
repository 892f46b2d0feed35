"""The ``kvarn-mla`` command line.

Only the standard library is imported at module level: ``kvarn-mla --help`` and ``--version`` must not pay for torch
and transformers (seconds of CPU). Each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import __version__

EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE (128 + 13), e.g. `... | head`


def _presets(args: argparse.Namespace) -> int:
    from .adapters import layer_specs
    from .archs import load_config
    from .config import PRESETS, UNQUANTIZED
    from .plan import bits_label, expected_nbytes, family_label

    model_config = load_config(args.model)
    dense = expected_nbytes(model_config, UNQUANTIZED, args.context)
    bits_header = bits_label(layer_specs(model_config, UNQUANTIZED))[0]
    print(f"{args.model}: {family_label(model_config)} attention; KV bytes per token over all layers at "
          f"{args.context} tokens (sink, tail and scales included), and per layer in a quantized tile (the "
          "long-context limit)")
    print(f"{'preset':<13} {'method':<14} {bits_header:<12} {'tile':>4} {'sink':>5} {'tile B/tok/layer':>16} "
          f"{'B/token':>9} {'vs 16-bit':>9}")
    for name, config in [("16-bit", UNQUANTIZED), *PRESETS.items()]:
        specs = layer_specs(model_config, config)
        per_layer = sum(s.num_heads * (s.tile_nbytes() / config.tile_size if s.bits < 16 else 2 * s.dim) for s in specs)
        held = expected_nbytes(model_config, config, args.context)
        method = "-" if config is UNQUANTIZED else config.method
        print(f"{name:<13} {method:<14} {bits_label(specs)[1]:<12} {config.tile_size:>4} {config.sink_tokens:>5} "
              f"{per_layer:>16.1f} {held / args.context:>9.1f} {dense / held:>8.3f}x")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .adapters import layer_specs
    from .archs import load_config
    from .config import UNQUANTIZED
    from .plan import (
        bits_label,
        family_label,
        format_bytes,
        parameter_count,
        parse_memory,
        plan,
        tp_kv_heads,
        weight_bytes,
    )

    memory = parse_memory(args.memory)
    model_config = load_config(args.model)
    family = family_label(model_config)  # unsupported model types stop here, with the supported list
    rows = plan(model_config, memory, args.batch, args.context, args.preset, dtype_bytes=args.dtype_bytes, tp=args.tp)
    text_config = model_config.get_text_config(decoder=True)
    parameters, weights = parameter_count(model_config, args.tp), weight_bytes(model_config, args.dtype_bytes, args.tp)
    max_positions = getattr(text_config, "max_position_embeddings", None)
    free = memory - weights
    positions = f", max_position_embeddings {max_positions}" if max_positions else ""
    print(f"model    {args.model}: {model_config.model_type}, {family} attention, "
          f"{text_config.num_hidden_layers} layers{positions}")
    if args.tp > 1:
        kv_heads = tp_kv_heads(model_config, args.tp)
        cache = ("the MLA latent and RoPE key are replicated on every rank" if family == "MLA" else
                 f"{kv_heads} kv head{'s' * (kv_heads != 1)} per rank" if kv_heads else
                 "attention is replicated by the model's TP plan")
        print(f"per rank of --tp {args.tp} (transformers' tp_plan='auto'): --memory is one device's; weights are "
              f"this rank's share; {cache}")
    print(f"weights  {parameters:,} parameters x {args.dtype_bytes:g} B = {weights:,} B ({format_bytes(weights)})")
    if free < 0:
        hint = "; for FP8 weights use --dtype-bytes 1" if args.dtype_bytes > 1 else ""
        print(f"memory   {memory:,} B ({format_bytes(memory)}): the weights do NOT fit, {-free:,} B "
              f"({format_bytes(-free)}) short, no room for a KV cache{hint}")
    else:
        print(f"memory   {memory:,} B ({format_bytes(memory)}): {free:,} B ({format_bytes(free)}) left for "
              "the KV cache")
    print(f"KV bytes per token at {args.context} tokens (all layers; sink, tail and scales included); "
          f"max context per sequence at batch {args.batch}; max batch at {args.context} tokens")
    bits_header = bits_label(layer_specs(model_config, UNQUANTIZED))[0]
    print(f"{'preset':<10} {bits_header:<11} {'B/token':>9} {'KV/sequence':>11} {'vs 16-bit':>9} "
          f"{'max context':>12} {'max batch':>9}")
    beyond = False
    for row in rows:
        bits = bits_label(layer_specs(model_config, row.config))[1]
        if free < 0:
            context, batch = "-", "-"
        elif row.max_context is None:
            context = "unbounded"
        else:
            context = f"{row.max_context:,}"
            if max_positions and row.max_context > max_positions:
                context, beyond = context + "*", True
        if free >= 0:
            batch = f"{row.max_batch:,}"
        print(f"{row.name:<10} {bits:<11} {row.bytes_per_token:>9.1f} "
              f"{format_bytes(row.sequence_nbytes):>11} {rows[0].sequence_nbytes / row.sequence_nbytes:>8.2f}x "
              f"{context:>12} {batch:>9}")
    if beyond:
        print(f"* more than max_position_embeddings ({max_positions}): the memory allows it, the model may not")
    if max_positions and args.context > max_positions:
        print(f"note: --context {args.context} is more than max_position_embeddings ({max_positions})")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .evaluation.bench import run_bench

    torch.set_num_threads(args.threads)
    rows = run_bench(args.families.split(","), [int(c) for c in args.contexts.split(",")], args.steps,
                     Path(args.out), prefill_up_to=args.prefill_up_to)
    print("\n| family | context | stock decode ms | k4v2 decode ms | speedup | stock prefill ms | k4v2 prefill ms "
          "| store / decode | cache MiB stock -> k4v2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        prefill = (f"{r['stock_prefill_ms']:.0f} | {r['k4v2_prefill_ms']:.0f}" if "stock_prefill_ms" in r
                   else "- | -")
        print(f"| {r['family']} | {r['context']} | {r['stock_decode_ms']:.1f} | {r['k4v2_decode_ms']:.1f} | "
              f"{r['decode_speedup']:.2f}x | {prefill} | {r['store_fraction_of_decode']:.2%} | "
              f"{r['stock_cache_mib']:.1f} -> {r['k4v2_cache_mib']:.1f} |")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import build_report, checkout_results

    if args.rerun and args.results is None:
        raise ValueError("--rerun writes new results into --results: give the directory explicitly (a fresh one "
                         "unless you mean to replace what is there)")
    results = Path(args.results) if args.results is not None else checkout_results()
    path = build_report(results, Path(args.out), rerun=args.rerun)
    print(f"wrote {path} and {path.with_suffix('.html')}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .evaluation.demo import demo

    demo(args.model, args.presets, args.max_new_tokens, args.prompt_tokens)
    return 0


def _eval(args: argparse.Namespace) -> int:
    import torch

    from .evaluation import reasoning
    from .evaluation.methods import parse_methods, reference_label, require_available
    from .evaluation.runner import check_mode, file_digest, load_model, run
    from .evaluation.tasks import jsonl_items, reasoning_items, retrieval_items

    methods = parse_methods(args.presets)
    require_available(methods)  # before any model is loaded or any method has run
    if args.suite == "jsonl" and not args.tasks:
        raise ValueError("--suite jsonl needs --tasks FILE (one {\"prompt\", \"answer\"} object per line)")
    sampling = {"do_sample": False}
    if args.temperature:
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    check_mode(args.mode, args.suite, sampling)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model, tokenizer = load_model(args.model, dtype)
    label = reference_label(dtype)
    asked = {m.name for m in methods if m.kind == "reference"} - {"reference", label}
    if asked:  # e.g. scripts written when the reference was always called "bf16"
        print(f"kvarn-mla: note: the reference runs in {args.dtype} (--dtype), so its results are labelled {label!r}, "
              f"not {', '.join(sorted(asked))}", file=sys.stderr)
    torch.manual_seed(args.seed)
    items = None
    batch_size = args.batch_size or (1 if args.suite == "retrieval" else 8)
    if args.suite == "reasoning":
        items = reasoning_items(tokenizer, args.limit, task=reasoning.task_of(model.config))  # the version it learned
    elif args.suite == "retrieval":  # --context tokens per item, fresh held-out items of --seed
        items = retrieval_items(tokenizer, args.context, args.seed, args.limit)
    elif args.suite == "jsonl":
        items = jsonl_items(args.tasks, args.checker, args.max_new_tokens)[: args.limit]
    text_ids = None
    if args.text:
        text_ids = tokenizer(open(args.text).read(), return_tensors="pt", add_special_tokens=False).input_ids
        text_ids = text_ids[:, : args.tokens]
    summary = run(model, tokenizer, methods, args.suite, args.out, text_ids=text_ids, tokens=args.tokens,
                  chunk=args.chunk, greedy_tokens=args.greedy_tokens, items=items, batch_size=batch_size,
                  sampling=sampling, context=args.context, seed=args.seed, model_name=args.model,
                  tasks_digest=file_digest(args.tasks) if args.suite == "jsonl" else None, mode=args.mode)
    print(json.dumps({name: {k: v for k, v in row.items() if not k.startswith("kl_curve") and k != "attn_err_last"}
                      for name, row in summary["methods"].items()}, indent=1))
    return 0


def _lm_eval(args: argparse.Namespace) -> int:
    import torch

    from .evaluation.lm_harness import require_lm_eval, run_lm_eval, write_results

    lm_eval = require_lm_eval()  # before the model loads: one line naming the extra when it is missing
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_size = int(args.batch_size) if args.batch_size.isdigit() else args.batch_size
    limit = None if args.limit is None else float(args.limit) if "." in args.limit else int(args.limit)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    results = run_lm_eval(args.model, args.preset, [t for t in args.tasks.split(",") if t], dtype=dtype, limit=limit,
                          num_fewshot=args.num_fewshot, batch_size=batch_size, include_path=args.include_path,
                          gen_kwargs=args.gen_kwargs, max_length=args.max_length, log_samples=args.log_samples,
                          seed=args.seed)
    kvarn = results["kvarn"]
    print(f"{kvarn['model']} | cache: {kvarn['preset']} | {kvarn['config'] or '16-bit (unpatched)'}")
    print(lm_eval.utils.make_table(results))
    if results.get("groups"):
        print(lm_eval.utils.make_table(results, "groups"))
    if kvarn["preset"] != "none":
        print(f"KVarNCache: {kvarn['scored_calls']} scoring calls, {kvarn['generate_calls']} generate calls; largest "
              f"cache {kvarn['max_cache_nbytes']:,} B (16-bit: {kvarn['max_cache_dense_nbytes']:,} B)")
    if args.out:
        write_results(results, Path(args.out))
        print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvarn-mla", description="KVarN KV-cache quantization for transformers")
    parser.add_argument("--version", action="version", version=f"kvarn-mla {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    presets = commands.add_parser("presets", help="list the presets with their bits and bytes per token")
    presets.add_argument("--model", default="deepseek-v3",
                         help="bundled architecture name, config.json or model directory (default: deepseek-v3)")
    presets.add_argument("--context", type=int, default=4096, help="context length in tokens (default: 4096)")
    presets.set_defaults(run=_presets)

    planner = commands.add_parser(
        "plan", help="capacity planning: max context and batch per preset in a memory budget, after the weights",
        description="How many tokens and sequences fit in a memory budget once the weights are loaded, per preset. "
                    "Offline: nothing is downloaded or allocated.")
    planner.add_argument("--model", required=True,
                         help="bundled architecture name (e.g. deepseek-v3, llama-3-8b), config.json, model directory, "
                              "or a hub name whose config.json is in the local Hugging Face cache")
    planner.add_argument("--memory", required=True,
                         help="memory budget, weights included: a number and B, KB, MB, GB, TB, KiB, MiB, GiB or TiB "
                              "(e.g. 80GiB, 1128GiB, 1.5TB)")
    planner.add_argument("--batch", type=int, default=8,
                         help="sequences decoded together, for the max context per sequence (default: 8)")
    planner.add_argument("--context", type=int, default=32768,
                         help="tokens per sequence, for the bytes per token and the max batch (default: 32768)")
    planner.add_argument("--preset", action="append", metavar="NAME",
                         help="only this preset (repeatable; default: every preset `kvarn-mla presets` lists); "
                              "the 16-bit row is always shown")
    planner.add_argument("--dtype-bytes", type=float, default=2,
                         help="bytes per weight parameter: 2 for bf16 (default), 1 for FP8, 0.5 for 4-bit")
    planner.add_argument("--tp", type=int, default=1,
                         help="tensor-parallel ranks: weights, KV bytes and capacity per rank, --memory per device "
                              "(default: 1)")
    planner.set_defaults(run=_plan)

    bench = commands.add_parser("bench", help="decode/prefill time, memory and store cost, patched vs stock (CPU)")
    bench.add_argument("--families", default="mla,gqa,mha",
                       help="mla (DeepSeek-V2-Lite widths), gqa (Llama-3-8B), mha (Llama-2-7B)")
    bench.add_argument("--contexts", default="1024,4096,8192,16384")
    bench.add_argument("--steps", type=int, default=3, help="timed decode steps per point (median)")
    bench.add_argument("--prefill-up-to", type=int, default=16384, help="time prefill up to this context")
    bench.add_argument("--threads", type=int, default=2)
    bench.add_argument("--out", required=True,
                       help="directory for bench_cpu.csv / .json (files of that name there are replaced; the "
                            "committed results are benchmarks/results)")
    bench.set_defaults(run=_bench)

    report = commands.add_parser("report", help="architecture comparison report (markdown + html + PNG charts)")
    report.add_argument("--out", required=True, help="output directory")
    report.add_argument("--results", help="results directory to read (default: the committed benchmarks/results "
                        "of the checkout kvarn_mla runs from; an error when there is none)")
    report.add_argument("--rerun", action="store_true",
                        help="recompute bench and accuracy results into --results first (slow; needs --results)")
    report.set_defaults(run=_report)

    show = commands.add_parser("demo", help="the bundled MLA reference model: 16-bit cache vs KVarN presets")
    show.add_argument("--model", default="mla", help="mla | gqa | mha (bundled, default mla), a model directory, or "
                      "a cached hub name")
    show.add_argument("--presets", default="k4v2,k2v2", help="methods to compare with the 16-bit cache")
    show.add_argument("--max-new-tokens", type=int, default=None,
                      help="cap on generated tokens per prompt (default: the whole reasoning answer, 256 of code)")
    show.add_argument("--prompt-tokens", type=int, default=384, help="tokens of held-out code in the code prompt")
    show.set_defaults(run=_demo)

    evaluate = commands.add_parser("eval", help="accuracy of cache methods on a model (resumable)")
    evaluate.add_argument("--model", required=True, help="mla | gqa | mha (bundled), a model directory, or a cached "
                          "hub name")
    evaluate.add_argument("--presets", default="k4v2,k2v2,kivi-k2v2,rot-k2v2",
                          help="comma-separated methods: presets (with +field=value), hf-quanto-2/4, hf-hqq-2/4, "
                          "hf-fp8; the reference (the unquantized cache) is always added, labelled by --dtype: "
                          "fp32, bf16 or fp16")
    evaluate.add_argument("--suite", required=True,
                          choices=["accumulation", "reasoning", "retrieval", "worst-vectors", "jsonl"])
    evaluate.add_argument("--out", required=True, help="summary JSON; records go to the same name with .jsonl "
                          "(a rerun resumes them; records of another model, suite or setting are refused)")
    evaluate.add_argument("--tasks", help="JSONL task file for --suite jsonl")
    evaluate.add_argument("--checker", default="exact", help="default checker: exact | last-number | boxed")
    evaluate.add_argument("--limit", type=int, default=100, help="items to run (default 100)")
    evaluate.add_argument("--max-new-tokens", type=int, default=512)
    evaluate.add_argument("--batch-size", type=int, default=None,
                          help="items generated together (default 8; 1 for retrieval: long prompts without padding)")
    evaluate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    evaluate.add_argument("--top-p", type=float, default=1.0)
    evaluate.add_argument("--seed", type=int, default=0, help="sampling seed; for --suite retrieval also the item "
                          "seed, which must lie outside the training seeds (0-999): such seeds give unseen items")
    evaluate.add_argument("--text", help="text file for accumulation / worst-vectors (default: held-out code)")
    evaluate.add_argument("--tokens", type=int, default=2048, help="text length for accumulation")
    evaluate.add_argument("--chunk", type=int, default=128, help="chunk (tile) size of the accumulation protocol")
    evaluate.add_argument("--greedy-tokens", type=int, default=1024)
    evaluate.add_argument("--context", type=int, default=1024,
                          help="cached tokens for worst-vectors; tokens per item (prompt + answer) for retrieval")
    evaluate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    evaluate.add_argument("--mode", default="greedy", choices=["greedy", "teacher-forced"],
                          help="reasoning/retrieval: generate and check (greedy), or the same exact-match verdict from "
                          "a few forward passes over the target, stopping at the first token that is not the argmax "
                          "(teacher-forced; records only `exact`)")
    evaluate.set_defaults(run=_eval)

    harness = commands.add_parser(
        "lm-eval", help="lm-evaluation-harness tasks on a patched model (pip install \".[lm-eval]\")",
        description="Run lm-evaluation-harness tasks (generate_until and loglikelihood) on a model patched with a "
                    "KVarN preset, through lm-eval's HFLM around the loaded instance. Scoring requests run through "
                    "the KVarN cache in tile-aligned chunks, so each token sees the cache greedy decoding would have.")
    harness.add_argument("--model", required=True, help="mla | gqa | mha (bundled), a model directory, or a cached "
                         "hub name")
    harness.add_argument("--preset", default=None,
                         help="KVarN method as `kvarn-mla eval` takes it (k4v2, k4v2+tile_size=64, kvarn-3, ...); "
                              "omitted or 'none': the 16-bit cache, unpatched")
    harness.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    harness.add_argument("--include-path", help="directory of local task YAMLs (e.g. dataset_path: json with "
                         "dataset_kwargs.data_files)")
    harness.add_argument("--limit", help="items per task: a count, or a fraction with a '.' (default: all)")
    harness.add_argument("--num-fewshot", type=int, default=None)
    harness.add_argument("--batch-size", default="1", help="requests per forward pass, or 'auto' (default 1)")
    harness.add_argument("--max-length", type=int, default=None,
                         help="token limit of a request (default: the model's max_position_embeddings)")
    harness.add_argument("--gen-kwargs", help="generation arguments for generate_until tasks, e.g. "
                         "'max_gen_toks=64,temperature=0'")
    harness.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    harness.add_argument("--seed", type=int, default=0, help="lm-eval's random, numpy, torch and few-shot seeds")
    harness.add_argument("--threads", type=int, default=None,
                         help="torch CPU threads (default: torch's; 1 is faster on a busy machine)")
    harness.add_argument("--log-samples", action="store_true", help="keep every request and response in --out")
    harness.add_argument("--out", help="write lm-eval's results (and the cache bytes) as JSON")
    harness.set_defaults(run=_lm_eval)
    return parser


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "context", 1) < 1:
        parser.error(f"--context must be a positive number of tokens, got {args.context}")
    try:
        return args.run(args)
    except (ValueError, NotImplementedError) as error:
        print(f"kvarn-mla: error: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad argument or value, with one line on stderr).

    A reader that stops early (``kvarn-mla presets | head``) ends the command quietly with status 141, as a
    SIGPIPE would, instead of a traceback.
    """
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's own flush at exit
    except BrokenPipeError:
        try:  # what is still buffered goes nowhere, so the exit flush cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout with no file descriptor (captured): nothing buffered to drop
            pass
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
