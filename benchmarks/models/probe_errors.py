"""Where a reference model's teacher-forced predictions go wrong on held-out reasoning or retrieval items.

Reasoning: counts wrong argmax tokens by place in the scratchpad: the first generated row or a later one, and
within a row the two-digit rows-to-go counter, the cells or the row break; then the answer and end of text. This
is the probe behind the openings phase in README.md (step 1400: the first row's counter held every error).
Retrieval (``--context N``): by place in the written facts: ``<|key|>``, the queried key (copied from the query),
a chain's next key (the value just written), ``<|value|>``, the value's first token (the lookup far back), its
later digits, and the end of text.

    python benchmarks/models/probe_errors.py gqa                        # the bundled checkpoint
    python benchmarks/models/probe_errors.py gqa --state runs/gqa/state.pt --items 100
    python benchmarks/models/probe_errors.py mha --state runs/lookup-ext-mha/state.pt --context 8192 --items 20
    python benchmarks/models/probe_errors.py mla --state runs/v5-mla/state.pt \
        --tokenizer-dir kvarn_mla/reference_models/gqa --context 1024
    python benchmarks/models/probe_errors.py gqa --context 512 --items 24 --attention   # where the lookup attends
    python benchmarks/models/probe_errors.py gqa --context 512 --items 8 --logits   # how its logits find the fact
    python benchmarks/models/probe_errors.py mha --recall 4 --items 30   # the key match's circuit, on recall documents
    python benchmarks/models/probe_errors.py mla --checkpoint benchmarks/models/states/v7-mla \
        --tokenizer-dir kvarn_mla/reference_models/gqa --probes   # the training monitor's recall and chain probes
    python benchmarks/models/probe_errors.py gqa --checkpoint benchmarks/models/states/v7-gqa \
        --tokenizer-dir kvarn_mla/reference_models/gqa --context 2048 --items 40   # a checkpoint directory
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))

from train_reference import (  # noqa: E402  (this folder is on the path)
    CHAIN_PROBE_FACTS,
    RECALL_PROBE_FACTS,
    LookupDocs,
    build_config,
    build_model,
    chain_accuracy,
    recall_accuracy,
    recipe_of_state,
    rope_of_state,
    set_rope,
    target_hits,
)

from kvarn_mla import reference_models  # noqa: E402
from kvarn_mla.evaluation import reasoning, retrieval  # noqa: E402


def place(index: int, num_rows: int, task: reasoning.Task) -> str:
    """Where target token ``index`` of an item of ``task`` with ``num_rows`` generated rows sits, e.g.
    ``"first row counter"``."""
    row, column = divmod(index, task.row_tokens)
    if row >= num_rows:
        return "answer / end of text"  # after <|answer|>, which fills the last row's break slot
    cells_end = reasoning.COUNTER + task.width
    part = "counter" if column < reasoning.COUNTER else "cell" if column < cells_end else "break"
    return f"{'first' if row == 0 else 'later'} row {part}"


@torch.no_grad()
def probe(model, tokenizer, items: int, task: reasoning.Task) -> tuple[Counter, Counter]:
    """Wrong and total target tokens per :func:`place` over the first ``items`` held-out items of ``task``."""
    wrong, total = Counter(), Counter()
    for item in reasoning.held_out_items(items, task=task):
        prompt = tokenizer(item.prompt, add_special_tokens=False).input_ids
        target = tokenizer(item.target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        for index, ok in enumerate(target_hits(model, prompt, target)):
            key = place(index, item.num_rows, task)
            total[key] += 1
            wrong[key] += not ok
    return wrong, total


def retrieval_places(item: retrieval.Item) -> list[str]:
    """The place of every target token of ``item`` (and its end of text), in order."""
    places = []
    values = {f.key: f.value for f in item.facts}
    for chain in item.chains:
        for hop, key in enumerate(chain):
            value_tokens = retrieval.VALUE_DIGITS if values[key].isdigit() else 1  # digits are single tokens
            places += ["<|key|>", "queried key" if hop == 0 else "chain key", "<|value|>", "value: first token"]
            places += ["value: later digits"] * (value_tokens - 1)
    return places + ["end of text"]


@torch.no_grad()
def probe_retrieval(model, tokenizer, items: int, context: int, seed: int) -> tuple[Counter, Counter, list[float]]:
    """Wrong and total target tokens per :func:`retrieval_places` over ``items`` held-out items, and the
    probability the model gave each right first value token (a lookup that does not happen leaves digits near
    0.1, the digit prior, and a chain's next key near 0)."""
    wrong, total, first_value_p = Counter(), Counter(), []
    for item in retrieval.held_out_items(tokenizer, context, seed, items):
        prompt = tokenizer(item.prompt, add_special_tokens=False).input_ids
        target = tokenizer(item.target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        places = retrieval_places(item)
        assert len(places) == len(target), (len(places), len(target))
        probs = model(input_ids=torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1].softmax(-1)
        for index, (key, want) in enumerate(zip(places, target)):
            total[key] += 1
            wrong[key] += int(probs[index].argmax()) != want
            if key == "value: first token":
                first_value_p.append(float(probs[index, want]))
    return wrong, total, first_value_p


def fact_span(tokenizer, item: retrieval.Item) -> tuple[list[int], int, slice]:
    """The ids of a held-out retrieval ``item`` written out (prompt and target), the position of the answer's first
    ``<|value|>`` (it predicts the first value token: the lookup), and the queried fact's tokens in the prompt, from
    its ``<|key|>`` to its first value token."""
    value = tokenizer.convert_tokens_to_ids(retrieval.VALUE)
    prompt = tokenizer(item.prompt, add_special_tokens=False).input_ids
    target = tokenizer(item.target, add_special_tokens=False).input_ids
    ids = prompt + target
    query = len(prompt) + target.index(value)  # the answer's <|key|> k <|value|>: copies k's value next
    key = ids[len(prompt) + 1 : query]
    # the fact k<|value|> occurs once in the prompt (retrieval keys are distinct and never in the filler)
    (at,) = [j for j in range(len(prompt)) if ids[j] == value and ids[j - len(key) : j] == key]
    return ids, query, slice(at - len(key) - 1, at + 2)


@torch.no_grad()
def fact_attention(model, tokenizer, items: int, context: int, seed: int) -> tuple[torch.Tensor, int]:
    """Where the lookup attends: for each layer and head, the mean attention weight that the answer's first
    ``<|value|>`` (the position that predicts the first value token) gives the queried fact's own tokens, from its
    ``<|key|>`` to its first value token, over ``items`` held-out items; and the number of items.

    A formed lookup puts nearly all of one head's weight there (the v5 GQA: 0.99 in its last layer); a model that
    does not look the fact up spreads it (1/context per token would be uniform). Needs eager attention (the weights).

    Returns:
        ``[layers, heads]`` mean weights, and the item count.
    """
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        mass = None
        for item in retrieval.held_out_items(tokenizer, context, seed, items):
            ids, query, fact = fact_span(tokenizer, item)
            attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
            layer_mass = torch.stack([a[0, :, query, fact].sum(-1) for a in attentions])
            mass = layer_mass if mass is None else mass + layer_mass
        return mass / items, items
    finally:
        model.set_attn_implementation(implementation)


def logit_parts(attention, hidden: torch.Tensor, position_embeddings) -> dict[str, torch.Tensor]:
    """The scaled attention logits ``[H, T, T]`` of one layer on ``hidden [1, T, hidden]``, by part: ``total`` for a
    Llama attention; for an MLA (DeepSeek-V3) attention also its ``content`` part (``q_nope . k_nope``, the key
    from the latent) and its ``rope`` part (``q_pe . k_pe``, the RoPE key shared by the heads)."""
    cos, sin = position_embeddings
    if hasattr(attention, "kv_a_proj_with_mqa"):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

        nope, rope, rank = attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.kv_lora_rank
        q = (
            attention.q_proj(hidden)
            if attention.q_lora_rank is None
            else attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(hidden)))
        )
        q = q.view(*hidden.shape[:2], -1, nope + rope).transpose(1, 2)
        q_nope, q_rope = q.split([nope, rope], -1)
        latent, k_rope = attention.kv_a_proj_with_mqa(hidden).split([rank, rope], -1)
        latent = attention.kv_a_layernorm(latent)[:, None]
        rotate = (
            deepseek.apply_rotary_pos_emb_interleave
            if attention.config.rope_interleave
            else deepseek.apply_rotary_pos_emb
        )
        q_rope, k_rope = rotate(q_rope, k_rope[:, None], cos, sin)
        k_nope = attention.expand_kv(latent, k_rope)[0][..., :nope]
        content = (q_nope @ k_nope.transpose(-1, -2))[0] * attention.scaling
        rotary = (q_rope @ k_rope.transpose(-1, -2))[0] * attention.scaling
        return {"content": content, "rope": rotary, "total": content + rotary}
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    shape = (*hidden.shape[:2], -1, attention.head_dim)
    q = attention.q_proj(hidden).view(shape).transpose(1, 2)
    k = attention.k_proj(hidden).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return {"total": (q @ k.transpose(-1, -2))[0] * attention.scaling}


