"""Do greedy and teacher-forced scoring give the same verdicts? Pairs two `kvarn-mla eval` record files item by item.

    kvarn-mla eval --model mla --suite reasoning --presets ... --mode teacher-forced --out tf/mla-reasoning.json
    python benchmarks/mode_agreement.py results/accuracy/mla-reasoning.jsonl tf/mla-reasoning.jsonl

Per method found in both: items in both files, both right, right only greedily, right only teacher-forced, both
wrong, agreement, and the exact McNemar p-value of the discordant items (a systematic difference between the modes
would show there). Greedy records of a batched run were generated with left padding, which moves KVarN's tile
boundaries and sink against an item's own tokens; teacher-forced scoring runs one unpadded item at a time, as
greedy decoding of one item does, so disagreements on batched records include that difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvarn_mla.evaluation.paired import compare, load_verdicts

# Records written before the reference was labelled by its dtype call the float32 reference "bf16".
REFERENCE_NAMES = ("bf16", "fp32")


def agreement_table(greedy: dict[str, dict[str, bool]], forced: dict[str, dict[str, bool]]) -> tuple[str, int, int]:
    """Markdown table per method found in both, and the paired verdicts and disagreements over all methods."""
    lines = ["| method | items | both right | greedy only | teacher-forced only | both wrong | agreement | McNemar p |",
             "|---|---|---|---|---|---|---|---|"]
    total = disagree = 0
    for method, mine in greedy.items():
        other = forced.get(method) or (forced.get("fp32") if method in REFERENCE_NAMES else None)
        if other is None:
            continue
        keys = mine.keys() & other.keys()
        both = sum(mine[k] and other[k] for k in keys)
        pair = compare(mine, other, "teacher-forced")
        neither = len(keys) - both - pair.only_method - pair.only_partner
        total, disagree = total + len(keys), disagree + pair.only_method + pair.only_partner
        lines.append(f"| {method} | {len(keys)} | {both} | {pair.only_method} | {pair.only_partner} | {neither} | "
                     f"{(both + neither) / max(1, len(keys)):.1%} | {pair.p_value:.3g} |")
    return "\n".join(lines), total, disagree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("greedy", type=Path, help="records (.jsonl) of a --mode greedy run")
    parser.add_argument("forced", type=Path, help="records (.jsonl) of a --mode teacher-forced run")
    args = parser.parse_args(argv)
    table, total, disagree = agreement_table(load_verdicts(args.greedy), load_verdicts(args.forced))
    print(table)
    print(f"\n{total} paired verdicts, {disagree} different ({disagree / max(1, total):.2%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
