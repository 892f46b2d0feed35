"""Which layer's quantized cache breaks a task: every layer but one kept 16-bit, teacher-forced.

On the v5 GQA's long chains, 2-bit KVarN values alone (keys 16-bit) leave 10 of 100 items right where rotation-only
values leave 96 (`results/v5/diagnosis/`). This script answers where: for each preset and each layer ``L`` it scores
the first ``--items`` held-out items teacher-forced with only layer ``L``'s cache quantized by the preset and every
other layer's cache exact, next to 16-bit and the preset on every layer. The task is the long-chain reasoning suite
or held-out retrieval at ``--context`` tokens (`sweep.SWEEP_SEED`, the sweep's items). All of an item's methods run
in one `tasks.teacher_forced_grid`, so the KVarN caches replay one prefill.

A KVarN cache whose layers differ in config is not something the library builds (`patch` refuses a cache that does
not match the patched model); this diagnostic swaps the other layers for 16-bit ones after building it, and turns
that check off for its own run only.

    python benchmarks/one_layer.py --model gqa --presets "kvarn-2+key_bits=16" --items 40
    python benchmarks/one_layer.py --model gqa --task retrieval --context 8192 --presets rot-2,rot-2+value_bits=16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from kvarn_mla.adapters import layer_specs
from kvarn_mla.cache import KVarNCache, KVarNLayer
from kvarn_mla.config import UNQUANTIZED
from kvarn_mla.evaluation import reasoning
from kvarn_mla.evaluation.methods import Method, parse_method
from kvarn_mla.evaluation.runner import load_model
from kvarn_mla.evaluation.sweep import SWEEP_SEED
from kvarn_mla.evaluation.tasks import reasoning_items, retrieval_items, teacher_forced_grid

_patch_module = sys.modules["kvarn_mla.patch"]  # the module (``kvarn_mla.patch`` is also the function)


class OneLayerMethod(Method):
    """A KVarN method whose caches quantize only layer ``cache_kwargs["layer"]`` (named ``PRESET@LAYER``)."""

    def new_cache(self, model) -> KVarNCache:
        cache = KVarNCache(model, self.config)
        exact_specs = layer_specs(model.config, UNQUANTIZED)
        for i, layer in enumerate(cache.layers):
            if i != self.cache_kwargs["layer"]:
                cache.layers[i] = KVarNLayer(exact_specs, UNQUANTIZED, layer.backend)
                cache.layers[i].index = i
        return cache


@contextlib.contextmanager
def allow_mixed_caches() -> Iterator[None]:
    """Let a patched forward pass take a cache whose layers differ from the patched config (restored on exit)."""
    check = _patch_module._check_cache_fits
    _patch_module._check_cache_fits = lambda cache, state: None
    try:
        yield
    finally:
        _patch_module._check_cache_fits = check


def run(model_name: str, presets: str | Sequence[str], items: int, *, task: str = "reasoning",
        context: int = 8192) -> dict[str, object]:
    """Items right (of ``items``) at 16 bits, with each preset on every layer, and with it on each layer alone.

    Returns ``{"model", "task", "context", "items", "ids", "exact": {label: [bool per item]}, "right": {label: n}}``
    with labels ``fp32``, ``PRESET`` and ``PRESET@L`` (only layer ``L`` quantized).
    """
    names = [presets] if isinstance(presets, str) else list(presets)
    bases = [parse_method(n.strip()) for name in names for n in name.split(",") if n.strip()]
    for base in bases:
        if base.kind != "kvarn":
            raise SystemExit(f"--presets takes KVarN methods (e.g. kvarn-2+key_bits=16), got {base.name!r}")
    model, tok = load_model(model_name, torch.float32)
    model.eval()
    if task == "reasoning":
        task_items = reasoning_items(tok, items, task=reasoning.task_of(model.config))
    elif task == "retrieval":
        task_items = retrieval_items(tok, context, SWEEP_SEED, items)
    else:
        raise SystemExit(f"--task must be reasoning or retrieval, got {task!r}")
    methods: list[Method] = [parse_method("fp32")]
    for base in bases:
        methods.append(base)
        methods += [OneLayerMethod(f"{base.name}@{layer}", base.kind, base.config, cache_kwargs={"layer": layer})
                    for layer in range(model.config.num_hidden_layers)]
    exact: dict[str, list[bool]] = {method.name: [] for method in methods}
    where = f"{model_name} {task}" + ("" if task == "reasoning" else f" {context}")
    with allow_mixed_caches():
        for method, record in teacher_forced_grid(model, tok, task_items, methods):
            exact[method.name].append(bool(record["exact"]))
            if method is methods[-1]:
                print(f"{where}: {len(exact['fp32'])}/{items} items", flush=True)
    right = {label: sum(v) for label, v in exact.items()}
    for label, n in right.items():
        print(f"{where}: {label}: {n}/{items} right")
    return {"model": model_name, "task": task, "context": context if task == "retrieval" else None, "items": items,
            "ids": [item.id for item in task_items], "exact": exact, "right": right}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gqa", help="a bundled reference model or a checkpoint directory (default gqa)")
    ap.add_argument("--presets", "--preset", required=True,
                    help="comma-separated KVarN method strings, as kvarn-mla eval --presets takes")
    ap.add_argument("--task", default="reasoning", choices=["reasoning", "retrieval"])
    ap.add_argument("--context", type=int, default=8192, help="retrieval prompt tokens (default 8192)")
    ap.add_argument("--items", type=int, default=40, help="held-out items (default 40)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, help="append the result as a JSON line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.model, args.presets, args.items, task=args.task, context=args.context)
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
