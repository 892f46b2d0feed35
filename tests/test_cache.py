"""`KVarNCache` / `KVarNLayer` storage: bytes, tiling, crop, reorder, reset and bad input, without a model."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, WIDE_CONFIGS
from transformers import AutoConfig

import kvarn_mla
from kvarn_mla import KVarNCache, KVarNConfig
from kvarn_mla.quant.rtn import packed_width
from kvarn_mla.store import GrowableTensor


def _config(model_type: str, **overrides):
    if model_type in WIDE_CONFIGS:
        model_type, kwargs = WIDE_CONFIGS[model_type]
    else:
        kwargs = TINY_CONFIGS[model_type]
    return AutoConfig.for_model(model_type, **dict(kwargs, **overrides))


def _fill(layer, tokens: int, batch: int = 1, dtype=torch.bfloat16, step: int | None = None, seed: int = 0):
    """Feed ``tokens`` random tokens through ``update`` + ``flush`` (what the attention function does)."""
    gen = torch.Generator().manual_seed(seed)
    step = step or tokens
    for start in range(0, tokens, step):
        n = min(step, tokens - start)
        k, v = (torch.randn(batch, s.num_heads, n, s.dim, generator=gen).to(dtype) for s in layer.specs)
        layer.update(k, v)
        layer.flush()


def _expected_stream_bytes(spec, length, batch, config: KVarNConfig, element_size=2) -> int:
    if spec.bits == 16:
        return batch * spec.num_heads * length * spec.dim * element_size
    sink = min(length, config.sink_tokens)
    tiles = (length - sink) // config.tile_size if sink == config.sink_tokens else 0
    tail = length - sink - tiles * config.tile_size
    fp = (sink + tail) * spec.dim * element_size
    return batch * spec.num_heads * (fp + tiles * spec.tile_nbytes())


@pytest.mark.parametrize("model_type", ["mla-512+64", "gqa-128", "deepseek_v32"])
@pytest.mark.parametrize("preset", ["k4v2", "k2v2", "k8v8", "k4v2-r8"])
def test_nbytes_equals_the_bytes_actually_held(model_type, preset):
    cache = KVarNCache(_config(model_type), preset)
    config = cache.config
    layer = cache.layers[0]
    _fill(layer, 700, batch=2, step=97)
    stored = []
    for stream in layer.streams:
        view = stream.view()
        stored += [view.sink, view.tail, *(view.tiles.parts() if view.tiles is not None else ())]
    if hasattr(layer, "indexer"):
        stored.append(layer.indexer.full())
    held = sum(t.numel() * t.element_size() for t in stored if t is not None)
    assert layer.nbytes() == held
    expected = sum(_expected_stream_bytes(s, 700, 2, config) for s in layer.specs)  # (no indexer keys written)
    assert layer.nbytes() == expected
    assert layer.allocated_nbytes() >= layer.nbytes()
    assert cache.nbytes() == sum(layer.nbytes() for layer in cache.layers)


@pytest.mark.parametrize("model_type, bound", [("mla-512+64", 0.37), ("gqa-128", 0.24)])
def test_k4v2_byte_ratio_after_4096_tokens(model_type, bound):
    """The tile layout's promise, sink included: <= 0.37 of bf16 at 512 + 64, <= 0.24 at dense head_dim 128."""
    cache = KVarNCache(_config(model_type), "k4v2")
    _fill(cache.layers[0], 4096, step=1024)
    ratio = cache.nbytes() / cache.dense_nbytes()
    assert ratio <= bound, f"{model_type}: {ratio:.4f} of the 16-bit bytes"
    # And the exact layout arithmetic: 402 B/token (MLA) and 108 B/token/kv-head (dense) per quantized tile token.
    spec = cache.layers[0].specs
    per_token = sum(s.tile_nbytes() * s.num_heads for s in spec if s.bits < 16) / 128
    per_token += sum(s.num_heads * s.dim * 2 for s in spec if s.bits == 16)
    assert per_token == {"mla-512+64": 402, "gqa-128": 108 * 2}[model_type]


def test_tiles_quantize_once_when_full_and_the_tail_stays_exact():
    cache = KVarNCache(_config("llama"), KVarNConfig(tile_size=64, sink_tokens=64))
    layer = cache.layers[0]
    x = torch.randn(1, 2, 200, 16)
    layer.update(x, x.clone())
    keys = layer.streams[0]
    assert (keys.sink_length, keys.num_tiles, keys.tail_length) == (64, 0, 136)  # quantization waits for flush
    layer.flush()
    assert (keys.sink_length, keys.num_tiles, keys.tail_length) == (64, 2, 8)
    assert torch.equal(keys.view().sink, x[:, :, :64]) and torch.equal(keys.view().tail, x[:, :, 192:])
    codes = keys.tiles.codes.clone()
    layer.flush()
    layer.update(torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16))
    layer.flush()
    assert keys.num_tiles == 2 and torch.equal(keys.tiles.codes, codes)  # never re-quantized
    assert layer.get_seq_length() == 210 and layer.get_mask_sizes(3) == (213, 0)


