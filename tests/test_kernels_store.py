"""The Triton store kernel against its torch reference: codes, packing and scales identical."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from kvarn_mla.config import TileScheme
from kvarn_mla.kernels.store import store_tiles
from kvarn_mla.quant import store_tiles_reference

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tiles(num: int, size: int, dim: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num, size, dim, generator=gen) * torch.exp(torch.randn(num, size, 1, generator=gen))
    x[..., torch.randperm(dim, generator=gen)[:3]] *= 10.0  # outlier channels
    return x.to(dtype)


def _assert_identical(x, bits, axis, token_valid=None, **fields):
    x = x.to(DEVICE)
    scheme = TileScheme(bits, axis, tile_size=x.shape[1], **fields)
    token_valid = None if token_valid is None else token_valid.to(DEVICE)
    kernel = store_tiles(x, scheme, token_valid)
    reference = store_tiles_reference(x, scheme, token_valid)
    for name, a, b in zip(("codes", "scale", "zero", "gamma"), kernel.parts(), reference.parts()):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [64, 96])  # 96: block-diagonal Hadamard with 32-wide blocks
def test_store_matches_reference_tile_64(axis, bits, dim):
    _assert_identical(_tiles(3, 64, dim, seed=bits), bits, axis)


@pytest.mark.parametrize("axis, bits, dim, dtype", [
    ("channel", 4, 512, torch.bfloat16),  # the MLA latent: the tile is streamed, never held in registers
    ("channel", 2, 512, torch.float16),
    ("channel", 4, 128, torch.float16),
    ("token", 2, 128, torch.bfloat16),
    ("token", 3, 128, torch.float32),
    ("channel", 8, 64, torch.bfloat16),  # the MLA RoPE key
])
def test_store_matches_reference_tile_128(axis, bits, dim, dtype):
    _assert_identical(_tiles(2, 128, dim, dtype), bits, axis)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_store_with_padding_and_baselines(axis):
    x = _tiles(4, 64, 64, seed=7)
    valid = torch.ones(4, 64, dtype=torch.bool)
    valid[0, :17] = False
    valid[2, :] = False  # a tile of padding only
    _assert_identical(x, 4, axis, token_valid=valid)
    _assert_identical(x, 2, axis, varnorm_iters=0, hadamard=False)  # KIVI-style
    _assert_identical(x, 2, axis, varnorm_iters=0, hadamard=True)  # rotation only
    _assert_identical(x, 3, axis, varnorm_iters=16)


def test_store_degenerate_tiles():
    # The last two have every std below the clamp: the normalization rescales them uniformly, which leaves the
    # imbalance unchanged up to rounding, and both implementations must still pick the same iterate.
    x = torch.stack([torch.zeros(64, 64), torch.full((64, 64), 3.5), 3.5 + 1e-4 * torch.randn(64, 64),
                     1e-5 * torch.randn(64, 64), 1e-4 * torch.randn(64, 64)])
    for axis in ("channel", "token"):
        _assert_identical(x, 4, axis)
        assert torch.isfinite(store_tiles(x.to(DEVICE), TileScheme(4, axis, tile_size=64)).scale.float()).all()


def test_store_rejects_bad_input():
    scheme = TileScheme(4, "token", tile_size=64)
    with pytest.raises(ValueError, match="scheme.bits must be one of"):
        store_tiles(torch.randn(1, 64, 64, device=DEVICE), TileScheme(16, "channel", tile_size=64))
    with pytest.raises(ValueError, match=r"\[N, 64, D\]"):
        store_tiles(torch.randn(64, 64, device=DEVICE), scheme)
    with pytest.raises(ValueError, match=r"\[N, 128, D\]"):
        store_tiles(torch.randn(1, 64, 64, device=DEVICE), TileScheme(4, "token"))
    empty = store_tiles(torch.randn(0, 64, 64, device=DEVICE), scheme)
    assert empty.codes.shape == (0, 64, 32)
