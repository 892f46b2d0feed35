"""The accuracy sweep of the committed results (issue: error accumulation, reasoning, baselines).

Runs `kvarn_mla.evaluation.sweep.sweep` (every reference model × method × bit width, resumable: rerun to continue)
into `benchmarks/results/accuracy/`, then rebuilds the report (`benchmarks/report/`), whose tables and PNG curves
are the results' presentation.

A rerun resumes only records of the same configuration (the same checkpoint weights, suite settings and method
definitions; `kvarn_mla.evaluation.runner`); it stops, naming what differs, at records of another one, and at the
legacy records written before records named their configuration: move those away to measure new checkpoints.
`--no-run` still rebuilds the summaries from legacy records.

    python benchmarks/accuracy.py                      # everything (hours on 2 CPU cores)
    python benchmarks/accuracy.py --models mla --suites accumulation-reasoning,reasoning --items 20 --bits 2,4
    python benchmarks/accuracy.py --suites retrieval-2048,retrieval-8192,reasoning-tf --long-items 200   # v2 models
    python benchmarks/accuracy.py --suites retrieval-8192 --out B --long-slice 100:200   # a second core's half
    python benchmarks/accuracy.py --suites retrieval-8192 --out A --merge-from B --no-run   # gather it into A
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvarn_mla.evaluation.sweep import CONTEXTS, SUITES, sweep
from kvarn_mla.report import build_report

HERE = Path(__file__).resolve().parent


def summary_table(accuracy: Path, models=("mha", "gqa", "mla")) -> str:
    """The headline table of benchmarks/README.md, read from the committed summaries (``--summary``)."""
    def load(model: str, suite: str) -> dict:
        path = accuracy / f"{model}-{suite}.json"
        return json.loads(path.read_text())["methods"] if path.exists() else {}

    lines = ["| model | method | bytes/token (4K) | code: KL last chunk | reasoning text: KL last chunk | KL mean | "
             "greedy chain: first divergence | reasoning exact match (95% CI) |", "|---|---|---|---|---|---|---|---|"]
    for model in models:
        code, text, exact = (load(model, s) for s in ("accumulation", "accumulation-reasoning", "reasoning"))
        for method, row in exact.items():
            if "exact" not in row:
                continue
            e, c, t = row["exact"], code.get(method, {}), text.get(method, {})
            kl = [f"{x[k]:.4f}" if k in x else "–" for x, k in ((c, "kl_last"), (t, "kl_last"), (t, "kl_mean"))]
            size = row.get("bytes_per_token_4k")
            size = "–" if size is None else f"{size:,.0f}"
            lines.append(f"| {model.upper()} | {method} | {size} | {kl[0]} | {kl[1]} | {kl[2]} | "
                         f"{t.get('first_divergence', '–')} | {e['correct']}/{row['n']} ({e['ci95'][0]:.0%}–"
                         f"{e['ci95'][1]:.0%}) |")
    return "\n".join(lines)


def goals_table(accuracy: Path, models=("mha", "gqa", "mla")) -> str:
    """The long-context goals at 8K as met / missed / not measured, from the retrieval records (``--goals``): the
    report's goals table."""
    from kvarn_mla.report import method_bytes
    from kvarn_mla.report.long_context import goal_lines, goal_sizes, goals, retrieval_verdicts

    found = [g for model in models for g in goals(model, retrieval_verdicts(accuracy, model),
                                                 goal_sizes(accuracy, model, method_bytes))]
    return "\n".join(goal_lines(found))


def _paired_cell(c) -> str:
    """A comparison as ``+d, p P`` (``p`` left out below 1e-4), bold when significant; empty when it did not run."""
    if c is None:
        return ""
    text = f"{c.difference:+d}" + (f", p {c.p_value:.2g}" if c.p_value >= 1e-4 else "")
    return f"**{text}**" if c.p_value < 0.05 else text


