"""`patch` / `unpatch` / `patched`: put a model instance on the KVarN cache, and take it off again exactly.

What `patch` changes, all on the instance (transformers' module globals are never touched):

* the text config's attention implementation becomes ``"kvarn"`` (registered with transformers' `AttentionInterface`
  and `AttentionMaskInterface` on first use, never at import);
* each attention module gets a binding (adapter + config), a forward pre-hook that hands the call's cache to the
  attention function and a forward hook that drops it, an ``extra_repr`` that says so, and for MLA an identity
  ``expand_kv`` so the latent reaches attention unexpanded;
* ``model._prepare_cache_for_generation`` makes ``generate`` use a `KVarNCache`, and a pre-hook on the decoder does
  the same for plain ``model(...)`` calls that would otherwise create a ``DynamicCache``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .adapters import Adapter, AttentionBinding, adapter_for, kvarn_attention
from .adapters.base import BINDING_ATTR, PADDED_SDPA, padded_sdpa_attention, to_bool_mask, token_validity
from .backends import resolve_backend
from .cache import QUANTIZED_LAYER_TYPES, KVarNCache
from .config import KVarNConfig, resolve_config

ATTN_IMPLEMENTATION = "kvarn"
STATE_ATTR = "_kvarn_state"


@dataclass
class PatchState:
    """Everything `unpatch` needs to put the model back."""

    config: KVarNConfig
    adapter: Adapter
    modules: list[nn.Module]
    text_config: object
    attn_implementation: str | None
    handles: list = field(default_factory=list)


def _register_interfaces() -> None:
    # Registration adds a name to transformers' registries; it changes nothing for models that do not select it.
    for name, attention in ((ATTN_IMPLEMENTATION, kvarn_attention), (PADDED_SDPA, padded_sdpa_attention)):
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, attention)
        if name not in AttentionMaskInterface._global_mapping:
            AttentionMaskInterface.register(name, sdpa_mask)


def _fallback_for(implementation: str | None) -> str:
    """How the patched model attends in full precision: as the unpatched one did (sdpa for anything else)."""
    return implementation if implementation in ("eager", PADDED_SDPA) else "sdpa"


def use_padded_sdpa(model: PreTrainedModel) -> bool:
    """Select ``"sdpa_pad_v"`` (`kvarn_mla.adapters.base.padded_sdpa_attention`) as ``model``'s attention when it runs
    sdpa with a value head narrower than its query head (MLA); returns whether it did.

    The same attention up to rounding, through torch's fused SDPA kernel instead of its math path: on the CPU about
    6x faster per layer at 8,192 tokens, and no ``[B, H, S, T]`` score tensor at 16K. Call it before `patch`: the
    patched prefill then attends through it too (it attends as the unpatched model does), and `unpatch` keeps it.
    """
    text_config = model.config.get_text_config(decoder=True)
    value_dim = getattr(text_config, "v_head_dim", None)
    query_dim = getattr(text_config, "qk_head_dim", None)
    if query_dim is None and value_dim is not None:
        query_dim = text_config.qk_nope_head_dim + text_config.qk_rope_head_dim
    if STATE_ATTR in model.__dict__ or text_config._attn_implementation_internal != "sdpa":
        return False
    if value_dim is None or value_dim >= query_dim:
        return False
    _register_interfaces()
    text_config._attn_implementation_internal = PADDED_SDPA
    return True


def _stash_cache(module: nn.Module, args, kwargs):
    module.__dict__[BINDING_ATTR].cache = kwargs.get("cache", kwargs.get("past_key_values"))


def _drop_cache(module: nn.Module, args, output):
    module.__dict__[BINDING_ATTR].cache = None


def _call_cache(kwargs: dict):
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _make_decoder_hooks(model: PreTrainedModel, state: PatchState):
    """The decoder's forward pre-hook and (always called) forward hook: one forward pass on a `KVarNCache` is
    atomic, and nothing but the patched attention ever reads the cache."""

    def before(decoder: nn.Module, args, kwargs):
        cache, injected = _call_cache(kwargs), False
        use_cache = kwargs.get("use_cache")
        if cache is None and (getattr(decoder.config, "use_cache", False) if use_cache is None else use_cache):
            kwargs["cache"] = cache = KVarNCache(model)  # where transformers would create a DynamicCache
            injected = True
        if isinstance(cache, KVarNCache):
            _keep_kvarn_attention(state)
            _check_cache_fits(cache, state)
            requested = kwargs.get("output_attentions")
            cache.output_attentions = bool(getattr(decoder.config, "output_attentions", False)
                                           if requested is None else requested)
            cache.begin_forward()
        elif cache is not None:
            warnings.warn(f"kvarn: a patched {type(model).__name__} was given a {type(cache).__name__}: this "
                          "forward pass runs on it unquantized (pass no cache, or a KVarNCache, to quantize)",
                          stacklevel=2)
        return (args, kwargs) if injected else None

    def after(decoder: nn.Module, args, kwargs, output):
        cache = _call_cache(kwargs)
        if isinstance(cache, KVarNCache):
            failed = output is None and sys.exc_info()[1] is not None  # called from the except branch of __call__
            pending = not failed and not torch.compiler.is_compiling() and cache.has_pending_tiles()
            cache.end_forward(failed, _token_valid(kwargs.get("attention_mask"), cache) if pending else None)

    return before, after


def _keep_kvarn_attention(state: PatchState) -> None:
    """A switch of the attention implementation after `patch` (``set_attn_implementation``, or the config field
    set directly) is taken as the choice of full-precision attention: the patched model keeps reading its
    quantized cache, which no other implementation can."""
    chosen = state.text_config._attn_implementation_internal
    if chosen == ATTN_IMPLEMENTATION:
        return
    warnings.warn(f"kvarn: the attention implementation was set to {chosen!r} after kvarn_mla.patch; the patched "
                  f"model keeps attending its KVarN cache and uses {chosen!r} for full-precision attention "
                  "(kvarn_mla.unpatch to run it unpatched)", stacklevel=3)
    for module in state.modules:
        module.__dict__[BINDING_ATTR].fallback = _fallback_for(chosen)
    state.attn_implementation = chosen  # what unpatch restores
    state.text_config._attn_implementation_internal = ATTN_IMPLEMENTATION


def _check_cache_fits(cache: KVarNCache, state: PatchState) -> None:
    binding = state.modules[0].__dict__[BINDING_ATTR]
    expected = state.adapter.stream_specs(state.text_config, binding.config, binding.kv_heads)
    for layer in cache.layers:
        if getattr(layer, "is_kvarn", False) and layer.specs != expected:
            raise ValueError(
                f"kvarn: this KVarNCache holds {layer.specs} per layer, but the model is patched for {expected}: "
                "build the cache with KVarNCache(model) after kvarn_mla.patch(model, ...) with the config you want"
            )


def _token_valid(mask, cache: KVarNCache):
    """``[B, T]`` bool padding mask from the decoder's attention mask (2D, or 4D custom), or None."""
    if not isinstance(mask, torch.Tensor):
        return None
    length = max((layer.length for layer in cache.layers if getattr(layer, "is_kvarn", False)), default=0)
    if mask.dim() == 4:
        mask = token_validity(to_bool_mask(mask), mask.shape[0])
    if mask.dim() != 2 or mask.shape[-1] < length:
        return None
    mask = mask[:, :length].bool()  # generate's mask may already cover the next step's token
    return None if bool(mask.all()) else mask