@torch.no_grad()
def fact_logits(model, tokenizer, items: int, context: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """How the logits of the answer's lookup single out the queried fact, per part (`logit_parts`): for each layer
    and head, the spread of the part over the visible positions (``std``) and how far above its mean the fact's best
    token is, in those spreads (``z``), means over ``items`` held-out items.

    A formed lookup head has a large ``z`` on a large spread (the v5 GQA's last layer: z ~5 at std ~4.5, the fact
    ~20 above the mean); a part with a small spread cannot move the attention whatever its ``z``.

    Returns:
        ``{part: {"std": [layers, heads], "z": [layers, heads]}}``.
    """
    captured, handles = [], []

    def hook(attention, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        captured.append(logit_parts(attention, hidden, kwargs["position_embeddings"]))

    for layer in model.model.layers:
        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    sums: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for item in retrieval.held_out_items(tokenizer, context, seed, items):
            ids, query, fact = fact_span(tokenizer, item)
            captured.clear()
            model(input_ids=torch.tensor([ids]))
            for part in captured[0]:
                logits = torch.stack([c[part][:, query, : query + 1] for c in captured])  # [layers, H, visible]
                spread = logits.std(-1)
                z = (logits[..., fact].amax(-1) - logits.mean(-1)) / spread
                sums.setdefault(part, {"std": 0, "z": 0})
                sums[part]["std"] = sums[part]["std"] + spread / items
                sums[part]["z"] = sums[part]["z"] + z / items
        return sums
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def recall_circuit(model, tokenizer, facts: int, documents: int) -> dict[str, torch.Tensor]:
    """The key match's attention on recall documents of ``facts`` facts (:class:`train_reference.LookupDocs`, a fixed
    seed), each ``[layers, heads]``, mean over the queried facts:

    - ``lookup: right first digit`` / ``lookup: other first digits``: weight from a target's ``<|value|>`` (it
      predicts the value's first digit) on the queried fact's first digit in the prompt, and on the other facts'.
      A formed match puts one head's weight on the right one; a head that finds value slots but not keys splits it
      evenly (right ``1 / facts``).
    - ``first digit -> key word`` (two back) and ``<|value|> -> key word`` (one back), in the prompt's facts: the
      heads that carry the key word to where the lookup reads it.
    - ``any token -> 1 back`` / ``any token -> 2 back``: the same offsets from every position (mean over the
      positions of every document): the positional heads a layer has, whatever the token.
    """
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    docs, rng = LookupDocs(tokenizer, max_facts=facts), random.Random(f"recall-circuit/{facts}")
    names = (
        "lookup: right first digit",
        "lookup: other first digits",
        "first digit -> key word",
        "<|value|> -> key word",
        "any token -> 1 back",
        "any token -> 2 back",
    )
    sums, facts_seen, lookups, positions = dict.fromkeys(names, 0.0), 0, 0, 0
    try:
        for _ in range(documents):
            ids, mask = docs.recall(rng, facts)
            attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
            weights = torch.stack([a[0] for a in attentions])  # [layers, heads, query, key]
            answer = mask.index(1)
            fact_at = {ids[k + 1]: k for k in range(answer) if ids[k] == docs.key}  # key word -> its <|key|>
            for k in fact_at.values():
                sums["first digit -> key word"] += weights[:, :, k + 3, k + 1]
                sums["<|value|> -> key word"] += weights[:, :, k + 2, k + 1]
            facts_seen += len(fact_at)
            for back in (1, 2):
                sums[f"any token -> {back} back"] += weights.diagonal(-back, -2, -1)[..., 2 - back :].sum(-1)
            positions += len(ids) - 2
            for j in range(answer, len(ids) - 1):
                if ids[j] != docs.key:
                    continue
                word, value = ids[j + 1], j + 2  # the target's <|key|> word <|value|>
                sums["lookup: right first digit"] += weights[:, :, value, fact_at[word] + 3]
                others = [k + 3 for w, k in fact_at.items() if w != word]
                sums["lookup: other first digits"] += weights[:, :, value, others].sum(-1)
                lookups += 1
        counts = dict(zip(names, (lookups, lookups, facts_seen, facts_seen, positions, positions)))
        return {name: sums[name] / counts[name] for name in names}
    finally:
        model.set_attn_implementation(implementation)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=("mla", "gqa", "mha"))
    parser.add_argument("--state", type=Path, help="a training state (runs/<name>/state.pt) instead of the checkpoint")
    parser.add_argument(
        "--checkpoint", type=Path, help="a checkpoint directory (config and safetensors) instead of the bundled one"
    )
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        help="the run's tokenizer (its --tokenizer-dir; default: the bundled checkpoint's)",
    )
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument(
        "--task",
        type=int,
        choices=sorted(reasoning.TASKS),
        help="reasoning task version (default: the checkpoint's; a --state of a run on another version needs it)",
    )
    parser.add_argument("--context", type=int, help="probe held-out retrieval items of this many tokens instead")
    parser.add_argument(
        "--recall",
        type=int,
        metavar="FACTS",
        help="instead: the key match's attention on --items recall documents of this many facts",
    )
    parser.add_argument(
        "--probes",
        action="store_true",
        help="instead: the training monitor's probes, key match on recall documents and word vs number lookups on "
        "chain documents (40 documents each, fixed seeds)",
    )
    parser.add_argument("--seed", type=int, default=20000, help="retrieval seed (default: the evaluation's)")
    parser.add_argument(
        "--attention",
        action="store_true",
        help="with --context: also where the answer's lookup attends (each layer's best head)",
    )
    parser.add_argument(
        "--logits",
        action="store_true",
        help="with --context: how the lookup's logits single out the fact (MLA: content vs RoPE part)",
    )
    args = parser.parse_args(argv)
    for flag in ("attention", "logits"):
        if getattr(args, flag) and not args.context:
            parser.error(f"--{flag} probes retrieval items: give --context N (tokens an item) as well")
    if args.state is not None and args.checkpoint is not None:
        parser.error("give --state or --checkpoint, not both")
    torch.set_num_threads(2)
    checkpoint = args.checkpoint or reference_models.path(args.name)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir or checkpoint)
    if args.state is None:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    else:  # the state's own architecture (its recipe's), weights and RoPE of that step (float32, as trained)
        state = torch.load(args.state, weights_only=False)
        model = build_model(build_config(args.name, recipe_of_state(state), tokenizer))
        model.load_state_dict(state["model"])
        set_rope(model, rope_of_state(state))
    model.eval()
    if args.probes:
        docs = LookupDocs(tokenizer, max_facts=max(RECALL_PROBE_FACTS + CHAIN_PROBE_FACTS))
        print(f"{args.name}: teacher-forced argmax accuracy on the training monitor's probe documents")
        for facts in RECALL_PROBE_FACTS:
            acc = recall_accuracy(model, docs, facts)
            print(f"  recall, {facts} facts: value digits {acc['value_acc']:.3f}, key match {acc['key_acc']:.3f}")
        for facts in CHAIN_PROBE_FACTS:
            acc = chain_accuracy(model, docs, facts)
            print(f"  chains, {facts} facts: word values {acc['word_acc']:.3f}, numbers {acc['number_acc']:.3f}")
        return
    if args.recall:
        print(f"{args.name}: attention on {args.items} recall documents of {args.recall} facts (layers x heads)")
        for part, weights in recall_circuit(model, tokenizer, args.recall, args.items).items():
            print(f"  {part}")
            for layer, heads in enumerate(weights):
                print(f"    layer {layer}: {' '.join(f'{float(w):.2f}' for w in heads)}")
        return
    if args.context:
        wrong, total, first_value_p = probe_retrieval(model, tokenizer, args.items, args.context, args.seed)
        suite = f"retrieval items of {args.context} tokens, seed {args.seed}"
    else:
        task = reasoning.TASKS[args.task] if args.task else reasoning.task_of(model.config)
        wrong, total = probe(model, tokenizer, args.items, task)
        suite = f"reasoning items, task version {task.version}"
    print(f"{args.name}: wrong / total target tokens, teacher-forced, first {args.items} held-out {suite}")
    for key in sorted(total):
        print(f"  {key:<22} {wrong[key]:>5} / {total[key]:,}")
    if args.context:
        print(
            f"  first value tokens: mean probability of the right one {sum(first_value_p) / len(first_value_p):.3f}"
            f" (median {sorted(first_value_p)[len(first_value_p) // 2]:.3f})"
        )
    if args.context and args.attention:
        mass, n = fact_attention(model, tokenizer, args.items, args.context, args.seed)
        print(f"attention weight from the answer's first <|value|> on the queried fact, mean of {n} items:")
        for layer, heads in enumerate(mass):
            print(
                f"  layer {layer}: best head {int(heads.argmax())} {float(heads.max()):.3f}"
                f" (all heads: {' '.join(f'{float(m):.2f}' for m in heads)})"
            )
    if args.context and args.logits:
        parts = fact_logits(model, tokenizer, args.items, args.context, args.seed)
        print(
            "the lookup's logits on the queried fact, per layer, heads 0..H-1: spread over the visible positions "
            "(std) and the fact's best token above the mean in spreads (z)"
        )
        for part, stats in parts.items():
            for layer in range(stats["std"].shape[0]):
                print(
                    f"  {part:<7} layer {layer}: std {' '.join(f'{float(v):.1f}' for v in stats['std'][layer])}"
                    f" | z {' '.join(f'{float(v):.1f}' for v in stats['z'][layer])}"
                )


if __name__ == "__main__":
    main()
