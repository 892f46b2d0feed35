"""Pinned digests of what every preset stores for one fixed input, on both backends.

A change that moves any stored code, scale, zero point or gamma of any preset by one bit fails here. The digests
were recorded before the backend table / tile scheme refactor and must never change unless the stored format
changes on purpose (then record them again and say why in the commit).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from conftest import DEVICE, TINY_CONFIGS
from transformers import AutoConfig

from kvarn_mla import PRESETS, KVarNCache, KVarNConfig
from kvarn_mla.backends import BACKENDS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKENS = 128 + 128 + 5  # sink, one tile, a partial tail


def _input(heads: int, dim: int, seed: int) -> torch.Tensor:
    """``[2, heads, TOKENS, dim]`` float32 with heavy-tailed token norms and a few outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, heads, TOKENS, dim, generator=gen) * torch.exp(torch.randn(2, heads, TOKENS, 1, generator=gen))
    x[..., torch.randperm(dim, generator=gen)[:2]] *= 8.0
    return x


def stored_tiles(model_type: str, config: KVarNConfig, **overrides) -> list[list[torch.Tensor]]:
    """Every stored tile tensor (codes, scale, zero, gamma) of each stream slot of a one-layer tiny model's cache,
    after one update of `_input` tokens and one flush (padding in row 1); an empty list for a 16-bit slot."""
    model_config = AutoConfig.for_model(model_type, **dict(TINY_CONFIGS[model_type], num_hidden_layers=1, **overrides))
    cache = KVarNCache(model_config, config)
    valid = torch.ones(2, TOKENS, dtype=torch.bool)
    valid[1, :140] = False  # row 1 is left-padded into the first tile
    layer = cache.layers[0]
    layer.update(*(_input(spec.num_heads, spec.dim, seed=slot).to(DEVICE) for slot, spec in enumerate(layer.specs)))
    cache.flush(valid.to(DEVICE))
    return [list(stream.tiles.parts()) if stream.spec.bits < 16 else [] for stream in layer.streams]


def stored_digest(model_type: str, preset: str, backend: str) -> str:
    """SHA-256 (first 16 hex digits) of `stored_tiles` for a preset on a backend."""
    digest = hashlib.sha256()
    for slot in stored_tiles(model_type, PRESETS[preset].replace(backend=backend)):
        for part in slot:
            digest.update(part.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


PINNED = {
    ('k2v2', 'llama'): '8774601b6e5c253b',
    ('k2v2', 'deepseek_v3'): '45a7a6ce751a58d8',
    ('k4v2', 'llama'): '9aa5b8ff93b72986',
    ('k4v2', 'deepseek_v3'): 'f00b355652412f28',
    ('k4v2-r8', 'llama'): '9aa5b8ff93b72986',
    ('k4v2-r8', 'deepseek_v3'): 'ddebf7024ae41849',
    ('k4v4', 'llama'): '05a9e60d1aa4a023',
    ('k4v4', 'deepseek_v3'): 'f00b355652412f28',
    ('k8v8', 'llama'): 'c4683d7d0f2f5d43',
    ('k8v8', 'deepseek_v3'): '9ad5eaabdf9540f6',
    ('kivi-k2v2', 'llama'): '1260e9322b662d33',
    ('kivi-k2v2', 'deepseek_v3'): '2218380ea225401a',
    ('kivi-k4v2', 'llama'): 'e1268645fc82eb99',
    ('kivi-k4v2', 'deepseek_v3'): '314123c0e9162473',
    ('kvarn-vn-k4v2', 'llama'): 'af3ccc97bb345450',  # recorded with the preset; keys are rot-k4v2's (below)
    ('kvarn-vn-k4v2', 'deepseek_v3'): 'be8b8c8c36348c3b',
    ('rot-k2v2', 'llama'): '4d03338b84448811',
    ('rot-k2v2', 'deepseek_v3'): '18a5d219f4e6ec19',
    ('rot-k4v2', 'llama'): 'b768e3f73aa0e9e3',
    ('rot-k4v2', 'deepseek_v3'): 'be8b8c8c36348c3b',
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_stored_tiles_match_the_pinned_digest(preset, model_type, backend):
    assert stored_digest(model_type, preset, backend) == PINNED[preset, model_type]


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", dict(num_key_value_heads=4)),  # MHA
    ("llama", {}),  # GQA
    ("deepseek_v3", {}),  # MLA: the latent follows the keys
])
def test_kvarn_vn_stores_keys_as_rotation_only_and_values_as_kvarn(model_type, overrides):
    keys_and_latent, values = stored_tiles(model_type, PRESETS["kvarn-vn-k4v2"], **overrides)
    rotation_keys = stored_tiles(model_type, PRESETS["rot-k4v2"], **overrides)[0]
    kvarn_values = stored_tiles(model_type, PRESETS["k4v2"], **overrides)[1]
    kvarn_keys = stored_tiles(model_type, PRESETS["k4v2"], **overrides)[0]
    assert all(torch.equal(a, b) for a, b in zip(keys_and_latent, rotation_keys, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(values, kvarn_values, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(keys_and_latent, kvarn_keys))  # the keys really differ