def test_storage_grows_into_spare_capacity_without_recopying():
    store = GrowableTensor()
    pointers = set()
    for _ in range(1000):
        store.append(torch.ones(1, 1, 1, 8))
        pointers.add(store.data.data_ptr())
    assert store.length == 1000 and torch.equal(store.data, torch.ones(1, 1, 1000, 8))
    assert len(pointers) < 40  # ~log_1.25(1000) reallocations, not one per append
    assert store.allocated_nbytes() <= 1.25 * store.nbytes() + 64


@pytest.mark.parametrize("bad", ["nan", "inf", "shape", "dtype", "batch", "rank"])
def test_bad_input_raises_and_leaves_the_cache_unchanged(bad):
    cache = KVarNCache(_config("deepseek_v3"), KVarNConfig(tile_size=64, sink_tokens=64))
    layer = cache.layers[0]
    _fill(layer, 150, batch=2, dtype=torch.float32)
    before = [s.dequantized().clone() for s in layer.streams]
    size = layer.nbytes()
    latent, rope = torch.randn(2, 1, 3, 32), torch.randn(2, 1, 3, 8)
    if bad == "nan":
        latent[1, 0, 2, 5] = float("nan")
    elif bad == "inf":
        rope[0, 0, 0, 0] = float("inf")
    elif bad == "shape":
        latent = torch.randn(2, 1, 3, 31)
    elif bad == "dtype":
        latent, rope = latent.half(), rope.half()
    elif bad == "batch":
        latent, rope = torch.randn(3, 1, 3, 32), torch.randn(3, 1, 3, 8)
    else:
        latent = torch.randn(2, 3, 32)
    message = {"nan": "NaN or Inf", "inf": "NaN or Inf", "shape": r"\(2, 1, 3, 31\) do not fit",
               "dtype": "dtype=torch.float16", "batch": "batch=3", "rank": "4D tensor"}[bad]
    with pytest.raises(ValueError, match=message):
        layer.update(latent, rope)
    after = [s.dequantized() for s in layer.streams]
    assert layer.nbytes() == size and layer.get_seq_length() == 150
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_fp16_metadata_overflow_is_refused_without_changing_the_cache():
    cache = KVarNCache(_config("llama"), KVarNConfig(tile_size=64, sink_tokens=0))
    layer = cache.layers[0]
    layer.update(torch.full((1, 2, 64, 16), 1e12), torch.randn(1, 2, 64, 16))  # past what fp16 scales can hold
    with pytest.raises(ValueError, match="too large for the tile scales.*key_bits=16"):
        layer.flush()
    assert layer.streams[0].num_tiles == 0 and layer.streams[0].tail_length == 64
    assert layer.streams[1].num_tiles == 0


@pytest.mark.parametrize("sink", [64, 0])
@pytest.mark.parametrize("keep", [180, 150, 130, 128, 100, 64, 30, 0])
def test_crop_to_any_length(keep, sink):
    config = KVarNConfig(tile_size=64, sink_tokens=sink)
    cache = KVarNCache(_config("deepseek_v3"), config)
    layer = cache.layers[0]
    _fill(layer, 200, batch=2, dtype=torch.float32)  # sink 64 | tiles 64..192 | tail 192..200 (or tiles from 0)
    before = layer.streams[0].dequantized()
    cache.crop(keep - 200)
    assert layer.get_seq_length() == keep
    if keep:
        after = layer.streams[0].dequantized()
        assert after.shape[2] == keep
        assert torch.allclose(after, before[:, :, :keep], atol=1e-6)  # a cut tile comes back dequantized, as it was
    # The cache keeps working: refill past the cut, tiles quantize again when full.
    _fill(layer, 100, batch=2, dtype=torch.float32, seed=1)
    stream = layer.streams[0]
    assert layer.get_seq_length() == keep + 100 == stream.length
    assert stream.tail_length < 64 or stream.sink_length < 64
    with pytest.raises(ValueError, match="negative number"):
        cache.crop(5)


def test_reorder_select_repeat_and_reset():
    config = KVarNConfig(tile_size=64, sink_tokens=64)
    cache = KVarNCache(_config("llama"), config)
    for layer in cache.layers:
        _fill(layer, 150, batch=3, dtype=torch.float32)
    full = [layer.streams[1].dequantized() for layer in cache.layers]
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for layer, before in zip(cache.layers, full):
        assert torch.equal(layer.streams[1].dequantized(), before[beam_idx])
    cache.batch_select_indices(torch.tensor([0, 2]))
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].streams[0].dequantized().shape[0] == 4
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    _fill(cache.layers[0], 10, batch=5, dtype=torch.float32)  # a reset cache takes a new batch size
    assert cache.get_seq_length() == 10


