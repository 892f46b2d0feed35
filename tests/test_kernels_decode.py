"""The fused Triton decode kernel against the torch reference, for MHA, GQA and MLA stores."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from kvarn_mla.config import TileScheme
from kvarn_mla.kernels.common import device_capability
from kvarn_mla.kernels.decode import (
    DecodeConfig,
    attend,
    kernel_supports,
    merge_splits,
    plan_tiled_attention,
    tiled_attention,
)
from kvarn_mla.quant import StreamView, store_tiles_reference, tiled_attention_reference
from kvarn_mla.store import Stream, StreamSpec, flush_streams

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
# Max abs error / max abs output. The interpreter computes the kernel's dots in float32 while the torch path keeps
# bfloat16 stores in bfloat16; compiled on CUDA, float32 dots run as TF32 and half-precision stores feed fp16/bf16
# dots (the scaled query is rounded to that precision).
TOLERANCE = ({torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2} if DEVICE.type == "cuda"
             else {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2})


def _spec(name: str, heads: int, dim: int, bits: int, axis: str) -> tuple:
    return name, heads, dim, bits, axis


def _stream(spec: tuple, batch: int, length: int, *, tile=64, sink=64, dtype=torch.float32, seed=0,
            steps=3) -> StreamView:
    """A stream filled in a few appends (prefill + chunks), every full tile flushed."""
    name, heads, dim, bits, axis = spec
    stream = Stream(StreamSpec(name, heads, dim, TileScheme(bits, axis, tile_size=tile, sink_tokens=sink)))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, length, dim, generator=gen)
    x = x * torch.exp(0.5 * torch.randn(batch, heads, length, 1, generator=gen))
    for chunk in torch.tensor_split(x.to(device=DEVICE, dtype=dtype), steps, dim=2):
        stream.append(chunk)
        flush_streams([stream], store_tiles_reference)
    return stream.view()


def _check(q, keys, values, *, q_len=1, kv_start=None, mask=None, num_splits=None, dtype=torch.float32,
           config=None):
    q = q.to(DEVICE)
    kv_start = None if kv_start is None else kv_start.to(DEVICE)
    mask = None if mask is None else mask.to(DEVICE)
    if config is None:
        out = tiled_attention(q, keys, values, 0.25, q_len=q_len, kv_start=kv_start, mask=mask,
                              num_splits=num_splits)
    else:  # the launcher's own plan with other block sizes
        plan = plan_tiled_attention(q, keys, values, 0.25, q_len=q_len, kv_start=kv_start, mask=mask,
                                    num_splits=num_splits, capability=device_capability(q.device), config=config)
        plan.launch.run()
        out = merge_splits(plan.partial, plan.lse, plan.rotated_tiles)
    ref = tiled_attention_reference(q, keys, values, 0.25, q_len=q_len, kv_start=kv_start, mask=mask)
    assert out.shape == ref.shape and out.dtype == torch.float32
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    return out


@pytest.mark.parametrize("kv_heads, group, dim", [(4, 1, 32), (2, 4, 64), (1, 8, 128)])  # MHA, GQA 4, GQA 8
@pytest.mark.parametrize("splits", [1, 3])
def test_dense_decode(kv_heads, group, dim, splits):
    keys = _stream(_spec("key", kv_heads, dim, 4, "channel"), 2, 330)  # sink 64, 4 tiles, partial tail
    values = _stream(_spec("value", kv_heads, dim, 2, "token"), 2, 330, seed=1)
    assert (keys.sink_length, keys.num_tiles, keys.tail_length) == (64, 4, 10)
    _check(torch.randn(2, kv_heads, group, dim), [keys], values, num_splits=splits)


@pytest.mark.parametrize("rope_bits", [16, 8])
@pytest.mark.parametrize("rank, rope", [(512, 64), (64, 16)])
def test_mla_decode(rank, rope, rope_bits):
    latent = _stream(_spec("latent", 1, rank, 4, "channel"), 2, 200)
    rope_key = _stream(_spec("rope", 1, rope, rope_bits, "channel"), 2, 200, seed=2)
    heads = 16
    _check(torch.randn(2, 1, heads, rank + rope), [latent, rope_key], None, num_splits=2)


@pytest.mark.parametrize("v_chunks", [4, 2, 1])  # the whole value in one program, or split over 2 or 4
def test_mla_head_blocks_and_value_split(v_chunks):
    # 40 heads in blocks of 16 (the last one partial), a 128-wide latent in four 32-channel chunks: the paths the
    # DeepSeek shapes (128 heads, 512 + 64) take on a GPU, at a size the interpreter runs quickly.
    latent = _stream(_spec("latent", 1, 128, 4, "channel"), 2, 200)
    rope_key = _stream(_spec("rope", 1, 16, 8, "channel"), 2, 200, seed=2)
    config = DecodeConfig(block_m=16, block_n=32, block_c=32, v_chunks=v_chunks, num_warps=4, num_stages=1)
    _check(torch.randn(2, 1, 40, 144), [latent, rope_key], None, num_splits=2, config=config)


def _random_mask(batch, q_len, length, seed=0):
    # A top-k-like mask: random keys, every query row seeing at least its own position.
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, 1, q_len, length, generator=gen) < 0.3
    mask[..., torch.arange(q_len), torch.arange(length - q_len, length)] = True
    return mask


@pytest.mark.parametrize("family", ["gqa", "mla"])
def test_explicit_mask(family):
    # Any [B, 1, S, T] bool mask (the DSA indexer's top-k, custom masks) is read by the kernel as given.
    if family == "gqa":
        keys = [_stream(_spec("key", 2, 32, 4, "channel"), 2, 260)]
        values = _stream(_spec("value", 2, 32, 2, "token"), 2, 260, seed=1)
        q = torch.randn(2, 2, 4 * 3, 32)
    else:
        keys = [_stream(_spec("latent", 1, 64, 4, "channel"), 2, 260),
                _stream(_spec("rope", 1, 16, 16, "channel"), 2, 260, seed=2)]
        values = None
        q = torch.randn(2, 1, 8 * 3, 80)
    _check(q, keys, values, q_len=3, mask=_random_mask(2, 3, 260), num_splits=2)
    # A mask broadcast over the batch, as a stride-0 view.
    _check(q, keys, values, q_len=3, mask=_random_mask(1, 3, 260).expand(2, 1, 3, 260), num_splits=2)


def test_attend_takes_the_mask_as_given():
    # The backend entry point: a left-padding + causal mask gives what kv_start gives, with no host round trip
    # to find the padding.
    keys = _stream(_spec("key", 2, 32, 4, "channel"), 3, 260)
    values = _stream(_spec("value", 2, 32, 2, "token"), 3, 260, seed=1)
    kv_start = torch.tensor([0, 20, 150], device=DEVICE)
    positions = torch.arange(260, device=DEVICE)
    mask = (positions >= kv_start.view(3, 1, 1, 1)) & (positions <= 260 - 2 + torch.arange(2, device=DEVICE)
                                                        .view(1, 1, 2, 1))
    q = torch.randn(3, 2, 4 * 2, 32, device=DEVICE)
    out = attend(q, [keys], values, 0.25, mask, 2)
    ref = tiled_attention_reference(q, [keys], values, 0.25, q_len=2, kv_start=kv_start)
    assert float((out - ref).abs().max() / ref.abs().max()) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_bit_widths_and_tile_128_without_sink(bits):
    keys = _stream(_spec("key", 2, 32, bits, "channel"), 1, 300, tile=128, sink=0)
    values = _stream(_spec("value", 2, 32, bits, "token"), 1, 300, tile=128, sink=0, seed=4)
    _check(torch.randn(1, 2, 4, 32), [keys], values)


def test_left_padded_batch_and_multi_query_causal():
    keys = _stream(_spec("key", 2, 32, 4, "channel"), 3, 260)
    values = _stream(_spec("value", 2, 32, 2, "token"), 3, 260, seed=1)
    kv_start = torch.tensor([0, 20, 150])  # the last row's padding runs into the tiles
    _check(torch.randn(3, 2, 4, 32), [keys], values, kv_start=kv_start)
    # A chunk of 6 queries per head (prefill chunk / speculative verify), causal over the last 6 positions.
    _check(torch.randn(3, 2, 4 * 6, 32), [keys], values, q_len=6, kv_start=kv_start, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_input_dtypes(dtype):
    keys = _stream(_spec("key", 2, 64, 4, "channel"), 2, 200, dtype=dtype)
    values = _stream(_spec("value", 2, 64, 2, "token"), 2, 200, dtype=dtype, seed=1)
    _check(torch.randn(2, 2, 4, 64).to(dtype), [keys], values, dtype=dtype)


def test_split_merge_is_exact_against_a_single_split():
    latent = _stream(_spec("latent", 1, 64, 4, "channel"), 2, 64 + 64 * 7 + 5)
    rope_key = _stream(_spec("rope", 1, 16, 16, "channel"), 2, 64 + 64 * 7 + 5, seed=2)
    q = torch.randn(2, 1, 8, 80, device=DEVICE)
    one = tiled_attention(q, [latent, rope_key], None, 0.25, num_splits=1)
    for splits in (2, 3, 7):
        many = tiled_attention(q, [latent, rope_key], None, 0.25, num_splits=splits)
        assert (one - many).abs().max() <= 1e-5 * one.abs().max()  # equal up to float32 rounding


def test_merge_of_hand_made_partials():
    # Two splits over disjoint keys: the merge must equal softmax over the union.
    scores = torch.randn(1, 1, 4, 2, 10)  # [B, H, splits (sink, 2 tile splits, tail), M, keys per split]
    values = torch.randn(4, 10, 3)  # per split
    partials = torch.softmax(scores, -1) @ values[None, None]  # normalized per split: [1, 1, 4, 2, 3]
    merged = merge_splits(partials, torch.logsumexp(scores, -1), rotated_tiles=False)
    exact = torch.softmax(scores.transpose(2, 3).flatten(-2), -1) @ values.flatten(0, 1)
    assert torch.allclose(merged, exact, atol=1e-6)


def test_unsupported_combinations_are_refused():
    dense_keys = _stream(_spec("key", 2, 32, 16, "channel"), 1, 100)
    values = _stream(_spec("value", 2, 32, 2, "token"), 1, 100)
    assert not kernel_supports([dense_keys], values)
    with pytest.raises(ValueError, match="quantized channel-axis first key stream"):
        tiled_attention(torch.randn(1, 2, 4, 32, device=DEVICE), [dense_keys], values, 0.25)
