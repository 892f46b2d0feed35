"""Patched vs unpatched tiny models of every supported type: logits, greedy tokens, generate modes, bytes."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, assert_greedy_choices, build_model, build_wide, sqnr, teacher_forced_logits

import kvarn_mla
from kvarn_mla import KVarNCache

PROMPT, DECODE = 256, 32  # a prompt of a few hundred tokens, then decode steps (teacher-forced)
SMALL_TILES = dict(tile_size=64, sink_tokens=64)  # so that the tiny runs cross several tile boundaries
# SQNR floors (dB) over the decode-step logits. 8-bit must be near-identical; the default preset (k4v2) is lossy,
# mostly from the 2-bit values on the dense models (random tiny models, so the numbers only guard regressions).
FLOOR_8BIT = 45.0
FLOOR_DEFAULT = {"dense": 12.0, "mla": 25.0}
FAMILY = {t: ("dense" if t in ("llama", "mistral", "qwen2", "qwen3") else "mla") for t in TINY_CONFIGS}
# DSA models: an indexer top-k larger than the context, so a tiny logit change cannot flip the selected set (the
# discontinuity would swamp the SQNR); `test_dsa_top_k_is_applied` covers a top-k smaller than the context.
NO_SELECTION = {"deepseek_v32": dict(index_topk=2048), "glm_moe_dsa": dict(index_topk=2048)}


def _ids(batch: int = 2, length: int = PROMPT + DECODE, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _greedy(model, ids, **kwargs):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, **kwargs)


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_patched_matches_unpatched(model_type):
    model = build_model(model_type, **NO_SELECTION.get(model_type, {}))
    ids = _ids()
    reference = teacher_forced_logits(model, ids, PROMPT)

    # No tile ever fills: the store is read in full precision, so this checks the plumbing (absorption, grouping,
    # masks) against the model's own attention.
    kvarn_mla.patch(model, "k4v2", sink_tokens=4096)
    assert sqnr(reference, teacher_forced_logits(model, ids, PROMPT)) > 100

    kvarn_mla.patch(model, "k8v8", **SMALL_TILES)
    logits = teacher_forced_logits(model, ids, PROMPT)
    assert torch.equal(logits[:, 0], reference[:, 0])  # the prefill is full precision
    eight_bit = sqnr(reference[:, 1:], logits[:, 1:])
    assert eight_bit >= FLOOR_8BIT, f"{model_type}: k8v8 SQNR {eight_bit:.1f} dB"
    greedy = _greedy(model, ids[:, :PROMPT])

    kvarn_mla.patch(model, "k4v2", **SMALL_TILES)
    default = sqnr(reference[:, 1:], teacher_forced_logits(model, ids, PROMPT)[:, 1:])
    floor = FLOOR_DEFAULT[FAMILY[model_type]]
    assert default >= floor, f"{model_type}: k4v2 SQNR {default:.1f} dB < {floor}"
    assert default < eight_bit

    kvarn_mla.unpatch(model)
    assert torch.equal(teacher_forced_logits(model, ids, PROMPT), reference)
    # Random tiny models have near-uniform logits, so an exact tie may break either way; anything else must not.
    assert_greedy_choices(model, greedy, PROMPT)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_top_k_is_applied(model_type):
    model = build_model(model_type)  # index_topk=16, far below the context
    ids = _ids()
    reference = teacher_forced_logits(model, ids, PROMPT)
    kvarn_mla.patch(model, "k4v2", sink_tokens=4096)  # nothing quantized: must match the model exactly
    assert sqnr(reference, teacher_forced_logits(model, ids, PROMPT)) > 100
    dense_attention = build_model(model_type, index_topk=2048)
    assert sqnr(reference, teacher_forced_logits(dense_attention, ids, PROMPT)) < 40  # the top-k matters here


@pytest.mark.parametrize("name", ["mla-512+64", "gqa-128"])
def test_realistic_widths(name):
    model = build_wide(name)
    ids = _ids(length=300 + 24)
    reference = teacher_forced_logits(model, ids, 300)
    results = {}
    for preset in ("k8v8", "k4v2"):
        kvarn_mla.patch(model, preset, tile_size=64, sink_tokens=64)
        logits = teacher_forced_logits(model, ids, 300)
        results[preset] = sqnr(reference[:, 1:], logits[:, 1:])
    assert results["k8v8"] >= FLOOR_8BIT and results["k4v2"] >= FLOOR_DEFAULT["mla" if "mla" in name else "dense"]
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    assert isinstance(cache, KVarNCache) and cache.get_seq_length() == ids.shape[1]
    kvarn_mla.unpatch(model)
    assert torch.equal(teacher_forced_logits(model, ids, 300), reference)


# ---- generate modes --------------------------------------------------------------------------------------------------
FAMILIES = ["llama", "deepseek_v3"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generate_greedy_returns_a_kvarn_cache_with_the_bytes_it_holds(model_type):
    model = build_model(model_type)
    ids = _ids(length=200)
    kvarn_mla.patch(model, "k4v2", **SMALL_TILES)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=70, do_sample=False, return_dict_in_generate=True)
    cache = out.cache
    assert isinstance(cache, KVarNCache)
    assert cache.get_seq_length() == out.sequences.shape[1] - 1  # the last token is never fed back
    stream = cache.layers[0].streams[0]
    assert stream.num_tiles == (cache.get_seq_length() - 64) // 64 and stream.tail_length < 64
    assert 0 < cache.nbytes() < cache.dense_nbytes()  # both in the model dtype (float32 here)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_sampling_and_beam_search(model_type):
    model = build_model(model_type)
    ids = _ids(length=150)
    with torch.no_grad():
        torch.manual_seed(7)
        sampled = model.generate(ids, max_new_tokens=10, do_sample=True, top_k=20)
        beams = model.generate(ids, max_new_tokens=10, num_beams=2, do_sample=False)
        kvarn_mla.patch(model, "k8v8", **SMALL_TILES)
        torch.manual_seed(7)
        out = model.generate(ids, max_new_tokens=10, do_sample=True, top_k=20, return_dict_in_generate=True)
        assert isinstance(out.cache, KVarNCache)
        assert torch.equal(out.sequences, sampled)
        out = model.generate(ids, max_new_tokens=10, num_beams=2, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache, KVarNCache)  # reorder_cache ran every step
    assert torch.equal(out.sequences, beams)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_left_padding_is_excluded_from_tile_statistics(model_type):
    """A row's result does not depend on its padding: not at all on the pad tokens, and on the pad length only
    within quantization error (tiles sit at absolute positions, so a shift regroups the row's tokens)."""
    model = build_model(model_type)
    row, other, pad = _ids(batch=1, length=200, seed=3), _ids(batch=1, length=230, seed=4), 30
    mask = torch.ones(2, pad + 200, dtype=torch.long)
    mask[0, :pad] = 0

    def padded_logits(pad_token: int) -> torch.Tensor:
        batch = torch.cat([torch.cat([torch.full((1, pad), pad_token), row], 1), other])
        return teacher_forced_logits(model, batch, pad + 170, attention_mask=mask)[0]

    reference = teacher_forced_logits(model, row, 170)[0]
    for preset, floor in (("k8v8", FLOOR_8BIT), ("k4v2", FLOOR_DEFAULT[FAMILY[model_type]])):
        kvarn_mla.patch(model, preset, tile_size=64, sink_tokens=0)  # padding inside quantized tiles
        first, second = padded_logits(0), padded_logits(77)
        assert sqnr(first, second) > 80  # the pad tokens' K/V never enter a real token's statistics
        alone = teacher_forced_logits(model, row, 170)[0]
        assert sqnr(alone, first) > floor and sqnr(reference, first) > floor
    kvarn_mla.patch(model, "k8v8", tile_size=64, sink_tokens=0)
    with torch.no_grad():
        batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), row[:, :170]], 1), other[:, :200]])
        padded = model.generate(batch, attention_mask=mask[:, :200], max_new_tokens=20, do_sample=False)[:1, pad:]
    kvarn_mla.unpatch(model)
    assert_greedy_choices(model, padded, 170)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_assisted_decoding_crops_the_cache(model_type):
    model = build_model(model_type)
    assistant = build_model(model_type, seed=5)
    ids = _ids(batch=1, length=150)
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=24, do_sample=False)
        kvarn_mla.patch(model, "k8v8", **SMALL_TILES)
        crops = []
        original_crop = KVarNCache.crop

        def counting_crop(cache, n):
            crops.append(n)
            return original_crop(cache, n)

        KVarNCache.crop = counting_crop
        try:
            out = model.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant)
        finally:
            KVarNCache.crop = original_crop
    assert any(n < 0 for n in crops), "the assistant's candidates were never rejected"
    assert torch.equal(out, reference)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_chunked_prefill_attends_earlier_chunks_in_quantized_form(model_type):
    model = build_model(model_type)
    ids = _ids(batch=1, length=256)

    def first_logits(**kwargs):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=1, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **kwargs)
        return out.logits[0], out.cache

    reference, _ = first_logits()
    kvarn_mla.patch(model, "k4v2", sink_tokens=4096)  # nothing quantized: chunking changes nothing
    assert sqnr(reference, first_logits(prefill_chunk_size=64)[0]) > 100
    kvarn_mla.patch(model, "k2v2", tile_size=64, sink_tokens=0)  # now earlier chunks are read quantized
    assert sqnr(reference, first_logits()[0]) > 100  # a one-shot prefill is full precision
    chunked, cache = first_logits(prefill_chunk_size=64)
    assert sqnr(reference, chunked) < 60  # the chunks saw their predecessors quantized
    assert isinstance(cache, KVarNCache) and cache.get_seq_length() == 256


