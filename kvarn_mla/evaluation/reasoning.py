"""Long-chain reasoning task: iterated running sums modulo a prime, written out row by row.

An item gives a row of ``W`` digits. The model must write ``G`` more rows, each the running sums modulo
``p = 7`` of the row above, and then the last number. Every row, the prompt's included, opens with the number
of rows still to write (two digits), so the model knows when to stop, and ends in the ``<|scratchpad|>`` token
(version 2, ``W = 20``)::

    prompt: <|problem|>0331415926535897932384<|scratchpad|>
    target: 0234120243142355035126<|scratchpad|>0130133525635164405610<|scratchpad|>
            0033403131031215220600<|answer|>0     (G = 3)

so cell ``(g, j) = (cell(g, j-1) + cell(g-1, j)) mod p`` and the counter is the one above minus one. One
wrong digit changes every later cell to its right in its row and below it, so an early slip breaks the
end (the last cell is downstream of every cell); :func:`check` demands the whole target exactly.

The row width and the held-out row range are versioned (:class:`Task`), and a checkpoint records the version it
was trained on in its config (:func:`record_task`, :func:`task_of`; a config that says nothing is version 1):

- version 1 (the first reference models): 16-digit rows, 16-48 held-out rows, a row is 19 tokens (digits and
  the row break are single tokens): 306-914 generated tokens;
- version 2: 20-digit rows, 16-96 held-out rows, a row is 23 tokens: 369-2,209 generated tokens, and items of
  87 rows or more write at least 2,000 (the two-digit counter allows at most 99 rows).

Items of a version are drawn from the same seeds whatever the other versions: adding a version changes no item.

Why this shape (measured, see benchmarks/models/README.md): the reference models must learn the task
in about a CPU-hour. Lookups whose target is found by content (a value by its index or key token) or
sits more than ~30 tokens back were still at chance after 300-400 training steps in every pilot of the first
models, while fixed-offset lookups (the cell to the left, 1 token back, and the cell above, one row back) are
learned within a few hundred steps. The cell above is the token the previous row wrote one row (19 or 23
positions) earlier, so every step reads the cache across a row boundary. The row break is a special token: with
a newline (a token code uses everywhere) neither a 512-token probe nor two full training runs learned the lookup.

Instances come from ``random.Random`` seeded with a string (stable across Python versions and processes)
and are assigned to ``"train"`` or ``"held_out"`` by a SHA-256 hash of the starting row, so the splits
never share a starting row, whatever the number of rows or items drawn.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

__all__ = [
    "ANSWER",
    "COUNTER",
    "EOS",
    "HELD_OUT_PERCENT",
    "LATEST",
    "MODULUS",
    "PAD",
    "PROBLEM",
    "SCRATCHPAD",
    "SPECIAL_TOKENS",
    "SPLITS",
    "TASKS",
    "TASK_KEY",
    "V1",
    "V2",
    "Item",
    "Task",
    "check",
    "check_answer",
    "held_out_items",
    "instance_split",
    "item_tokens",
    "make_item",
    "record_task",
    "render",
    "solve",
    "parse_answer",
    "task_of",
    "train_items",
]

# Format tokens. They are added to the tokenizer as special tokens, so each is exactly one token.
PROBLEM = "<|problem|>"
SCRATCHPAD = "<|scratchpad|>"
ANSWER = "<|answer|>"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS, PAD, PROBLEM, SCRATCHPAD, ANSWER)

MODULUS = 7  # prime; cells after the first row are single digits 0..6
COUNTER = 2  # digits of the rows-to-go counter that opens every row
HELD_OUT_PERCENT = 10  # share of starting rows that are held out (hash-based, see instance_split)
SPLITS = ("train", "held_out")
TASK_KEY = "reasoning_task"  # the config attribute a checkpoint records its task version in


@dataclass(frozen=True)
class Task:
    """One version of the task: the row width and the row range of held-out items.

    Attributes:
        version: the number a checkpoint records (:func:`record_task`).
        width: cells per row ``W``.
        min_rows: fewest generated rows of a held-out item.
        max_rows: most generated rows of a held-out item (at most 99: the counter has two digits).
    """

    version: int
    width: int
    min_rows: int
    max_rows: int

    @property
    def row_tokens(self) -> int:
        """Tokens per row (counter, cells, row break): the cell above is this many tokens back."""
        return COUNTER + self.width + 1

    @property
    def prompt_tokens(self) -> int:
        """Tokens of an item's prompt (``<|problem|>``, counter, cells, ``<|scratchpad|>``)."""
        return 2 + COUNTER + self.width

    def to_dict(self) -> dict[str, int]:
        """What a checkpoint's config records (the modulus too, for a reader of config.json)."""
        return {
            "version": self.version,
            "width": self.width,
            "min_rows": self.min_rows,
            "max_rows": self.max_rows,
            "modulus": MODULUS,
        }


