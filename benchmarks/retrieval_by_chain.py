"""Retrieval records split by the queried chain's length (facts from the queried key to its number).

A one-fact item is a lookup; a longer chain also needs the model to restate each value it reads as the next key.
Where a 16-bit model follows only one-fact chains (the v7 GQA and MLA), its quantized methods are best compared on
those items. Rebuilds each item from the records' seed and context (the tokenizer of ``--model``) and prints, per
method, right of n (Wilson 95%) per chain length, and paired against 16-bit on the one-fact items (exact McNemar).

    python benchmarks/retrieval_by_chain.py benchmarks/results/three-recipes/accuracy/mha-retrieval-8192.jsonl \
        --model mha
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import AutoTokenizer

from kvarn_mla.evaluation import retrieval
from kvarn_mla.evaluation.checkers import mcnemar_exact, wilson_interval
from kvarn_mla.evaluation.paired import load_verdicts
from kvarn_mla.evaluation.runner import read_records
from kvarn_mla.reference_models import path as model_dir


def chain_lengths(tokenizer, records: Path) -> dict[str, int]:
    """``{item key: facts in its queried chain}`` for every item of a retrieval records file (one query an item)."""
    lines = read_records(records)
    seed, context = lines[0]["run"]["settings"]["seed"], lines[0]["run"]["settings"]["context"]
    keys = {record["key"] for record in lines}
    out = {}
    for key in sorted(keys):
        index = int(key.rsplit("-", 1)[1])
        item = retrieval.make_item(tokenizer, context, seed, index)
        if len(item.chains) != 1:
            raise ValueError(f"{key} queries {len(item.chains)} chains; this table splits one-query items")
        out[key] = len(item.chains[0])
    return out


def table(verdicts: dict[str, dict[str, bool]], lengths: dict[str, int]) -> list[str]:
    """Markdown: one row per method, right of n per chain length, and paired vs the first method (the 16-bit
    reference) on one-fact items; methods not scored on every reference item are named and left out."""
    reference = next(iter(verdicts))
    keys = set(verdicts[reference])
    partial = [m for m, items in verdicts.items() if not keys <= set(items)]
    verdicts = {m: items for m, items in verdicts.items() if m not in partial}
    by_length = {n: sorted(k for k in keys if lengths[k] == n) for n in sorted(set(lengths.values()))}
    lines = ["| method | " + " | ".join(f"{n} fact{'s' if n > 1 else ''} (n={len(k)})" for n, k in by_length.items())
             + f" | one fact vs {reference}: only it / only {reference}, p |",
             "|---|" + "---|" * (len(by_length) + 1)]
    one = by_length.get(1, [])
    for method, items in verdicts.items():
        cells = []
        for group in by_length.values():
            right = sum(items[k] for k in group)
            low, high = wilson_interval(right, len(group))
            cells.append(f"{right} ({low:.0%}-{high:.0%})")
        mine = sum(items[k] and not verdicts[reference][k] for k in one)
        theirs = sum(verdicts[reference][k] and not items[k] for k in one)
        paired = "-" if method == reference else f"{mine} / {theirs}, p = {mcnemar_exact(mine, theirs):.2g}"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {paired} |")
    if partial:
        lines += ["", f"Left out (not scored on every item of {reference}): {', '.join(partial)}."]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("records", type=Path, help="a retrieval suite's OUT.jsonl")
    parser.add_argument("--model", default="gqa", help="a bundled name or a directory with the items' tokenizer")
    args = parser.parse_args(argv)
    source = args.model if Path(args.model).is_dir() else model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    print("\n".join(table(load_verdicts(args.records), chain_lengths(tokenizer, args.records))))


if __name__ == "__main__":
    main()
