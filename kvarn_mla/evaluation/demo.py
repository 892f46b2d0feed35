"""`kvarn-mla demo`: one model, a reasoning prompt, a long-context retrieval prompt and a code prompt, the 16-bit cache
against KVarN presets."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from . import reasoning, retrieval
from .methods import Method, parse_methods, require_available, with_reference_label


class _Progress(BaseStreamer):
    """Advances a progress bar by the tokens ``generate`` produces (the prompt is the first ``put``)."""

    def __init__(self, bar: tqdm):
        self.bar, self.prompt_seen = bar, False

    def put(self, value):
        if self.prompt_seen:
            self.bar.update(value.numel())
        self.prompt_seen = True

    def end(self):
        pass


DEMO_RETRIEVAL_CONTEXT = 2048  # tokens of the retrieval prompt (prompt + answer)
DEMO_RETRIEVAL_SEED = 31_337  # a held-out seed (outside retrieval.TRAIN_SEEDS)


@dataclass
class Prompt:
    name: str
    ids: torch.Tensor  # [1, P]
    new_tokens: int
    check: object = None  # completion text -> bool, or None


def demo_prompts(tokenizer, new_tokens: int | None, prompt_tokens: int, task: reasoning.Task) -> list[Prompt]:
    """A held-out reasoning item of ``task`` (the model's: `reasoning.task_of` its config) and a held-out retrieval
    item (when the tokenizer knows the tasks' format tokens) and held-out code."""
    prompts = []
    if reasoning.SCRATCHPAD in tokenizer.get_vocab():
        item = reasoning.make_item(0, "held_out", task=task, min_rows=24, max_rows=24)  # 457 (v1) or 553 (v2) tokens
        ids = tokenizer(item.prompt, return_tensors="pt", add_special_tokens=False).input_ids
        target = len(tokenizer(item.target, add_special_tokens=False).input_ids) + 4
        prompts.append(Prompt(f"reasoning ({item.num_rows} rows)", ids, min(target, new_tokens or target),
                              lambda text, item=item: reasoning.check(item, text)))
    if retrieval.KEY in tokenizer.get_vocab():  # a held-out item: its answers sit in quantized tiles far back
        item = retrieval.make_item(tokenizer, DEMO_RETRIEVAL_CONTEXT, DEMO_RETRIEVAL_SEED, 0)
        ids = tokenizer(item.prompt, return_tensors="pt", add_special_tokens=False).input_ids
        target = item.target_tokens + 4
        prompts.append(Prompt(f"retrieval ({item.prompt_tokens:,}-token prompt)", ids,
                              min(target, new_tokens or target), lambda text, item=item: retrieval.check(item, text)))
    from .data import read_code_files

    code = next(f for f in read_code_files("held_out") if len(f.text) > 8 * prompt_tokens)
    ids = tokenizer(code.text, return_tensors="pt", add_special_tokens=False).input_ids[:, :prompt_tokens]
    prompts.append(Prompt(f"code ({code.path})", ids, new_tokens or 256))
    return prompts


@torch.no_grad()
def run_demo(model, tokenizer, methods: list[Method], prompts: list[Prompt]) -> list[dict]:
    """Greedy generation for every (prompt, method); returns one row per pair (see `format_rows`)."""
    rows = []
    total = sum(p.new_tokens for p in prompts) * len(methods)
    bar = tqdm(total=total, desc="generating", unit="tok")
    for prompt in prompts:
        reference = None
        for method in methods:
            bar.set_postfix_str(f"{prompt.name.split()[0]} / {method.name}")
            with method.applied(model):
                start = time.perf_counter()
                # A checked answer may stop at end-of-text; free text runs the full length for comparison.
                fixed = {} if prompt.check is not None else {"min_new_tokens": prompt.new_tokens}
                out = model.generate(prompt.ids, attention_mask=torch.ones_like(prompt.ids), do_sample=False,
                                     max_new_tokens=prompt.new_tokens, **fixed,
                                     return_dict_in_generate=True, streamer=_Progress(bar),
                                     **method.generate_kwargs())
                seconds = time.perf_counter() - start
            tokens = out.sequences[0, prompt.ids.shape[1]:]
            cache = out.cache
            held = cache.nbytes() if hasattr(cache, "nbytes") else _dynamic_bytes(cache)
            dense = cache.dense_nbytes() if hasattr(cache, "dense_nbytes") else _dynamic_bytes(cache, 2)
            if reference is None:
                reference = tokens
            common = min(len(tokens), len(reference))  # a run that stops early disagrees on the rest
            longer = max(len(tokens), len(reference))
            same = (tokens[:common] == reference[:common]).tolist() + [False] * (longer - common)
            text = tokenizer.decode(tokens, skip_special_tokens=False)
            rows.append({
                "prompt": prompt.name, "method": method.name, "cache_bytes": held, "compression": dense / held,
                "agreement": sum(same) / len(same), "first_divergence": same.index(False) if False in same else None,
                "correct": None if prompt.check is None else bool(prompt.check(text)),
                "ms_per_token": 1e3 * seconds / len(tokens), "tokens": len(tokens),
            })
    bar.close()
    return rows


def _dynamic_bytes(cache, element_size: int | None = None) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * (element_size or t.element_size())
    return total


def format_rows(rows: list[dict]) -> str:
    """The demo's table."""
    width = max(9, *(len(r["method"]) for r in rows))
    lines = [f"{'prompt':<34} {'cache':<{width}} {'KiB':>8} {'x16-bit':>8} {'agree':>6} {'diverge@':>9} "
             f"{'correct':>8} {'ms/tok':>7}"]
    for r in rows:
        correct = "-" if r["correct"] is None else ("yes" if r["correct"] else "no")
        diverge = "-" if r["first_divergence"] is None else str(r["first_divergence"])
        lines.append(f"{r['prompt'][:34]:<34} {r['method']:<{width}} {r['cache_bytes'] / 1024:>8.1f} "
                     f"{r['compression']:>7.2f}x {r['agreement']:>6.1%} {diverge:>9} {correct:>8} "
                     f"{r['ms_per_token']:>7.1f}")
    return "\n".join(lines)


def demo(model_name: str = "mla", presets: str = "k4v2,k2v2", new_tokens: int | None = None,
         prompt_tokens: int = 384) -> list[dict]:
    """Load ``model_name`` and print the table; returns the rows."""
    from .runner import load_model

    methods = parse_methods(presets)
    require_available(methods)  # before the model loads and the first method runs
    torch.manual_seed(0)
    model, tokenizer = load_model(model_name, torch.bfloat16)  # a 16-bit model, so the reference cache is 16-bit
    methods = with_reference_label(methods, model.dtype)
    rows = run_demo(model, tokenizer, methods, demo_prompts(tokenizer, new_tokens, prompt_tokens,
                                                                reasoning.task_of(model.config)))
    print(f"\n{model_name}: {type(model).__name__} (bf16), greedy decoding; 'agree' = share of tokens identical to "
          "the 16-bit run, 'diverge@' = first token that differs")
    print(format_rows(rows))
    return rows
