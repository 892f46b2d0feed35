"""DeepSeek-style MLA with weight absorption: MQA over the latent ``c_kv`` (value = latent) plus the RoPE key.

The effective weight of ``kv_b_proj``, viewed as ``[H, dn + dv, R]``, holds ``W_UK [H, dn, R]`` and
``W_UV [H, dv, R]``. The absorbed query ``q_lat = q_nope @ W_UK`` scores against the latent directly, ``q_pe``
against the RoPE key, and the output latent ``o_lat = softmax(.) @ c_kv`` goes through ``W_UV`` afterwards, so the
cache is never expanded per head.

The effective weight is what ``kv_b_proj``'s own forward computes, whatever implements it (a plain Linear, an FP8
block-quantized or bitsandbytes layer, a LoRA-adapted layer, a tensor-parallel shard): `effective_weight` runs that
forward on the identity once per patch and keeps the dense result in the model's compute dtype (``H (dn + dv) R``
elements per layer), recomputed when the module, its parameters or its adapter state change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..backends import Backend
from ..config import KVarNConfig
from ..store import StreamSpec
from .base import Adapter, fallback_attention

ABSORBED_ATTR = "_kvarn_absorbed"  # instance attribute set by `prepare`: the module's `Absorbed` projections


def _keep_latents(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for `expand_kv` on patched modules: the attention function receives the latents themselves."""
    return kv_nope, k_rot


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a module computes in: that of its floating-point parameters wider than one byte (so FP8 weights
    and packed integer weights do not count; their layers compute in the model dtype)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point() and p.element_size() > 1),
                torch.float32)


@torch.no_grad()
def effective_weight(linear: nn.Module, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """``[out, in]``: the matrix a linear map implements, from its own forward, ``W^T = f(I) - f(0)`` (the bias
    cancels). Run in eval mode (no adapter dropout); a tensor-parallel layer gives its local output shard."""
    device = next(linear.parameters()).device
    eye = torch.eye(in_features, dtype=dtype, device=device)
    training = linear.training
    linear.eval()
    try:
        out = linear(eye) - linear(torch.zeros_like(eye[:1]))
    finally:
        linear.train(training)
    out = out.to_local() if hasattr(out, "to_local") else out  # a DTensor output (tensor parallelism)
    return out.transpose(0, 1).to(dtype).contiguous()


def _fingerprint(linear: nn.Module) -> tuple:
    """Changes when the module implementing ``kv_b_proj`` is replaced, a parameter is replaced or changed in place,
    or its adapters are switched, disabled or merged (peft)."""
    state = tuple(str(getattr(linear, name, None)) for name in ("active_adapters", "disable_adapters", "merged"))
    return (id(linear), *((id(p), p._version) for p in linear.parameters()), *state)


@dataclass
class Absorbed:
    """``W_UK [H, dn, R]`` and ``W_UV [H, dv, R]`` of one module (local heads under tensor parallelism), and the
    fingerprint of the ``kv_b_proj`` they came from."""

    fingerprint: tuple
    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @classmethod
    def of(cls, module: nn.Module) -> Absorbed:
        rank, nope = module.kv_lora_rank, module.qk_nope_head_dim
        weight = effective_weight(module.kv_b_proj, rank, compute_dtype(module))
        weight = weight.view(-1, nope + module.v_head_dim, rank)
        return cls(_fingerprint(module.kv_b_proj), weight[:, :nope], weight[:, nope:])


class MLAAdapter(Adapter):
    family = "mla"

    def stream_specs(self, text_config, config: KVarNConfig, kv_heads: int | None = None) -> tuple[StreamSpec, ...]:
        # The latent and RoPE key are one "kv head" shared by all query heads: replicated under tensor parallelism.
        return (
            StreamSpec("latent", 1, text_config.kv_lora_rank, config.scheme("latent")),
            StreamSpec("rope", 1, text_config.qk_rope_head_dim, config.scheme("rope")),
        )

    def is_attention(self, module: nn.Module) -> bool:
        return all(hasattr(module, name) for name in ("layer_idx", "kv_b_proj", "expand_kv"))

    def prepare(self, module: nn.Module) -> None:
        module.expand_kv = _keep_latents
        module.__dict__[ABSORBED_ATTR] = Absorbed.of(module)

    def restore(self, module: nn.Module) -> None:
        module.__dict__.pop("expand_kv", None)
        module.__dict__.pop(ABSORBED_ATTR, None)

    @staticmethod
    def absorbed(module: nn.Module) -> Absorbed:
        """The module's absorbed projections, recomputed if ``kv_b_proj`` changed since they were taken."""
        absorbed = module.__dict__[ABSORBED_ATTR]
        if not torch.compiler.is_compiling() and absorbed.fingerprint != _fingerprint(module.kv_b_proj):
            absorbed = module.__dict__[ABSORBED_ATTR] = Absorbed.of(module)
        return absorbed

    def full_precision(self, module, query, key, value, mask, fallback: str, **kwargs) -> tuple:
        key, value = type(module).expand_kv(module, key, value)  # the model's own expansion, as unpatched
        return fallback_attention(module, query, key, value, mask, fallback, **kwargs)

    def quantized(self, module, query, layer, mask, scaling: float, backend: Backend) -> torch.Tensor:
        latent, rope = (stream.view() for stream in layer.streams[:2])
        batch, heads, q_len, _ = query.shape
        rank, rope_dim = latent.dim, rope.dim
        nope_dim = query.shape[-1] - rope_dim
        # The absorbed projections run in the compute dtype, as the model's own kv_b_proj does.
        absorbed = self.absorbed(module)
        w_uk, w_uv = absorbed.w_uk, absorbed.w_uv
        q_nope, q_pe = query.split([nope_dim, rope_dim], dim=-1)
        q_lat = torch.einsum("bhsd,hdr->bhsr", q_nope.to(w_uk.dtype), w_uk)
        # MQA over [c_kv | k_pe]: all heads are query rows of the single latent "kv head", ordered (head, query).
        q = torch.cat([q_lat.float(), q_pe.float()], -1).reshape(batch, 1, heads * q_len, rank + rope_dim)
        o_lat = backend.attend(q, [latent, rope], None, scaling, mask, q_len).view(batch, heads, q_len, rank)
        return torch.einsum("bhsr,hvr->bshv", o_lat.to(w_uv.dtype), w_uv).to(query.dtype)
