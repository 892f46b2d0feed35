"""DeepSeek-style MLA with weight absorption: MQA over the latent ``c_kv`` (value = latent) plus the RoPE key.

``kv_b_proj.weight`` viewed as ``[H, dn + dv, R]`` holds ``W_UK [H, dn, R]`` and ``W_UV [H, dv, R]``. The absorbed
query ``q_lat = q_nope @ W_UK`` scores against the latent directly, ``q_pe`` against the RoPE key, and the output
latent ``o_lat = softmax(.) @ c_kv`` goes through ``W_UV`` afterwards, so the cache is never expanded per head.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backends import Backend
from ..config import KVarNConfig
from ..store import StreamSpec
from .base import Adapter, fallback_attention


def _keep_latents(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for `expand_kv` on patched modules: the attention function receives the latents themselves."""
    return kv_nope, k_rot


class MLAAdapter(Adapter):
    family = "mla"

    def stream_specs(self, text_config, config: KVarNConfig) -> tuple[StreamSpec, StreamSpec]:
        return (
            StreamSpec("latent", 1, text_config.kv_lora_rank, config.scheme("latent")),
            StreamSpec("rope", 1, text_config.qk_rope_head_dim, config.scheme("rope")),
        )

    def is_attention(self, module: nn.Module) -> bool:
        return all(hasattr(module, name) for name in ("layer_idx", "kv_b_proj", "expand_kv"))

    def prepare(self, module: nn.Module) -> None:
        module.expand_kv = _keep_latents

    def restore(self, module: nn.Module) -> None:
        module.__dict__.pop("expand_kv", None)

    def full_precision(self, module, query, key, value, mask, fallback: str, **kwargs) -> torch.Tensor:
        key, value = type(module).expand_kv(module, key, value)  # the model's own expansion, as unpatched
        return fallback_attention(module, query, key, value, mask, fallback, **kwargs)

    def quantized(self, module, query, layer, mask, scaling: float, backend: Backend) -> torch.Tensor:
        latent, rope = (stream.view() for stream in layer.streams[:2])
        batch, heads, q_len, _ = query.shape
        rank, rope_dim = latent.dim, rope.dim
        nope_dim = query.shape[-1] - rope_dim
        # The absorbed projections run in the weights' dtype, as the model's own kv_b_proj does.
        weight = module.kv_b_proj.weight.view(heads, -1, rank)
        w_uk, w_uv = weight[:, :nope_dim], weight[:, nope_dim:]
        q_nope, q_pe = query.split([nope_dim, rope_dim], dim=-1)
        q_lat = torch.einsum("bhsd,hdr->bhsr", q_nope.to(weight.dtype), w_uk)
        # MQA over [c_kv | k_pe]: all heads are query rows of the single latent "kv head", ordered (head, query).
        q = torch.cat([q_lat.float(), q_pe.float()], -1).reshape(batch, 1, heads * q_len, rank + rope_dim)
        o_lat = backend.attend(q, [latent, rope], None, scaling, mask, q_len).view(batch, heads, q_len, rank)
        return torch.einsum("bhsr,hvr->bshv", o_lat.to(weight.dtype), w_uv).to(query.dtype)
