"""Paired comparison of training runs on the same held-out items (from their ``results.json`` records).

    python benchmarks/models/compare_legs.py base=benchmarks/models/results/lookup/mha.json \
        scaled=benchmarks/models/results/lookup_ext/mha_scaled.json

Every run is scored against the first: held-out reasoning and retrieval exact match at each context both evaluated,
with Wilson 95% intervals and the exact McNemar test on the items where the two runs disagree. A suite is tabled
only where every run has it at the same task version, context and seed (an item is a pure function of tokenizer,
context, seed and index, so the runs of one model then saw the same items).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))

from kvarn_mla.evaluation.checkers import wilson_interval  # noqa: E402
from kvarn_mla.evaluation.paired import compare  # noqa: E402


def verdicts(record: dict) -> dict[str, dict[int, bool]]:
    """``{suite: {item index: exact}}``: ``reasoning``, and ``retrieval vV @N (seed S)`` for each evaluated task
    version V and context N."""
    out: dict[str, dict[int, bool]] = {}
    reasoning = record.get("held_out_reasoning")
    if reasoning:
        failed = set(reasoning["failed_indices"])
        out["reasoning"] = {i: i not in failed for i in range(reasoning["n"])}
    for res in record.get("held_out_retrieval", []):  # records before task version 2 hold none: version 1
        version = res.get("task_version", 1)
        out[f"retrieval v{version} @{res['context']} (seed {res['seed']})"] = {
            it["index"]: bool(it["exact"]) for it in res["items"]
        }
    return out


def cell(mine: dict[int, bool]) -> str:
    right, n = sum(mine.values()), len(mine)
    lo, hi = wilson_interval(right, n)
    return f"{right}/{n} ({lo:.2f}-{hi:.2f})"


def paired(mine: dict[int, bool], ref: dict[int, bool]) -> str:
    c = compare(mine, ref, "reference")
    return f"+{c.only_method} -{c.only_partner}, p = {c.p_value:.2g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=RESULTS.json", help="the first run is the reference")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"expected LABEL=RESULTS.json, got {spec!r}")
        runs[label] = verdicts(json.loads(Path(path).read_text()))
    (ref_label, ref), *others = runs.items()
    suites = [s for s in ref if all(s in v for _, v in others)]
    print("| suite | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for suite in suites:
        row = [cell(ref[suite])] + [
            f"{cell(v[suite])}; vs {ref_label} {paired(v[suite], ref[suite])}" for _, v in others
        ]
        print(f"| {suite} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
