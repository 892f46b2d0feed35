"""`kvarn-mla eval`: run a suite for several cache methods, resumably, and summarize.

Every finished unit of work (one reasoning item, one accumulation curve, ...) is appended to ``OUT.jsonl`` as it
completes; a rerun with the same ``--out`` skips what is there. The summary goes to ``OUT`` (JSON).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkers import wilson_interval
from .methods import REFERENCE, Method

SUITES = ("accumulation", "reasoning", "retrieval", "worst-vectors", "jsonl")
GREEDY_PROMPT = 512  # tokens of the text that prompt the free-running greedy comparison


class ResultLog:
    """Append-only JSONL of finished records, keyed by ``(suite, method, key)``."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[tuple[str, str, str], dict] = {}
        if path.exists():
            text = path.read_text()
            if text and not text.endswith("\n"):  # a record cut short: start the next one on a fresh line
                with path.open("a") as f:
                    f.write("\n")
            for line in text.splitlines():
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by an interruption: redo that unit
                    continue
                self.records[(record["suite"], record["method"], record["key"])] = record

    def has(self, suite: str, method: str, key: str) -> bool:
        return (suite, method, key) in self.records

    def add(self, suite: str, method: str, key: str, payload: dict) -> None:
        record = {"suite": suite, "method": method, "key": key, **payload}
        self.records[(suite, method, key)] = record
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def of(self, suite: str, method: str) -> list[dict]:
        return [r for (s, m, _), r in self.records.items() if s == suite and m == method]


