"""What every launcher shares: the device check, prepared launches, and the per-target limits they are sized by."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

# Largest dynamic shared memory one block may opt into, by compute capability (CUDA programming guide, "Technical
# Specifications per Compute Capability": 227 KB on sm_90/sm_100, 163 KB on sm_80/sm_87, 99 KB on sm_86/sm_89/sm_120).
_SHARED_MEMORY_LIMIT = {(8, 0): 166_912, (8, 7): 166_912, (9, 0): 232_448, (10, 0): 232_448}
_SHARED_MEMORY_SMALL = 101_376


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_triton_device(device: torch.device) -> None:
    """Triton kernels run on CUDA tensors, or anywhere under the interpreter (``TRITON_INTERPRET=1``)."""
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors (got device={device}); on CPU set TRITON_INTERPRET=1 "
            "before importing kvarn_mla's kernels to run them in Triton's interpreter"
        )


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability the kernels are configured for: the CUDA device's, or None (Triton's interpreter)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def shared_memory_limit(capability: tuple[int, int]) -> int:
    """Bytes of shared memory one block may use on a device of this compute capability."""
    if capability[0] < 8:
        raise ValueError(f"the kernels target compute capability 8.0 or newer, got {capability}")
    return _SHARED_MEMORY_LIMIT.get(tuple(capability), _SHARED_MEMORY_SMALL)


@dataclass
class KernelLaunch:
    """One launch of a Triton kernel, prepared but not run.

    The launchers build one and run it; `benchmarks/compile_report.py` builds the same launch for a chosen compute
    capability on CPU tensors and compiles it ahead of time (registers, spills, shared memory) without a GPU.

    Attributes:
        kernel: The ``@triton.jit`` function.
        grid: Programs along each grid axis.
        args: Positional arguments (tensors and scalars).
        kwargs: Compile-time meta-parameters and launch options (``num_warps``, ``num_stages``).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict = field(default_factory=dict)

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A `UserWarning` the first time ``message`` is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
