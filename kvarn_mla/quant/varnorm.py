"""Dual-axis variance normalization ("Sinkhorn-like", in log space) with best-iterate selection.

The tile ``X [R, C]`` is divided by a row scale and a column scale, ``Z = X / (s_r s_c^T)``, chosen so that every
row and every column of ``Z`` has about the same standard deviation. That equalizes the quantization error across
tokens, which is what stops errors from accumulating over long decodes. The iterate kept is the one with the
lowest imbalance, not the last one: later iterates can oscillate, and taking the last one costs accuracy.
"""

from __future__ import annotations

import torch

STD_MIN, STD_MAX = 1e-3, 1e3  # clamp on a measured std before taking its log
# An iterate is kept when its imbalance is <= the best so far (ties move forward, as in the spec), with ties taken
# up to this relative slack: a tile whose stds all clamp gets a uniform rescale, whose imbalance equals the raw
# tile's up to rounding, and rounding must not decide (the store kernel and this reference round differently).
TIE_SLACK = 1e-9
LOG_SCALE_MIN, LOG_SCALE_MAX = -0.3, 10.0  # clamp on the accumulated log-scales
SPREAD_FLOOR = 1e-8  # floor on the smallest std of an imbalance ratio


def _masked_std(y: torch.Tensor, weight: torch.Tensor | None, dim: int) -> torch.Tensor:
    """Unbiased std of ``y`` along ``dim`` over the entries where ``weight`` is 1 (all when None).

    Computed in one pass from the sums, ``(Σy² - (Σy)²/n) / (n - 1)``, as the store kernel does; in float64 the
    cancellation costs nothing that matters here (std is clamped to >= 1e-3 relative to O(1) normalized values).
    """
    if weight is None:
        count = torch.full_like(y.sum(dim), y.shape[dim])
        total, squares = y.sum(dim), y.square().sum(dim)
    else:
        count = weight.sum(dim)
        total, squares = (y * weight).sum(dim), (y.square() * weight).sum(dim)
    var = (squares - total.square() / count.clamp(min=1)) / (count - 1).clamp(min=1)
    return var.clamp(min=0).sqrt()


def _spread(std: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``max(std) / max(min(std), 1e-8)`` over the valid entries of the last axis."""
    if valid is None:
        hi, lo = std.amax(-1), std.amin(-1)
    else:
        hi = std.masked_fill(~valid, 0.0).amax(-1)
        lo = std.masked_fill(~valid, float("inf")).amin(-1)
        lo = torch.where(valid.any(-1), lo, torch.ones_like(lo))
    return hi / lo.clamp(min=SPREAD_FLOOR)


def imbalance(
    y: torch.Tensor, row_valid: torch.Tensor | None = None, col_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Imbalance ``max σ_col / min σ_col + max σ_row / min σ_row`` of ``y [..., R, C]`` (2 is perfect).

    Returns:
        ``[...]`` float tensor, one value per tile.
    """
    weight = _entry_weight(y, row_valid, col_valid)
    return _spread(_masked_std(y, weight, -2), col_valid) + _spread(_masked_std(y, weight, -1), row_valid)


def _entry_weight(
    y: torch.Tensor, row_valid: torch.Tensor | None, col_valid: torch.Tensor | None
) -> torch.Tensor | None:
    if row_valid is None and col_valid is None:
        return None
    weight = torch.ones_like(y)
    if row_valid is not None:
        weight = weight * row_valid.unsqueeze(-1)
    if col_valid is not None:
        weight = weight * col_valid.unsqueeze(-2)
    return weight


def variance_normalize(
    x: torch.Tensor,
    iters: int,
    row_valid: torch.Tensor | None = None,
    col_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column scales that balance the per-row and per-column std of ``x``.

    Each iteration first updates the column log-scales, then the row log-scales (spec order), both clamped; the
    returned scales are those of the iterate with the lowest imbalance (``<=``, so ties move forward), starting from
    the identity (all ones), which is kept when no iterate improves on the raw tile (ties within `TIE_SLACK`
    relative count as equal). Invalid rows/columns (padding)
    are left out of every statistic and keep a scale of 1.

    Args:
        x: ``[..., R, C]`` float64 tiles (float32 works, with float32 rounding).
        iters: Number of iterations; 0 returns all-ones scales.
        row_valid: Optional ``[..., R]`` bool, False for rows to ignore.
        col_valid: Optional ``[..., C]`` bool, False for columns to ignore.

    Returns:
        ``(row_scale [..., R], col_scale [..., C])`` in ``x.dtype``, each in ``[exp(-0.3), exp(10)]``.
    """
    row_log = x.new_zeros(x.shape[:-1])
    col_log = x.new_zeros(x.shape[:-2] + x.shape[-1:])
    if iters == 0:
        return row_log.exp(), col_log.exp()
    weight = _entry_weight(x, row_valid, col_valid)

    def keep_valid(step: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        return step if valid is None else step * valid

    best_row, best_col = row_log, col_log
    best = imbalance(x, row_valid, col_valid)
    y = x
    for _ in range(iters):
        col_std = _masked_std(y, weight, -2).clamp(STD_MIN, STD_MAX)
        col_log = (col_log + keep_valid(col_std.log(), col_valid)).clamp(LOG_SCALE_MIN, LOG_SCALE_MAX)
        y = x / (row_log.exp().unsqueeze(-1) * col_log.exp().unsqueeze(-2))
        row_std = _masked_std(y, weight, -1).clamp(STD_MIN, STD_MAX)
        row_log = (row_log + keep_valid(row_std.log(), row_valid)).clamp(LOG_SCALE_MIN, LOG_SCALE_MAX)
        y = x / (row_log.exp().unsqueeze(-1) * col_log.exp().unsqueeze(-2))
        score = imbalance(y, row_valid, col_valid)
        better = score <= best * (1 + TIE_SLACK)
        best = torch.where(better, score, best)
        best_row = torch.where(better.unsqueeze(-1), row_log, best_row)
        best_col = torch.where(better.unsqueeze(-1), col_log, best_col)
    return best_row.exp(), best_col.exp()
