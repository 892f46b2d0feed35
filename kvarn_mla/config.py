"""`KVarNConfig`, the one configuration object of kvarn_mla, and the named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

BITS = (2, 3, 4, 8, 16)  # 16 = keep the stream in the model dtype
TILE_SIZES = (64, 128)
BACKENDS = ("auto", "torch", "triton")
MAX_VARNORM_ITERS = 64


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
    hadamard: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("key_bits", "value_bits", "latent_bits", "rope_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in BITS:
                raise ValueError(f"{name} must be one of {BITS} (16 keeps the stream unquantized), got {value!r}")
        if isinstance(self.tile_size, bool) or self.tile_size not in TILE_SIZES:
            raise ValueError(f"tile_size must be one of {TILE_SIZES}, got {self.tile_size!r}")
        if not isinstance(self.sink_tokens, int) or isinstance(self.sink_tokens, bool) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        iters = self.varnorm_iters
        if not isinstance(iters, int) or isinstance(iters, bool) or not 0 <= iters <= MAX_VARNORM_ITERS:
            raise ValueError(f"varnorm_iters must be an integer in [0, {MAX_VARNORM_ITERS}], got {iters!r}")
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"hadamard must be True or False, got {self.hadamard!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    def replace(self, **changes) -> KVarNConfig:
        """A copy with some fields changed (validated like a new config)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown KVarNConfig fields {sorted(unknown)}; allowed: {field_names()}")
        return dataclasses.replace(self, **changes)

    @property
    def method(self) -> str:
        """Which quantizer this is: ``"kvarn"``, ``"rotation"`` (QuaRot-style) or ``"rtn"`` (KIVI-style)."""
        if self.varnorm_iters > 0:
            return "kvarn"
        return "rotation" if self.hadamard else "rtn"


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(KVarNConfig)]


_KIVI = dict(hadamard=False, varnorm_iters=0)
_ROTATION = dict(hadamard=True, varnorm_iters=0)

PRESETS: dict[str, KVarNConfig] = {
    # The published KVarN setting: K 4-bit, V 2-bit; MLA latent 4-bit with the RoPE key kept 16-bit.
    "k4v2": KVarNConfig(),
    "k4v4": KVarNConfig(value_bits=4),
    "k2v2": KVarNConfig(key_bits=2, value_bits=2, latent_bits=2),
    # Sanity preset: everything at 8 bits, the RoPE key included.
    "k8v8": KVarNConfig(key_bits=8, value_bits=8, latent_bits=8, rope_bits=8),
    # MLA with the RoPE key quantized too (8-bit), latent 4-bit.
    "k4v2-r8": KVarNConfig(rope_bits=8),
    # Baselines from the same quantizer: KIVI-style RTN (no rotation, no normalization) and rotation-only.
    "kivi-k4v2": KVarNConfig(**_KIVI),
    "kivi-k2v2": KVarNConfig(key_bits=2, value_bits=2, latent_bits=2, **_KIVI),
    "rot-k4v2": KVarNConfig(**_ROTATION),
    "rot-k2v2": KVarNConfig(key_bits=2, value_bits=2, latent_bits=2, **_ROTATION),
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
