"""`KVarNConfig` validation and the presets."""

from __future__ import annotations

import pytest

from kvarn_mla import PRESETS, KVarNConfig, TileScheme, resolve_config


def test_defaults_are_the_published_setting():
    config = KVarNConfig()
    assert (config.key_bits, config.value_bits, config.latent_bits, config.rope_bits) == (4, 2, 4, 16)
    assert (config.tile_size, config.sink_tokens, config.varnorm_iters, config.hadamard) == (128, 128, 8, True)
    assert PRESETS["k4v2"] == config and resolve_config(None) == config


def test_presets_cover_the_required_settings():
    assert PRESETS["k8v8"].key_bits == PRESETS["k8v8"].value_bits == PRESETS["k8v8"].latent_bits == 8
    assert PRESETS["k8v8"].rope_bits == 8
    assert PRESETS["k2v2"].key_bits == PRESETS["k2v2"].value_bits == PRESETS["k2v2"].latent_bits == 2
    assert PRESETS["k4v2-r8"].rope_bits == 8 and PRESETS["k4v2-r8"].latent_bits == 4
    assert PRESETS["kivi-k2v2"].method == "rtn" and PRESETS["rot-k2v2"].method == "rotation"
    assert PRESETS["k4v2"].method == "kvarn"
    for name, preset in PRESETS.items():
        if name.startswith(("kivi-", "rot-")):
            base = PRESETS[name.split("-", 1)[1]]
            assert preset.replace(hadamard=base.hadamard, varnorm_iters=base.varnorm_iters) == base


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("key_bits", 5, r"key_bits must be one of \(2, 3, 4, 8, 16\).*got 5"),
        ("value_bits", 1, "value_bits must be one of"),
        ("latent_bits", True, "latent_bits must be one of"),
        ("key_bits", 4.0, r"key_bits must be one of .*got 4\.0 \(float\)"),
        ("tile_size", 128.0, r"tile_size must be one of \(64, 128\), got 128\.0"),
        ("key_varnorm_iters", -1, r"key_varnorm_iters must be an integer in \[0, 64\], got -1"),
        ("value_varnorm_iters", True, "value_varnorm_iters must be an integer in"),
        ("rope_bits", 32, "rope_bits must be one of"),
        ("tile_size", 96, r"tile_size must be one of \(64, 128\), got 96"),
        ("sink_tokens", -1, "sink_tokens must be an integer >= 0, got -1"),
        ("varnorm_iters", 100, r"varnorm_iters must be an integer in \[0, 64\], got 100"),
        ("hadamard", 1, "hadamard must be True or False, got 1"),
        ("backend", "cuda", r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"),
    ],
)
def test_invalid_fields_name_the_value_and_the_allowed_ones(field, value, message):
    with pytest.raises(ValueError, match=message):
        KVarNConfig(**{field: value})


def test_config_is_frozen_and_replace_validates():
    config = KVarNConfig()
    with pytest.raises(AttributeError):
        config.key_bits = 2
    assert config.replace(tile_size=64).tile_size == 64
    with pytest.raises(ValueError, match="tile_size"):
        config.replace(tile_size=32)
    with pytest.raises(ValueError, match=r"unknown KVarNConfig fields \['bits'\]"):
        config.replace(bits=4)


def test_resolve_config_errors():
    with pytest.raises(ValueError, match=r"unknown preset 'k5v5'; available presets: \["):
        resolve_config("k5v5")
    with pytest.raises(TypeError, match="KVarNConfig or a preset name"):
        resolve_config(4)
    assert resolve_config("k2v2", tile_size=64) == PRESETS["k2v2"].replace(tile_size=64)


def test_schemes_per_stream():
    config = KVarNConfig(key_bits=3, value_bits=2, latent_bits=4, rope_bits=8, value_varnorm_iters=2)
    key, value, latent, rope = (config.scheme(s) for s in ("key", "value", "latent", "rope"))
    assert (key.bits, key.axis, key.varnorm_iters) == (3, "channel", 8)
    assert (value.bits, value.axis, value.varnorm_iters) == (2, "token", 2)
    assert (latent.bits, latent.axis, rope.bits, rope.axis) == (4, "channel", 8, "channel")
    assert {s.tile_size for s in (key, value, latent, rope)} == {128} and key.hadamard
    vn = PRESETS["kvarn-vn-k4v2"]  # keys and the MLA streams rotation-only, values KVarN
    assert [vn.scheme(s).varnorm_iters for s in ("key", "value", "latent", "rope")] == [0, 8, 0, 0]
    assert vn.method == "rotation/kvarn" and vn.replace(key_varnorm_iters=None) == PRESETS["k4v2"]
    assert TileScheme(4, "token").tile_nbytes(128) == 128 * 64 + 2 * (2 * 128 + 128)
    with pytest.raises(ValueError, match="axis must be one of"):
        TileScheme(4, "head")
