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
