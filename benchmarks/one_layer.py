"""Which layer's quantized cache breaks a task: every layer but one kept 16-bit, teacher-forced.

On the v5 GQA's long chains, 2-bit KVarN values alone (keys 16-bit) leave 10 of 100 items right where rotation-only
values leave 96 (`results/v5/diagnosis/`). This script answers where: for each layer ``L`` it scores the first
``--items`` held-out reasoning items teacher-forced (`kvarn_mla.evaluation.tasks.teacher_forced_items`) with only
layer ``L``'s cache quantized by ``--preset`` and every other layer's cache exact.

A KVarN cache whose layers differ in config is not something the library builds (`patch` refuses a cache that does
not match the patched model); this diagnostic swaps the other layers for 16-bit ones after building it, and turns
that check off for its own run only.

    python benchmarks/one_layer.py --model gqa --preset "kvarn-2+key_bits=16" --items 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from kvarn_mla import reference_models
from kvarn_mla.adapters import layer_specs
from kvarn_mla.cache import KVarNCache, KVarNLayer
from kvarn_mla.config import UNQUANTIZED
from kvarn_mla.evaluation import reasoning
from kvarn_mla.evaluation.methods import Method, parse_method
from kvarn_mla.evaluation.tasks import reasoning_items, teacher_forced_items

_patch_module = sys.modules["kvarn_mla.patch"]  # the module (``kvarn_mla.patch`` is also the function)


class OneLayerMethod(Method):
    """A KVarN method whose caches quantize only layer ``cache_kwargs["layer"]``."""

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


def run(model_name: str, preset: str, items: int) -> dict[str, object]:
    """Items right (of ``items``) with only each layer quantized by ``preset``: ``{"right_by_layer": [...], ...}``."""
    method = parse_method(preset)
    if method.kind != "kvarn":
        raise SystemExit(f"--preset must be a KVarN method (e.g. kvarn-2+key_bits=16), got {preset!r}")
    model, tok = reference_models.load(model_name)
    model.float().eval()
    task_items = reasoning_items(tok, items, task=reasoning.task_of(model.config))
    right = []
    with allow_mixed_caches():
        for layer in range(model.config.num_hidden_layers):
            one = OneLayerMethod(method.name, method.kind, method.config, cache_kwargs={"layer": layer})
            right.append(sum(r["exact"] for r in teacher_forced_items(model, tok, task_items, one)))
            print(f"{model_name} {preset}: only layer {layer} quantized: {right[-1]}/{items} right", flush=True)
    return {"model": model_name, "preset": preset, "items": items, "right_by_layer": right}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gqa", help="a bundled reference model (default gqa)")
    ap.add_argument("--preset", required=True, help="a KVarN method string, as kvarn-mla eval --presets takes")
    ap.add_argument("--items", type=int, default=40, help="held-out reasoning items (default 40)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, help="append the result as a JSON line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.model, args.preset, args.items)
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
