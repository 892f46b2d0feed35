"""Capacity planning: how many tokens and sequences fit in a memory budget, per preset, for a model config.

Nothing is allocated: KV bytes come from `expected_nbytes` (what `KVarNCache.nbytes` reports, sink, tail and
tile scales included) and weight bytes from the exact parameter count of the real transformers class, built on the
meta device.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from .adapters import adapter_for, layer_specs
from .cache import QUANTIZED_LAYER_TYPES
from .config import PRESETS, UNQUANTIZED, KVarNConfig, resolve_config
from .store import StreamSpec

# The row every plan starts with: every stream kept in the model dtype, i.e. what an unpatched cache holds.
UNQUANTIZED_NAME = "16-bit"
# Past this many tokens the search stops and calls the context unbounded: the cache stopped growing (every layer
# is a sliding window), which no memory budget can turn into a limit.
MAX_TOKENS = 2**40

_UNITS = {
    "B": 1,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4,
}
_MEMORY = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)")
_ACCEPTED = ("a positive number and a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
             "(powers of 1024), e.g. '80GiB', '1.5TB' or '512 MiB'")


def expected_nbytes(
    model_config: PretrainedConfig,
    config: KVarNConfig | str | None,
    tokens: int,
    batch: int = 1,
    element_size: int = 2,
    kv_heads: int | None = None,
) -> int:
    """Bytes a `KVarNCache` holds after ``tokens`` tokens, computed from the layout (what `KVarNCache.nbytes`
    reports once every full tile is flushed), without building tensors.

    Args:
        model_config: A config of a supported model type.
        config: Preset name or `KVarNConfig`.
        tokens: Context length T.
        batch: Sequences in the batch.
        element_size: Bytes per element of the model dtype (sink, tail, unquantized streams).
        kv_heads: A dense model's kv heads per tensor-parallel rank (`tp_kv_heads`); None: the config's.
    """
    config = resolve_config(config)
    text_config = model_config.get_text_config(decoder=True)
    specs = layer_specs(model_config, config, kv_heads)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    sink = min(tokens, config.sink_tokens)
    tiles = (tokens - sink) // config.tile_size if sink == config.sink_tokens else 0
    fp_tokens = tokens - tiles * config.tile_size
    per_layer = 0
    for spec in specs:
        if spec.bits >= 16:
            per_layer += tokens * spec.num_heads * spec.dim * element_size
        else:
            per_layer += spec.num_heads * (fp_tokens * spec.dim * element_size + tiles * spec.tile_nbytes())
    total = 0
    for layer_type, kwargs in zip(layer_types, layer_kwargs):
        if layer_type in QUANTIZED_LAYER_TYPES:
            total += per_layer
            if layer_type == "indexed_attention":
                total += tokens * text_config.index_head_dim * element_size
        else:  # transformers' sliding layer keeps the last window - 1 tokens
            kept = min(tokens, kwargs["sliding_window"] - 1)
            total += kept * sum(s.num_heads * s.dim for s in specs) * element_size
    return batch * total


def family_label(model_config: PretrainedConfig) -> str:
    """``"MLA"``, ``"GQA"`` or ``"MHA"``, from the streams a layer of this model caches."""
    key, _ = layer_specs(model_config, UNQUANTIZED)
    if key.name == "latent":
        return "MLA"
    return "MHA" if key.num_heads == model_config.get_text_config(decoder=True).num_attention_heads else "GQA"


def bits_label(specs: tuple[StreamSpec, StreamSpec]) -> tuple[str, str]:
    """``("key/value", "4/2")`` or ``("latent/rope", "4/16")``: the streams' names and bit widths."""
    return "/".join(s.name for s in specs), "/".join(str(s.bits) for s in specs)


@dataclass(frozen=True)
class PlanRow:
    """One preset's line of a plan.

    Attributes:
        name: ``"16-bit"`` or the preset name.
        config: The `KVarNConfig` the row was computed with.
        context: The context length T the bytes are given at.
        sequence_nbytes: KV-cache bytes of one sequence of ``context`` tokens, all layers.
        max_context: The longest context per sequence that fits at the plan's batch size (0 if not even one token
            does; None when the cache stops growing, so no context length is too long).
        max_batch: The most sequences of ``context`` tokens that fit.
    """

    name: str
    config: KVarNConfig
    context: int
    sequence_nbytes: int
    max_context: int | None
    max_batch: int

    @property
    def bytes_per_token(self) -> float:
        """KV-cache bytes per token at ``context`` tokens, all layers, one sequence."""
        return self.sequence_nbytes / self.context


