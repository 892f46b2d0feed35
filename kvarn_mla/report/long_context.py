"""Accuracy vs context length: the retrieval suite at each context, the reasoning suite by scratchpad length, and
the long-context goals of `benchmarks/README.md`, stated as met or missed from the records.

Reads ``accuracy/{model}-retrieval-{N}.jsonl`` (one file per context ``N``, written by the sweep's ``retrieval-N``
suites) and ``accuracy/{model}-reasoning-tf.jsonl`` (teacher-forced reasoning records, which carry each item's
target length). Every number comes from the records: exact match with its Wilson interval, and exact McNemar
p-values of paired comparisons on the same items (`evaluation.paired`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..evaluation.checkers import wilson_interval
from ..evaluation.paired import PARTNERS, Comparison, PairedRow, bits_of, compare, load_verdicts, paired_rows
from .charts import context_chart

GOAL_CONTEXT = 8192  # the context at which the goals are stated
GOAL_POINTS = 0.02  # "within 2 points"
GOAL_COMPRESSION = 4.0  # "at >= 4x fewer bytes than 16-bit"
# The goals ask whether quantization keeps what the model can do: below half the items at 16 bits there is too little
# to lose (at 0% every method is trivially "within 2 points"), so no verdict is given and the evidence says why.
REFERENCE_FLOOR = 0.5
FAMILY_OF = {"mha": "MHA", "gqa": "GQA", "mla": "MLA"}
# How results label the unquantized reference: by the model's dtype (fp32, bf16, fp16; `evaluation.methods`);
# results written before that call it "bf16" whatever the dtype.
REFERENCE_LABELS = ("fp32", "bf16", "fp16")
Verdicts = dict[str, dict[str, bool]]  # {method: {item: verdict}} (`evaluation.paired.load_verdicts`)
LENGTH_BINS = (0, 500, 1000, 1500, 2000)  # reasoning scratchpad length bins (target tokens): [a, b), last open


def retrieval_verdicts(accuracy: Path, model: str) -> dict[int, Verdicts]:
    """``{context: {method: {item: verdict}}}`` of a model's retrieval records, by increasing context (each file
    read once; the goals, tables and discussion all work from this)."""
    found = {}
    for path in accuracy.glob(f"{model}-retrieval-*.jsonl"):
        match = re.fullmatch(rf"{model}-retrieval-(\d+)\.jsonl", path.name)
        if match:
            found[int(match.group(1))] = load_verdicts(path)
    return dict(sorted(found.items()))


def goal_sizes(accuracy: Path, model: str, bytes_of) -> dict[str, float]:
    """``{method: bytes per token}`` of the methods in a model's `GOAL_CONTEXT` retrieval summary, by ``bytes_of(model,
    method, row)`` (the report's `method_bytes`)."""
    summary = accuracy / f"{model}-retrieval-{GOAL_CONTEXT}.json"
    rows = json.loads(summary.read_text())["methods"] if summary.exists() else {}
    return {m: b for m, row in rows.items() if (b := bytes_of(model, m, row))}


def reference_of(verdicts: dict) -> str | None:
    """The unquantized reference's label among a records file's methods."""
    return next((label for label in REFERENCE_LABELS if label in verdicts), None)


def _rate(items: dict[str, bool]) -> float:
    return sum(items.values()) / len(items) if items else 0.0


def _within_goal(gap: float) -> bool:
    """Whether an accuracy gap (method minus 16-bit) is within `GOAL_POINTS`, inclusive. Rounded first: 178/200 -
    182/200 is -0.020000000000000018 in floats, which is exactly 2 points."""
    return round(gap, 9) >= -GOAL_POINTS


def curve_points(per_x: dict[int, Verdicts]) -> dict[str, list[tuple[int, int, int]]]:
    """``{method: [(x, correct, n)]}`` from ``{x: {method: {item: verdict}}}``."""
    curves: dict[str, list[tuple[int, int, int]]] = {}
    for x, verdicts in per_x.items():
        for method, items in verdicts.items():
            curves.setdefault(method, []).append((x, sum(items.values()), len(items)))
    return curves


def length_verdicts(records: Path, bins=LENGTH_BINS) -> dict[int, Verdicts]:
    """Teacher-forced reasoning verdicts grouped by target length: ``{bin start: {method: {item: verdict}}}``."""
    grouped: dict[int, Verdicts] = {}
    for line in records.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "exact" not in record or "target_tokens" not in record:
            continue
        start = max(b for b in bins if record["target_tokens"] >= b)
        grouped.setdefault(start, {}).setdefault(record["method"], {})[record["key"]] = bool(record["exact"])
    return dict(sorted(grouped.items()))


def _cell(correct: int, n: int) -> str:
    low, high = wilson_interval(correct, n)
    return f"{correct / n:.1%} ({low:.0%}–{high:.0%}, n={n})" if n else "-"


def curve_table(curves: dict[str, list[tuple[int, int, int]]], xs: list[int], label) -> list[str]:
    """One row per method, one column per x: exact match (Wilson 95%, n)."""
    lines = ["| method | " + " | ".join(label(x) for x in xs) + " |", "|---|" + "---|" * len(xs)]
    for method, points in curves.items():
        by_x = {x: (c, n) for x, c, n in points}
        lines.append(f"| {method} | " + " | ".join(_cell(*by_x[x]) if x in by_x else "-" for x in xs) + " |")
    return lines


def comparison_cell(c: Comparison | None) -> str:
    """A paired comparison as a table cell: items right only with the method minus only with the partner, and the
    exact McNemar p-value (bold below 0.05); ``-`` when the partner did not run."""
    if c is None:
        return "-"
    text = f"{c.difference:+d} (p = {c.p_value:.2g})"
    return f"**{text}**" if c.p_value < 0.05 else text


def partner_comparisons(row: PairedRow, reference: str | None) -> list[Comparison | None]:
    """``row``'s comparisons with the 16-bit ``reference`` and with each of `PARTNERS` at its bit width, in that
    order; None where that partner did not run (or the method names no bit width)."""
    by_partner = {c.partner: c for c in row.comparisons}
    bits = bits_of(row.method)
    partners = (reference, *(f"{family}-{bits}" if bits else None for family in PARTNERS))
    return [by_partner.get(p) for p in partners]


def paired_table(verdicts: Verdicts) -> list[str]:
    """Each method against the 16-bit reference, KVarN (``kvarn-B``) and rotation-only (``rot-B``) at its bit width
    (`evaluation.paired.paired_rows`)."""
    reference = reference_of(verdicts)
    lines = ["| method | vs 16-bit | " + " | ".join(f"vs {family}-B" for family in PARTNERS) + " |",
             "|---|---|" + "---|" * len(PARTNERS)]
    for row in paired_rows(verdicts, also=(reference,) if reference else ()):
        cells = (comparison_cell(c) for c in partner_comparisons(row, reference))
        lines.append(f"| {row.method} | " + " | ".join(cells) + " |")
    return lines


@dataclass(frozen=True)
class Goal:
    """One long-context goal on one model: ``met`` is None when the records to judge it are missing, or when the
    16-bit model itself solves fewer than `REFERENCE_FLOOR` of the items (``judged`` False)."""

    model: str
    goal: str
    met: bool | None
    evidence: str
    judged: bool = True


def goals(model: str, per_context: dict[int, Verdicts], bytes_per_token: dict[str, float]) -> list[Goal]:
    """The three goals at `GOAL_CONTEXT` on ``model``'s retrieval records (`retrieval_verdicts`).

    1. KVarN 4-bit (``kvarn-4``) within 2 points of 16-bit;
    2. (MLA) some method at >= 4x fewer bytes per token than 16-bit within 2 points;
    3. KVarN or ``kvarnvn`` at each bit width at least as good as every other method at that bit width (the same
       bytes up to the per-tile metadata): no significant paired loss (McNemar p < 0.05) of the better of the two.

    Args:
        bytes_per_token: ``{method: bytes per token}`` (`goal_sizes`: the summary's ``bytes_per_token_4k``, the
            report's convention; at 8K a KVarN cache is slightly smaller, its sink and tail amortized over more
            tokens).
    """
    verdicts = per_context.get(GOAL_CONTEXT)
    names = ["kvarn-4 within 2 points of 16-bit", "baselines: no significant loss of KVarN/kvarn-vn"]
    if model == "mla":
        names.insert(1, f">= {GOAL_COMPRESSION:.0f}x fewer bytes within 2 points")
    if verdicts is None:
        return [Goal(model, name, None, f"no {model}-retrieval-{GOAL_CONTEXT}.jsonl") for name in names]
    reference = reference_of(verdicts)
    if reference is None:
        return [Goal(model, name, None, "no 16-bit reference in the records") for name in names]
    accuracy_of = {m: _rate(v) for m, v in verdicts.items() if v}
    ref = accuracy_of[reference]
    if ref < REFERENCE_FLOOR:
        why = (f"16-bit solves {sum(verdicts[reference].values())}/{len(verdicts[reference])} items ({ref:.1%}), "
               f"below {REFERENCE_FLOOR:.0%}: the model does not do the task at {GOAL_CONTEXT:,} tokens")
        return [Goal(model, name, None, why, judged=False) for name in names]
    out = []
    if "kvarn-4" in accuracy_of:
        gap = accuracy_of["kvarn-4"] - ref
        out.append(Goal(model, names[0], _within_goal(gap),
                        f"kvarn-4 {accuracy_of['kvarn-4']:.1%} vs 16-bit {ref:.1%} ({100 * gap:+.1f} points)"))
    else:
        out.append(Goal(model, names[0], None, "kvarn-4 not in the records"))
    if model == "mla":
        small = {m: a for m, a in accuracy_of.items() if m in bytes_per_token and reference in bytes_per_token
                 and bytes_per_token[reference] / bytes_per_token[m] >= GOAL_COMPRESSION}
        best = max(small, key=lambda m: (small[m], -bytes_per_token[m]), default=None)
        if best is None:
            out.append(Goal(model, names[1], None, f"no method at >= {GOAL_COMPRESSION:.0f}x fewer bytes measured"))
        else:
            ratio = bytes_per_token[reference] / bytes_per_token[best]
            out.append(Goal(model, names[1], _within_goal(small[best] - ref),
                            f"best at >= {GOAL_COMPRESSION:.0f}x: {best} ({ratio:.1f}x) {small[best]:.1%} vs 16-bit "
                            f"{ref:.1%} ({100 * (small[best] - ref):+.1f} points)"))
    losses, compared = [], 0
    for bits in sorted({b for m in verdicts if (b := bits_of(m))}):
        ours = [m for m in (f"kvarn-{bits}", f"kvarnvn-{bits}") if m in verdicts]
        if not ours:
            continue
        mine = max(ours, key=lambda m: accuracy_of[m])
        for other in verdicts:
            if bits_of(other) != bits or other in ours or "rope_bits" in other:
                continue
            compared += 1
            c = compare(verdicts[mine], verdicts[other], other)
            if c.difference < 0 and c.p_value < 0.05:
                losses.append(f"{mine} vs {other}: {c.difference:+d} items (p = {c.p_value:.2g})")
    out.append(Goal(model, names[-1], None if not compared else not losses,
                    "; ".join(losses) if losses else f"no significant loss in {compared} paired comparisons"))
    return out


def goal_lines(found: list[Goal]) -> list[str]:
    """The goals as a Markdown table (the report's and ``benchmarks/accuracy.py --goals``)."""
    lines = ["| model | goal | met | evidence |", "|---|---|---|---|"]
    for g in found:
        verdict = "met" if g.met else "**missed**" if g.met is False else "not measured" if g.judged else "no verdict"
        lines.append(f"| {g.model.upper()} | {g.goal} | {verdict} | {g.evidence} |")
    return lines


def long_context_section(accuracy: Path, out: Path, bytes_of) -> tuple[list[str], list[Goal], list[str]]:
    """The report's accuracy-vs-context section (with a chart per model), the goals, and the discussion lines
    (`context_discussion`).

    Args:
        bytes_of: ``bytes_of(model, method, row)`` -> bytes per token (the report's `method_bytes`).
    """
    lines = ["## 2b. Accuracy vs context length\n",
             "Retrieval (`kvarn-mla eval --suite retrieval`): held-out items of N tokens, facts at depths spread over "
             "the whole context, teacher-forced exact match of the whole answer (`--mode teacher-forced`, the greedy "
             "verdict). Reasoning: held-out long-chain items, teacher-forced, by scratchpad length. Cells: exact "
             "match (Wilson 95% interval, items). Paired columns: items right only with the method minus only with "
             "the partner, exact McNemar p (bold below 0.05).\n"]
    found_goals: list[Goal] = []
    per_model: dict[str, dict[int, Verdicts]] = {}
    sizes_of: dict[str, dict[str, float]] = {}
    for model in ("mha", "gqa", "mla"):
        family = FAMILY_OF[model]
        per_context = retrieval_verdicts(accuracy, model)
        if per_context:
            per_model[model] = per_context
            curves = curve_points(per_context)
            chart = f"context_{model}.png"
            context_chart(curves, f"{family} reference model: retrieval exact match vs context", "context (tokens)",
                          out / chart)
            lines += [f"### {family}: retrieval vs context (`accuracy/{model}-retrieval-N.jsonl`)\n",
                      *curve_table(curves, list(per_context), lambda n: f"{n // 1024}K"), "",
                      f"![{chart[:-4]}]({chart})\n"]
            for n, verdicts in per_context.items():
                if n in (GOAL_CONTEXT, max(per_context)):
                    lines += [f"#### {family}: retrieval at {n:,} tokens, paired\n", *paired_table(verdicts), ""]
            sizes_of[model] = goal_sizes(accuracy, model, bytes_of)
            found_goals += goals(model, per_context, sizes_of[model])
        tf = accuracy / f"{model}-reasoning-tf.jsonl"
        if tf.is_file():
            per_length = length_verdicts(tf)
            curves = curve_points(per_length)
            chart = f"length_{model}.png"
            context_chart(curves, f"{family} reference model: reasoning exact match vs scratchpad length",
                          "scratchpad length (target tokens, bin start)", out / chart)
            lines += [f"### {family}: reasoning by scratchpad length (`accuracy/{model}-reasoning-tf.jsonl`)\n",
                      *curve_table(curves, list(per_length), lambda b: f"≥{b}"), "", f"![{chart[:-4]}]({chart})\n",
                      f"#### {family}: reasoning (teacher-forced, all lengths), paired\n",
                      *paired_table(load_verdicts(tf)), ""]
    if found_goals:
        lines += [f"### Goals at {GOAL_CONTEXT:,} tokens\n", *goal_lines(found_goals), ""]
    if len(lines) == 2:
        lines.append("No long-context records under `accuracy/` yet (the sweep's `retrieval-N` and "
                     "`reasoning-tf` suites).\n")
    return lines, found_goals, context_discussion(per_model, sizes_of)


def context_discussion(per_model: dict[str, dict[int, Verdicts]],
                       bytes_per_token: dict[str, dict[str, float]]) -> list[str]:
    """Discussion lines from the long-context records: how 16-bit and each quantizer pair (KVarN vs rotation-only,
    KVarN vs KIVI-style, kvarn-vn vs KVarN) change with context, and whether another preset than the default
    ``k4v2`` is better at 8K on every model (significantly, at no more bytes).

    Args:
        per_model: ``{model: retrieval_verdicts(...)}``.
        bytes_per_token: ``{model: {method: bytes per token}}``.
    """
    lines: list[str] = []
    better_than_default: dict[str, set[str]] = {}
    for model, per_context in per_model.items():
        reference = {n: reference_of(v) for n, v in per_context.items()}
        ref = ", ".join(f"{_rate(v[reference[n]]):.0%} at {n // 1024}K" for n, v in per_context.items()
                        if reference[n])
        pairs = []
        for bits in (4, 3, 2):
            for mine, other in ((f"kvarn-{bits}", f"rot-{bits}"), (f"kvarn-{bits}", f"kivi-{bits}"),
                                (f"kvarnvn-{bits}", f"kvarn-{bits}")):
                cells = []
                for n, verdicts in per_context.items():
                    if mine in verdicts and other in verdicts:
                        c = compare(verdicts[mine], verdicts[other], other)
                        mark = "*" if c.p_value < 0.05 else ""
                        cells.append(f"{100 * c.difference / max(1, len(verdicts[mine])):+.0f}{mark} ({n // 1024}K)")
                if cells:
                    pairs.append(f"{mine} − {other}: {', '.join(cells)}")
        lines.append(f"- {FAMILY_OF[model]} retrieval vs context: 16-bit {ref or 'not measured'}. Paired differences "
                     f"in points (* p < 0.05): " + "; ".join(pairs) + ".")
        verdicts = per_context.get(GOAL_CONTEXT, {})
        sizes = bytes_per_token.get(model, {})
        if "k4v2" in verdicts and "k4v2" in sizes:
            better_than_default[model] = {
                m for m in verdicts if m != "k4v2" and m in sizes and sizes[m] <= sizes["k4v2"]
                and (c := compare(verdicts[m], verdicts["k4v2"], "k4v2")).difference > 0 and c.p_value < 0.05}
    if better_than_default:
        everywhere = set.intersection(*better_than_default.values()) if len(better_than_default) == 3 else set()
        lines.append(
            f"- Default preset: at {GOAL_CONTEXT // 1024}K, "
            + (f"{', '.join(sorted(everywhere))} beat k4v2 significantly at no more bytes on all three models: the "
               "evidence favours it as the default on these models." if everywhere else
               "no method beats k4v2 significantly at no more bytes on all three models (methods that do, per "
               f"model: {', '.join(f'{FAMILY_OF[m]} {len(s)}' for m, s in better_than_default.items())}); k4v2 "
               "stays the default."))
    return lines
