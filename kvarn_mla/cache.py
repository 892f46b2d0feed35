"""`KVarNCache` and `KVarNLayer`: KVarN-quantized storage on transformers' Cache API.

A layer holds two streams (dense: K and V; MLA: latent and RoPE key). ``update`` appends the new tokens in full
precision and returns them unchanged; the patched attention function reads the layer's store directly, and after the
decoder's forward pass the hook `kvarn_mla.patch` installs calls `KVarNCache.flush`, which quantizes every tile that
filled. So a forward pass attends the tokens cached *before* it in their stored (quantized) form and its own tokens
exactly, and a tile is quantized once, when it is full.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from .adapters import layer_specs
from .adapters.base import find_binding
from .backends import Backend, resolve_backend
from .config import KVarNConfig, resolve_config
from .quant.scheme import TileScheme
from .store import Stream, StreamSpec, quantize_pending


class KVarNLayer(CacheLayerMixin):
    """One full-attention layer's quantized cache: ``streams = (key slot, value slot)``, each ``[B, H, T, D]``."""

    is_kvarn = True
    is_sliding = False
    # A decode step holds no host sync, and the flush that quantizes a full tile runs between steps when the step is
    # compiled (see `KVarNCache.begin_forward`), so transformers may compile the forward around this cache.
    is_compileable = True
    is_croppable = True

    def __init__(self, specs: tuple[StreamSpec, StreamSpec], config: KVarNConfig, backend: Backend | None = None):
        super().__init__()
        self.specs = specs
        self.config = config
        self.backend = backend  # resolved for the data's device at the first flush when None
        self.new_tokens = 0  # tokens appended by the latest `update`: the current forward's own tokens
        self.index: int | None = None  # the layer's index in its cache, for error messages
        # Inside a patched forward pass the finite check runs once for the whole pass, in `KVarNCache.end_forward`
        # (one host sync instead of one per stream and layer); a direct `update` checks its input at once.
        self.defer_finite_check = False
        self._make_streams()

    def _make_streams(self) -> None:
        self.streams = tuple(Stream(spec) for spec in self.specs)

    def __repr__(self) -> str:
        widths = ", ".join(f"{s.name}={s.num_heads}x{s.dim}@{s.bits}b" for s in self.specs)
        return f"{type(self).__name__}({widths}, tokens={self.length})"

    # ---- transformers' layer API ---------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[B, H, S, D]`` (MLA: latent ``[B, 1, S, R]``, RoPE key
        ``[B, 1, S, dr]``) and return them unchanged; the attention function reads the store itself.

        Raises:
            ValueError: on non-finite values or a shape/dtype that does not match the layer; the cache is unchanged.
        """
        for spec, x in zip(self.specs, (key_states, value_states)):
            self._check(spec, x, key_states)
        if not self.defer_finite_check and not torch.compiler.is_compiling():
            for spec, x in zip(self.specs, (key_states, value_states)):
                _check_finite(x, spec.name, self.index)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for stream, x in zip(self.streams, (key_states, value_states)):
            stream.append(x)
        self.new_tokens = key_states.shape[2]
        return key_states, value_states

    def _check(self, spec: StreamSpec, x: torch.Tensor, key_states: torch.Tensor) -> None:
        where = "" if self.index is None else f" of layer {self.index}"
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"kvarn: {spec.name} states{where} must be a 4D tensor [B, H, S, D], got {_describe(x)}")
        expected = (spec.num_heads, spec.dim)
        same_tokens = (x.shape[0], x.shape[2]) == (key_states.shape[0], key_states.shape[2])
        if (x.shape[1], x.shape[3]) != expected or not same_tokens:
            raise ValueError(
                f"kvarn: {spec.name} states{where} of shape {tuple(x.shape)} do not fit this layer "
                f"(expected [B, {spec.num_heads}, S, {spec.dim}] with B and S equal across streams)"
            )
        if not x.is_floating_point():
            raise ValueError(f"kvarn: {spec.name} states{where} must be floating point, got dtype={x.dtype}")
        if self.is_initialized:
            batch = self.streams[0].batch_size
            if x.dtype != self.dtype or x.device != self.device or (batch is not None and x.shape[0] != batch):
                raise ValueError(
                    f"kvarn: {spec.name} states{where} (dtype={x.dtype}, device={x.device}, batch={x.shape[0]}) do not "
                    f"match the cache (dtype={self.dtype}, device={self.device}, batch={batch})"
                )

    def flush(self, token_valid: torch.Tensor | None = None) -> None:
        """Quantize every tile that is full. ``token_valid [B, T]`` marks padding to leave out of the statistics."""
        flush_layers([self], token_valid)

    @property
    def length(self) -> int:
        return self.streams[0].length

    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys (MLA: the latent) as attention sees them, dequantized on demand: ``[B, H, T, D]`` in the
        model dtype (None before the first update). Read-only: the store is written by `update` only."""
        return self._dequantized(0)

    @property
    def values(self) -> torch.Tensor | None:
        """The cached values (MLA: the RoPE key), like `keys`."""
        return self._dequantized(1)

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_write("keys", value)

    @values.setter
    def values(self, value) -> None:
        self._refuse_write("values", value)

    def _dequantized(self, slot: int) -> torch.Tensor | None:
        stream = self.streams[slot]
        return stream.dequantized().to(stream.dtype) if stream.length else None

    @staticmethod
    def _refuse_write(name: str, value) -> None:
        if value is not None:  # transformers' base __init__ sets None
            raise AttributeError(f"KVarNLayer.{name} is read-only (dequantized from the store); use update()")

    def mark(self) -> tuple:
        """What `rollback` needs to undo every later `update` (appends only: flushes, crops and reorders are
        not undone)."""
        return (self.is_initialized, self.new_tokens, getattr(self, "device", None), getattr(self, "dtype", None),
                tuple(stream.mark() for stream in self.streams))

    def appended_since(self, mark: tuple):
        """``(stream name, tokens)`` for every part appended since ``mark`` (views, no copy)."""
        for stream, stream_mark in zip(self.streams, mark[4]):
            for part in stream.appended_since(stream_mark):
                yield stream.spec.name, part

    def rollback(self, mark: tuple) -> None:
        self.is_initialized, self.new_tokens, self.device, self.dtype, streams = mark
        for stream, stream_mark in zip(self.streams, streams):
            stream.rollback(stream_mark)

    @property
    def past_length(self) -> int:
        """Tokens cached before the current forward call."""
        return self.length - self.new_tokens

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._make_streams()
        self.new_tokens = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers passes a negative count).

        A quantized tile the cut falls inside returns to the full-precision tail in dequantized form and is
        quantized again when it refills.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove, got tokens_to_remove={tokens_to_remove}"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(self.length + tokens_to_remove, 0)
        for stream in self.streams:
            stream.crop(keep)
        self.new_tokens = 0

    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            for stream in self.streams:
                stream.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def offload(self) -> None:
        raise NotImplementedError("KVarNCache does not support offloading")

    prefetch = offload

    # ---- bytes ---------------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes this layer stores: codes, fp16 scales, and the full-precision sink and tail."""
        return sum(stream.nbytes() for stream in self.streams)

    def allocated_nbytes(self) -> int:
        """`nbytes` plus spare capacity reserved for future tiles."""
        return sum(stream.allocated_nbytes() for stream in self.streams)

    def dense_nbytes(self) -> int:
        """Bytes an unquantized cache in the model dtype (the dtype `nbytes` counts the sink and tail in) would hold
        for the same tokens."""
        batch = self.streams[0].batch_size or 0
        return sum(batch * s.spec.num_heads * s.spec.dim * s.length * s.dtype.itemsize
                   for s in self.streams if s.length)


