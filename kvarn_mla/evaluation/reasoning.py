"""Long-chain reasoning task: running sums modulo a prime, written out step by step.

An item lists ``n`` single digits ``a_1 .. a_n`` (50 <= n <= 200), each labelled by a key token
``<|k1|> .. <|kn|>``. The model must write the whole scratchpad, step ``i`` being ``<|ki|>a_i>s_i`` with
``s_i = (s_{i-1} + a_i) mod p`` (``s_0 = 0``), and then the final sum::

    prompt: <|problem|>sum mod 7:<|k1|>3<|k2|>5<|k3|>9...<|scratchpad|>
    target: <|k1|>3>3<|k2|>5>1<|k3|>9>3...<|answer|>3

Why this shape: every ``s_i`` depends on ``s_{i-1}``, so one wrong token anywhere in the 200-800 generated
tokens breaks every later step, and :func:`check` demands the whole target exactly (a lucky final digit
does not count). Each step needs a long-range lookup (recall ``a_i`` from the prompt by its key) and a
short-range one (the previous sum, 4 tokens back), which is exactly the traffic a quantized KV cache has
to get right. The keys are single format tokens so that the lookup is one-token associative recall,
which a few-million-parameter model learns within a CPU-hour; with two-digit indices (``07:3``) the
lookup needs a two-token match and our pilots had not learned it after 2.4M training tokens. Values and
sums stay single-digit tokens, so the arithmetic is digit arithmetic.

Instances are drawn from ``random.Random`` seeded with a string (stable across Python versions and
processes), and assigned to ``"train"`` or ``"held_out"`` by a SHA-256 hash of the instance itself, so the
two splits never share an instance no matter how many items are drawn from either.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

__all__ = [
    "ANSWER",
    "EOS",
    "HELD_OUT_PERCENT",
    "KEYS",
    "MAX_LEN",
    "MIN_LEN",
    "MODULUS",
    "PROBLEM",
    "SCRATCHPAD",
    "SPLITS",
    "SPECIAL_TOKENS",
    "Item",
    "check",
    "check_answer",
    "held_out_items",
    "instance_split",
    "make_item",
    "parse_answer",
    "train_items",
]

# Format tokens. They are added to the tokenizer as special tokens, so each is exactly one token.
PROBLEM = "<|problem|>"
SCRATCHPAD = "<|scratchpad|>"
ANSWER = "<|answer|>"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
MAX_LEN = 200  # longest chain, and number of key tokens
KEYS: tuple[str, ...] = tuple(f"<|k{i}|>" for i in range(1, MAX_LEN + 1))
SPECIAL_TOKENS: tuple[str, ...] = (EOS, PAD, PROBLEM, SCRATCHPAD, ANSWER, *KEYS)

MODULUS = 7  # prime; sums stay single digits so every step has the same width (4 tokens)
MIN_LEN = 50  # held-out chain lengths are drawn uniformly from [MIN_LEN, MAX_LEN]
HELD_OUT_PERCENT = 10  # share of the instance space that is held out (hash-based, see instance_split)
SPLITS = ("train", "held_out")


@dataclass(frozen=True)
class Item:
    """One reasoning instance.

    Attributes:
        index: position of the item within its split (``make_item(index, split)`` rebuilds it).
        split: ``"train"`` or ``"held_out"``.
        modulus: the prime ``p``.
        values: the digits ``a_1 .. a_n``.
        sums: the running sums ``s_1 .. s_n`` (``s_i = (s_{i-1} + a_i) mod p``).
        prompt: text given to the model, ending in ``<|scratchpad|>``.
        target: exact text the model must generate after the prompt (scratchpad, ``<|answer|>``, final
            sum), without the end-of-text token.
        answer: the final sum ``s_n`` as text.
    """

    index: int
    split: str
    modulus: int
    values: tuple[int, ...]
    sums: tuple[int, ...]
    prompt: str
    target: str
    answer: str

    @property
    def text(self) -> str:
        """Training text: prompt, target and end-of-text token."""
        return self.prompt + self.target + EOS


def instance_split(values: tuple[int, ...], modulus: int = MODULUS) -> str:
    """Split an instance belongs to, from a SHA-256 hash of the instance (not of its index).

    Args:
        values: the digits ``a_1 .. a_n``.
        modulus: the prime ``p``.

    Returns:
        ``"held_out"`` for ``HELD_OUT_PERCENT`` percent of the instance space, ``"train"`` otherwise.
    """
    key = f"{modulus}|{''.join(map(str, values))}".encode()
    bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 100
    return "held_out" if bucket < HELD_OUT_PERCENT else "train"


def _render(values: tuple[int, ...], modulus: int) -> tuple[tuple[int, ...], str, str]:
    sums: list[int] = []
    s = 0
    for a in values:
        s = (s + a) % modulus
        sums.append(s)
    prompt = f"{PROBLEM}sum mod {modulus}:" + "".join(f"{k}{a}" for k, a in zip(KEYS, values)) + SCRATCHPAD
    steps = "".join(f"{k}{a}>{s}" for k, (a, s) in zip(KEYS, zip(values, sums)))
    target = f"{steps}{ANSWER}{sums[-1]}"
    return tuple(sums), prompt, target


def make_item(
    index: int,
    split: str = "held_out",
    *,
    min_len: int = MIN_LEN,
    max_len: int = MAX_LEN,
    modulus: int = MODULUS,
) -> Item:
    """Build item ``index`` of ``split``, deterministically.

    Draws candidates from ``random.Random(f"{split}/{index}/{attempt}")`` until one hashes into ``split``
    (about 10 attempts for ``"held_out"``, 1.1 for ``"train"``).

    Args:
        index: item number within the split, ``>= 0``.
        split: ``"train"`` or ``"held_out"``.
        min_len: shortest chain (number of digits), ``>= 1``.
        max_len: longest chain, ``<= MAX_LEN`` (one key token per step).
        modulus: the prime ``p``, at most 10 so sums are single digits.

    Returns:
        The item.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split=}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index=}")
    if not 1 <= min_len <= max_len <= MAX_LEN:
        raise ValueError(f"need 1 <= min_len <= max_len <= {MAX_LEN}, got {min_len=}, {max_len=}")
    if not 2 <= modulus <= 10:
        raise ValueError(f"modulus must be in [2, 10] so sums are one digit, got {modulus=}")
    attempt = 0
    while True:
        rng = random.Random(f"{split}/{index}/{attempt}")
        n = rng.randint(min_len, max_len)
        values = tuple(rng.randrange(10) for _ in range(n))
        if instance_split(values, modulus) == split:
            sums, prompt, target = _render(values, modulus)
            return Item(index, split, modulus, values, sums, prompt, target, str(sums[-1]))
        attempt += 1


def held_out_items(n: int, start: int = 0, **kwargs: int) -> list[Item]:
    """The first ``n`` held-out items (from ``start``); the evaluation set is always a prefix of this list.

    Args:
        n: number of items.
        start: index of the first item.
        **kwargs: ``min_len``, ``max_len``, ``modulus`` forwarded to :func:`make_item`.
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
    """Exact match of the whole generation (scratchpad and answer) against ``item.target``.

    Args:
        item: the instance.
        generated_text: the decoded continuation of ``item.prompt`` (special tokens kept); anything from
            the first ``<|endoftext|>`` on and surrounding whitespace are ignored.

    Returns:
        True only if every step and the final answer are exactly right.
    """
    return _clean(generated_text) == item.target


def check_answer(item: Item, generated_text: str) -> bool:
    """Looser check: only the final answer must match (a 1-in-``p`` guess passes; report ``check``)."""
    return parse_answer(generated_text) == item.answer
