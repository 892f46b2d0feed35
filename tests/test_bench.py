"""`kvarn-mla bench` measurements on tiny models (numbers are benchmarks; this checks what is measured)."""

from __future__ import annotations

import pytest
from conftest import build_model

import kvarn_mla
from kvarn_mla.evaluation.bench import FAMILIES, fill, measure


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_measure_reports_every_quantity(model_type):
    model = build_model(model_type)
    row = measure(model, model_type, 300, steps=1, prefill=True, preset="k4v2")
    for key in ("stock_decode_ms", "k4v2_decode_ms", "stock_attention_ms", "k4v2_attention_ms", "stock_prefill_ms",
                "k4v2_prefill_ms", "store_ms_per_tile_all_layers", "decode_speedup", "attention_speedup"):
        assert row[key] > 0, key
    assert 0 < row["store_fraction_of_decode"] < 1
    assert 0 < row["k4v2_cache_mib"] < row["stock_cache_mib"] * 2  # fp32 tiny model: sink/tail are 4-byte
    assert not kvarn_mla.is_patched(model)


def test_fill_leaves_the_requested_context_and_pending_tiles():
    model = build_model("llama")
    kvarn_mla.patch(model, "k4v2", tile_size=64, sink_tokens=64)
    cache = kvarn_mla.KVarNCache(model)
    fill(cache, model, 256, extra_tail=64)
    stream = cache.layers[0].streams[0]
    assert cache.get_seq_length() == 256 and stream.pending_tiles() == 1 and stream.num_tiles == 2


def test_benchmark_families_have_the_published_attention_widths():
    mla, gqa, mha = FAMILIES["mla"][1], FAMILIES["gqa"][1], FAMILIES["mha"][1]
    assert (mla["num_attention_heads"], mla["kv_lora_rank"], mla["qk_rope_head_dim"], mla["qk_nope_head_dim"],
            mla["v_head_dim"]) == (16, 512, 64, 128, 128)
    assert (gqa["num_attention_heads"], gqa["num_key_value_heads"], gqa["head_dim"]) == (32, 8, 128)
    assert (mha["num_attention_heads"], mha["num_key_value_heads"], mha["head_dim"]) == (32, 32, 128)
