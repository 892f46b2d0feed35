"""benchmarks/one_layer.py: caches that quantize one layer only."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import load_benchmark

from kvarn_mla import reference_models
from kvarn_mla.evaluation import reasoning
from kvarn_mla.evaluation.methods import parse_method
from kvarn_mla.evaluation.tasks import reasoning_items, teacher_forced_items


@pytest.fixture(scope="module")
def one_layer():
    return load_benchmark("one_layer")


def _method(one_layer, layer: int):
    base = parse_method("kvarn-2")
    return one_layer.OneLayerMethod(f"{base.name}@{layer}", base.kind, base.config, cache_kwargs={"layer": layer})


def test_only_the_chosen_layer_is_quantized(tiny, one_layer):
    model = tiny("llama")
    ids = torch.randint(0, 128, (1, 320), generator=torch.Generator().manual_seed(0))
    logits = {}
    for layer in (0, 1):
        method = _method(one_layer, layer)
        with method.applied(model):
            cache = method.new_cache(model)
            assert [[s.scheme.bits for s in lay.specs] for lay in cache.layers] == [
                [2, 2] if i == layer else [16, 16] for i in range(2)
            ]
            with one_layer.allow_mixed_caches(), torch.no_grad():
                model(ids[:, :256], cache=cache, use_cache=True)  # the first tile after the sink fills
                logits[layer] = model(ids[:, 256:], cache=cache, use_cache=True).logits
    with torch.no_grad():
        exact = model(ids).logits[:, 256:]
    for layer in (0, 1):  # each reads a quantized tile somewhere, and not the same one
        assert not torch.allclose(logits[layer], exact, atol=1e-4)
    assert not torch.allclose(logits[0], logits[1], atol=1e-4)


def test_run_scores_every_layer_and_restores_the_check(one_layer):
    check = sys.modules["kvarn_mla.patch"]._check_cache_fits
    result = one_layer.run("gqa", "kvarn-2,rot-2+value_bits=16", 2)
    labels = ["fp32"] + [f"{p}{suffix}" for p in ("kvarn-2", "rot-2+value_bits=16")
                         for suffix in ("", "@0", "@1", "@2", "@3")]
    assert list(result["exact"]) == labels and all(len(v) == 2 for v in result["exact"].values())
    assert result["right"] == {label: sum(v) for label, v in result["exact"].items()}
    assert sys.modules["kvarn_mla.patch"]._check_cache_fits is check
    # the preset on every layer, inside the mixed grid, gives the verdicts it gets scored on its own
    model, tok = reference_models.load("gqa")  # float32, eval mode
    items = reasoning_items(tok, 2, task=reasoning.task_of(model.config))
    alone = [r["exact"] for r in teacher_forced_items(model, tok, items, parse_method("kvarn-2"))]
    assert result["exact"]["kvarn-2"] == alone
    with pytest.raises(SystemExit, match="KVarN method"):
        one_layer.run("gqa", "fp32", 1)
    with pytest.raises(SystemExit, match="--task"):
        one_layer.run("gqa", "kvarn-2", 1, task="summaries")