def _describe(config: KVarNConfig, adapter: Adapter, text_config) -> str:
    bits = ", ".join(f"{s.name}={s.bits}b" for s in adapter.stream_specs(text_config, config))
    return f"kvarn({bits}, tile={config.tile_size}, sink={config.sink_tokens}, method={config.method})"


def patch(model: PreTrainedModel, config: KVarNConfig | str | None = None, **overrides) -> PreTrainedModel:
    """Run ``model`` on a KVarN-quantized KV cache. Patches this instance only; `unpatch` restores it exactly.

    Args:
        model: A transformers causal LM of a supported ``model_type`` (see `supported_model_types`).
        config: A preset name (see `PRESETS`), a `KVarNConfig`, or None for the default preset ``"k4v2"``.
        **overrides: `KVarNConfig` fields to change on top of ``config``, e.g. ``tile_size=64``.

    Returns:
        The same model, patched (a patched model is re-patched with the new config).

    Raises:
        NotImplementedError: unsupported model type (the message lists the supported ones).
        ValueError: unknown preset or invalid config field.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"kvarn_mla.patch expects a transformers PreTrainedModel, got {type(model).__name__}")
    config = resolve_config(config, **overrides)
    adapter = adapter_for(model.config)
    parameter = next(model.parameters(), None)
    backend = resolve_backend(config.backend, parameter.device if parameter is not None else "cpu")
    decoder = model.get_decoder()
    modules = [m for m in decoder.modules() if adapter.is_attention(m)]
    if not modules:
        raise NotImplementedError(f"found no {adapter.family} attention modules in {type(decoder).__name__}")
    if STATE_ATTR in model.__dict__:
        unpatch(model)
    _register_interfaces()

    text_config = model.config.get_text_config(decoder=True)
    layer_types = get_layer_types_and_kwargs(text_config)[0]
    if not any(t in QUANTIZED_LAYER_TYPES for t in layer_types):
        warnings.warn(
            f"{type(model).__name__} has only {sorted(set(layer_types))} layers; kvarn_mla quantizes full-attention "
            "layers only, so this model's cache stays unquantized",
            stacklevel=2,
        )
    previous = text_config._attn_implementation_internal
    fallback = _fallback_for(previous)
    state = PatchState(config, adapter, modules, text_config, previous)
    description = _describe(config, adapter, text_config)
    for module in modules:
        module.__dict__[BINDING_ATTR] = AttentionBinding(adapter, config, backend, fallback,
                                                         adapter.local_kv_heads(module))
        adapter.prepare(module)
        module.extra_repr = types.MethodType(lambda self: description, module)
        state.handles.append(module.register_forward_pre_hook(_stash_cache, with_kwargs=True))
        state.handles.append(module.register_forward_hook(_drop_cache, always_call=True))
    before, after = _make_decoder_hooks(model, state)
    state.handles.append(decoder.register_forward_pre_hook(before, with_kwargs=True))
    state.handles.append(decoder.register_forward_hook(after, with_kwargs=True, always_call=True))
    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
    model.prepare_inputs_for_generation = types.MethodType(
        _flushing_prepare_inputs(type(model).prepare_inputs_for_generation), model
    )
    text_config._attn_implementation_internal = ATTN_IMPLEMENTATION
    model.__dict__[STATE_ATTR] = state
    return model


def unpatch(model: PreTrainedModel) -> PreTrainedModel:
    """Undo `patch`: hooks, module attributes, attention implementation and cache injection. A no-op if unpatched."""
    state: PatchState | None = model.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return model
    for handle in state.handles:
        handle.remove()
    for module in state.modules:
        state.adapter.restore(module)
        module.__dict__.pop(BINDING_ATTR, None)
        module.__dict__.pop("extra_repr", None)
    model.__dict__.pop("_prepare_cache_for_generation", None)
    model.__dict__.pop("prepare_inputs_for_generation", None)
    state.text_config._attn_implementation_internal = state.attn_implementation
    return model


@contextlib.contextmanager
def patched(model: PreTrainedModel, config: KVarNConfig | str | None = None, **overrides) -> Iterator[PreTrainedModel]:
    """``with kvarn_mla.patched(model, "k4v2"): model.generate(...)``; the model is unpatched on exit."""
    patch(model, config, **overrides)
    try:
        yield model
    finally:
        unpatch(model)


def is_patched(model: nn.Module) -> bool:
    return STATE_ATTR in model.__dict__


def _prepare_cache_for_generation(self: PreTrainedModel, generation_config, model_kwargs: dict, *args, **kwargs):
    """`generate` hook: a `KVarNCache` wherever transformers would create a ``DynamicCache``; another requested
    cache implementation (``"static"``, ``"quantized"``, ...) runs as transformers builds it, unquantized by
    kvarn_mla, with a warning."""
    cache = _call_cache(model_kwargs)
    if isinstance(cache, KVarNCache):  # the user's: compiled if asked, checked by transformers as usual
        cache.compile_requested = generation_config.compile_config is not None
    elif cache is None and generation_config.use_cache is not False:
        if generation_config.cache_implementation in (None, "dynamic"):
            model_kwargs["cache"] = cache = KVarNCache(self)  # where transformers would build a DynamicCache
            cache.compile_requested = generation_config.compile_config is not None
            return None
        warnings.warn(f"kvarn: generate(cache_implementation={generation_config.cache_implementation!r}) on a "
                      f"patched {type(self).__name__} runs on transformers' cache, unquantized by kvarn_mla (leave "
                      "cache_implementation unset to quantize)", stacklevel=3)
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


def _flushing_prepare_inputs(prepare_inputs):
    """``prepare_inputs_for_generation`` that first quantizes the tiles a compiled step (which holds no flush) left
    full: `generate` calls it before every step, outside the compiled forward. After an eager step nothing is
    pending and it costs nothing. It keeps the wrapped method's signature, which `generate` inspects."""

    @functools.wraps(prepare_inputs)
    def prepare_inputs_for_generation(self: PreTrainedModel, *args, **kwargs):
        cache = _call_cache(kwargs)
        if isinstance(cache, KVarNCache) and cache.has_pending_tiles():
            cache.flush(_token_valid(kwargs.get("attention_mask"), cache))
        return prepare_inputs(self, *args, **kwargs)

    return prepare_inputs_for_generation


__all__ = ["patch", "unpatch", "patched", "is_patched", "ATTN_IMPLEMENTATION"]