def long_summary(accuracy: Path, models=("mha", "gqa", "mla")) -> str:
    """The long-context tables of benchmarks/README.md, from the records and summaries (``--long-summary``):
    ``reasoning-tf`` right of N (Wilson 95%) and paired against 16-bit, ``kvarn-B`` and ``rot-B`` for the models
    side by side; right per scratchpad-length bin; ``accumulation-long`` and ``accumulation-retrieval`` mean KL per
    quarter of the text (and the static cache's last quarter); each retrieval context's right of N, bytes per token
    and paired cells."""
    from kvarn_mla.evaluation.checkers import wilson_interval
    from kvarn_mla.evaluation.paired import load_verdicts, paired_rows
    from kvarn_mla.report.long_context import length_verdicts, partner_comparisons, reference_of

    def right(items: dict[str, bool]) -> str:
        low, high = wilson_interval(sum(items.values()), len(items))
        return f"{sum(items.values())} ({low:.0%}-{high:.0%})"

    records = {m: accuracy / f"{m}-reasoning-tf.jsonl" for m in models}
    records = {m: path for m, path in records.items() if path.exists()}
    lines = []
    if records:
        cells: dict[str, dict[str, list[str]]] = {}
        n: dict[str, int] = {}
        for model, path in records.items():
            verdicts = load_verdicts(path)
            reference = reference_of(verdicts)
            n[model] = len(verdicts[reference])
            cells.setdefault("16-bit", {})[model] = [right(verdicts[reference]), "", "", ""]
            for row in paired_rows(verdicts, also=(reference,)):
                if row.method != reference:
                    cells.setdefault(row.method, {})[model] = [
                        right(verdicts[row.method]), *map(_paired_cell, partner_comparisons(row, reference))]
        lines += ["| method | " + " | ".join(f"{m.upper()}: right of {n[m]} | vs 16-bit | vs kvarn-B | vs rot-B"
                                           for m in records) + " |", "|---|" + "---|" * (4 * len(records))]
        lines += [f"| {method} | " + " | ".join(" | ".join(row.get(m, [""] * 4)) for m in records) + " |"
                  for method, row in cells.items()]
        for model, path in records.items():
            bins = length_verdicts(path)
            every = list(dict.fromkeys(m for by_method in bins.values() for m in by_method))
            methods = [m for m in every if any(sum(b.get(m, {}).values()) for b in bins.values())]
            starts = list(bins)
            labels = [f"{a:,}-{b - 1:,}" if a else f"< {b:,}" for a, b in zip(starts, starts[1:])]
            labels.append(f"≥ {starts[-1]:,}")
            lines += ["", f"{model.upper()}, right per scratchpad length (generated tokens):", "",
                      "| tokens | n | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
            lines += [f"| {label} | {len(next(iter(by_method.values())))} | "
                      + " | ".join(str(sum(by_method.get(m, {}).values())) for m in methods) + " |"
                      for label, by_method in zip(labels, bins.values())]
            if len(methods) < len(every):
                lines += ["", "Right on no item: " + ", ".join(m for m in every if m not in methods) + "."]
    for model, context in ((m, n) for m in models for n in CONTEXTS):
        path = accuracy / f"{model}-retrieval-{context}.jsonl"
        if not path.exists():
            continue
        verdicts = load_verdicts(path)
        reference = reference_of(verdicts)
        summary = path.with_suffix(".json")
        sizes = json.loads(summary.read_text())["methods"] if summary.exists() else {}
        lines += ["", f"{model.upper()}, retrieval at {context:,} tokens: right of n (Wilson 95%) and paired (items "
                  "right only with the method minus only with the partner, on the items both have; exact McNemar p, "
                  "left out below 1e-4; bold below 0.05):", "",
                  "| method | bytes/token @4K | right of n | vs 16-bit | vs kvarn-B | vs rot-B |",
                  "|---|---|---|---|---|---|"]
        for row in paired_rows(verdicts, also=(reference,)):
            size = sizes.get(row.method, {}).get("bytes_per_token_4k")
            size_cell = "-" if size is None else f"{size:,.0f}"
            cells = [""] * 3 if row.method == reference else map(_paired_cell, partner_comparisons(row, reference))
            lines.append(f"| {row.method} | {size_cell} | {right(verdicts[row.method])} of {row.n} | "
                         + " | ".join(cells) + " |")
    for model, suite in ((m, s) for m in models for s in ("accumulation-long", "accumulation-retrieval")):
        path = accuracy / f"{model}-{suite}.json"
        if not path.exists():
            continue
        lines += ["", f"{model.upper()}, {suite}: mean KL to 16-bit per quarter of the text "
                  "(accumulated cache; static: the cache holds the reference's K/V):", "",
                  "| method | 1st quarter | 2nd | 3rd | 4th | 4th, static | top-1 agreement |",
                  "|---|---|---|---|---|---|---|"]
        for method, row in json.loads(path.read_text())["methods"].items():
            if "kl_curve" not in row:
                continue
            curve, static, q = row["kl_curve"], row.get("kl_curve_static"), len(row["kl_curve"]) // 4
            quarters = [sum(curve[i * q:(i + 1) * q]) / q for i in range(4)]
            last_static = f"{sum(static[3 * q:4 * q]) / q:.4f}" if static else "-"
            lines.append(f"| {method} | " + " | ".join(f"{x:.4f}" for x in quarters)
                         + f" | {last_static} | {row['top1_mean']:.3f} |")
    return "\n".join(lines)


def _item_slice(text: str) -> slice:
    """``START:STOP`` (either may be left out) as a slice of item indices."""
    start, colon, stop = text.partition(":")
    if not colon or not all(part.isdigit() for part in (start, stop) if part):
        raise argparse.ArgumentTypeError(f"{text!r} is not START:STOP with non-negative integers (e.g. 0:100 or 100:)")
    return slice(int(start) if start else None, int(stop) if stop else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mla,gqa,mha",
                        help="bundled names, or NAME=DIR for a checkpoint directory filed under NAME")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "accuracy",
                        help="results directory (default: the committed results/accuracy)")
    parser.add_argument("--suites", default=",".join(SUITES))
    parser.add_argument("--items", type=int, default=100, help="held-out reasoning problems per method")
    parser.add_argument("--long-items", type=int, default=200,
                        help="items per retrieval context and of reasoning-tf (the long-context suites)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--bits", default="2,3,4", help="bit widths of the quantizers and baselines")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--families",
                        help="only methods whose name starts with one of these (e.g. hf-); NAME$ is that name only")
    parser.add_argument("--summary", action="store_true", help="only print the README table from the results")
    parser.add_argument("--no-run", action="store_true", help="only rebuild summaries and report from the records")
    parser.add_argument("--goals", action="store_true", help="only print the long-context goals table (8K)")
    parser.add_argument("--long-summary", action="store_true",
                        help="only print the README's long-chain reasoning and 16K accumulation tables")
    parser.add_argument("--long-slice", metavar="START:STOP", type=_item_slice,
                        help="score only these of the long suites' items (split a grid over processes, one --out each)")
    parser.add_argument("--merge-from", type=Path, metavar="DIR",
                        help="first append DIR's records that OUT lacks (a grid split over processes, one --out each)")
    args = parser.parse_args(argv)
    if args.merge_from:
        from kvarn_mla.evaluation.runner import merge_records

        for source in sorted(args.merge_from.glob("*.jsonl")):
            try:
                added, shared = merge_records(args.out / source.name, source)
            except ValueError as error:
                print(f"accuracy.py: error: {error}", file=sys.stderr)
                return 2
            print(f"{source.name}: {added} records added, {shared} already there and equal")
    if args.goals:
        print(goals_table(args.out, [m.partition("=")[0] for m in args.models.split(",")]))
        return 0
    if args.summary:
        print(summary_table(args.out, [m.partition("=")[0] for m in args.models.split(",")]))
        return 0
    if args.long_summary:
        print(long_summary(args.out, [m.partition("=")[0] for m in args.models.split(",")]))
        return 0
    torch.set_num_threads(args.threads)
    try:
        results = sweep(args.out, models=args.models.split(","), items=args.items,
                        suites=args.suites.split(","), batch_size=args.batch_size,
                        bits=tuple(int(b) for b in args.bits.split(",")), compute=not args.no_run,
                        families=tuple(args.families.split(",")) if args.families else None,
                        long_items=args.long_items,
                        long_slice=args.long_slice)
    except ValueError as error:  # records of another configuration, an unknown suite
        print(f"accuracy.py: error: {error}", file=sys.stderr)
        return 2
    if results["_missing_baselines"]:
        print("baselines that could not run:", results["_missing_baselines"])
    if args.out.resolve() == (HERE / "results" / "accuracy").resolve():
        print("report:", build_report(HERE / "results", HERE / "report"))
    else:  # another results set: its own report, on request
        print(f"report: kvarn-mla report --results {args.out.parent} --out DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
