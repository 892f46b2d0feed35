"""What every launcher checks before it launches."""

from __future__ import annotations

import os
import warnings

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_triton_device(device: torch.device) -> None:
    """Triton kernels run on CUDA tensors, or anywhere under the interpreter (``TRITON_INTERPRET=1``)."""
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors (got device={device}); on CPU set TRITON_INTERPRET=1 "
            "before importing kvarn_mla's kernels to run them in Triton's interpreter"
        )


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A `UserWarning` the first time ``message`` is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