@pytest.mark.parametrize("model_type", FAMILIES)
def test_cache_reused_across_two_generate_calls(model_type):
    model = build_model(model_type)
    ids = _ids(batch=1, length=150)
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=30, do_sample=False)
        kvarn_mla.patch(model, "k8v8", **SMALL_TILES)
        first = model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
        second = model.generate(first.sequences, cache=first.cache, max_new_tokens=20, do_sample=False)
    assert torch.equal(second, reference)
    assert first.cache.get_seq_length() == second.shape[1] - 1


def test_sliding_window_layers_stay_unquantized_and_exact():
    model = build_model("qwen3", layer_types=["full_attention", "sliding_attention"], sliding_window=64,
                        use_sliding_window=True)
    ids = _ids(length=200)
    reference = teacher_forced_logits(model, ids, 160)
    kvarn_mla.patch(model, "k4v2", sink_tokens=4096)
    assert sqnr(reference, teacher_forced_logits(model, ids, 160)) > 100
    kvarn_mla.patch(model, "k8v8", **SMALL_TILES)
    assert sqnr(reference[:, 1:], teacher_forced_logits(model, ids, 160)[:, 1:]) > FLOOR_8BIT
    with torch.no_grad():
        layers = model(ids).cache.layers
    assert isinstance(layers[0], kvarn_mla.KVarNLayer) and type(layers[1]).__name__ == "DynamicSlidingWindowLayer"
    with pytest.warns(UserWarning, match="stays unquantized"):
        kvarn_mla.patch(build_model("mistral", sliding_window=64))


def test_plain_forward_calls_get_a_kvarn_cache_and_use_cache_false_gets_none():
    model = kvarn_mla.patch(build_model("qwen3"), "k4v2")
    with torch.no_grad():
        assert isinstance(model(_ids(length=20)).cache, KVarNCache)
        assert model(_ids(length=20), use_cache=False).cache is None
