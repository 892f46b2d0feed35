"""Print the README tables from ``benchmarks/models/results/*.json`` (every number comes from those files).

    python benchmarks/models/summarize.py > /tmp/tables.md
    python benchmarks/models/summarize.py --readme runs/README_draft.md > benchmarks/models/README.md

``--readme`` fills a template: a line ``TABLE_MODELS`` becomes the models and training tables, ``RECIPE`` the phase
table, ``RESULTS`` the held-out tables; it refuses while a model's results or evaluations are missing, or while the
template still holds another all-capitals placeholder line (prose to write by hand). ``--models gqa,mha`` tables
those models only (while the third ships a checkpoint of another recipe, which the template then describes).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NAMES = ("mla", "gqa", "mha")
CODE_TARGET = 0.8  # held-out code NLL per token at most this times the text's own unigram entropy


def kv_bytes_per_token_layer(cfg: dict) -> int:
    """16-bit KV-cache bytes one token takes in one layer (MLA: latent + RoPE key; else K and V)."""
    if "kv_lora_rank" in cfg:
        return 2 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * 2 * cfg["num_key_value_heads"] * head_dim


def attention(cfg: dict) -> str:
    heads = cfg["num_attention_heads"]
    if "kv_lora_rank" in cfg:
        return (
            f"MLA, {heads} heads, kv_lora_rank {cfg['kv_lora_rank']}, nope {cfg['qk_nope_head_dim']}, "
            f"rope {cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}"
        )
    return f"{heads} q heads / {cfg['num_key_value_heads']} kv heads x {cfg.get('head_dim')}"


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def load_runs(results: Path = RESULTS, names: tuple[str, ...] = NAMES) -> dict[str, dict]:
    """``{name: metrics}`` of the models among ``names`` with a results file of version 2 or later (the v1 MLA's
    metrics, still bundled, predate the code, retrieval and token counts these tables read: left out, with a line
    on stderr)."""
    runs = {n: json.loads((results / f"{n}.json").read_text()) for n in names if (results / f"{n}.json").exists()}
    for n in [n for n, m in runs.items() if "code_tokens" not in m["tokens_seen"]]:
        print(
            f"summarize: {n}: {results / f'{n}.json'} is a version-1 result (no code or retrieval counts); left out",
            file=sys.stderr,
        )
        del runs[n]
    return runs


def models_section(runs: dict[str, dict]) -> None:
    """The models table (class, attention, sizes, RoPE base) and the training table (steps, tokens, time)."""
    rows = []
    for n, m in runs.items():
        c, p = m["config"], m["params"]
        rows.append(
            [
                n,
                f"`{m['architecture']}`",
                attention(c),
                f"{p['total'] / 1e6:.2f}M ({p['non_embedding'] / 1e6:.2f}M)",
                str(kv_bytes_per_token_layer(c)),
                f"{c.get('rope_parameters', {}).get('rope_theta', 0):,.0f}",
                f"{m['checkpoint_bytes'] / 2**20:.2f} MiB",
            ]
        )
    table(
        [
            "model",
            "class",
            "attention",
            "params (non-emb.)",
            "KV bytes/token/layer (16-bit)",
            "RoPE base",
            "checkpoint",
        ],
        rows,
    )

    rows = []
    for n, m in runs.items():
        s = m["tokens_seen"]
        rows.append(
            [
                n,
                str(m["steps_done"]),
                f"{s['input_tokens'] / 1e6:.2f}M",
                f"{s['code_tokens'] / 1e6:.2f}M",
                f"{(s['reasoning_tokens'] + s['prompt_tokens']) / 1e6:.2f}M",
                f"{s['retrieval_tokens'] / 1e3:.0f}k",
                f"{m['train_seconds'] / 3600:.2f} h",
                f"{m['final_train_loss_mean_last_20']:.3f}",
            ]
        )
    table(
        [
            "model",
            "steps",
            "tokens seen",
            "code targets",
            "reasoning targets (with prompts)",
            "retrieval targets",
            "train time",
            "final loss (last 20 steps)",
        ],
        rows,
    )


def recipe_section(runs: dict[str, dict]) -> None:
    """The phase table of the recipe the runs share (``Recipe.phases`` as the results record it)."""
    recipes = {json.dumps(m["recipe"], sort_keys=True) for m in runs.values()}
    if len(recipes) != 1:
        raise ValueError(f"the runs were trained with {len(recipes)} different recipes; the README describes one")
    recipe = next(iter(runs.values()))["recipe"]
    rows = []
    for p in recipe["phases"]:
        kinds = {"r": "reasoning", "o": "openings", "c": "code", "k": "retrieval"}
        mix = ", ".join(f"{p['mix'].count(k)} {name}" for k, name in kinds.items() if k in p["mix"])
        rows.append(
            [
                p["name"],
                str(p["steps"]),
                f"{len(p['mix'])} x {p['context']:,}",
                mix,
                f"{p['lr']:.0e}"
                + ("" if p["final_lr"] == p["lr"] else f" -> {p['final_lr']:.0e}")
                + (f" (warm-up {p['warmup']})" if p["warmup"] else ""),
                str(p["max_rows"]) if set(p["mix"]) & {"r", "o"} else "-",
                ", ".join(f"{c:,}" for c in p["retrieval"]) if "k" in p["mix"] else "-",
                f"{p['span']:,}" if p["span"] else "-",
                f"{(p['rope_theta'] or recipe['rope_theta']):,.0f}",
                " / ".join(f"{w:g}" for w in p["weights"]),
            ]
        )
    table(
        [
            "phase",
            "steps",
            "rows x tokens",
            "rows per step",
            "lr",
            "reasoning rows up to",
            "retrieval items (tokens)",
            "position span",
            "RoPE base",
            "loss weights (reasoning / code / retrieval)",
        ],
        rows,
    )


def results_section(runs: dict[str, dict]) -> None:
    """Held-out code, reasoning and retrieval tables, and the monitoring during training."""
    if all("held_out_code" in m for m in runs.values()):
        rows = []
        for n, m in runs.items():
            c = m["held_out_code"]
            ok = c["nll_over_own_unigram_entropy"] <= CODE_TARGET
            rows.append(
                [
                    n,
                    f"{c['nll_per_token']:.3f}",
                    f"{c['own_unigram_entropy']:.3f}",
                    f"**{c['nll_over_own_unigram_entropy']:.3f}**" + (" (met)" if ok else " (missed)"),
                    f"{c['train_unigram_cross_entropy']:.3f}",
                    f"{c['tokens_scored']:,} ({c['files']} files)",
                ]
            )
        table(
            [
                "model",
                "held-out code NLL (nats/token)",
                "the text's own unigram entropy",
                "ratio (target <= 0.8)",
                "train-unigram cross-entropy",
                "tokens scored",
            ],
            rows,
        )

    if all("held_out_reasoning" in m for m in runs.values()):
        rows = []
        for n, m in runs.items():
            r = m["held_out_reasoning"]
            lo, hi = r["wilson95"]
            rows.append(
                [
                    n,
                    f"**{r['exact_match']:.2f}** ({r['correct']}/{r['n']})",
                    f"{lo:.3f}-{hi:.3f}",
                    f"{r['final_answer_acc']:.2f}",
                    f"{r['correct_2000_plus_tokens']}/{r['items_2000_plus_tokens']}",
                    f"{r['mean_target_tokens']:.0f} / {r['max_target_tokens']}",
                ]
            )
        table(
            [
                "model",
                "reasoning exact match",
                "95% Wilson",
                "final answer only",
                "items of 2,000+ tokens solved",
                "generated tokens mean / max",
            ],
            rows,
        )

    contexts = sorted({res["context"] for m in runs.values() for res in m.get("held_out_retrieval", [])})
    if contexts:
        rows = []
        for n, m in runs.items():
            by = {res["context"]: res for res in m.get("held_out_retrieval", [])}
            cells = []
            for c in contexts:
                res = by.get(c)
                cells.append(
                    f"{res['exact_match']:.2f} ({res['correct']}/{res['n']}; numbers {res['answer_acc']:.2f})"
                    if res
                    else "-"
                )
            rows.append([n, *cells])
        table(["model", *(f"retrieval @ {c:,} tokens: exact (numbers)" for c in contexts)], rows)

    steps = sorted({h["step"] for m in runs.values() for h in m["history"] if "tf_acc_cell" in h})
    if steps:
        keys = sorted(
            {k for m in runs.values() for h in m["history"] for k in h if k.endswith("_tf_all")},
            key=lambda k: int(k.split("_")[1]),
        )
        print(
            "Monitoring during training (teacher-forced on other held-out items: reasoning cell accuracy; share of "
            "retrieval items with every target token right at "
            + ", ".join(k.split("_")[1] for k in keys)
            + " tokens):\n"
        )
        rows = []
        for st in steps:
            cells = []
            for m in runs.values():
                h = next((h for h in m["history"] if h["step"] == st and "tf_acc_cell" in h), None)
                # the monitored retrieval contexts differ between phases: a context not monitored at a step is "-"
                retrieval_cells = (f"{h[k]:.2f}" if k in h else "-" for k in keys)
                cells.append(f"{h['tf_acc_cell']:.3f} / " + " / ".join(retrieval_cells) if h else "")
            phase = next(h["phase"] for m in runs.values() for h in m["history"] if h["step"] == st)
            rows.append([str(st), phase, *cells])
        table(["step", "phase", *runs], rows)


SECTIONS = {"TABLE_MODELS": models_section, "RECIPE": recipe_section, "RESULTS": results_section}


def fill(template: str, runs: dict[str, dict], names: tuple[str, ...] = NAMES) -> str:
    """``template`` with each placeholder line of :data:`SECTIONS` replaced by the tables of ``names``.

    Raises:
        ValueError: a model's results or evaluations are missing, or another placeholder line remains.
    """
    absent = [n for n in names if n not in runs]
    lacking = [
        f"{n}: {k}"
        for n, m in runs.items()
        for k in ("held_out_code", "held_out_reasoning", "held_out_retrieval")
        if k not in m
    ]
    if absent or lacking:
        raise ValueError(f"results missing: {', '.join(absent + lacking)}")
    lines = []
    for line in template.splitlines():
        if line.strip() in SECTIONS:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                SECTIONS[line.strip()](runs)
            lines.append(out.getvalue().rstrip("\n"))
        elif re.fullmatch(r"[A-Z][A-Z_]{2,}", line.strip()) or re.search(r"\b(TODO|LEGS|PILOTS)\b", line):
            raise ValueError(f"the template still holds a placeholder: {line.strip()!r}")
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


_STEP = re.compile(r"^\[(\w+)\] step (\d+)/\d+ (\S+) loss \S+ \(([^)]*)\)")
_MONITOR = re.compile(
    r"\| reasoning tf cell ([\d.]+) all ([\d.]+) \| retrieval tf (.*?)(?: \| recall value/key (.*))? \(\d+s\)"
)


def monitor_rows(log_lines: list[str], contexts: list[int], window: int = 50) -> list[list[str]]:
    """Rows of the README's training-monitor table from a ``train_reference.py`` log: model, step, phase, the lookup
    loss (the ``retrieval`` group: copy, recall or retrieval targets; mean of the ``window`` steps up to the row),
    reasoning cell accuracy / items whole, and for each of ``contexts`` the monitored retrieval items' target-token /
    first-value-token accuracy ("-" where not monitored), and the recall probe's key match at 2 / 4 / 8 facts ("-" in
    logs from before it was monitored). A step logged twice (a resumed run) counts as last logged."""
    steps: dict[int, tuple[str, str, dict[str, float], str]] = {}
    for line in log_lines:
        m = _STEP.match(line)
        if m:
            words = m[4].split()  # "reasoning 0.302 code 5.806 retrieval 5.897"
            groups = {words[i]: float(words[i + 1]) for i in range(0, len(words) - 1, 2)}
            steps[int(m[2])] = (m[1], m[3], groups, line)
    rows = []
    for step in sorted(steps):
        name, phase, _, line = steps[step]
        mon = _MONITOR.search(line)
        if not mon:
            continue
        recent = (steps[s][2] for s in range(step - window + 1, step + 1) if s in steps)
        lookup = [groups["retrieval"] for groups in recent if "retrieval" in groups]
        at = {int(c): v.split("/") for c, v in (part.split() for part in mon[3].split("@")[1:])}  # all/token/value
        rows.append(
            [
                name,
                str(step),
                phase,
                f"{sum(lookup) / len(lookup):.2f}" if lookup else "-",
                f"{mon[1]} / {float(mon[2]):.2f}",
            ]
            + [f"{float(at[c][1]):.2f} / {float(at[c][2]):.2f}" if c in at else "-" for c in contexts]
            + [" / ".join(pair.split("/")[1] for pair in mon[4].split()) if mon[4] else "-"]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory of <name>.json (default: committed)")
    parser.add_argument("--readme", type=Path, help="a README template to fill (see the module docstring)")
    parser.add_argument(
        "--monitor", type=Path, nargs="+", help="print the training-monitor table of these logs instead"
    )
    parser.add_argument(
        "--models",
        type=lambda s: tuple(s.split(",")),
        default=NAMES,
        help=f"the models to table (default {','.join(NAMES)})",
    )
    args = parser.parse_args(argv)
    if args.monitor:
        logs = [log.read_text() for log in args.monitor]
        contexts = sorted({int(c) for text in logs for c in re.findall(r"@(\d+) [\d.]+/", text)})
        table(
            ["model", "step", "phase", "lookup loss (mean of the 50 steps up to it)", "reasoning cell / items whole"]
            + [f"retrieval @{c:,}: tokens / first value" for c in contexts]
            + ["key match at 2 / 4 / 8 facts"],
            [row for text in logs for row in monitor_rows(text.splitlines(), contexts)],
        )
        return 0
    unknown = sorted(set(args.models) - set(NAMES))
    if unknown:
        parser.error(f"--models {','.join(unknown)}: expected some of {', '.join(NAMES)}")
    runs = load_runs(args.results, args.models)
    if not runs:
        print(f"no results in {args.results}", file=sys.stderr)
        return 2
    if args.readme:
        try:
            print(fill(args.readme.read_text(), runs, args.models), end="")
        except ValueError as error:
            print(f"summarize: {error}", file=sys.stderr)
            return 2
        return 0
    models_section(runs)
    if all("phases" in m["recipe"] for m in runs.values()):
        recipe_section(runs)
    results_section(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