def test_indexed_layer_keeps_indexer_keys_and_crops_them():
    cache = KVarNCache(_config("deepseek_v32"), KVarNConfig(tile_size=64, sink_tokens=64))
    layer = cache.layers[0]
    assert isinstance(layer, kvarn_mla.KVarNIndexedLayer)
    keys = [torch.randn(2, n, 16) for n in (100, 1, 1)]
    for k in keys:
        _fill(layer, k.shape[1], batch=2, dtype=torch.float32)
        out = cache.update_indexer(k, 0)
    assert torch.equal(out, torch.cat(keys, 1))
    cache.crop(-2)
    assert layer.indexer.length == 100 == layer.get_seq_length()
    # layer 0 only: batch x tokens x (latent + rope + indexer) x 4 bytes (a float32 cache)
    assert cache.dense_nbytes() == 2 * 100 * (32 + 8 + 16) * 4
    with pytest.raises(ValueError, match=r"indexer keys must be \[B, S, 16\]"):
        cache.update_indexer(torch.randn(2, 1, 15), 0)


def test_sliding_window_layers_stay_unquantized():
    cache = KVarNCache(_config("mistral", sliding_window=256, layer_types=["full_attention", "sliding_attention"]))
    assert isinstance(cache.layers[0], kvarn_mla.KVarNLayer)
    assert type(cache.layers[1]).__name__ == "DynamicSlidingWindowLayer"


def test_fake_quantize_matches_the_cache_and_keeps_sink_and_tail():
    x = torch.randn(2, 3, 300, 40)
    out = kvarn_mla.fake_quantize(x, 4, "channel", tile_size=64, sink_tokens=64)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out[:, :, :64], x[:, :, :64]) and torch.equal(out[:, :, 256:], x[:, :, 256:])
    cache = KVarNCache(_config("llama"), KVarNConfig(key_bits=4, tile_size=64, sink_tokens=64))
    stream = cache.layers[0].streams[0]
    stream.append(x[:1, :2, :, :16])
    cache.flush()
    ref = kvarn_mla.fake_quantize(x[:1, :2, :, :16], 4, "channel", tile_size=64, sink_tokens=64)
    assert torch.equal(stream.dequantized(), ref)
    assert torch.equal(kvarn_mla.fake_quantize(x, 16, "token"), x)
    with pytest.raises(ValueError, match="NaN or Inf"):
        kvarn_mla.fake_quantize(torch.tensor([[float("nan")] * 4] * 4), 4, "token")
    with pytest.raises(ValueError, match=r"bits must be one of"):
        kvarn_mla.fake_quantize(x, 5, "token")
    with pytest.raises(ValueError, match="unknown"):
        kvarn_mla.fake_quantize(x, 4, "token", value_bits=2)
    with pytest.raises(ValueError, match="axis"):
        kvarn_mla.fake_quantize(x, 4, "head")


def test_packed_width_of_every_bit_width():
    assert [packed_width(128, b) for b in (2, 3, 4, 8)] == [32, 48, 64, 128]
    assert packed_width(72, 3) == 27


def test_flush_groups_tiles_by_device(monkeypatch):
    """Layers placed on different devices (accelerate's ``device_map``) are quantized one store call per device and
    stream slot: a call never concatenates tensors of two devices.

    Torch has one CPU device (``cpu:1`` is ``cpu``), so the placement is faked: the streams of layers 2 and 3 report
    another device. The check is that of a real placement: the store receives per-device groups, and the stored
    tiles are those of the ordinary all-layers-at-once flush.
    """
    from kvarn_mla.backends import Backend, resolve_backend
    from kvarn_mla.store import Stream

    config = KVarNConfig(tile_size=64, sink_tokens=64, backend="torch")
    expected, placed = (KVarNCache(_config("llama", num_hidden_layers=4), config) for _ in range(2))
    for cache in (expected, placed):
        for index, layer in enumerate(cache.layers):
            gen = torch.Generator().manual_seed(index)
            layer.update(*(torch.randn(1, s.num_heads, 200, s.dim, generator=gen) for s in layer.specs))
    expected.flush()

    second = {id(stream) for layer in placed.layers[2:] for stream in layer.streams}
    monkeypatch.setattr(Stream, "device", property(
        lambda self: torch.device("cpu", 1) if id(self) in second else torch.device("cpu", 0)))
    calls, reference = [], resolve_backend("torch", "cpu")

    def store(x, scheme, token_valid):
        calls.append((scheme.axis, x.shape[0]))
        return reference.store(x, scheme, token_valid)

    for layer in placed.layers:
        layer.backend = Backend("recording", store, reference.attend)
    placed.flush()
    tiles_per_layer = 2 * placed.layers[0].specs[0].num_heads  # (200 - 64) // 64 tiles of each kv head
    assert calls == [("channel", 2 * tiles_per_layer)] * 2 + [("token", 2 * tiles_per_layer)] * 2
    for a, b in zip(expected.layers, placed.layers):
        for x, y in zip(a.streams, b.streams):
            assert all(torch.equal(p, q) for p, q in zip(x.tiles.parts(), y.tiles.parts()))
