"""The backend table: a backend name -> how tiles are stored and how attention reads them.

`kvarn_mla.patch` resolves the table once, for the model's device; the resulting `Backend` lives on the cache and on
each attention binding, so the hot path never looks it up again. A new backend is a kernel file plus one row of
`BACKENDS` (its loader imports the kernels, so importing this module imports neither torch kernels nor Triton).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Backend:
    """One row of the table, loaded.

    Attributes:
        name: The row's name.
        store: ``store(x [N, G, D], scheme, token_valid [N, G] bool | None) -> QuantizedTile`` with fp16 metadata;
            every backend writes the same codes and scales as `kvarn_mla.quant.store_tiles_reference`.
        attend: ``attend(q [B, Hkv, M, Dq], keys, values, scaling, mask [B, 1, S, T] bool | None, q_len)`` ->
            ``[B, Hkv, M, Dv]`` float32 over `StreamView` keys/values (see `kvarn_mla.quant.attention`).
    """

    name: str
    store: Callable
    attend: Callable


def _torch() -> Backend:
    from .quant.attention import tiled_attention_reference
    from .quant.tile import store_tiles_reference

    def attend(q, keys, values, scaling, mask, q_len):
        return tiled_attention_reference(q, keys, values, scaling, q_len=q_len, mask=mask)

    return Backend("torch", store_tiles_reference, attend)


def _triton() -> Backend:
    from .kernels.decode import attend
    from .kernels.store import store_tiles

    return Backend("triton", store_tiles, attend)


# name -> loader. "auto" is not a row: it picks Triton for CUDA tensors and torch elsewhere.
BACKENDS: dict[str, Callable[[], Backend]] = {"torch": _torch, "triton": _triton}
BACKEND_NAMES = ("auto", *BACKENDS)
_loaded: dict[str, Backend] = {}


def resolve_backend(name: str, device: torch.device | str) -> Backend:
    """The backend ``name`` for tensors on ``device``; ``"auto"`` is Triton on CUDA and torch elsewhere.

    An explicit choice is honoured or refused, never switched: ``"triton"`` for CPU tensors needs Triton's
    interpreter (``TRITON_INTERPRET=1`` before kvarn_mla's kernels are imported).
    """
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "triton":
        from .kernels.common import check_triton_device

        check_triton_device(device)
    if name not in _loaded:
        _loaded[name] = BACKENDS[name]()
    return _loaded[name]


__all__ = ["BACKENDS", "BACKEND_NAMES", "Backend", "resolve_backend"]
