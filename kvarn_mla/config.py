"""`KVarNConfig`, the one configuration object of kvarn_mla, the per-stream `TileScheme` built from it, the presets.

Fields are validated by the checks of `kvarn_mla.quant.scheme`, the same ones `TileScheme` runs; the quantizer, the
kernels and `fake_quantize` receive a validated `TileScheme` and never check its fields again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .backends import BACKEND_NAMES
from .quant.scheme import Axis, TileScheme, check_bits, check_iters, check_layout, quantizer_method

# The quantizers of the evaluation grammar (``kvarn-4``, ``rot-3``, ...) and of the presets, by the config fields
# that make them: the one place where "KIVI-style" and "rotation-only" are defined.
QUANTIZERS: dict[str, dict] = {
    "kvarn": {},
    "kivi": dict(hadamard=False, varnorm_iters=0),
    "rot": dict(hadamard=True, varnorm_iters=0),
    "kvarnvn": dict(key_varnorm_iters=0),  # keys rotation-only, values KVarN
}
# Which config fields make each stream's scheme: (bits field, axis, the role whose normalization it follows).
# The MLA latent and RoPE key are quantized per channel, like keys, and follow the keys' normalization.
STREAMS: dict[str, tuple[str, Axis, str]] = {
    "key": ("key_bits", "channel", "key"),
    "value": ("value_bits", "token", "value"),
    "latent": ("latent_bits", "channel", "key"),
    "rope": ("rope_bits", "channel", "key"),
}


@dataclass(frozen=True)
class KVarNConfig:
    """How a KV cache is quantized. Frozen and validated on construction.

    Dense (MHA/GQA) layers use ``key_bits``/``value_bits``; MLA layers use ``latent_bits`` for the latent
    ``c_kv`` and ``rope_bits`` for the decoupled RoPE key ``k_pe``. A width of 16 keeps that stream in the model
    dtype. Keys and the latent are quantized per channel (over the tokens of a tile), values per token.

    Args:
        key_bits: Bits per dense key element, one of 2, 3, 4, 8, 16.
        value_bits: Bits per dense value element.
        latent_bits: Bits per MLA latent (``c_kv``) element.
        rope_bits: Bits per MLA RoPE-key (``k_pe``) element; 16 keeps it exact, as the published KVarN MLA does.
        tile_size: Tokens per quantized tile (64 or 128); a tile is quantized once, when it fills.
        sink_tokens: The first tokens of a sequence, kept in the model dtype for the whole generation.
        varnorm_iters: Iterations of the dual-axis variance normalization; 0 turns it off.
        key_varnorm_iters: Iterations for keys and the MLA latent and RoPE key; None inherits ``varnorm_iters``.
        value_varnorm_iters: Iterations for dense values; None inherits ``varnorm_iters``.
        hadamard: Rotate channels with the orthonormal Hadamard transform before normalizing.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
    """

    key_bits: int = 4
    value_bits: int = 2
    latent_bits: int = 4
    rope_bits: int = 16
    tile_size: int = 128
    sink_tokens: int = 128
    varnorm_iters: int = 8
    key_varnorm_iters: int | None = None
    value_varnorm_iters: int | None = None
    hadamard: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("key_bits", "value_bits", "latent_bits", "rope_bits"):
            check_bits(name, getattr(self, name))
        check_layout(self.tile_size, self.sink_tokens, self.hadamard)
        check_iters("varnorm_iters", self.varnorm_iters)
        for name in ("key_varnorm_iters", "value_varnorm_iters"):
            if getattr(self, name) is not None:
                check_iters(name, getattr(self, name))
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {self.backend!r}")

    def replace(self, **changes) -> KVarNConfig:
        """A copy with some fields changed (validated like a new config)."""
        unknown = set(changes) - set(field_names())
        if unknown:
            raise ValueError(f"unknown KVarNConfig fields {sorted(unknown)}; allowed: {field_names()}")
        return dataclasses.replace(self, **changes)

    def scheme(self, stream: str) -> TileScheme:
        """The `TileScheme` of a stream: ``"key"``, ``"value"``, ``"latent"`` or ``"rope"``."""
        bits_field, axis, role = STREAMS[stream]
        own = getattr(self, f"{role}_varnorm_iters")
        iters = self.varnorm_iters if own is None else own
        return TileScheme(getattr(self, bits_field), axis, self.tile_size, self.sink_tokens, iters, self.hadamard)

    @property
    def method(self) -> str:
        """``"kvarn"``, ``"rotation"`` or ``"rtn"``; ``"<keys>/<values>"`` (e.g. ``"rotation/kvarn"``) when keys
        and values are quantized differently."""
        key, value = (quantizer_method(self.hadamard, self.scheme(s).varnorm_iters) for s in ("key", "value"))
        return key if key == value else f"{key}/{value}"


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(KVarNConfig)]


UNQUANTIZED = KVarNConfig(key_bits=16, value_bits=16, latent_bits=16, rope_bits=16)  # the 16-bit cache
_K2V2 = dict(key_bits=2, value_bits=2, latent_bits=2)

PRESETS: dict[str, KVarNConfig] = {
    # The published KVarN setting: K 4-bit, V 2-bit; MLA latent 4-bit with the RoPE key kept 16-bit.
    "k4v2": KVarNConfig(),
    "k4v4": KVarNConfig(value_bits=4),
    "k2v2": KVarNConfig(**_K2V2),
    # Sanity preset: everything at 8 bits, the RoPE key included.
    "k8v8": KVarNConfig(key_bits=8, value_bits=8, latent_bits=8, rope_bits=8),
    # MLA with the RoPE key quantized too (8-bit), latent 4-bit.
    "k4v2-r8": KVarNConfig(rope_bits=8),
    # Keys (and the MLA latent) rotation-only, values KVarN: on the dense reference models all of KVarN's loss
    # against rotation-only came from normalizing keys, while normalizing values helped.
    "kvarn-vn-k4v2": KVarNConfig(**QUANTIZERS["kvarnvn"]),
    # Baselines from the same quantizer: KIVI-style RTN (no rotation, no normalization) and rotation-only.
    "kivi-k4v2": KVarNConfig(**QUANTIZERS["kivi"]),
    "kivi-k2v2": KVarNConfig(**_K2V2, **QUANTIZERS["kivi"]),
    "rot-k4v2": KVarNConfig(**QUANTIZERS["rot"]),
    "rot-k2v2": KVarNConfig(**_K2V2, **QUANTIZERS["rot"]),
}
DEFAULT_PRESET = "k4v2"


def resolve_config(config: KVarNConfig | str | None = None, **overrides) -> KVarNConfig:
    """A `KVarNConfig` from a preset name, a config, or None (the default preset), with optional field overrides."""
    if config is None:
        config = DEFAULT_PRESET
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"unknown preset {config!r}; available presets: {sorted(PRESETS)}")
        config = PRESETS[config]
    if not isinstance(config, KVarNConfig):
        raise TypeError(f"expected a KVarNConfig or a preset name, got {type(config).__name__}")
    return config.replace(**overrides) if overrides else config
