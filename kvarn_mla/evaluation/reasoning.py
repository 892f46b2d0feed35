"""Long-chain reasoning task: iterated running sums modulo a prime, written out row by row.

An item gives a row of ``W = 16`` digits. The model must write ``G`` more rows (16 <= G <= 48 held out),
each the running sums modulo ``p = 7`` of the row above, and then the last number. Every row, the
prompt's included, opens with the number of rows still to write (two digits), so the model knows when to
stop, and ends in the ``<|scratchpad|>`` token::

    prompt: <|problem|>033141592653589793<|scratchpad|>
    target: 023412024314235503<|scratchpad|>013013352563516440<|scratchpad|>003340313103121522<|answer|>2
            (G = 3)

so cell ``(g, j) = (cell(g, j-1) + cell(g-1, j)) mod p`` and the counter is the one above minus one. One
wrong digit changes every later cell to its right in its row and below it, so an early slip breaks the
end (the last cell is downstream of every cell); :func:`check` demands the whole target exactly. A row
is 19 tokens (digits and the row break are single tokens): 306-914 generated tokens held out.

Why this shape (measured, see benchmarks/models/README.md): the reference models must learn the task
in about a CPU-hour. Lookups whose target is found by content (a value by its index or key token) or
sits more than ~30 tokens back were still at chance after 300-400 training steps in every pilot, while
fixed-offset lookups (the cell to the left, 1 token back, and the cell above, one row back) are learned
within a few hundred steps. The cell above is the token the previous row wrote 19 positions earlier, so
every step reads the cache across a row boundary. The row break is a special token: with a newline (a
token code uses everywhere) neither a 512-token probe nor two full training runs learned the lookup.

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
    "MAX_ROWS",
    "MIN_ROWS",
    "MODULUS",
    "PAD",
    "PROBLEM",
    "ROW_TOKENS",
    "SCRATCHPAD",
    "SPECIAL_TOKENS",
    "SPLITS",
    "WIDTH",
    "Item",
    "check",
    "check_answer",
    "held_out_items",
    "instance_split",
    "item_tokens",
    "make_item",
    "render",
    "solve",
    "parse_answer",
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
WIDTH = 16  # cells per row
COUNTER = 2  # digits of the rows-to-go counter that opens every row
ROW_TOKENS = COUNTER + WIDTH + 1  # the cell above is this many tokens back (counter and row break count)
MIN_ROWS = 16  # held-out items have MIN_ROWS..MAX_ROWS generated rows
MAX_ROWS = 48
HELD_OUT_PERCENT = 10  # share of starting rows that are held out (hash-based, see instance_split)
SPLITS = ("train", "held_out")


@dataclass(frozen=True)
class Item:
    """One reasoning instance.

    Attributes:
        index: position of the item within its split (``make_item(index, split)`` rebuilds it).
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
    min_rows: int = MIN_ROWS,
    max_rows: int = MAX_ROWS,
    modulus: int = MODULUS,
) -> Item:
    """Build item ``index`` of ``split``, deterministically.

    Draws candidates from ``random.Random(f"{split}/{index}/{attempt}")`` until the starting row hashes
    into ``split`` (about 10 attempts for ``"held_out"``, 1.1 for ``"train"``).

    Args:
        index: item number within the split, ``>= 0``.
        split: ``"train"`` or ``"held_out"``.
        min_rows: fewest generated rows, ``>= 1``.
        max_rows: most generated rows.
        modulus: the prime ``p``, at most 10 so cells are single digits.

    Returns:
        The item.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split=}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index=}")
    if not 1 <= min_rows <= max_rows:
        raise ValueError(f"need 1 <= min_rows <= max_rows, got {min_rows=}, {max_rows=}")
    if not 2 <= modulus <= 10:
        raise ValueError(f"modulus must be in [2, 10] so cells are one digit, got {modulus=}")
    num_rows, start = _draw(index, split, min_rows, max_rows, modulus)
    rows = solve(start, num_rows, modulus)
    prompt, target = render(rows, modulus)
    return Item(index, split, modulus, rows, prompt, target, str(rows[-1][-1]))


def _draw(index: int, split: str, min_rows: int, max_rows: int, modulus: int) -> tuple[int, tuple[int, ...]]:
    attempt = 0
    while True:
        rng = random.Random(f"{split}/{index}/{attempt}")
        num_rows = rng.randint(min_rows, max_rows)
        start = tuple(rng.randrange(10) for _ in range(WIDTH))
        if instance_split(start, modulus) == split:
            return num_rows, start
        attempt += 1


def item_tokens(
    index: int, split: str = "held_out", *, min_rows: int = MIN_ROWS, max_rows: int = MAX_ROWS, modulus: int = MODULUS
) -> tuple[int, int]:
    """Token counts ``(prompt, target)`` of ``make_item(index, split, ...)`` without building it (digits and format
    strings are single tokens; the target's count includes the end-of-text token), for packing training rows."""
    num_rows, _ = _draw(index, split, min_rows, max_rows, modulus)
    return 2 + COUNTER + WIDTH, num_rows * ROW_TOKENS + 2


def held_out_items(n: int, start: int = 0, **kwargs: int) -> list[Item]:
    """The first ``n`` held-out items (from ``start``); the evaluation set is always a prefix of this list.

    Args:
        n: number of items.
        start: index of the first item.
        **kwargs: ``min_rows``, ``max_rows``, ``modulus`` forwarded to :func:`make_item`.
    """
    return [make_item(i, "held_out", **kwargs) for i in range(start, start + n)]


def train_items(n: int, start: int = 0, **kwargs: int) -> list[Item]:
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