V1 = Task(1, width=16, min_rows=16, max_rows=48)  # the first reference models: 306-914 generated tokens
V2 = Task(2, width=20, min_rows=16, max_rows=96)  # 369-2,209 generated tokens, 2,000+ from 87 rows
TASKS: dict[int, Task] = {t.version: t for t in (V1, V2)}
LATEST = V2  # what the generators default to and the training recipe uses


def task_of(config) -> Task:
    """The task version a checkpoint was trained on, from its config's ``reasoning_task`` entry.

    Args:
        config: a model config (``model.config``) or the dict of a ``config.json``.

    Returns:
        The recorded :class:`Task`; :data:`V1` when the config records none (the checkpoints before versions).

    Raises:
        ValueError: the recorded version is unknown, or its fields differ from that version's.
    """
    spec = config.get(TASK_KEY) if isinstance(config, dict) else getattr(config, TASK_KEY, None)
    if spec is None:
        return V1
    version = spec.get("version") if isinstance(spec, dict) else spec
    if version not in TASKS:
        raise ValueError(f"unknown reasoning task version in config.{TASK_KEY}: {spec!r}; known: {sorted(TASKS)}")
    task = TASKS[version]
    if isinstance(spec, dict) and spec != task.to_dict():
        raise ValueError(f"config.{TASK_KEY} = {spec!r} differs from version {version}: {task.to_dict()}")
    return task


def record_task(config, task: Task) -> None:
    """Record ``task`` in a model config (saved with it to config.json), for :func:`task_of`."""
    setattr(config, TASK_KEY, task.to_dict())


@dataclass(frozen=True)
class Item:
    """One reasoning instance.

    Attributes:
        index: position of the item within its split (``make_item(index, split, task=...)`` rebuilds it).
        split: ``"train"`` or ``"held_out"``.
        modulus: the prime ``p``.
        rows: the starting row (digits 0..9) followed by the ``G`` generated rows (digits 0..p-1).
        prompt: text given to the model, ending in ``<|scratchpad|>``.
        target: exact text the model must generate after the prompt (rows separated by ``<|scratchpad|>``,
            ``<|answer|>``, the last cell), without the end-of-text token.
        answer: the last cell as text.
    """

    index: int
    split: str
    modulus: int
    rows: tuple[tuple[int, ...], ...]
    prompt: str
    target: str
    answer: str

    @property
    def num_rows(self) -> int:
        """Number of generated rows ``G``."""
        return len(self.rows) - 1

    @property
    def width(self) -> int:
        """Cells per row ``W``."""
        return len(self.rows[0])

    @property
    def text(self) -> str:
        """Training text: prompt, target and end-of-text token."""
        return self.prompt + self.target + EOS


def instance_split(start: tuple[int, ...], modulus: int = MODULUS) -> str:
    """Split a starting row belongs to, from a SHA-256 hash of the row (not of the item index).

    Args:
        start: the starting row.
        modulus: the prime ``p``.

    Returns:
        ``"held_out"`` for ``HELD_OUT_PERCENT`` percent of starting rows, ``"train"`` otherwise.
    """
    key = f"{modulus}|{''.join(map(str, start))}".encode()
    bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 100
    return "held_out" if bucket < HELD_OUT_PERCENT else "train"


def solve(start: tuple[int, ...], num_rows: int, modulus: int = MODULUS) -> tuple[tuple[int, ...], ...]:
    """The starting row followed by ``num_rows`` rows of running sums modulo ``modulus``."""
    rows = [tuple(start)]
    for _ in range(num_rows):
        out, s = [], 0
        for x in rows[-1]:
            s = (s + x) % modulus
            out.append(s)
        rows.append(tuple(out))
    return tuple(rows)


def render(rows: tuple[tuple[int, ...], ...], modulus: int = MODULUS) -> tuple[str, str]:
    """Prompt and target text for a solved grid (``rows[0]`` is the starting row)."""
    last = len(rows) - 1
    if last >= 10**COUNTER:
        raise ValueError(f"at most {10**COUNTER - 1} rows fit the {COUNTER}-digit counter, got {last}")
    text = [f"{last - g:0{COUNTER}d}" + "".join(map(str, r)) for g, r in enumerate(rows)]
    prompt = PROBLEM + text[0] + SCRATCHPAD
    target = SCRATCHPAD.join(text[1:]) + f"{ANSWER}{rows[-1][-1]}"
    return prompt, target


