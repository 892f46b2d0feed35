"""Generation tasks: the reference models' long-chain reasoning and long-context retrieval sets, and user JSONL files
with named checkers."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..cache import KVarNLayer
from . import reasoning, retrieval
from .checkers import load_tasks
from .methods import Method


@dataclass(frozen=True)
class GenerationItem:
    """A prompt to complete and how to score the completion.

    Attributes:
        id: Stable identifier (results are resumed by it).
        prompt: Text to continue.
        checks: Named checks of the decoded completion; the first is the headline one.
        max_new_tokens: Generation budget.
        target: The completion the headline check accepts, token for token (teacher-forced scoring), if known.
    """

    id: str
    prompt: str
    checks: dict[str, Callable[[str], bool]]
    max_new_tokens: int
    target: str | None = None


def reasoning_items(tokenizer, count: int, *, task: reasoning.Task, margin: int = 8) -> list[GenerationItem]:
    """The first ``count`` held-out long-chain items of ``task`` (a model's is `reasoning.task_of` its config); exact
    match of the whole scratchpad is the headline check."""
    items = []
    for item in reasoning.held_out_items(count, task=task):
        budget = len(tokenizer(item.target, add_special_tokens=False).input_ids) + margin
        items.append(GenerationItem(
            f"reasoning-{item.index}", item.prompt,
            {"exact": lambda text, item=item: reasoning.check(item, text),
             "answer": lambda text, item=item: reasoning.check_answer(item, text)},
            budget, item.target,
        ))
    return items


def retrieval_items(tokenizer, context: int, seed: int, count: int, margin: int = 4) -> list[GenerationItem]:
    """``count`` fresh held-out retrieval items of ``context`` tokens from ``seed`` (a seed outside
    `retrieval.TRAIN_SEEDS`: its items share no code file and no number with training). Checks: ``exact`` (the whole
    target, every fact on the way) and ``numbers`` (the queried numbers, in order)."""
    items = []
    for item in retrieval.held_out_items(tokenizer, context, seed, count):
        items.append(GenerationItem(
            f"retrieval-{context}-{seed}-{item.index}", item.prompt,
            {"exact": lambda text, item=item: retrieval.check(item, text),
             "numbers": lambda text, item=item: retrieval.check_answers(item, text) == 1.0},
            item.target_tokens + margin, item.target,
        ))
    return items


def reasoning_text(tokenizer, tokens: int, *, task: reasoning.Task) -> torch.Tensor:
    """``[1, tokens]`` ids of held-out long-chain items of ``task`` written out back to back (prompt, scratchpad,
    answer, end of text), the teacher-forced text of the accumulation suite on the reference models.

    Almost every token of it is determined by the tokens before (only the digits of each starting row are not),
    so the 16-bit next-token distributions are sharp, unlike on code, where these small models are near unigram.
    Keep ``tokens`` within the reasoning lengths the models were trained on (1,024 for the version-1 models): past
    it they lose the task.
    """
    ids: list[int] = []
    index = 0
    while len(ids) < tokens:
        ids += tokenizer(reasoning.make_item(index, task=task).text, add_special_tokens=False).input_ids
        index += 1
    return torch.tensor([ids[:tokens]])


def reasoning_chain_prompt(tokenizer, *, task: reasoning.Task, rows: int | None = None) -> tuple[torch.Tensor, int]:
    """The prompt ``[1, P]`` of the first held-out item of ``task`` with ``rows`` rows (default its most) and the
    length of its target in tokens: the free-running greedy comparison of the accumulation suite then decodes a whole
    chain."""
    rows = task.max_rows if rows is None else rows
    item = reasoning.make_item(0, task=task, min_rows=rows, max_rows=rows)
    prompt = tokenizer(item.prompt, add_special_tokens=False, return_tensors="pt").input_ids
    return prompt, len(tokenizer(item.target, add_special_tokens=False).input_ids)


def jsonl_items(path: str, checker: str, max_new_tokens: int) -> list[GenerationItem]:
    """Items of a user task file (see `kvarn_mla.evaluation.checkers.load_tasks`)."""
    return [GenerationItem(task.id, task.prompt, {task.checker: task.check}, max_new_tokens)
            for task in load_tasks(path, checker)]


@torch.no_grad()
def generate_items(
    model,
    tokenizer,
    items: Sequence[GenerationItem],
    method: Method,
    *,
    batch_size: int = 8,
    sampling: dict | None = None,
) -> Iterator[dict]:
    """Complete ``items`` with ``method``'s cache, in left-padded batches of similar length; yields one record
    per item: ``id``, each check's result, ``new_tokens`` and the completion ``text``.

    Args:
        sampling: ``generate`` sampling arguments (default greedy: ``{"do_sample": False}``).
    """
    sampling = {"do_sample": False} if sampling is None else sampling
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    order = sorted(items, key=lambda it: (it.max_new_tokens, len(it.prompt)))
    device = next(model.parameters()).device
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        encoded = tokenizer([it.prompt for it in batch], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
        with method.applied(model):
            out = model.generate(**encoded, max_new_tokens=max(it.max_new_tokens for it in batch),
                                 pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id,
                                 **sampling, **method.generate_kwargs())
        for item, row in zip(batch, out[:, encoded.input_ids.shape[1]:].tolist()):
            row = row[: item.max_new_tokens]
            stop = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
            text = tokenizer.decode(row[:stop], skip_special_tokens=False)  # the completion, up to end of text
            yield {"id": item.id, **{name: bool(check(text)) for name, check in item.checks.items()},
                   "new_tokens": min(stop + 1, len(row)), "text": text}


MODES = ("greedy", "teacher-forced")


def target_chunks(method: Method, cache, prompt_tokens: int, total_tokens: int) -> list[tuple[int, int]]:
    """``(start, end)`` position spans covering ``range(prompt_tokens, total_tokens)`` that end wherever greedy decoding
    would change what earlier tokens look like in ``cache``, so that a chunked forward pass over the target leaves
    every token the cache one-token decoding steps would:

    * a KVarN cache quantizes a tile when decoding completes it (at ``sink_tokens + k * tile_size``);
    * transformers' quantized cache re-quantizes everything when its full-precision residual reaches
      ``residual_length`` tokens after the prefill (every ``residual_length`` steps); its fp8 layer quantizes each
      token as it arrives, and the unquantized cache never changes a token: one span.
    """
    if method.kind == "kvarn":
        return chunk_spans(prompt_tokens, total_tokens, method.config.sink_tokens + method.config.tile_size,
                           method.config.tile_size)
    step = getattr(cache.layers[0], "residual_length", None) if method.kind == "hf" else None
    if step is None:
        return [(prompt_tokens, total_tokens)] if total_tokens > prompt_tokens else []
    return chunk_spans(prompt_tokens, total_tokens, prompt_tokens + step, step)


def chunk_spans(start: int, end: int, first: int, step: int) -> list[tuple[int, int]]:
    """``(a, b)`` spans covering ``range(start, end)``, cut at ``first, first + step, ...``."""
    cuts = [start, *(cut for cut in range(first, end, step) if cut > start), end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


@torch.no_grad()
def teacher_forced_items(model, tokenizer, items: Sequence[GenerationItem], method: Method) -> Iterator[dict]:
    """Score ``items`` against their targets without generating: the same verdict as greedy exact match, in a few
    forward passes instead of one per token.

    The prompt is prefilled in one pass, as ``generate`` does; the target (and the end of text) is then fed in the
    chunks of `target_chunks`, so each target token attends the cache greedy decoding would have left at its
    position had every earlier token been right. An item is right when every target token is the argmax; scoring
    stops at the first miss. One item at a time (no padding). Yields ``id``, ``exact`` (the verdict, under the name
    of the greedy headline check), ``first_miss`` (index into the target tokens, None when right), ``target_tokens``
    and ``new_tokens`` (target tokens scored).

    Raises:
        ValueError: an item has no ``target`` (user JSONL tasks are scored by checkers: greedy only).
    """
    for item in items:
        prompt, ids = _item_ids(model, tokenizer, item)
        with method.applied(model):
            cache = method.new_cache(model)
            logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
            yield _score_target(model, method, cache, item, ids, prompt.shape[1], logits[0, -1:].argmax(-1))


@torch.no_grad()
def teacher_forced_grid(
    model,
    tokenizer,
    items: Sequence[GenerationItem],
    methods: Sequence[Method],
    skip: Callable[[Method, GenerationItem], bool] = lambda method, item: False,
) -> Iterator[tuple[Method, dict]]:
    """`teacher_forced_items` for every method on every item (item by item), with one prefill per item shared by
    the KVarN methods: yields ``(method, record)`` for each pair that ``skip`` does not exclude.

    A patched prefill attends the prompt in full precision, exactly as the unpatched model does, and quantizes its
    full tiles only after the pass, so every layer is given the same states whatever the KVarN config. The first
    KVarN method of an item prefills and records what each layer was given; every other KVarN method replays those
    states into its own cache and quantizes them as its patched prefill would (`tests/test_teacher_forced.py` checks
    caches and records equal those of separate prefills). The reference's prefill records its states too: on the
    first item where both ran, if they equal the KVarN prefill's (states and first prediction, bit for bit), every
    later item's KVarN methods replay the reference's and the item costs one prefill, not two. On a long prompt with
    a short target that is most of an item's time. Other methods (transformers' caches) and caches with layers other
    than `KVarNLayer` (DSA's indexer keys, sliding windows) prefill on their own.
    """
    reference_shares = None  # whether the reference's prefill gives the KVarN layers their own prefill's states
    for item in items:
        todo = [m for m in methods if not skip(m, item)]
        if not todo:
            continue
        prompt, ids = _item_ids(model, tokenizer, item)
        reference = None  # (first prediction, each layer's recorded states) of this item's reference prefill
        shared = None  # the same, of the prefill the item's KVarN methods replay
        for method in todo:
            with method.applied(model):
                cache = method.new_cache(model)
                replayable = method.kind == "kvarn" and all(type(layer) is KVarNLayer for layer in cache.layers)
                replay = shared if shared is not None else reference if reference_shares else None
                if method.kind == "reference" or (replayable and replay is None):
                    states = _record_updates(cache)
                    try:
                        first = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1:].argmax(-1)
                    finally:
                        for layer in cache.layers:
                            del layer.update  # the recording wrapper (an instance attribute)
                    if method.kind == "reference":
                        reference = first, states
                    else:
                        shared = first, states
                        if reference is not None and reference_shares is None:
                            reference_shares = _same_prefill(reference, shared)
                elif not replayable:
                    first = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1:].argmax(-1)
                else:
                    shared = replay
                    first, states = replay
                    for layer, calls in zip(cache.layers, states):
                        for key_states, value_states in calls:
                            layer.update(key_states, value_states)
                    cache.flush()
                yield method, _score_target(model, method, cache, item, ids, prompt.shape[1], first)


def _same_prefill(a: tuple, b: tuple) -> bool:
    """Whether two recorded prefills (first prediction, per-layer states) are bit-equal."""
    (first_a, states_a), (first_b, states_b) = a, b
    calls_a, calls_b = [c for layer in states_a for c in layer], [c for layer in states_b for c in layer]
    return (torch.equal(first_a, first_b) and [len(x) for x in states_a] == [len(x) for x in states_b]
            and all(torch.equal(x, y) for ca, cb in zip(calls_a, calls_b) for x, y in zip(ca, cb)))


def _record_updates(cache) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Wrap each layer's ``update`` on this cache instance so that it records the states it is given."""
    states: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in cache.layers]
    for calls, layer in zip(states, cache.layers):
        def recording(key_states, value_states, *args, _update=layer.update, _calls=calls, **kwargs):
            _calls.append((key_states, value_states))
            return _update(key_states, value_states, *args, **kwargs)

        layer.update = recording
    return states


