"""Long-context retrieval task (RULER-style): key -> value facts hidden at random depths in real code.

An item is ``context`` tokens of Python source (the stdlib code split, :mod:`kvarn_mla.evaluation.data`) with
*needles* (facts) inserted at line ends, at depths drawn uniformly over the whole context, followed by a query::

    ...    return result<|key|> render<|value|>4821
    ...
        def close(self):<|key|> stream<|value|> render        (a fact whose value is another key)
    ...
    <|query|> stream<|answer|>

and the model writes every fact on the way from the queried key to a number::

    <|key|> stream<|value|> render<|key|> render<|value|>4821

then ``<|endoftext|>``. A key is one lowercase word of :data:`WORDS` (a single token of the reference models'
tokenizer, with its leading space); a value is either :data:`VALUE_DIGITS` digits (single tokens) or another key.
Facts form *chains* ``k1 -> k2 -> ... -> number`` of 1..``MAX_HOPS`` facts: a one-fact chain is multi-key
associative recall, a longer one variable tracking (the model resolves one hop per written fact, so every hop
is the same lookup). Each key is defined by exactly one fact, so the token sequence ``<|key|> w<|value|>`` of a
lookup occurs exactly once earlier in the prompt. Items hold 4..8 chains, one of them queried; the others are
distractors (short contexts hold fewer facts, see :data:`TOKENS_PER_FACT`). :func:`check` demands the whole target;
:func:`check_answers` scores the numbers.

One query an item (RULER's multi-key needle and variable tracking; its multi-query variant dropped). Until
2026-12-02 held-out items asked 1..4 keys (``<|query|> stream table<|answer|>``, the chains answered in query
order): teacher-forced, the 4-layer reference models then wrote every looked-up value right (4 of 95 wrong at 2K
tokens) but never the second or a later queried key (32 of 32 wrong, after 2,460 training steps on items with up
to 8 queries): taking the next key from the query list is a pointer these models do not learn, and it is not the
long-range retrieval the task measures. Training drills may still pack several queries (``max_queries``).

Splits and seeds. An item is a pure function of ``(tokenizer, context, seed, index)``. Seeds in
:data:`TRAIN_SEEDS` make training items; every other seed makes held-out items. The two never share content,
by construction: held-out filler comes only from held-out code files (a SHA-256 rule on the file path), and
every number in a held-out item is a held-out value (a SHA-256 rule on the digits, :func:`value_split`), which
no training item ever contains, so no held-out answer was ever seen in training, whatever the seed or index.

Depths. Needles go at the end of a filler line (before its newline, after a non-space character); a needle's
depth is the token position of its ``<|key|>`` in the prompt over the prompt length, so with 128-token tiles
and a 128-token sink almost every answer sits in a quantized tile far from the tail.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .data import read_code_files
from .reasoning import ANSWER, EOS

__all__ = [
    "HELD_OUT_VALUE_PERCENT",
    "KEY",
    "MAX_CHAINS",
    "MAX_HOPS",
    "MAX_QUERIES",
    "MIN_CHAINS",
    "TOKENS_PER_FACT",
    "QUERY",
    "SPECIAL_TOKENS",
    "TRAIN_SEEDS",
    "VALUE",
    "VALUE_DIGITS",
    "VERSION",
    "WORDS",
    "Fact",
    "Item",
    "check",
    "check_answers",
    "depth_histogram",
    "fact_text",
    "held_out_items",
    "make_item",
    "parse_answers",
    "seed_split",
    "value_split",
]

KEY = "<|key|>"
VALUE = "<|value|>"
QUERY = "<|query|>"
SPECIAL_TOKENS: tuple[str, ...] = (KEY, VALUE, QUERY)  # added to the tokenizer next to the reasoning task's

VALUE_DIGITS = 4  # a number value is this many digits (each a single token)
HELD_OUT_VALUE_PERCENT = 20  # share of the 10**VALUE_DIGITS numbers reserved for held-out items
TRAIN_SEEDS = range(0, 1000)  # training items use these seeds only; any other seed gives held-out items
MIN_CHAINS, MAX_CHAINS = 4, 8
MAX_QUERIES = 1  # queried chains an item (held out; see the module docstring)
VERSION = 2  # of the held-out items: 1 asked 1..4 keys (until 2026-12-02), 2 asks one; results record it
MAX_HOPS = 3  # facts per chain
TOKENS_PER_FACT = 64  # short contexts hold fewer facts: at most one per this many tokens (no limit from 1,536 on)

# Keys: lowercase words that the reference tokenizer (byte-level BPE on the stdlib code) keeps as one token
# with their leading space; tests/test_reference_models.py checks that for the bundled tokenizer.
WORDS: tuple[str, ...] = tuple(
    """about above access action actual added address after again allow allowed already also always another archive
    argument array assert async await back base because been before being between binary block body bool both bound
    break buffer build built byte bytes cache call callback called calling calls cannot case cases change changes char
    chars check child chunk class client close closed code column command comment compile compiler complex config
    context continue cookie copy could count create created current custom data date debug decimal decode default
    defined dialog dict display document does domain done each either element elements else email empty encode encoded
    encoding ensure entry environ equal error errors even event events every exact example except exist exists exit
    expect expected explicit extra fail failed fails field fields file filename files filter final finally find first
    flag flags float follow form format found frame from full function future given global group hand handle handler
    happen hash have header headers help here host idle ignore import include indent index info initial inner input
    inspect instance instead integer into invalid issue item items just keep keys keyword lambda last least left length
    level like limit line lines link list literal load loader local locale lock logger logging long look loop mail main
    make manager many mapping mark master match math member memory message method methods missing mock mode module
    modules more most multiple must name named names need needed newline next node normal number numbers object objects
    offset once only operator option optional options order original other output over override pack package pair
    parent parse parser part parts pass passed patch path paths pattern pickle pipe platform point policy port position
    possible prefix present previous print process program proper protocol python queue raise raised raises random
    range read reader real recent record relative release remain remove replace request required requires resource
    response rest result results return returned returns right root running same save script search second seconds
    section select self send sent sequence server setting shape should show sign signal simple since single size skip
    slice socket some sorted source space spam special split stack standard start starts state stderr stdin stdout
    still stop stream strict string strings strip struct style subclass success such suffix suite super support sure
    syntax system table take target task temp test testing tests text than that their them then there these they thing
    this thread threads through time timeout times token trace tree true tuple type types under unicode until usage
    used user uses using valid value values variable verbose version wait want were what when where whether which while
    widget width will window with without work works would wrap wrapper write writer yield zero""".split()
)


@dataclass(frozen=True)
class Fact:
    """One needle: ``<|key|> key<|value|>value``.

    Attributes:
        key: the key word (without its leading space).
        value: :data:`VALUE_DIGITS` digits, or another key word (the next hop of a chain).
        depth: token position of the fact's ``<|key|>`` in the prompt divided by the prompt length, in [0, 1).
    """

    key: str
    value: str
    depth: float

    @property
    def text(self) -> str:
        """The fact as it appears in the prompt and in the target."""
        return fact_text(self.key, self.value)


@dataclass(frozen=True)
class Item:
    """One retrieval instance.

    Attributes:
        context: the token budget: ``prompt_tokens + target_tokens <= context`` (the end-of-text token not counted).
        seed, index: the item's identity (``make_item(tokenizer, context, seed, index)`` rebuilds it).
        split: ``"train"`` (seed in :data:`TRAIN_SEEDS`) or ``"held_out"``.
        facts: every needle, in prompt order.
        queries: the queried keys, in the order the target answers them.
        chains: per query, the keys visited from the queried key to the number (``chains[i][0] == queries[i]``).
        answers: per query, the number at the end of its chain.
        prompt: filler with the facts, then ``<|query|>``, the queried keys and ``<|answer|>``.
        target: the exact text to generate (without ``<|endoftext|>``).
        prompt_tokens, target_tokens: their lengths in tokens of the tokenizer the item was made with.
        code_start: character offset in the split's code stream where the filler starts (provenance).
    """

    context: int
    seed: int
    index: int
    split: str
    facts: tuple[Fact, ...]
    queries: tuple[str, ...]
    chains: tuple[tuple[str, ...], ...]
    answers: tuple[str, ...]
    prompt: str
    target: str
    prompt_tokens: int
    target_tokens: int
    code_start: int

    @property
    def text(self) -> str:
        """Training text: prompt, target and end-of-text token."""
        return self.prompt + self.target + EOS

    @property
    def answer_depths(self) -> tuple[float, ...]:
        """Depth of the last fact of each queried chain (the one holding the number)."""
        by_key = {f.key: f.depth for f in self.facts}
        return tuple(by_key[chain[-1]] for chain in self.chains)


def fact_text(key: str, value: str) -> str:
    """``<|key|> key<|value|>value``; a word value keeps its leading space, digits have none."""
    return f"{KEY} {key}{VALUE}{value if value.isdigit() else ' ' + value}"


def seed_split(seed: int) -> str:
    """``"train"`` for seeds in :data:`TRAIN_SEEDS`, ``"held_out"`` for every other seed."""
    return "train" if seed in TRAIN_SEEDS else "held_out"


def value_split(value: str) -> str:
    """Split a number value belongs to, from a SHA-256 hash of its digits (:data:`HELD_OUT_VALUE_PERCENT` held out)."""
    bucket = int.from_bytes(hashlib.sha256(f"value|{value}".encode()).digest()[:8], "big") % 100
    return "held_out" if bucket < HELD_OUT_VALUE_PERCENT else "train"


@lru_cache(maxsize=2)
def _values(split: str) -> tuple[str, ...]:
    return tuple(v for v in (f"{i:0{VALUE_DIGITS}d}" for i in range(10**VALUE_DIGITS)) if value_split(v) == split)


@lru_cache(maxsize=2)
def _code_stream(split: str) -> tuple[str, tuple[int, ...]]:
    """The split's code files joined (each ends in a newline), and the offsets of its line starts."""
    text = "".join(f.text if f.text.endswith("\n") else f.text + "\n" for f in read_code_files(split))
    starts, i = [0], text.find("\n")
    while 0 <= i < len(text) - 1:
        starts.append(i + 1)
        i = text.find("\n", i + 1)
    return text, tuple(starts)