def make_item(
    index: int,
    split: str = "held_out",
    *,
    task: Task = LATEST,
    min_rows: int | None = None,
    max_rows: int | None = None,
    modulus: int = MODULUS,
) -> Item:
    """Build item ``index`` of ``split``, deterministically.

    Draws candidates from ``random.Random(f"{split}/{index}/{attempt}")`` until the starting row hashes
    into ``split`` (about 10 attempts for ``"held_out"``, 1.1 for ``"train"``).

    Args:
        index: item number within the split, ``>= 0``.
        split: ``"train"`` or ``"held_out"``.
        task: the version (row width and default row range); a model's is :func:`task_of` its config.
        min_rows: fewest generated rows, ``>= 1`` (default ``task.min_rows``).
        max_rows: most generated rows (default ``task.max_rows``).
        modulus: the prime ``p``, at most 10 so cells are single digits.

    Returns:
        The item.
    """
    min_rows, max_rows = _row_range(task, min_rows, max_rows)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split=}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index=}")
    if not 1 <= min_rows <= max_rows:
        raise ValueError(f"need 1 <= min_rows <= max_rows, got {min_rows=}, {max_rows=}")
    if not 2 <= modulus <= 10:
        raise ValueError(f"modulus must be in [2, 10] so cells are one digit, got {modulus=}")
    num_rows, start = _draw(index, split, task.width, min_rows, max_rows, modulus)
    rows = solve(start, num_rows, modulus)
    prompt, target = render(rows, modulus)
    return Item(index, split, modulus, rows, prompt, target, str(rows[-1][-1]))


def _row_range(task: Task, min_rows: int | None, max_rows: int | None) -> tuple[int, int]:
    if not isinstance(task, Task):
        raise TypeError(f"task must be a reasoning.Task (e.g. reasoning.V2), got {task!r}")
    return task.min_rows if min_rows is None else min_rows, task.max_rows if max_rows is None else max_rows


def _draw(
    index: int, split: str, width: int, min_rows: int, max_rows: int, modulus: int
) -> tuple[int, tuple[int, ...]]:
    # The seed string names no version: a version is its width and row range, and adding one changes no item.
    attempt = 0
    while True:
        rng = random.Random(f"{split}/{index}/{attempt}")
        num_rows = rng.randint(min_rows, max_rows)
        start = tuple(rng.randrange(10) for _ in range(width))
        if instance_split(start, modulus) == split:
            return num_rows, start
        attempt += 1


def item_tokens(
    index: int,
    split: str = "held_out",
    *,
    task: Task = LATEST,
    min_rows: int | None = None,
    max_rows: int | None = None,
    modulus: int = MODULUS,
) -> tuple[int, int]:
    """Token counts ``(prompt, target)`` of ``make_item(index, split, ...)`` without building it (digits and format
    strings are single tokens; the target's count includes the end-of-text token), for packing training rows."""
    min_rows, max_rows = _row_range(task, min_rows, max_rows)
    num_rows, _ = _draw(index, split, task.width, min_rows, max_rows, modulus)
    return task.prompt_tokens, num_rows * task.row_tokens + 2


def held_out_items(n: int, start: int = 0, **kwargs) -> list[Item]:
    """The first ``n`` held-out items (from ``start``); the evaluation set is always a prefix of this list.

    Args:
        n: number of items.
        start: index of the first item.
        **kwargs: ``task``, ``min_rows``, ``max_rows``, ``modulus`` forwarded to :func:`make_item`.
    """
    return [make_item(i, "held_out", **kwargs) for i in range(start, start + n)]


def train_items(n: int, start: int = 0, **kwargs) -> list[Item]:
    """Training items ``start .. start + n - 1``; see :func:`held_out_items`."""
    return [make_item(i, "train", **kwargs) for i in range(start, start + n)]


def _clean(generated_text: str) -> str:
    # Generation may run on past the end-of-text token or decode it; everything after it is ignored.
    return generated_text.split(EOS, 1)[0].strip()


def parse_answer(generated_text: str) -> str | None:
    """Final answer in a generation (the text after ``<|answer|>``), or ``None`` if there is none."""
    text = _clean(generated_text)
    if ANSWER not in text:
        return None
    return text.rsplit(ANSWER, 1)[1].strip()


def check(item: Item, generated_text: str) -> bool:
    """Exact match of the whole generation (every row and the answer) against ``item.target``.

    Args:
        item: the instance.
        generated_text: the decoded continuation of ``item.prompt`` (special tokens kept); anything from
            the first ``<|endoftext|>`` on and surrounding whitespace are ignored.

    Returns:
        True only if every cell and the final answer are exactly right.
    """
    return _clean(generated_text) == item.target


def check_answer(item: Item, generated_text: str) -> bool:
    """Looser check: only the final answer must match (a 1-in-``p`` guess passes; report ``check``)."""
    return parse_answer(generated_text) == item.answer
