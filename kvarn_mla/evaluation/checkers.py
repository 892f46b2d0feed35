"""Answer checkers and the generic JSONL task format, for running MATH500-, AIME- or GSM8K-style files.

A task file has one JSON object per line: ``{"prompt": str, "answer": str}``, optionally ``"id"`` and
``"checker"`` (``exact``, ``last-number`` or ``boxed``; the file-wide default otherwise).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _normalize(text: str) -> str:
    return " ".join(text.split())


def check_exact(generated: str, answer: str) -> bool:
    """The completion equals the answer up to surrounding and repeated whitespace."""
    return _normalize(generated) == _normalize(answer)


def last_number(text: str) -> float | None:
    """The last number in ``text`` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def check_last_number(generated: str, answer: str) -> bool:
    """The last number of the completion equals the answer's number."""
    got, want = last_number(generated), last_number(answer)
    return got is not None and want is not None and abs(got - want) <= 1e-9 * max(1.0, abs(want))


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def _canonical_math(text: str) -> str:
    return text.replace(" ", "").replace("$", "").replace("\\left", "").replace("\\right", "").strip()


def check_boxed(generated: str, answer: str) -> bool:
    """The last ``\\boxed{}`` of the completion equals the answer (spaces and ``$`` ignored; a boxed answer in
    ``answer`` is unwrapped first)."""
    got = last_boxed(generated)
    want = last_boxed(answer) or answer
    return got is not None and _canonical_math(got) == _canonical_math(want)


CHECKERS: dict[str, Callable[[str, str], bool]] = {
    "exact": check_exact,
    "last-number": check_last_number,
    "boxed": check_boxed,
}


@dataclass(frozen=True)
class Task:
    """One line of a task file."""

    id: str
    prompt: str
    answer: str
    checker: str

    def check(self, generated: str) -> bool:
        return CHECKERS[self.checker](generated, self.answer)


def load_tasks(path: str | Path, checker: str = "exact") -> list[Task]:
    """Read a JSONL task file.

    Raises:
        ValueError: naming the file and line for malformed JSON, a missing or non-string ``prompt``/``answer``,
            an unknown checker, or a duplicate id.
    """
    if checker not in CHECKERS:
        raise ValueError(f"unknown checker {checker!r}; allowed: {sorted(CHECKERS)}")
    tasks, seen = [], set()
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(record).__name__}")
        for key in ("prompt", "answer"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{where}: '{key}' must be a string, got {record.get(key)!r}")
        item_checker = record.get("checker", checker)
        if item_checker not in CHECKERS:
            raise ValueError(f"{where}: unknown checker {item_checker!r}; allowed: {sorted(CHECKERS)}")
        task_id = str(record.get("id", number))
        if task_id in seen:
            raise ValueError(f"{where}: duplicate id {task_id!r}")
        seen.add(task_id)
        tasks.append(Task(task_id, record["prompt"], record["answer"], item_checker))
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def wilson_interval(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if total == 0:
        return 0.0, 1.0
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * ((p * (1 - p) / total + z * z / (4 * total * total)) ** 0.5) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact McNemar p-value of paired right/wrong outcomes: the discordant items (right with the first
    method only, right with the second only) against a fair coin, ``min(1, 2 P[X <= min])`` with
    ``X ~ Binomial(only_first + only_second, 1/2)``; 1.0 when no item is discordant."""
    discordant = only_first + only_second
    smaller = min(only_first, only_second)
    tail = sum(math.comb(discordant, k) for k in range(smaller + 1)) / 2**discordant
    return min(1.0, 2 * tail)