def _chains(
    rng: random.Random, split: str, context: int, chains: tuple[int, int], max_queries: int, tokens_per_fact: int
) -> tuple[list[list[str]], list[str], list[int]]:
    """Draw chains of keys, each ending in a number, and the queried chains (indices); at most one fact per
    ``tokens_per_fact`` tokens of context (longer chains are shortened first)."""
    num_chains = rng.randint(*chains)
    hops = [rng.choice((1, 1) + tuple(range(2, MAX_HOPS + 1))) for _ in range(num_chains)]  # half one-fact chains
    limit = max(chains[0], context // tokens_per_fact)
    while sum(hops) > limit:
        if max(hops) > 1:
            hops[hops.index(max(hops))] -= 1
        else:
            hops.pop()
    num_chains = len(hops)
    words = rng.sample(WORDS, sum(hops))
    values = _values(split)
    numbers = []
    while len(numbers) < num_chains:  # distinct numbers, so a wrong chain never ends in the right number
        v = values[rng.randrange(len(values))]
        if v not in numbers:
            numbers.append(v)
    chains, at = [], 0
    for h in hops:
        chains.append(words[at : at + h])
        at += h
    queried = rng.sample(range(num_chains), rng.randint(1, min(max_queries, num_chains)))
    return chains, numbers, queried


def _line_ends(text: str, lo: int, hi: int) -> list[int]:
    """Offsets ``i`` in ``[lo, hi)`` with ``text[i] == "\\n"`` after a non-space character (needle slots)."""
    out, i = [], text.find("\n", lo, hi)
    while i >= 0:
        if i > 0 and not text[i - 1].isspace():
            out.append(i)
        i = text.find("\n", i + 1, hi)
    return out


def make_item(
    tokenizer,
    context: int,
    seed: int,
    index: int,
    *,
    chains: tuple[int, int] = (MIN_CHAINS, MAX_CHAINS),
    max_queries: int = MAX_QUERIES,
    tokens_per_fact: int = TOKENS_PER_FACT,
    max_tries: int = 8,
) -> Item:
    """Build item ``index`` of ``seed`` at ``context`` tokens, deterministically.

    Args:
        tokenizer: a tokenizer that knows :data:`SPECIAL_TOKENS` and ``<|answer|>`` as single tokens (the
            reference models'); it fixes the token counts, nothing else.
        context: token budget of prompt + target, at least 256.
        seed: :data:`TRAIN_SEEDS` for training items, any other integer for held-out items.
        index: item number, ``>= 0``.
        chains, max_queries, tokens_per_fact: how many chains (least, most), queries and facts per token an item
            holds. Held-out items always use the defaults (:data:`MIN_CHAINS`.. :data:`MAX_CHAINS`,
            :data:`MAX_QUERIES`, :data:`TOKENS_PER_FACT`); training may drill on denser items.
        max_tries: attempts at trimming the filler if the assembled prompt tokenizes longer than planned.

    Returns:
        The item, with ``prompt_tokens + target_tokens <= context``; the filler fills the rest of the budget
        (up to the end of a token).
    """
    if context < 256:
        raise ValueError(f"context must be at least 256 tokens, got {context=}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index=}")
    for t in (KEY, VALUE, QUERY, ANSWER):
        if len(tokenizer(t, add_special_tokens=False).input_ids) != 1:
            raise ValueError(f"the tokenizer does not keep {t!r} as one token; use the reference models' tokenizer")
    split = seed_split(seed)
    rng = random.Random(f"retrieval/{seed}/{context}/{index}")
    if not 1 <= chains[0] <= chains[1] or max_queries < 1 or tokens_per_fact < 1:
        raise ValueError(
            f"need 1 <= chains[0] <= chains[1], max_queries >= 1, tokens_per_fact >= 1, got {chains=}, "
            f"{max_queries=}, {tokens_per_fact=}"
        )
    chain_keys, numbers, queried = _chains(rng, split, context, chains, max_queries, tokens_per_fact)
    facts = [
        (c[h], c[h + 1] if h + 1 < len(c) else numbers[i]) for i, c in enumerate(chain_keys) for h in range(len(c))
    ]
    rng.shuffle(facts)
    depths = sorted(rng.random() for _ in facts)  # uniform over the whole context
    queries = [chain_keys[i][0] for i in queried]
    target = "".join(fact_text(k, v) for i in queried for k, v in zip(chain_keys[i], chain_keys[i][1:] + [numbers[i]]))
    tail = QUERY + "".join(" " + q for q in queries) + ANSWER

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    target_tokens = count(target)
    budget = context - target_tokens - count(tail) - sum(count(fact_text(k, v)) for k, v in facts)
    if budget < 8 * len(facts):
        raise ValueError(f"context {context} is too short for {len(facts)} facts and the query")
    stream, starts = _code_stream(split)
    for _ in range(100):  # a window with too few line ends for the facts (a data table, say) is drawn again
        code_start = starts[rng.randrange(len(starts))]
        chunk = stream[code_start : code_start + 8 * budget + 4096]
        if len(chunk) < 8 * budget:  # near the end of the stream: wrap around to its start
            chunk += stream[: 8 * budget + 4096 - len(chunk)]
        offsets = tokenizer(chunk, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
        if len(offsets) < budget:
            raise ValueError(f"the {split} code has too little text for {context} tokens")
        if len(_line_ends(chunk, 0, offsets[budget - 1][1])) >= len(facts):
            break
    else:
        raise RuntimeError(f"no code window with {len(facts)} line ends for item {seed}/{index}")
    for _ in range(max_tries):
        filler = chunk[: offsets[budget - 1][1]]
        slots = _line_ends(filler, 0, len(filler))
        # A fact at depth d goes to the first line end at or after the d-th share of the filler's tokens.
        token_starts = [o[0] for o in offsets[:budget]]
        cuts = []
        for d in depths:
            char = token_starts[min(budget - 1, int(d * budget))]
            j = min(bisect.bisect_left(slots, char), len(slots) - 1)
            cuts.append(slots[j])
        pieces, at = [], 0
        for cut, (k, v) in zip(cuts, facts):
            pieces += [filler[at:cut], fact_text(k, v)]
            at = cut
        prompt = "".join(pieces) + filler[at:] + tail
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        over = len(ids) + target_tokens - context
        if over <= 0:
            break
        budget -= over  # the filler tokenized differently next to a fact: trim and rebuild
    else:
        raise RuntimeError(f"could not fit item {seed}/{index} into {context} tokens")
    key_id = tokenizer.convert_tokens_to_ids(KEY)
    key_positions = [i for i, t in enumerate(ids) if t == key_id]
    assert len(key_positions) == len(facts), "a fact's <|key|> is missing from the prompt's tokens"
    return Item(
        context=context,
        seed=seed,
        index=index,
        split=split,
        facts=tuple(Fact(k, v, p / len(ids)) for (k, v), p in zip(facts, key_positions)),
        queries=tuple(queries),
        chains=tuple(tuple(chain_keys[i]) for i in queried),
        answers=tuple(numbers[i] for i in queried),
        prompt=prompt,
        target=target,
        prompt_tokens=len(ids),
        target_tokens=target_tokens,
        code_start=code_start,
    )


def held_out_items(tokenizer, context: int, seed: int, count: int, start: int = 0) -> list[Item]:
    """Items ``start .. start + count - 1`` of held-out ``seed`` (a seed outside :data:`TRAIN_SEEDS`).

    Raises:
        ValueError: ``seed`` is a training seed.
    """
    if seed_split(seed) != "held_out":
        raise ValueError(f"seed {seed} is a training seed (TRAIN_SEEDS = {TRAIN_SEEDS}); use a seed outside it")
    return [make_item(tokenizer, context, seed, i) for i in range(start, start + count)]


def _clean(generated_text: str) -> str:
    return generated_text.split(EOS, 1)[0].strip()


def parse_answers(generated_text: str) -> list[str]:
    """The numbers a generation gives, one per resolved chain: every ``<|value|>`` followed by digits."""
    out = []
    for part in _clean(generated_text).split(VALUE)[1:]:
        head = part.split(KEY, 1)[0]
        if head.isdigit():
            out.append(head)
    return out


def check(item: Item, generated_text: str) -> bool:
    """Exact match of the whole generation (every fact written, in order) against ``item.target``.

    Args:
        item: the instance.
        generated_text: the decoded continuation of ``item.prompt`` (special tokens kept); anything from the first
            ``<|endoftext|>`` on and surrounding whitespace are ignored.
    """
    return _clean(generated_text) == item.target


def check_answers(item: Item, generated_text: str) -> float:
    """Share of the queried numbers given right, in order (looser than :func:`check`)."""
    got = parse_answers(generated_text)
    return sum(a == b for a, b in zip(got, item.answers)) / len(item.answers)


def depth_histogram(items: Sequence[Item], bins: int = 10) -> list[int]:
    """How many queried answers fall in each of ``bins`` equal depth ranges (spread check)."""
    counts = [0] * bins
    for it in items:
        for d in it.answer_depths:
            counts[min(bins - 1, int(d * bins))] += 1
    return counts
