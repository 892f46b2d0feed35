"""A failed step never leaves the cache broken, and no attention path reads a KVarN cache wrongly.

Each test here reproduces one failure found by trying the library with bad input (issue 15) and checks it is fixed:
atomic forward passes (a pass that raises leaves every layer as it was), tiles that cannot be stored never poison the
cache, a KVarNCache in an unpatched model raises, an attention implementation switched after `patch` keeps reading
the quantized cache, ``output_attentions`` returns real weights, ``cache_implementation="static"`` warns.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, build_model, sqnr

import kvarn_mla
from kvarn_mla import KVarNCache

PRESET = dict(tile_size=64, sink_tokens=64)


def _ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _state(cache: KVarNCache) -> list:
    """Every layer's lengths and every stored tensor (cloned), to compare a cache before and after."""
    state = []
    for layer in cache.layers:
        for stream in layer.streams:
            view = stream.view()
            parts = [view.sink, view.tail, *(view.tiles.parts() if view.tiles is not None else ())]
            state.append((stream.length, stream.num_tiles,
                          [None if t is None or t.numel() == 0 else t.clone() for t in parts]))
    return state


def _same(a: list, b: list) -> bool:
    return all(x[:2] == y[:2] and all((p is None and q is None) or torch.equal(p, q) for p, q in zip(x[2], y[2]))
               for x, y in zip(a, b))


def _projection(model, layer: int) -> torch.nn.Module:
    attention = model.model.layers[layer].self_attn
    return getattr(attention, "k_proj", None) or attention.kv_a_proj_with_mqa


def _poison(model, layer: int, value: float):
    """A forward hook that writes ``value`` into the key (dense) or latent (MLA) projection of one layer."""
    def hook(module, args, output):
        output = output.clone()
        output[..., -1, 3] = value
        return output
    return _projection(model, layer).register_forward_hook(hook)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("phase, bad", [("prefill", float("nan")), ("decode", float("inf"))])
def test_a_non_finite_step_leaves_every_layer_unchanged(backend, model_type, phase, bad):
    model = build_model(model_type).to(DEVICE)
    kvarn_mla.patch(model, "k4v2", backend=backend, **PRESET)
    ids = _ids(140)
    with torch.no_grad():
        cache = model(ids[:, :130]).cache  # a sink and one quantized tile per layer
        before = _state(cache)
        step = ids[:, 130:131] if phase == "decode" else ids[:, 130:]
        for layer in range(len(cache.layers)):
            handle = _poison(model, layer, bad)
            with pytest.raises(ValueError, match=rf"of layer {layer} contain (nan|-?inf) \(NaN or Inf\)"):
                model(step, cache=cache)
            handle.remove()
            assert _same(_state(cache), before), f"layer {layer}: the cache changed"
        clean = model(step, cache=cache).logits
        reference = model(step, cache=model(ids[:, :130]).cache).logits
    assert torch.equal(clean, reference)


@pytest.mark.parametrize("model_type, dtype, magnitude", [
    ("llama", torch.float32, 1e4), ("llama", torch.float32, 1e5), ("llama", torch.float32, 1e10),
    ("llama", torch.float16, 6.5e4), ("deepseek_v3", torch.bfloat16, 3e38), ("deepseek_v3", torch.float32, 1e6),
])
def test_huge_finite_values_are_stored_or_refused_without_poisoning(model_type, dtype, magnitude):
    """Values up to the model dtype's largest: either stored (tile flushed) or refused with a clear error that
    changes nothing; either way later forward passes work."""
    model = build_model(model_type).to(device=DEVICE, dtype=dtype)
    kvarn_mla.patch(model, "k4v2", **PRESET)
    ids = _ids(200)
    handle = _poison(model, 1, magnitude)  # the last token of the prefill: it lands in the first tile
    with torch.no_grad():
        cache = model(ids[:, :64]).cache  # the sink
        before = _state(cache)
        try:
            model(ids[:, 64:128], cache=cache)  # fills one tile: flushed after the pass
            stored = True
        except ValueError as error:
            assert "too large for the tile scales" in str(error) and "key_bits=16" in str(error) \
                or "latent_bits=16" in str(error)
            assert _same(_state(cache), before)
            stored = False
        handle.remove()
        out = model(ids[:, 128:130], cache=cache)  # never poisoned: the next pass works
    assert torch.isfinite(out.logits.float()).all()
    assert cache.layers[1].streams[0].num_tiles == int(stored)
    assert cache.get_seq_length() == (130 if stored else 66)