def _item_ids(model, tokenizer, item: GenerationItem) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, P]`` prompt ids and ``[1, P + T]`` prompt + target + end-of-text ids of an item with a target."""
    if item.target is None:
        raise ValueError(f"item {item.id!r} has no target: teacher-forced scoring needs the reasoning or retrieval "
                         "suite (user task files are checked on generated text: --mode greedy)")
    device = next(model.parameters()).device
    prompt = tokenizer(item.prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
    target = tokenizer(item.target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return prompt, torch.cat([prompt, torch.tensor([target], device=device)], 1)


def _score_target(model, method: Method, cache, item: GenerationItem, ids: torch.Tensor, start: int,
                  predicted: torch.Tensor) -> dict:
    """Feed the target after a prefilled prompt of ``start`` tokens in `target_chunks`, stopping at the first token
    that is not the argmax; ``predicted`` is the prefill's prediction of the first target token."""
    first_miss, scored = None, 0
    for span in [None, *target_chunks(method, cache, start, ids.shape[1] - 1)]:
        if span is not None:
            predicted = model(ids[:, span[0]:span[1]], cache=cache, use_cache=True).logits[0].argmax(-1)
        expected = ids[0, scored + start : scored + start + len(predicted)]
        wrong = (predicted != expected).nonzero()
        if len(wrong):
            first_miss = scored + int(wrong[0])
            scored = first_miss + 1
            break
        scored += len(predicted)
    return {"id": item.id, "exact": first_miss is None, "first_miss": first_miss, "target_tokens": ids.shape[1] - start,
            "new_tokens": scored}
