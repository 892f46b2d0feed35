"""Family adapters and the registry from ``config.model_type`` to the adapter that serves it."""

from __future__ import annotations

from ..config import KVarNConfig, resolve_config
from ..store import StreamSpec
from .base import Adapter, AttentionBinding, kvarn_attention
from .dense import DenseAdapter
from .mla import MLAAdapter

DENSE = DenseAdapter()
MLA = MLAAdapter()

# Every model type kvarn_mla supports. Dense models quantize their full-attention layers only; sliding-window
# layers keep transformers' own (unquantized) cache layer.
ADAPTERS: dict[str, Adapter] = {
    "llama": DENSE,
    "mistral": DENSE,
    "qwen2": DENSE,
    "qwen3": DENSE,
    "deepseek_v2": MLA,
    "deepseek_v3": MLA,
    "kimi_k25": MLA,  # a vision-language wrapper whose text tower is deepseek_v3
    "glm4_moe_lite": MLA,
    "minicpm3": MLA,
    "longcat_flash": MLA,
    "deepseek_v32": MLA,  # DSA: the indexer's top-k arrives as `indices=`
    "glm_moe_dsa": MLA,
}
# Known and refused, with the reason given to the user.
REFUSED = {
    "deepseek_v4": "deepseek_v4 is not latent MLA (shared-KV sliding window with compressor caches)",
}


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(config) -> Adapter:
    """The adapter for a model config (its top-level ``model_type``).

    Raises:
        NotImplementedError: for model types kvarn_mla does not support, listing the supported ones.
    """
    model_type = getattr(config, "model_type", None)
    if model_type in ADAPTERS:
        return ADAPTERS[model_type]
    reason = REFUSED.get(model_type, "no adapter for this model type")
    raise NotImplementedError(
        f"kvarn_mla does not support model_type={model_type!r} ({reason}); supported: {supported_model_types()}"
    )


def layer_specs(
    model_config, config: KVarNConfig | str | None, kv_heads: int | None = None
) -> tuple[StreamSpec, StreamSpec]:
    """The (key slot, value slot) streams of one full-attention layer of a model of a supported type; ``kv_heads``
    overrides the config's kv heads (a tensor-parallel rank's share of a dense model)."""
    text_config = model_config.get_text_config(decoder=True)
    return adapter_for(model_config).stream_specs(text_config, resolve_config(config), kv_heads)


__all__ = ["ADAPTERS", "Adapter", "AttentionBinding", "adapter_for", "kvarn_attention", "layer_specs",
           "supported_model_types"]