class KVarNIndexedLayer(KVarNLayer):
    """A KVarN layer for DSA models: a third stream keeps the indexer keys ``[B, T, index_head_dim]`` in full
    precision (cropped, reordered and counted with the other two)."""

    def __init__(self, specs: tuple[StreamSpec, StreamSpec], config: KVarNConfig, index_head_dim: int,
                 backend: Backend | None = None):
        self.indexer_spec = StreamSpec("indexer", 1, index_head_dim, TileScheme(16, "channel"))
        super().__init__(specs, config, backend)

    def _make_streams(self) -> None:
        super()._make_streams()
        self.indexer = Stream(self.indexer_spec)
        self.streams += (self.indexer,)

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Append ``[B, S, index_head_dim]`` indexer keys; return all of them, ``[B, T, index_head_dim]``."""
        x = indexer_key_states
        if x.dim() != 3 or x.shape[-1] != self.indexer_spec.dim:
            raise ValueError(f"kvarn: indexer keys must be [B, S, {self.indexer_spec.dim}], got shape={tuple(x.shape)}")
        if not self.defer_finite_check and not torch.compiler.is_compiling():
            _check_finite(x, "indexer key", self.index)
        self.indexer.append(indexer_key_states.unsqueeze(1))
        return self.indexer.full().squeeze(1)


def _check_finite(x: torch.Tensor, name: str, index: int | None) -> None:
    if not bool(torch.isfinite(x).all()):
        raise _nonfinite_error(x, name, index)


def _nonfinite_error(x: torch.Tensor, name: str, index: int | None) -> ValueError:
    bad = x[~torch.isfinite(x)][0].item()
    where = "" if index is None else f" of layer {index}"
    return ValueError(f"kvarn: {name} states{where} contain {bad} (NaN or Inf); the cache was left unchanged")


def _describe(x) -> str:
    return f"shape={tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def flush_layers(layers, token_valid: torch.Tensor | None = None) -> None:
    """Quantize every full tile of a cache's layers: one store call per stream slot and device, for all layers.

    The layers share one config and one backend; a cache built without a backend (from a model config) resolves
    it here, once, for the device of the data.
    """
    layers = [layer for layer in layers if getattr(layer, "is_kvarn", False)]
    commits = []  # every group is quantized and checked before any is stored: a failed flush changes nothing
    for slot in range(2):
        by_device: dict[torch.device, list[Stream]] = {}  # layers placed on several devices (device_map)
        for layer in layers:
            if layer.streams[slot].pending_tiles():
                by_device.setdefault(layer.streams[slot].device, []).append(layer.streams[slot])
        for device, streams in by_device.items():
            if layers[0].backend is None:
                backend = resolve_backend(layers[0].config.backend, device)
                for layer in layers:
                    layer.backend = backend
            commits.append(quantize_pending(streams, layers[0].backend.store, token_valid))
    for commit in commits:
        commit()


QUANTIZED_LAYER_TYPES = ("full_attention", "indexed_attention")
UNQUANTIZED_LAYER_TYPES = ("sliding_attention", "chunked_attention")


class KVarNCache(Cache):
    """A KVarN-quantized cache for a patched model (or, for sizing, any supported model config).

    Full-attention layers become `KVarNLayer` (DSA layers `KVarNIndexedLayer`); sliding-window layers keep
    transformers' own unquantized layer.

    Args:
        model: A model patched with `kvarn_mla.patch`, or a model config (e.g. to size a cache without a model).
        config: Preset name or `KVarNConfig`; defaults to the patch's config (or the default preset for a config).

    Example:
        >>> kvarn_mla.patch(model, "k4v2")
        >>> out = model.generate(ids, max_new_tokens=64, return_dict_in_generate=True)
        >>> out.cache.nbytes() / out.cache.dense_nbytes()  # fraction of the unquantized cache
    """

    def __init__(self, model: PreTrainedModel | PretrainedConfig, config: KVarNConfig | str | None = None):
        backend, kv_heads = None, None
        if isinstance(model, PreTrainedModel):
            binding = find_binding(model)
            if binding is None:
                raise ValueError(
                    "KVarNCache(model) needs a model patched with kvarn_mla.patch(model, ...): an unpatched model's "
                    "attention would not read the quantized store"
                )
            config = binding.config if config is None else config
            backend, kv_heads = binding.backend, binding.kv_heads
            model_config = model.config
        elif isinstance(model, PretrainedConfig):
            model_config = model
        else:
            raise TypeError(f"KVarNCache takes a patched PreTrainedModel or a PretrainedConfig, got "
                            f"{type(model).__name__}")
        self.config = resolve_config(config)
        if backend is not None and backend.name != self.config.backend and self.config.backend != "auto":
            backend = None  # a config of another backend than the patch's: resolved at the first flush
        text_config = model_config.get_text_config(decoder=True)
        specs = layer_specs(model_config, self.config, kv_heads)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        layers = []
        for layer_type, kwargs in zip(layer_types, layer_kwargs):
            if layer_type == "full_attention":
                layers.append(KVarNLayer(specs, self.config, backend))
            elif layer_type == "indexed_attention":
                layers.append(KVarNIndexedLayer(specs, self.config, text_config.index_head_dim, backend))
            elif layer_type in UNQUANTIZED_LAYER_TYPES:
                layers.append(DynamicSlidingWindowLayer(**kwargs))
            else:
                raise NotImplementedError(
                    f"kvarn_mla cannot cache layer type {layer_type!r}; supported: "
                    f"{QUANTIZED_LAYER_TYPES + UNQUANTIZED_LAYER_TYPES}"
                )
        super().__init__(layers=layers)
        for index, layer in enumerate(layers):
            layer.index = index
        self._forward_marks: list | None = None  # each layer's state before the running (eager) patched pass
        self._patched_pass = False  # whether a patched forward pass is running
        # Whether `generate` may compile the forward around this cache: when it was given a compile config (set by
        # `kvarn_mla.patch`'s generate hook). Otherwise generate runs eagerly, as with a DynamicCache.
        self.compile_requested = False
        self.output_attentions = False  # whether that pass returns attention weights (set by the patched decoder)

    def flush(self, token_valid: torch.Tensor | None = None) -> None:
        """Quantize every full tile of every layer: one store call (one kernel launch) per stream slot and device.
        All or nothing: if any tile cannot be stored, no layer changes.

        `kvarn_mla.patch` calls this after each forward pass of the decoder.

        Args:
            token_valid: Optional ``[B, T]`` bool, False at padding positions (left out of the tile statistics).
        """
        flush_layers(self.layers, token_valid)

    # ---- one forward pass of a patched model, atomically --------------------------------------------------------
    def begin_forward(self) -> None:
        """Called by the patched decoder before a forward pass: quantize tiles left full by calls that did not go
        through it, then remember every layer's state, so that a pass that raises changes nothing.

        Under ``torch.compile`` only the pass is recorded: the graph holds no flush, check or host sync (a compiled
        decode step appends to the tails; `flush` runs between steps, outside the graph, see `kvarn_mla.patch`).
        """
        self._patched_pass = True
        if torch.compiler.is_compiling():
            return
        if self._forward_marks is not None:  # a pass that never ended (interrupted, e.g. KeyboardInterrupt)
            self._restore(self._forward_marks)
        self.flush()
        self._forward_marks = [layer.mark() if getattr(layer, "is_kvarn", False) else dict(layer.__dict__)
                               for layer in self.layers]
        self._defer_finite_checks(True)

    def end_forward(self, failed: bool, token_valid: torch.Tensor | None = None) -> None:
        """Called by the patched decoder after a forward pass: check the tokens it appended (one host sync) and
        quantize the tiles it filled, or, if the pass, the check or the quantization failed, put every layer back
        as it was before the pass.

        Raises:
            ValueError: naming the stream, layer and value, when the pass appended NaN or Inf.
        """
        self._patched_pass = False
        if torch.compiler.is_compiling():
            return
        marks, self._forward_marks = self._forward_marks, None
        self._defer_finite_checks(False)
        if marks is None:
            return
        if failed:
            self._restore(marks)
            return
        try:
            self._check_appended(marks)
            self.flush(token_valid)
        except BaseException:
            self._restore(marks)
            raise

    @property
    def is_compileable(self) -> bool:
        """Whether transformers' `generate` compiles its decode steps: only when asked (``compile_config``), and
        only when every layer allows it (transformers' sliding-window layers do not)."""
        return self.compile_requested and super().is_compileable

    def has_pending_tiles(self) -> bool:
        """Whether any layer holds a full tile waiting for `flush` (host-side lengths only, no sync)."""
        return any(stream.pending_tiles() for layer in self.layers if getattr(layer, "is_kvarn", False)
                   for stream in layer.streams)

    def _defer_finite_checks(self, defer: bool) -> None:
        for layer in self.layers:
            if getattr(layer, "is_kvarn", False):
                layer.defer_finite_check = defer

    def _check_appended(self, marks: list) -> None:
        appended = [(layer, name, x) for layer, mark in zip(self.layers, marks) if not isinstance(mark, dict)
                    for name, x in layer.appended_since(mark)]
        if not appended:
            return
        bad = [(~torch.isfinite(x)).any() for _, _, x in appended]
        device = bad[0].device
        if not bool(torch.stack([flag.to(device) for flag in bad]).any()):  # the pass's one host sync
            return
        layer, name, x = next(item for item, flag in zip(appended, bad) if bool(flag))  # the first, in layer order
        raise _nonfinite_error(x, name, layer.index)

    def _restore(self, marks: list) -> None:
        for layer, mark in zip(self.layers, marks):
            if isinstance(mark, dict):  # transformers' own layer: its update replaces its tensors, never edits them
                layer.__dict__.clear()
                layer.__dict__.update(mark)
            else:
                layer.rollback(mark)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """`Cache.update`, for the attention of a patched model only: any other attention would read just the
        tokens it passes (a KVarN layer returns them unchanged and keeps its store to itself).

        Raises:
            ValueError: when no patched forward pass is running (an unpatched model was given this cache).
        """
        if not self._patched_pass and getattr(self.layers[layer_idx], "is_kvarn", False):
            raise ValueError(
                "kvarn: this KVarNCache is being filled by a model that is not patched for it: call "
                "kvarn_mla.patch(model, ...) first (an unpatched attention would attend only the newest tokens)"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        """Bytes the cache holds: quantized codes and scales, full-precision sink and tail, unquantized layers."""
        return sum(_layer_bytes(layer, "nbytes") for layer in self.layers)

    def allocated_nbytes(self) -> int:
        """`nbytes` plus the spare capacity reserved for future tiles."""
        return sum(_layer_bytes(layer, "allocated_nbytes") for layer in self.layers)

    def dense_nbytes(self) -> int:
        """Bytes an unquantized cache in the model dtype would hold for the same tokens."""
        return sum(_layer_bytes(layer, "dense_nbytes") for layer in self.layers)


def _layer_bytes(layer, which: str) -> int:
    """A KVarN layer's own count; what transformers' (sliding, unquantized) layers hold."""
    if getattr(layer, "is_kvarn", False):
        return getattr(layer, which)()
    if not layer.is_initialized:
        return 0
    return (layer.keys.numel() + layer.values.numel()) * layer.keys.element_size()
