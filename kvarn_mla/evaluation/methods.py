"""The cache methods an evaluation compares: the 16-bit cache, KVarN presets, and transformers' quantized caches.

A method is named by a string:

* the reference — the unpatched model and its ``DynamicCache`` in the model's own dtype, labelled by that dtype:
  ``"fp32"``, ``"bf16"`` or ``"fp16"`` (`reference_label`; any of these names, or ``"reference"``, asks for it, and
  `with_reference_label` gives it the label of the model it runs on; results written before the label followed the
  dtype call a float32 reference ``"bf16"``);
* a KVarN preset, optionally with field overrides: ``"k4v2"``, ``"kivi-k2v2"``, ``"k4v2+latent_bits=2+rope_bits=8"``;
* a quantizer at one bit width for every quantized stream (keys, values, latent; the RoPE key stays 16-bit):
  ``"kvarn-3"``, ``"kivi-2"`` (no rotation, no normalization), ``"rot-4"`` (rotation only), ``"kvarnvn-2"`` (keys
  and the MLA latent rotation-only, values KVarN);
* transformers' own quantized caches on the unpatched model: ``"hf-quanto-2"``, ``"hf-quanto-4"``, ``"hf-hqq-2"``,
  ``"hf-hqq-4"`` (need optimum-quanto / hqq) and ``"hf-fp8"``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from transformers import DynamicCache
from transformers.cache_utils import QuantizedCache
from transformers.utils import is_hqq_available, is_optimum_quanto_available, is_quanto_greater

from ..cache import KVarNCache
from ..config import PRESETS, QUANTIZERS, UNQUANTIZED, KVarNConfig, field_names, resolve_config
from ..patch import patch, unpatch
from ..plan import expected_nbytes

REFERENCE_LABELS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # model dtype -> reference label
REFERENCE_NAMES = ("reference", *REFERENCE_LABELS.values())  # method names that ask for the reference
REFERENCE = "reference"  # the reference before it knows its model's dtype (`with_reference_label` names it)
HF_BACKENDS = {"quanto": (2, 4), "hqq": (2, 4), "fp8": (None,)}
HF_GROUP_SIZE = 64  # transformers' QuantizedCache defaults (q_group_size, residual_length), which the methods keep
HF_RESIDUAL_LENGTH = 128
BASELINES_HINT = "pip install \"kvarn-mla[baselines]\""


@dataclass(frozen=True)
class Method:
    """One way of caching K/V during an evaluation.

    Attributes:
        name: The method string it was parsed from.
        kind: ``"reference"``, ``"kvarn"`` or ``"hf"``.
        config: The KVarN config (kvarn only).
        backend, nbits: transformers' QuantizedCache backend and bits (hf only; fp8 has no bits).
    """

    name: str
    kind: str
    config: KVarNConfig | None = None
    backend: str | None = None
    nbits: int | None = None
    cache_kwargs: dict = field(default_factory=dict, compare=False)

    @contextlib.contextmanager
    def applied(self, model) -> Iterator[None]:
        """Patch the model for the duration (KVarN); the others run on the unpatched model."""
        if self.kind != "kvarn":
            yield
            return
        patch(model, self.config)
        try:
            yield
        finally:
            unpatch(model)

    def new_cache(self, model):
        """A fresh cache for chunked forward calls (inside `applied`)."""
        if self.kind == "kvarn":
            return KVarNCache(model, self.config)
        if self.kind == "hf":
            return QuantizedCache(backend=self.backend, config=model.config.get_text_config(decoder=True),
                                  **self.cache_kwargs)
        return DynamicCache(config=model.config)

    def generate_kwargs(self) -> dict:
        """Extra ``generate`` arguments (inside `applied`)."""
        if self.kind == "hf":
            return dict(cache_implementation="quantized", cache_config=dict(backend=self.backend, **self.cache_kwargs))
        return {}

    def bytes_per_token(self, model_config, tokens: int) -> float | None:
        """Cache bytes per token at ``tokens`` with 16-bit elements wherever the cache keeps full precision (the
        reference, sink and tail), as a bf16 deployment holds them, whatever dtype the evaluation ran in; None if
        unknown.

        transformers' quantized caches are counted by `hf_cache_nbytes`.
        """
        if self.kind == "kvarn":
            return expected_nbytes(model_config, self.config, tokens) / tokens
        if self.kind == "reference":
            return expected_nbytes(model_config, UNQUANTIZED, tokens) / tokens
        return hf_cache_nbytes(model_config, self.backend, self.nbits, tokens) / tokens


def stock_cache_elements(model_config) -> int:
    """Elements per token of one layer's keys plus values as transformers' own caches hold them on the unpatched
    model: what its attention passes to ``cache.update``, the same streams a `KVarNCache` stores (dense: kv heads ×
    head_dim, twice; MLA: the latent and the RoPE key, which the model's attention expands per head on every call)."""
    from ..adapters import layer_specs

    return sum(spec.num_heads * spec.dim for spec in layer_specs(model_config, UNQUANTIZED))


def hf_cache_nbytes(model_config, backend: str, nbits: int | None, tokens: int, element_size: int = 2,
                    residual: float | None = None) -> float:
    """Bytes of transformers' quantized cache (``backend`` quanto, hqq or fp8) over all layers after ``tokens``
    tokens, batch 1, in a 16-bit deployment (``element_size``-byte scales, zero points and residual window).

    * quanto / hqq: ``nbits``-bit codes, one scale and one zero point per group of `HF_GROUP_SIZE` elements, and a
      full-precision residual window that fills to `HF_RESIDUAL_LENGTH` tokens and is then quantized with the rest:
      counted at its mean over a decode, ``(residual_length - 1) / 2`` tokens (its size at a given length depends on
      where the prefill ended), unless ``residual`` gives it.
    * fp8: one byte per element and one float32 scale per tensor.

    Exact when a stream's width is a multiple of the group size (every real model's: 128-wide heads, a 512 latent,
    a 64 RoPE key); quanto pads narrower rows to a group.
    """
    elements = stock_cache_elements(model_config)
    layers = model_config.get_text_config(decoder=True).num_hidden_layers
    if backend == "fp8":
        return layers * (elements * tokens + 2 * 4)
    residual = min(tokens, (HF_RESIDUAL_LENGTH - 1) / 2 if residual is None else residual)
    quantized = tokens - residual
    per_element = nbits / 8 + 2 * element_size / HF_GROUP_SIZE
    return layers * elements * (quantized * per_element + residual * element_size)


def backend_problem(backend: str) -> str | None:
    """Why transformers' quantized cache ``backend`` cannot run here (a package it needs is missing, too old or
    failing to import), or None: the checks transformers makes when the cache is built, made before any run."""
    if backend == "quanto":
        if not is_optimum_quanto_available():
            return f"optimum-quanto is not installed ({BASELINES_HINT})"
        if not is_quanto_greater("0.2.5", accept_dev=True):
            return f"transformers needs optimum-quanto >= 0.2.5 ({BASELINES_HINT})"
        module = "optimum.quanto"
    elif backend == "hqq":
        if not is_hqq_available():
            return f"hqq is not installed ({BASELINES_HINT})"
        module = "hqq.core.quantize"
    else:
        return None
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"{module} does not import ({error}; {BASELINES_HINT})"
    return None


def require_available(methods: list[Method]) -> None:
    """Check up front that every method can run here, so that a run does not fail after others have run.

    Raises:
        ValueError: one line naming each method that cannot run and what it needs.
    """
    problems = {m.name: backend_problem(m.backend) for m in methods if m.kind == "hf"}
    problems = {name: problem for name, problem in problems.items() if problem}
    if problems:
        raise ValueError("cannot run " + "; ".join(f"{name}: {problem}" for name, problem in problems.items()))


def reference_label(dtype) -> str:
    """The reference's label for a model of ``dtype`` (a ``torch.dtype`` or its name): ``"fp32"``, ``"bf16"`` or
    ``"fp16"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in REFERENCE_LABELS:
        raise ValueError(f"no reference label for model dtype {name!r}; allowed dtypes: {list(REFERENCE_LABELS)}")
    return REFERENCE_LABELS[name]


def with_reference_label(methods: list[Method], dtype) -> list[Method]:
    """``methods`` with the reference named after the dtype the model runs in (one reference, first place kept):
    a float32 model's unquantized cache is ``"fp32"``, whatever name asked for it."""
    label, labelled, seen = reference_label(dtype), [], False
    for method in methods:
        if method.kind == "reference":
            if seen:
                continue
            method, seen = Method(label, "reference"), True
        labelled.append(method)
    return labelled


def parse_method(name: str) -> Method:
    """A `Method` from its name (see the module docstring).

    Raises:
        ValueError: unknown preset, backend, bit width or config field (the message lists what is allowed).
    """
    if name in REFERENCE_NAMES:
        return Method(name, "reference")
    if name.startswith("hf-"):
        parts = name.split("-")
        backend = parts[1] if len(parts) > 1 else ""
        if backend not in HF_BACKENDS:
            allowed = [f"hf-{b}" + ("" if n is None else f"-{n}") for b, ns in HF_BACKENDS.items() for n in ns]
            raise ValueError(f"unknown transformers cache backend in {name!r}; allowed: {allowed}")
        nbits = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
        if nbits not in HF_BACKENDS[backend]:
            raise ValueError(f"{name!r}: the {backend} backend takes bits {HF_BACKENDS[backend]}, got {nbits}")
        kwargs = {} if nbits is None else {"nbits": nbits}
        return Method(name, "hf", backend=backend, nbits=nbits, cache_kwargs=kwargs)
    preset, *changes = name.split("+")
    family, _, bits = preset.partition("-")
    if family in QUANTIZERS and bits.isdigit():
        base = KVarNConfig(key_bits=int(bits), value_bits=int(bits), latent_bits=int(bits), **QUANTIZERS[family])
        return Method(name, "kvarn", config=_with_changes(base, changes, name))
    if preset not in PRESETS:
        raise ValueError(f"unknown method {name!r}: use a reference {REFERENCE_NAMES}, a preset {sorted(PRESETS)} "
                         f"(optionally '+field=value' with fields {field_names()}), "
                         f"{' / '.join(f'{q}-B' for q in QUANTIZERS)} with B in (2, 3, 4, 8), or hf-quanto-2/4, "
                         "hf-hqq-2/4, hf-fp8")
    return Method(name, "kvarn", config=_with_changes(resolve_config(preset), changes, name))


def _with_changes(config: KVarNConfig, changes: list[str], name: str) -> KVarNConfig:
    overrides = {}
    for change in changes:
        key, _, value = change.partition("=")
        if key not in field_names() or not value:
            raise ValueError(f"{name!r}: '{change}' is not field=value with a field of {field_names()}")
        overrides[key] = {"True": True, "False": False, "None": None}.get(
            value, int(value) if value.lstrip("-").isdigit() else value)
    return config.replace(**overrides) if overrides else config


def parse_methods(names: str) -> list[Method]:
    """Comma-separated method names -> methods (the reference is always included, first unless named later;
    `with_reference_label` labels it by the model's dtype)."""
    methods = [parse_method(n.strip()) for n in names.split(",") if n.strip()]
    if not any(m.kind == "reference" for m in methods):
        methods.insert(0, parse_method(REFERENCE))
    return methods
