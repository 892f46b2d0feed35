"""Channel rotation: the orthonormal Sylvester Hadamard transform, block-diagonal for non-power-of-two widths."""

from __future__ import annotations

import functools

import torch


def hadamard_block_size(dim: int) -> int:
    """The largest power of two that divides ``dim`` (the block of the block-diagonal Hadamard)."""
    if dim < 1:
        raise ValueError(f"hadamard width must be positive, got {dim=}")
    return dim & -dim


@functools.lru_cache(maxsize=64)
def _hadamard_cpu(dim: int) -> torch.Tensor:
    block = hadamard_block_size(dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / block**0.5
    return torch.block_diag(*([h] * (dim // block)))  # float64; converted per (device, dtype) below


# Per (dim, device, dtype). A plain dict rather than lru_cache: torch.compile reads a dict entry as a constant, while
# it would trace through an lru_cache-wrapped function and rebuild the matrix in every compiled step.
_MATRICES: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def hadamard_matrix(
    dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Orthonormal, symmetric Hadamard matrix ``H`` of shape ``[dim, dim]`` (so ``H @ H = I``).

    For a power-of-two ``dim`` this is the Sylvester matrix scaled by ``1/sqrt(dim)``; otherwise it is
    block-diagonal with Sylvester blocks of the largest power of two dividing ``dim`` (odd widths give the
    identity). Matrices are cached per (dim, device, dtype).
    """
    key = (dim, torch.device(device), dtype)
    if key not in _MATRICES:
        _MATRICES[key] = _hadamard_cpu(dim).to(device=key[1], dtype=dtype)
    return _MATRICES[key]


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotate the last (channel) axis: ``x @ H``. Being symmetric and orthonormal, ``rotate`` is its own inverse.

    Args:
        x: ``[..., D]`` tensor of any float dtype (computed in float32, whatever the input dtype).

    Returns:
        ``[..., D]`` float32 tensor.
    """
    x = x.float()
    return x @ hadamard_matrix(x.shape[-1], x.device, torch.float32)