def load_model(name: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a bundled reference model name (``mla``, ``gqa``, ``mha``), a local directory, or
    a hub name already in the local cache (no downloads)."""
    from .. import reference_models

    if name in reference_models.NAMES:
        return reference_models.load(name, dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except OSError as error:
        raise ValueError(f"cannot load model {name!r} offline: give {reference_models.NAMES}, a local directory, "
                         f"or a hub name in the local cache ({error})") from None
    return model.eval(), tokenizer


def default_text(tokenizer, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids of held-out real text: the Python standard library files the reference models never saw."""
    from .data import read_code_files

    ids: list[int] = []
    for code in read_code_files("held_out"):
        ids += tokenizer(code.text + (tokenizer.eos_token or ""), add_special_tokens=False).input_ids
        if len(ids) >= tokens:
            break
    if len(ids) < tokens:
        raise ValueError(f"the held-out text has only {len(ids)} tokens, fewer than the {tokens} asked for")
    return torch.tensor([ids[:tokens]])


def run(
    model,
    tokenizer,
    methods: list[Method],
    suite: str,
    out: Path,
    *,
    text_ids: torch.Tensor | None = None,
    tokens: int = 2048,
    chunk: int = 128,
    greedy_tokens: int = 1024,
    greedy_prompt: torch.Tensor | None = None,
    items: list | None = None,
    batch_size: int = 8,
    sampling: dict | None = None,
    context: int = 1024,
    compute: bool = True,
) -> dict:
    """Run ``suite`` for every method, resuming from ``out.jsonl``, and write the summary to ``out``.

    Args:
        model, tokenizer: The unpatched model (methods patch it temporarily) and its tokenizer.
        methods: Methods to compare (the 16-bit reference among them).
        suite: ``accumulation``, ``reasoning``/``retrieval``/``jsonl`` (``items`` to generate), or ``worst-vectors``.
        out: Summary path; records go to ``out`` with suffix ``.jsonl``.
        text_ids: ``[1, T]`` text for accumulation/worst-vectors (default: held-out code, ``tokens`` long).
        chunk: Chunk size of the accumulation protocol (the tile size).
        greedy_tokens: Length of the free-running greedy comparison.
        greedy_prompt: ``[1, P]`` prompt of that comparison (default: the first 512 tokens of the text).
        items: `GenerationItem` list for the generation suites.
        sampling: ``generate`` sampling arguments (default greedy).
        context: Cached tokens for worst-vectors (the rest of the text is scored).
        compute: False only summarizes the records already in ``out.jsonl`` (a stopped run's partial table).
    """
    from .accumulation import accumulation_curve, greedy_divergence, reference_greedy
    from .tasks import generate_items
    from .worst import worst_vectors

    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; allowed: {SUITES}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = ResultLog(out.with_suffix(".jsonl"))
    sampling = {"do_sample": False} if sampling is None else sampling
    if suite in ("accumulation", "worst-vectors") and text_ids is None:
        text_ids = default_text(tokenizer, tokens)
    if suite == "accumulation" and greedy_prompt is None:
        greedy_prompt = text_ids[:, :GREEDY_PROMPT]
    name = "reasoning" if suite == "jsonl" else suite
    for method in tqdm(methods if compute else [], desc=f"{suite}", unit="method"):
        if suite == "accumulation":
            if method.kind == "reference":
                continue
            if not log.has(name, method.name, "curve"):
                static = method.kind == "kvarn" and method.config.tile_size == chunk
                curve = accumulation_curve(model, text_ids, method, chunk, static=static)
                log.add(name, method.name, "curve", {"curve": curve})
            if not log.has(name, method.name, "greedy"):
                if not log.has(name, REFERENCE, "greedy-tokens"):  # one 16-bit run serves every method
                    tokens_16bit = reference_greedy(model, greedy_prompt, greedy_tokens).tolist()
                    log.add(name, REFERENCE, "greedy-tokens", {"tokens": tokens_16bit})
                reference = torch.tensor(log.records[(name, REFERENCE, "greedy-tokens")]["tokens"],
                                         device=greedy_prompt.device)
                log.add(name, method.name, "greedy",
                        greedy_divergence(model, greedy_prompt, method, greedy_tokens, chunk, reference))
        elif suite == "worst-vectors":
            if method.kind == "kvarn" and not log.has(name, method.name, "worst"):
                log.add(name, method.name, "worst", worst_vectors(model, text_ids, method, context))
        else:
            todo = [it for it in items if not log.has(name, method.name, it.id)]
            progress = tqdm(total=len(todo), desc=method.name, unit="item", leave=False)
            for record in generate_items(model, tokenizer, todo, method, batch_size=batch_size, sampling=sampling):
                log.add(name, method.name, record["id"], record)
                progress.update()
            progress.close()
    summary = summarize(log, methods, name, model.config)
    summary["settings"] = {"suite": suite, "sampling": sampling, "chunk": chunk, "tokens": int(text_ids.shape[1])
                           if text_ids is not None else None, "greedy_tokens": greedy_tokens, "greedy_prompt_tokens":
                           None if greedy_prompt is None else int(greedy_prompt.shape[1]), "context": context}
    out.write_text(json.dumps(summary, indent=1))
    return summary


def summarize(log: ResultLog, methods: list[Method], suite: str, model_config) -> dict:
    """Per-method summary of the records of ``suite``."""
    rows = {}
    for method in methods:
        records = log.of(suite, method.name)
        if suite in ("reasoning", "retrieval") and records:
            checks = [k for k in records[0] if k not in ("suite", "method", "key", "id", "new_tokens", "text")]
            row = {"n": len(records)}
            for check in checks:
                correct = sum(bool(r[check]) for r in records)
                low, high = wilson_interval(correct, len(records))
                row[check] = {"correct": correct, "accuracy": correct / len(records), "ci95": [low, high]}
            row["mean_new_tokens"] = statistics.mean(r["new_tokens"] for r in records)
        elif suite == "accumulation" and method.kind != "reference" and records:
            row = {}
            for record in records:
                if record["key"] == "curve":
                    curve = record["curve"]
                    row["kl_last"] = curve[-1]["kl"]
                    row["kl_mean"] = statistics.mean(c["kl"] for c in curve)
                    row["top1_mean"] = statistics.mean(c["top1"] for c in curve)
                    row["kl_curve"] = [c["kl"] for c in curve]
                    if "kl_static" in curve[-1]:
                        row["kl_last_static"] = curve[-1]["kl_static"]
                        row["kl_curve_static"] = [c["kl_static"] for c in curve]
                    row["attn_err_last"] = curve[-1]["attn_err"]
                else:
                    row.update({k: v for k, v in record.items() if k not in ("suite", "method", "key")})
        elif suite == "worst-vectors" and records:
            row = {k: v for k, v in records[0].items() if k not in ("suite", "method", "key")}
        else:
            continue
        tokens = 4096
        per_token = method.bytes_per_token(model_config, tokens)
        row["bytes_per_token_4k"] = per_token
        rows[method.name] = row
    return {"suite": suite, "methods": rows}
