"""What every launcher checks before it launches."""

from __future__ import annotations

import os

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or anywhere under the interpreter (``TRITON_INTERPRET=1``)."""
    for t in tensors:
        if t.device.type != "cuda" and not interpreter_enabled():
            raise RuntimeError(
                f"the Triton kernels need CUDA tensors (got device={t.device}); on CPU set TRITON_INTERPRET=1 "
                "before importing kvarn_mla.kernels to run them in Triton's interpreter"
            )


def select_backend(requested: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device``. ``"auto"`` picks Triton on CUDA and torch elsewhere;
    an explicit choice is honoured or refused, never switched."""
    if requested == "torch":
        return "torch"
    if requested == "triton":
        check_triton_device(torch.empty(0, device=device))
        return "triton"
    if requested != "auto":
        raise ValueError(f"backend must be one of ('auto', 'torch', 'triton'), got {requested!r}")
    return "triton" if device.type == "cuda" else "torch"


def quantizer(backend: str):
    """The tile quantizer of a backend: the store kernel, or its torch reference (same signature)."""
    if backend == "triton":
        from .store import store_tiles

        return store_tiles
    from ..quant.tile import store_tiles_reference

    return store_tiles_reference