def parse_memory(text: str) -> int:
    """Bytes in a memory size such as ``"80GiB"``, ``"1.5TB"`` or ``"512 MiB"`` (rounded down to whole bytes).

    Raises:
        ValueError: naming ``text`` and the accepted forms, when it is not a positive number and a unit.
    """
    match = _MEMORY.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"invalid memory size {text!r}: expected {_ACCEPTED}")
    nbytes = int(Fraction(match.group(1)) * _UNITS[match.group(2)])  # Fraction: "0.1GB" is exactly 10**8 bytes
    if nbytes < 1:
        raise ValueError(f"invalid memory size {text!r}: it is less than one byte; expected {_ACCEPTED}")
    return nbytes


def format_bytes(nbytes: int | float) -> str:
    """``nbytes`` in binary units with three significant figures, e.g. ``"1.22 TiB"`` or ``"877 MiB"``."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.{2 if abs(value) < 10 else 1 if abs(value) < 100 else 0}f} {unit}"


_PARAMETERS: dict[str, tuple[dict[str, int], dict[str, str]]] = {}


def parameter_count(model_config: PretrainedConfig, tp: int = 1) -> int:
    """The exact number of parameters of the transformers class for ``model_config``; with ``tp > 1``, those one
    rank of tensor parallelism holds under the class's own TP plan (sharded weights divided, rounded up per tensor;
    everything else replicated).

    The model is built on the meta device (no memory, well under a second even for DeepSeek-V3), as a causal LM,
    else as an image-text-to-text model (vision-language wrappers such as Kimi-K2.5 count their vision tower too),
    else as the base model. Tied embeddings count once. Results are cached per config.

    Raises:
        ValueError: when transformers has no class for the config's ``model_type`` or cannot build it.
    """
    key = model_config.to_json_string(use_diff=False)
    if key not in _PARAMETERS:
        _PARAMETERS[key] = _parameters(model_config)
    sizes, tp_plan = _PARAMETERS[key]
    return sum(-(-numel // tp) if _sharded(name, tp_plan) else numel for name, numel in sizes.items())


def _sharded(name: str, tp_plan: dict[str, str]) -> bool:
    """Whether a TP plan splits parameter ``name``: a colwise/rowwise style on it or on its module (the bias of a
    rowwise layer stays replicated)."""
    for pattern, style in tp_plan.items():
        regex = re.escape(pattern).replace(r"\*", r"[^.]+")
        if re.fullmatch(rf"{regex}(\..+)?", name) and ("colwise" in style or "rowwise" in style):
            return not (style.endswith("rowwise") and name.endswith(".bias"))
    return False


def tp_kv_heads(model_config: PretrainedConfig, tp: int) -> int | None:
    """A dense model's kv heads per rank when its TP plan shards ``k_proj`` (None for MLA, whose latent is
    replicated, and for ``tp == 1``).

    Raises:
        ValueError: when ``tp`` does not divide the kv heads of a model whose attention it would shard.
    """
    key, _ = layer_specs(model_config, UNQUANTIZED)
    if tp == 1 or key.name != "key":
        return None
    parameter_count(model_config)  # builds the meta model once, for its TP plan
    _, tp_plan = _PARAMETERS[model_config.to_json_string(use_diff=False)]
    if not any(pattern.endswith("self_attn.k_proj") and "colwise" in style for pattern, style in tp_plan.items()):
        return None
    if key.num_heads % tp:
        raise ValueError(f"--tp {tp} does not divide the {key.num_heads} kv heads of this model")
    return key.num_heads // tp


def _parameters(model_config: PretrainedConfig) -> tuple[dict[str, int], dict[str, str]]:
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    for auto_class in (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModel):
        if type(model_config) in auto_class._model_mapping:
            try:
                with torch.device("meta"):
                    model = auto_class.from_config(model_config)
            except Exception as error:  # any failure to build means no count; say which model and why
                raise ValueError(f"cannot build {auto_class.__name__} for model_type {model_config.model_type!r} "
                                 f"on the meta device to count its parameters: {error}") from error
            # named_parameters() yields a tied (shared) tensor once, so tied embeddings count once.
            return {name: p.numel() for name, p in model.named_parameters()}, dict(model._tp_plan or {})
    raise ValueError(f"transformers has no model class for model_type {model_config.model_type!r}")


def weight_bytes(model_config: PretrainedConfig, dtype_bytes: float = 2, tp: int = 1) -> int:
    """Bytes of the model weights (on one rank of ``tp``): `parameter_count` × ``dtype_bytes``, rounded up.

    Args:
        model_config: The model config.
        dtype_bytes: Bytes per parameter: 2 for bf16/fp16, 1 for FP8 (DeepSeek-V3's published weights), 0.5 for
            4-bit weights (quantization scales not counted).
        tp: Tensor-parallel ranks.

    Raises:
        ValueError: when ``dtype_bytes`` is not a positive number.
    """
    _check_dtype_bytes(dtype_bytes)
    return math.ceil(parameter_count(model_config, tp) * Fraction(str(dtype_bytes)))


def plan(
    model_config: PretrainedConfig,
    memory_bytes: int,
    batch: int = 8,
    context: int = 32768,
    presets: Sequence[str] | None = None,
    *,
    dtype_bytes: float = 2,
    element_size: int = 2,
    tp: int = 1,
) -> list[PlanRow]:
    """What fits in ``memory_bytes`` once the weights are loaded: one row for the 16-bit cache, then one per preset.
    With ``tp > 1`` everything is per rank of tensor parallelism: ``memory_bytes`` is one device's, the weights and
    the KV bytes are that rank's share (a dense model's kv heads are split, the MLA latent is replicated).

    A row's ``max_context`` is the largest T with ``weights + batch · expected_nbytes(T) <= memory_bytes`` (binary
    search: the cache never shrinks as T grows) and its ``max_batch`` the largest B with
    ``weights + B · expected_nbytes(context) <= memory_bytes``. When the weights alone exceed ``memory_bytes``,
    both are 0 in every row; compare `weight_bytes` with ``memory_bytes`` to say so.

    Args:
        model_config: A config of a supported model type.
        memory_bytes: The memory budget, weights included (`parse_memory` reads ``"80GiB"``).
        batch: Sequences decoded together, for ``max_context``.
        context: Tokens per sequence, for the bytes per token and ``max_batch``.
        presets: Preset names, in order; None means every preset in `PRESETS`.
        dtype_bytes: Bytes per weight parameter (see `weight_bytes`).
        element_size: Bytes per element of the model dtype, which the sink, the tail and 16-bit streams keep.
        tp: Tensor-parallel ranks (transformers' ``tp_plan="auto"``).

    Raises:
        NotImplementedError: for a model type kvarn_mla does not support.
        ValueError: for an unknown preset name or a budget, batch or context that is not a positive integer.
    """
    adapter_for(model_config)  # unsupported model types fail here, before any work
    for name, value in (("memory_bytes", memory_bytes), ("batch", batch), ("context", context), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    names = list(PRESETS) if presets is None else [name for name in presets if name != UNQUANTIZED_NAME]
    configs = [(UNQUANTIZED_NAME, UNQUANTIZED)] + [(name, resolve_config(name)) for name in names]
    free = memory_bytes - weight_bytes(model_config, dtype_bytes, tp)
    kv_heads = tp_kv_heads(model_config, tp)
    rows = []
    for name, config in configs:
        def kv_nbytes(tokens: int, config: KVarNConfig = config) -> int:
            return expected_nbytes(model_config, config, tokens, batch=1, element_size=element_size, kv_heads=kv_heads)

        sequence = kv_nbytes(context)
        rows.append(PlanRow(
            name=name,
            config=config,
            context=context,
            sequence_nbytes=sequence,
            max_context=_max_tokens(kv_nbytes, free // batch) if free >= 0 else 0,
            max_batch=max(free, 0) // sequence,
        ))
    return rows


def _max_tokens(kv_nbytes, budget: int) -> int | None:
    """The largest T with ``kv_nbytes(T) <= budget`` (``kv_nbytes`` non-decreasing), or None past `MAX_TOKENS`."""
    # batch · kv(T) <= free  <=>  kv(T) <= free // batch, as kv(T) is an integer.
    low, high = 0, 1
    while kv_nbytes(high) <= budget:  # low always fits, high is the first power of two that does not
        low, high = high, 2 * high
        if high > MAX_TOKENS:
            return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if kv_nbytes(middle) <= budget else (low, middle)
    return low


def _check_dtype_bytes(dtype_bytes: float) -> None:
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, (int, float)) or not 0 < dtype_bytes < math.inf:
        raise ValueError(f"dtype_bytes must be a positive number of bytes per parameter (e.g. 2 for bf16, 1 for "
                         f"FP8, 0.5 for 4-bit), got {dtype_bytes!r}")
