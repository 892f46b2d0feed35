"""benchmarks/lookup_error.py: the key capture, the quantized-key layout and the tables it reports from."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_benchmark
from transformers import DynamicCache

from kvarn_mla.config import QUANTIZERS, KVarNConfig


@pytest.fixture(scope="module")
def lookup_error():
    return load_benchmark("lookup_error")


def test_captured_keys_are_the_keys_the_model_caches(tiny, lookup_error):
    model = tiny("llama")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    captured = lookup_error.capture(model, ids)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    assert len(captured) == model.config.num_hidden_layers
    for layer, (queries, keys) in enumerate(captured):
        assert queries.shape == (4, 40, 16) and keys.shape == (2, 40, 16)
        torch.testing.assert_close(keys, cache.layers[layer].keys[0])
    assert not any(m._forward_pre_hooks for m in model.modules())  # the hooks are gone


def test_quantized_keys_touch_only_full_tiles_after_the_sink(lookup_error):
    config = KVarNConfig(key_bits=2, tile_size=64, sink_tokens=64, **QUANTIZERS["kivi"])
    keys = torch.randn(2, 64 + 2 * 64 + 10, 32, generator=torch.Generator().manual_seed(1))
    restored = lookup_error.quantized_keys(keys, config)
    assert torch.equal(restored[:, :64], keys[:, :64]) and torch.equal(restored[:, -10:], keys[:, -10:])
    assert not torch.equal(restored[:, 64:192], keys[:, 64:192])
    # per channel over a tile's tokens: at 2 bits each channel of a tile takes at most 4 values
    assert all(restored[h, 64:128, c].unique().numel() <= 4 for h in range(2) for c in range(32))


def test_band_rotation_is_orthonormal_and_mixes_only_within_a_rope_band(lookup_error):
    dim = 32
    rotation = lookup_error.band_rotation(dim)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(dim))
    band = (torch.arange(dim) % (dim // 2)) // (dim // 2 // lookup_error.BANDS)
    mixed = rotation != 0
    assert torch.equal(mixed, band[:, None] == band[None, :])


def test_exact_keys_give_no_attention_error(lookup_error):
    gen = torch.Generator().manual_seed(2)
    queries, keys = torch.randn(4, 300, 16, generator=gen), torch.randn(2, 300, 16, generator=gen)
    error = lookup_error.lookup_error(queries, keys, keys.clone(), 0.25, sink=64, size=64)
    assert error["tv"] == 0 and error["tv_p99"] == 0 and error["logit_rms"] == 0
    noisy = keys + 0.1 * torch.randn(keys.shape, generator=gen)
    assert lookup_error.lookup_error(queries, keys, noisy, 0.25, sink=64, size=64)["tv"] > 0


def test_first_miss_table_bins_by_tail_fill(lookup_error, tmp_path):
    from kvarn_mla.evaluation import reasoning

    class Whitespace:  # one token per character: prompt lengths are known exactly
        def __call__(self, text, add_special_tokens=False):
            return type("Ids", (), {"input_ids": list(text)})()

    model = type("Model", (), {"config": type("Config", (), {})()})()
    task = reasoning.task_of(model.config)
    items = reasoning.held_out_items(2, task=task)
    prompt = [len(i.prompt) for i in items]
    # first misses placed 5 and 40 tokens after a tile boundary (sink 128, tiles of 128)
    miss = [(128 + 128 * 4 + 5 - prompt[0]), (128 + 128 * 6 + 40 - prompt[1])]
    rows = [dict(method="fp32", id=f"reasoning-{items[0].index}", exact=True, first_miss=None),
            dict(method="fp32", id=f"reasoning-{items[1].index}", exact=True, first_miss=None),
            dict(method="rot-3", id=f"reasoning-{items[0].index}", exact=False, first_miss=miss[0]),
            dict(method="rot-3", id=f"reasoning-{items[1].index}", exact=False, first_miss=miss[1])]
    records = tmp_path / "r.jsonl"
    records.write_text("\n".join(json.dumps(r) for r in rows))
    table = lookup_error.first_miss_table(records, model, Whitespace())
    assert "| `rot-3` | 2 | 1 | 0 | 1 | 0 | 0 | 0 | 0 | 0 |" in table
