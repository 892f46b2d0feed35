"""Pilot: does a reference model learn content-addressed lookup, and how many steps does it take?

The v2 reference models retrieve nothing (``README.md``): teacher-forced on held-out retrieval items they do not
even copy the previous token when a chain hop asks for it. Retrieval needs an induction-style circuit (match an
earlier token by content, copy what follows it); the reasoning task needs only fixed-offset lookups. This
script measures whether that circuit forms on the densest data there is, so a recipe can be built on it:

- ``recall``: facts-only associative recall. A document is 1..F facts in the retrieval task's own format
  (``<|key|> w<|value|>dddd``, :func:`kvarn_mla.evaluation.retrieval.fact_text`), then ``<|query|>``, some of
  their keys and ``<|answer|>``; the target writes the queried facts. No code filler: ~35% of all tokens are
  targets. ``--no-separator`` drops ``<|value|>`` from facts and targets, so the value follows its key directly
  (a plain one-token induction match instead of a match on the token two back).
- ``copy``: ``<|query|> t1 .. tL<|answer|> t1 .. tL``, the textbook induction task (every target is a copy).
- ``echo``: groups ``<|key|> w<|value|>d w``, trained on the repeated key word: a copy from two tokens back, the
  step of the key match that the MLA never formed (``train_reference.LookupDocs``). ``recall+echo`` draws each
  document from one of the two at even odds.
- ``retrieval``: the real task, one training item of ``--context`` tokens with code filler a row, trained on its
  answer only: whether the lookup forms in filler when drilled there directly.

Documents are packed into ``--rows`` rows of ``--context`` tokens with the block-diagonal mask of
``train_reference.py``. Every ``--probe-every`` steps the script scores fresh recall documents with 1, 2, 4
and 8 facts (value-digit accuracy: picking any one fact's value scores about ``1/F``, so only accuracy above that
at F >= 2 shows keys being matched) and the held-out retrieval monitor items at 512 tokens (the real task, with
code filler). The history goes to ``--out`` (JSON) as it grows.

    python benchmarks/models/pilot_lookup.py gqa --task recall --facts 4 --lr 3e-3 --steps 2000 --out r.json
    python benchmarks/models/pilot_lookup.py gqa --task copy --lr 3e-3 --steps 2000 --out c.json
    python benchmarks/models/pilot_lookup.py gqa --task copy:800,recall:1700 --out cr.json   # a curriculum

``--steps 0`` only probes the starting weights (``--init`` also takes a ``train_reference.py`` ``state.pt``,
built with that run's own architecture and RoPE).
``--task`` takes one task for ``--steps`` steps or a curriculum ``task:steps,...`` (its steps replace ``--steps``;
one optimizer throughout). ``--save`` keeps the weights (float32 state dict) at every probe; ``--init`` starts from
such a file instead of the bundled checkpoint. ``--widen-content-key N`` (MLA) widens the starting model's
content (no-RoPE) key from ``qk_nope_head_dim`` to N without changing its outputs (`widen_content_key`), to ask
whether a wider key matches keys sooner from the same weights. ``--freeze-layers 3 --freeze-steps 150`` keeps
the last layer as it is for the first 150 steps, so what is learnt then is learnt below it (the echo head forms
in the last layer otherwise, where the key match cannot use it). Measured on the v6 MLA, freezing does not do
that: the layers below learn to steer the frozen layer's heads two back instead. ``--echo-exit-layer 1`` reads
echo steps' logits from layer 1's output (through the final norm and the head), so only layers 0-1 can echo.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_reference as T  # noqa: E402

from kvarn_mla import reference_models  # noqa: E402
from kvarn_mla.evaluation import retrieval  # noqa: E402

PROBE_FACTS = (1, 2, 4, 8)


TASKS = ("recall", "copy", "echo", "recall+echo", "code", "retrieval")


class Docs(T.LookupDocs):
    """:class:`train_reference.LookupDocs` packed into whole rows of one task (end-of-text padding, no code), or
    windows of the train split's code stream (``code``: language modelling on every token)."""

    def __init__(self, tok, *args, without_separator: float = 0.0, **kwargs) -> None:
        super().__init__(tok, *args, **kwargs)
        self.tok, self._code = tok, None
        self.without_separator = without_separator  # share of training recall documents drawn without <|value|>

    def document(self, task: str, rng: random.Random, max_facts: int | None = None) -> tuple[list[int], list[int]]:
        if task == "recall+echo":
            task = rng.choice(("recall", "echo"))
        # a bridge: the match one token back (no <|value|>), which the v6 MLA forms in 50 steps, beside the task's
        # two-back one, which it did not form in 600; the probe (``recall``) keeps the instance's format
        if task == "recall" and self.separator and rng.random() < self.without_separator:
            return super().document(task, rng, max_facts, separator=False)
        return super().document(task, rng, max_facts)

    def code_window(self, rng: random.Random, n: int) -> torch.Tensor:
        if self._code is None:  # tokenized on first use (~40 s): the lookup tasks never need it
            self._code = torch.from_numpy(T.code_stream(self.tok))
        start = rng.randrange(len(self._code) - n)
        return self._code[start : start + n]

    def batch(self, task: str, step: int, rows: int, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, target mask and document ids, each ``[rows, context + 1]``, of ``task``'s documents at step
        ``step`` (deterministic).

        A row packs whole documents; the rest is end-of-text padding in a document of its own, not trained on.
        """
        rng = random.Random(f"pilot-lookup/{step}")
        if task == "code":
            ids = torch.stack([self.code_window(rng, context + 1) for _ in range(rows)])
            return ids, torch.ones_like(ids), torch.zeros_like(ids)
        if task == "retrieval":  # one training item of the real task (code filler) a row, trained on its answer only
            ids, mask = [], []
            for row in range(rows):
                item = retrieval.make_item(self.tok, context, rng.choice(retrieval.TRAIN_SEEDS), step * rows + row)
                prompt = self.tok(item.prompt, add_special_tokens=False).input_ids
                target = self.tok(item.target, add_special_tokens=False).input_ids + [self.eos]
                pad = context + 1 - len(prompt) - len(target)
                ids.append(prompt + target + [self.eos] * pad)
                mask.append([0] * len(prompt) + [1] * len(target) + [0] * pad)
            return torch.tensor(ids), torch.tensor(mask), torch.zeros(rows, context + 1, dtype=torch.long)
        ids, mask, doc = [], [], []
        for _ in range(rows):
            row_ids, row_mask, row_doc = [], [], []
            while True:
                d, m = self.document(task, rng)
                if len(row_ids) + len(d) > context + 1:
                    if not row_ids:
                        raise ValueError(f"a {len(d)}-token document does not fit rows of context={context}")
                    break
                row_doc += [row_doc[-1] + 1 if row_doc else 0] * len(d)
                row_ids, row_mask = row_ids + d, row_mask + m
            pad = context + 1 - len(row_ids)
            ids.append(row_ids + [self.eos] * pad)
            mask.append(row_mask + [0] * pad)
            doc.append(row_doc + [row_doc[-1] + 1] * pad)
        return torch.tensor(ids), torch.tensor(mask), torch.tensor(doc)


@torch.no_grad()
def probe(model, docs: Docs, tok, monitor: list[retrieval.Item], per_size: int = 40) -> dict[str, float]:
    """Value-digit and key-match accuracy (:func:`train_reference.recall_accuracy`) on fresh recall documents of each
    size in :data:`PROBE_FACTS` (fixed seed), and on the
    repeated words of echo documents (``echo_acc``), and on the
    held-out retrieval monitor items: the target tokens that follow ``<|value|>`` (the first value token of each
    written fact), and the share of items whose whole target is the argmax."""
    model.eval()
    out = {}
    for facts in PROBE_FACTS:
        out.update({f"recall_{facts}_{m}": v for m, v in T.recall_accuracy(model, docs, facts, per_size).items()})
    first = whole = lookups = 0
    for it in monitor:
        prompt = tok(it.prompt, add_special_tokens=False).input_ids
        target = tok(it.target, add_special_tokens=False).input_ids + [tok.eos_token_id]
        ok = T.target_hits(model, prompt, target)
        whole += all(ok)
        for j in range(1, len(target)):
            if target[j - 1] == docs.value:
                first, lookups = first + ok[j], lookups + 1
    rng, hit, total = random.Random("pilot-probe/echo"), 0, 0
    for _ in range(per_size):  # the two-back copy alone: the repeated key words of echo documents
        ids, mask = docs.echo(rng)
        pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        ok = [int(pred[i - 1] == ids[i]) for i in range(1, len(ids) - 1) if mask[i]]
        hit, total = hit + sum(ok), total + len(ok)
    out["echo_acc"] = hit / total
    out["retrieval_512_first_value_acc"] = first / lookups
    out["retrieval_512_items_all_right"] = whole / len(monitor)
    return out


def parse_tasks(spec: str) -> list[tuple[str, int | None]]:
    """``"recall"`` -> ``[("recall", None)]`` (run for ``--steps``); ``"copy:800,recall:1700"`` -> a curriculum."""
    out = []
    for part in spec.split(","):
        task, _, steps = part.partition(":")
        if task not in TASKS or (steps and not steps.isdigit()):
            raise argparse.ArgumentTypeError(f"expected one of {' | '.join(TASKS)} or task:steps,..., got {spec!r}")
        out.append((task, int(steps) if steps else None))
    if len(out) > 1 and any(n is None for _, n in out):
        raise argparse.ArgumentTypeError(f"a curriculum gives every task its steps, got {spec!r}")
    return out


def scratch_config(
    name: str,
    tok,
    layers: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    rope_dim: int | None = None,
) -> transformers.PretrainedConfig:
    """train_reference's architecture for ``name`` (`Recipe` defaults), with these layers, query heads (head width
    hidden / heads), key/value heads (Llama models) or MLA RoPE-key width instead."""
    base = T.Recipe()
    recipe = replace(
        base, num_layers=layers or base.num_layers, num_heads=heads or base.num_heads, mla_rope_head_dim=rope_dim
    )
    config = T.build_config(name, recipe, tok)
    if kv_heads:
        if config.model_type == "deepseek_v3":
            raise SystemExit("--kv-heads is for the Llama models (MLA has no key/value heads to group)")
        config.num_key_value_heads = kv_heads
    return config


def widen_content_key(model, width: int, seed: int = 0):
    """The MLA ``model`` with its content key (``qk_nope_head_dim``, per head) widened to ``width``, same outputs.

    The new query rows are zero, so they add nothing to any score until trained; the new key rows (``kv_b_proj``) are
    small random ones, so the new query rows get a gradient at once. The softmax scale is ``qk_head_dim ** -0.5``, so
    every query row is scaled by ``sqrt(new / old qk_head_dim)`` to keep the scores.
    """
    c = model.config
    if c.model_type != "deepseek_v3" or c.q_lora_rank is not None:
        raise SystemExit(f"--widen-content-key is for MLA without a query low-rank; got {c.model_type}")
    heads, old, rope, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    if width < old:
        raise SystemExit(f"--widen-content-key {width} is narrower than the model's {old}")
    config = copy.deepcopy(c)
    config.qk_nope_head_dim, config.qk_head_dim = width, width + rope
    wide = T.build_model(config)
    weights, gen = dict(model.state_dict()), torch.Generator().manual_seed(seed)
    for i in range(c.num_hidden_layers):
        q_name, kv_name = (f"model.layers.{i}.self_attn.{n}.weight" for n in ("q_proj", "kv_b_proj"))
        q = weights[q_name].view(heads, old + rope, -1)  # per head: [content | rope] rows
        q = torch.cat([q[:, :old], q.new_zeros(heads, width - old, q.shape[-1]), q[:, old:]], 1)
        weights[q_name] = (q * ((width + rope) / (old + rope)) ** 0.5).reshape(-1, q.shape[-1])
        kv = weights[kv_name].view(heads, old + v, -1)  # per head: [content key | value] rows
        extra = 0.02 * torch.randn(heads, width - old, kv.shape[-1], generator=gen)
        weights[kv_name] = torch.cat([kv[:, :old], extra, kv[:, old:]], 1).reshape(-1, kv.shape[-1])
    wide.load_state_dict(weights)
    return wide


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=T.MODEL_NAMES)
    ap.add_argument(
        "--task",
        type=parse_tasks,
        default="recall",
        help=f"{' | '.join(TASKS)} | task:steps,... (curriculum)",
    )
    ap.add_argument("--facts", type=int, default=4, help="most facts in a recall document")
    ap.add_argument("--no-separator", action="store_true", help="facts without <|value|>")
    ap.add_argument(
        "--without-separator-share",
        type=float,
        default=0.0,
        help="share of training recall documents without <|value|> (the probe keeps it)",
    )
    ap.add_argument("--words", type=int, help="key vocabulary: the first N words (default all)")
    ap.add_argument("--scratch", action="store_true", help="fresh weights of train_reference's architecture")
    ap.add_argument("--layers", type=int, help="with --scratch: this many layers")
    ap.add_argument("--heads", type=int, help="with --scratch: this many query heads (head dim = hidden / heads)")
    ap.add_argument("--kv-heads", type=int, help="with --scratch (Llama models): this many key/value heads")
    ap.add_argument("--rope-dim", type=int, help="with --scratch (MLA): the shared RoPE key's width")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--probe-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, help="history JSON, rewritten at every probe")
    ap.add_argument("--save", type=Path, help="weights (state dict), rewritten at every probe")
    ap.add_argument("--init", type=Path, help="start from weights saved by --save")
    ap.add_argument(
        "--freeze-layers",
        type=lambda v: [int(i) for i in v.split(",")],
        default=[],
        help="decoder layers (comma-separated indices) not trained for the first --freeze-steps steps",
    )
    ap.add_argument("--freeze-steps", type=int, help="steps the --freeze-layers stay frozen (default: all)")
    ap.add_argument(
        "--echo-exit-layer",
        type=int,
        help="echo steps read their logits from this decoder layer's output (final norm and head), not the last",
    )
    ap.add_argument("--widen-content-key", type=int, help="(MLA) widen the content key to this width, same outputs")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    state = torch.load(args.init, weights_only=False) if args.init else None
    if args.scratch:
        # the lookup tokenizer every recipe trains with (the bundled GQA's; the bundled MLA is v1, without the
        # retrieval task's tokens)
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(reference_models.path("gqa"))
        model = T.build_model(scratch_config(args.name, tok, args.layers, args.heads, args.kv_heads, args.rope_dim))
    elif isinstance(state, dict) and "recipe" in state:
        # a train_reference.py state: its own architecture (a v4 MLA's is not the bundled v1's) and RoPE, and the
        # lookup tokenizer its recipes train with (the bundled GQA's)
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(reference_models.path("gqa"))
        model = T.build_model(T.build_config(args.name, T.recipe_of_state(state), tok))
        T.set_rope(model, T.rope_of_state(state))
    else:
        model, tok = reference_models.load(args.name)
    if args.init:
        model.load_state_dict(state.get("model", state))
    if args.widen_content_key:
        model = widen_content_key(model, args.widen_content_key)
    model.config._attn_implementation = "sdpa_pad_v"
    layers = model.config.num_hidden_layers
    if any(not 0 <= i < layers for i in args.freeze_layers):
        ap.error(f"--freeze-layers {args.freeze_layers}: the model's layers are 0..{layers - 1}")
    # the last layer's output is already normed (hidden_states[-1]); an early exit is a layer below it
    if args.echo_exit_layer is not None and not 0 <= args.echo_exit_layer < layers - 1:
        ap.error(f"--echo-exit-layer {args.echo_exit_layer}: expected a layer below the last, 0..{layers - 2}")
    schedule = [(task, steps or args.steps) for task, steps in args.task]
    args.steps = sum(steps for _, steps in schedule)
    docs = Docs(
        tok,
        args.facts,
        separator=not args.no_separator,
        words=args.words,
        without_separator=args.without_separator_share,
    )
    phase_of = [task for task, steps in schedule for _ in range(steps)]
    monitor = retrieval.held_out_items(tok, 512, T.MONITOR_SEED, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    history = [{"step": 0, **probe(model, docs, tok, monitor)}]
    print(json.dumps(history[-1]), flush=True)
    if args.out:
        write_record(args, history)
    for step in range(args.steps):
        model.train()
        frozen = args.freeze_steps is None or step < args.freeze_steps
        for i in args.freeze_layers:  # AdamW skips a parameter without a gradient (no update, no decay)
            model.model.layers[i].requires_grad_(not frozen)
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        seq, mask, doc = docs.batch(phase_of[step], step, args.rows, args.context)
        inputs, targets, mask = seq[:, :-1], seq[:, 1:], mask[:, 1:].float()
        attn, positions = T.doc_mask_and_positions(doc[:, :-1])
        exit_early = args.echo_exit_layer is not None and phase_of[step] == "echo"
        out = model(
            input_ids=inputs,
            attention_mask=attn,
            position_ids=positions,
            use_cache=False,
            output_hidden_states=exit_early,
        )
        logits = out.logits
        if exit_early:  # hidden_states[i + 1] is layer i's output, before the final norm for every layer but the last
            logits = model.lm_head(model.model.norm(out.hidden_states[args.echo_exit_layer + 1]))
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        loss = (nll * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec = {
            "step": step + 1,
            "task": phase_of[step],
            "loss": float(loss.detach()),
            "target_acc": float(((logits.argmax(-1) == targets) * mask).sum() / mask.sum()),
            "sec": time.time() - t0,
        }
        if (step + 1) % args.probe_every == 0 or step + 1 == args.steps:
            rec.update(probe(model, docs, tok, monitor))
            print(json.dumps(rec), flush=True)
            if args.save:
                torch.save(model.state_dict(), args.save)
            if args.out:
                write_record(args, history + [rec])
        history.append(rec)
    return history


def write_record(args: argparse.Namespace, history: list[dict]) -> None:
    record = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "history": history}
    args.out.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
