"""Paired statistics of generation results: every method scored on the same items, compared item by item.

Two methods' exact-match rates on the same items are compared with the exact McNemar test on the items where they
disagree (`checkers.mcnemar_exact`), not by their intervals: the pairing removes the items' own difficulty, which
dominates the variance at a hundred items. Each method is compared with KVarN and with rotation-only at its own
bit width (``kvarn-B``, ``rot-B``), the two quantizers whose difference the project measures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .checkers import mcnemar_exact, wilson_interval

PARTNERS = ("kvarn", "rot")  # quantizer families every method is paired with, at its bit width


def load_verdicts(path: Path, check: str = "exact") -> dict[str, dict[str, bool]]:
    """``{method: {item key: verdict}}`` of a records file (``OUT.jsonl`` of `kvarn-mla eval`): ``check`` of every
    generation record (greedy or teacher-forced), in the order the methods first appear."""
    out: dict[str, dict[str, bool]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if check in record:
                out.setdefault(record["method"], {})[record["key"]] = bool(record[check])
    return out


def bits_of(method: str) -> int | None:
    """The bit width named by a method (``kvarn-3``, ``rot-2+rope_bits=8``, ``hf-quanto-4``), or None (a preset
    such as ``k4v2``, the reference, ``hf-fp8``)."""
    match = re.search(r"-(\d)(?:\+|$)", method)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Comparison:
    """``method`` against ``partner`` on their common items: right only with one or the other, and the p-value."""

    partner: str
    only_method: int
    only_partner: int
    p_value: float

    @property
    def difference(self) -> int:
        """Items right with the method minus items right with the partner (of the common items)."""
        return self.only_method - self.only_partner


@dataclass(frozen=True)
class PairedRow:
    """One method's exact match (Wilson 95% interval) and its paired comparisons."""

    method: str
    n: int
    correct: int
    ci95: tuple[float, float]
    comparisons: tuple[Comparison, ...]

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0


def compare(a: dict[str, bool], b: dict[str, bool], partner: str) -> Comparison:
    """Paired comparison of two methods' verdicts on the items both have."""
    keys = a.keys() & b.keys()
    only_a = sum(a[k] and not b[k] for k in keys)
    only_b = sum(b[k] and not a[k] for k in keys)
    return Comparison(partner, only_a, only_b, mcnemar_exact(only_a, only_b))


def paired_rows(verdicts: dict[str, dict[str, bool]], also: tuple[str, ...] = ()) -> list[PairedRow]:
    """For each method: exact match with its Wilson interval, and the exact McNemar comparison with each method of
    ``also`` (e.g. the 16-bit reference) and with ``kvarn-B`` and ``rot-B`` at its bit width B, where those ran
    (itself excluded)."""
    rows = []
    for method, mine in verdicts.items():
        bits = bits_of(method)
        partners = [*also, *([f"{family}-{bits}" for family in PARTNERS] if bits is not None else [])]
        comparisons = tuple(compare(mine, verdicts[p], p) for p in partners if p in verdicts and p != method)
        correct = sum(mine.values())
        rows.append(PairedRow(method, len(mine), correct, wilson_interval(correct, len(mine)), comparisons))
    return rows