def test_a_kvarn_cache_in_an_unpatched_model_raises():
    model = build_model("llama").to(DEVICE)
    cache = KVarNCache(model.config, "k4v2")
    with pytest.raises(ValueError, match=r"not patched for it: call kvarn_mla.patch"):
        model(_ids(20), cache=cache)
    assert cache.get_seq_length() == 0
    patched = build_model("deepseek_v3").to(DEVICE)
    kvarn_mla.patch(patched, "k2v2")
    with pytest.raises(ValueError, match="patched for"):  # a cache of another configuration (or model)
        patched(_ids(20), cache=KVarNCache(patched.config, "k4v2"))


@pytest.mark.parametrize("model_type, switch", [
    ("llama", "set_attn_implementation"), ("llama", "config"), ("deepseek_v3", "config"), ("llama", "eager-first"),
])
def test_an_attention_implementation_switched_after_patch_keeps_reading_the_cache(model_type, switch):
    """As transformers' own assisted-decoding test does: the implementation changes after `patch`; the patched
    model warns and keeps attending its quantized cache (the choice becomes its full-precision attention)."""
    model = build_model(model_type, attn_implementation="eager" if switch == "eager-first" else None).to(DEVICE)
    kvarn_mla.patch(model, "k4v2", **PRESET)
    ids = _ids(150)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)
        if switch == "set_attn_implementation":
            model.set_attn_implementation("sdpa")
        else:
            model.config._attn_implementation = "sdpa" if switch == "eager-first" else "eager"
        with pytest.warns(UserWarning, match="keeps attending its KVarN cache"):
            switched = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(switched, expected)
    chosen = model.config._attn_implementation_internal
    kvarn_mla.unpatch(model)
    assert chosen == "kvarn" and model.config._attn_implementation in ("eager", "sdpa")


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_output_attentions_returns_the_weights_over_the_quantized_cache(model_type):
    model = build_model(model_type).to(DEVICE)
    kvarn_mla.patch(model, "k4v2", **PRESET)
    ids = _ids(150)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        out = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, output_attentions=True,
                             return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert sqnr(torch.stack(plain.logits), torch.stack(out.logits)) > 60  # eager over the dequantized store
    heads = model.config.num_attention_heads
    assert len(out.attentions) == 6 and out.attentions[0][0].shape == (1, heads, 150, 150)
    weights = out.attentions[-1][0]  # the last decode step, layer 0
    assert weights.shape == (1, heads, 1, 155) and torch.allclose(weights.sum(-1), torch.ones(1, heads, 1))


def test_assisted_generation_with_output_attentions():
    """transformers' assisted-decoding test: the model is its own assistant, with output_attentions."""
    model = build_model("llama").to(DEVICE)
    kvarn_mla.patch(model, "k8v8", **PRESET)
    ids = _ids(100)
    kwargs = dict(max_new_tokens=4, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    with torch.no_grad():
        greedy = model.generate(ids, **kwargs)
        assisted = model.generate(ids, assistant_model=model, **kwargs)
    assert torch.equal(greedy.sequences, assisted.sequences)


def test_layer_keys_and_values_are_the_dequantized_cache():
    model = build_model("llama").to(DEVICE)
    kvarn_mla.patch(model, "k4v2", **PRESET)
    with torch.no_grad():
        cache = model(_ids(150)).cache
    layer = cache.layers[0]
    assert layer.keys.shape == (1, 2, 150, 16) and layer.values.dtype == torch.float32
    assert torch.equal(layer.keys, layer.streams[0].dequantized())
    with pytest.raises(AttributeError, match="read-only"):
        layer.keys = torch.zeros(1)


def test_static_cache_request_warns_that_it_runs_unquantized():
    model = build_model("llama").to(DEVICE)
    kvarn_mla.patch(model, "k4v2")
    with pytest.warns(UserWarning, match=r"cache_implementation='static'.*unquantized by kvarn_mla"):
        out = model.generate(_ids(20), max_new_tokens=3, do_sample=False, cache_implementation="static",
                             return_dict_in_generate=True)
    assert not isinstance(out.cache, KVarNCache)
