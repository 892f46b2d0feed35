"""Model-based tests: random sequences of cache operations on a `KVarNCache`, checked against transformers'
`DynamicCache` after every step — exactly when nothing is quantized, within a bound with 8-bit tiles — for MHA,
GQA and MLA; and property tests of the quantizer (any shape, dtype, bits, axis)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, TINY_CONFIGS, sqnr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import AutoConfig, DynamicCache

from kvarn_mla import KVarNCache, KVarNConfig, TileScheme
from kvarn_mla.kernels.store import store_tiles
from kvarn_mla.quant import dequantize_tile, quantize_tile, store_tiles_reference, unpack

FAMILIES = {"mha": ("llama", dict(num_key_value_heads=4)), "gqa": ("llama", {}), "mla": ("deepseek_v3", {})}
EXACT = KVarNConfig(key_bits=8, value_bits=8, latent_bits=8, rope_bits=8, sink_tokens=100_000)  # nothing quantized
EIGHT_BIT = KVarNConfig(key_bits=8, value_bits=8, latent_bits=8, rope_bits=8, tile_size=64, sink_tokens=64)
EIGHT_BIT_SQNR_DB = 35  # 8-bit tiles of Gaussian tokens reconstruct at about 45 dB


class CacheMachine(RuleBasedStateMachine):
    """Drives a KVarNCache and a DynamicCache through the same operations (what generate, beam search, assisted
    decoding and batch pruning do to a cache), then compares what each holds."""

    family: str = "gqa"
    config: KVarNConfig = EXACT

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed: int) -> None:
        model_type, overrides = FAMILIES[self.family]
        model_config = AutoConfig.for_model(model_type, **dict(TINY_CONFIGS[model_type], **overrides))
        self.kvarn = KVarNCache(model_config, self.config)
        self.dynamic = DynamicCache(config=model_config)
        self.specs = self.kvarn.layers[0].specs
        self.batch = 2
        self.gen = torch.Generator().manual_seed(seed)

    def _append(self, tokens: int) -> None:
        for index, layer in enumerate(self.kvarn.layers):
            pair = [torch.randn(self.batch, s.num_heads, tokens, s.dim, generator=self.gen).to(DEVICE)
                    for s in self.specs]
            layer.update(*pair)
            self.dynamic.update(*pair, index)
        self.kvarn.flush()  # what the patched decoder does after each forward pass

    @rule(tokens=st.integers(2, 90))
    def prefill_chunk(self, tokens: int) -> None:
        self._append(tokens)

    @rule()
    def decode_step(self) -> None:
        self._append(1)

    @precondition(lambda self: self.dynamic.get_seq_length() > 0)
    @rule(remove=st.integers(1, 200))
    def crop(self, remove: int) -> None:
        remove = min(remove, self.dynamic.get_seq_length())
        self.kvarn.crop(-remove)
        self.dynamic.crop(-remove)

    @precondition(lambda self: self.dynamic.get_seq_length() > 0)
    @rule(data=st.data())
    def reorder(self, data) -> None:
        beams = torch.tensor(data.draw(st.lists(st.integers(0, self.batch - 1), min_size=self.batch,
                                                max_size=self.batch)), device=DEVICE)
        self.kvarn.reorder_cache(beams)
        self.dynamic.reorder_cache(beams)

    @precondition(lambda self: self.dynamic.get_seq_length() > 0 and self.batch > 1)
    @rule(data=st.data())
    def select_batch(self, data) -> None:
        keep = sorted(data.draw(st.sets(st.integers(0, self.batch - 1), min_size=1, max_size=self.batch - 1)))
        self.kvarn.batch_select_indices(torch.tensor(keep, device=DEVICE))
        self.dynamic.batch_select_indices(torch.tensor(keep, device=DEVICE))
        self.batch = len(keep)

    @precondition(lambda self: self.dynamic.get_seq_length() > 0 and self.batch <= 2)
    @rule()
    def repeat_batch(self) -> None:
        self.kvarn.batch_repeat_interleave(2)
        self.dynamic.batch_repeat_interleave(2)
        self.batch *= 2

    @rule()
    def reset(self) -> None:
        self.kvarn.reset()
        self.dynamic.reset()
        self.batch = 2

    @invariant()
    def same_tokens(self) -> None:
        length = self.dynamic.get_seq_length()
        assert self.kvarn.get_seq_length() == length
        for ours, theirs in zip(self.kvarn.layers, self.dynamic.layers):
            if length == 0:
                assert ours.keys is None and ours.values is None
                continue
            for got, expected in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                assert got.shape == expected.shape
                if self.config is EXACT:
                    assert torch.equal(got, expected)
                else:
                    assert sqnr(expected, got) > EIGHT_BIT_SQNR_DB


def _machine(family: str, config: KVarNConfig):
    machine = type(f"{family.upper()}{'Exact' if config is EXACT else 'EightBit'}Machine", (CacheMachine,),
                   dict(family=family, config=config))
    machine.TestCase.settings = settings(max_examples=12, stateful_step_count=10, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
    return machine.TestCase


TestMHAExact = _machine("mha", EXACT)
TestGQAExact = _machine("gqa", EXACT)
TestMLAExact = _machine("mla", EXACT)
TestMHAEightBit = _machine("mha", EIGHT_BIT)
TestGQAEightBit = _machine("gqa", EIGHT_BIT)
TestMLAEightBit = _machine("mla", EIGHT_BIT)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tiles=st.integers(1, 3), size=st.sampled_from([64, 128]), dim=st.integers(1, 12).map(lambda k: 8 * k),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), bits=st.sampled_from([2, 3, 4, 8]),
    axis=st.sampled_from(["channel", "token"]), iters=st.integers(0, 8), hadamard=st.booleans(),
    scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16),
)
def test_quantizer_properties(tiles, size, dim, dtype, bits, axis, iters, hadamard, scale, seed):
    """Any shape, dtype, bits and axis (finite inputs): the kernel (in the interpreter) stores exactly the reference's
    codes and scales, every code is below 2^bits, and the dequantized tile is within half an RTN step of the input
    in the normalized domain."""
    gen = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(tiles, size, dim, generator=gen) * torch.exp(torch.randn(tiles, size, 1, generator=gen)))
    # Inputs the dtype can hold: at scale ~1e3 the heavy tail passes fp16's 65504 and would cast to inf, which the
    # cache rejects before any store (tests/test_cache.py); the kernel's contract is finite tiles.
    limit = torch.finfo(dtype).max
    x = x.clamp(-limit, limit).to(dtype)
    scheme = TileScheme(bits, axis, tile_size=size, varnorm_iters=iters, hadamard=hadamard)
    reference = store_tiles_reference(x, scheme)
    kernel = store_tiles(x.to(DEVICE), scheme)
    for a, b in zip(kernel.parts(), reference.parts()):
        assert torch.equal(a.cpu(), b)
    assert int(unpack(reference.codes, bits, dim).max()) < 2**bits
    exact = quantize_tile(x, scheme)  # float32 metadata: the bound holds before fp16 rounding
    restored = dequantize_tile(exact, scheme, dim)
    step = exact.scale.abs().amax(-1) if axis == "channel" else exact.scale.abs()
    bound = step.unsqueeze(-1).unsqueeze(-1) if axis == "channel" else step.unsqueeze(-1)
    gamma = exact.gamma.abs().amax(-1).view(-1, 1, 1)
    # |x - x̂| per element <= (step of its row / 2) * gamma of its column, in the rotated basis; the rotation is
    # orthonormal, so the per-token L2 error is bounded by that times sqrt(D).
    per_token = (restored - x.float()).norm(dim=-1)
    assert (per_token <= 0.5 * (bound * gamma).amax(dim=(-1, -2), keepdim=True).squeeze(-1) * dim**0.5 * 1.01
            + 1e-3 * scale).all()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_machine_families_are_real(family):
    """The machines above run the families they say: MHA (kv heads = heads), GQA, MLA (latent + RoPE key)."""
    model_type, overrides = FAMILIES[family]
    cache = KVarNCache(AutoConfig.for_model(model_type, **dict(TINY_CONFIGS[model_type], **overrides)), EXACT)
    names = [s.name for s in cache.layers[0].specs]
    heads = cache.layers[0].specs[0].num_heads
    assert names == (["latent", "rope"] if family == "mla" else ["key", "value"])
    assert family == "mla" or (heads == 4) == (family == "mha")
