"""`kvarn-mla report`: the architecture comparison report (MHA vs GQA vs MLA: bytes, capacity, error, speed).

Every number in the report is read from a results file (named next to it) or computed from the bundled published
configs; nothing is typed in. Sections: bytes per token and capacity for well-known models × methods; measured
accuracy of the reference models (error accumulation, reasoning accuracy against bytes); measured decode speed;
and a short discussion per family generated from those numbers.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path

from .charts import bar_chart, curve_chart, pareto_chart, speed_chart
from .long_context import FAMILY_OF, REFERENCE_LABELS, comparison_cell, long_context_section

CAPACITY_BUDGET_GIB = 64  # cache memory the capacity column fills
CAPACITY_CONTEXT = 32768  # context at which bytes per token are counted
BYTES_METHODS = ["bf16", "hf-fp8", "hf-quanto-4", "hf-quanto-2", "kivi-k2v2", "k4v2", "k2v2", "k4v2-r8"]
REPORT_CONTEXT = 4096  # context at which the accuracy tables count bytes per token
BENCH_FILES = ("bench_cpu.json", "bench_decode_cpu.json")


def checkout_results() -> Path:
    """The committed ``benchmarks/results`` of the checkout this package runs from (an editable install).

    Raises:
        ValueError: there is none (an installed package has no results next to it): the message says to pass
            ``--results``.
    """
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    if not results.is_dir():
        raise ValueError(f"no results to report: kvarn_mla does not run from a checkout with committed results "
                         f"({results} does not exist); pass --results DIR (a checkout's benchmarks/results, or "
                         "a directory of `kvarn-mla bench --out` and accuracy/*.json summaries)")
    return results


def result_files(results: Path) -> list[Path]:
    """The files under ``results`` that the report reads (accuracy summaries, long-context records, decode
    benchmarks)."""
    accuracy = [results / "accuracy" / f"{model}-{suite}.json" for model in FAMILY_OF
                for suite in (*ACCUMULATION_TEXTS, "reasoning", "worst-vectors")]
    patterns = [f"{model}-{suite}.jsonl" for model in FAMILY_OF for suite in ("retrieval-*", "reasoning-tf")]
    long_context = [path for pattern in patterns for path in sorted((results / "accuracy").glob(pattern))]
    return [path for path in (*accuracy, *long_context, *(results / name for name in BENCH_FILES)) if path.is_file()]


def reference_row(rows: dict) -> dict:
    """The unquantized reference's row among a summary's method rows (under whichever label it has), or {}."""
    return next((rows[label] for label in REFERENCE_LABELS if label in rows), {})


def bytes_section(out: Path) -> tuple[list[str], dict]:
    """Bytes per token and tokens per 64 GiB of cache, bundled configs × methods; table, chart, numbers."""
    from ..archs import ARCHITECTURES, load_config
    from ..evaluation.methods import parse_method
    from ..plan import family_label

    rows, numbers = [], {}
    header = "| model | family | " + " | ".join(BYTES_METHODS) + " |"
    lines = ["## 1. Bytes per token and capacity\n",
             f"KV-cache bytes per token over all layers at {CAPACITY_CONTEXT:,} tokens (sink, tail and scales "
             f"included, exactly as `KVarNCache.nbytes()` counts them), and in parentheses the tokens that fit in "
             f"{CAPACITY_BUDGET_GIB} GiB of cache. transformers' own quantized caches (`hf-*`, on the unpatched model) "
             "hold the same streams (MLA: the latent and the RoPE key): `hf-fp8` one byte per element; "
             "`hf-quanto-B` B-bit codes with a 16-bit scale and zero point per 64 elements and a 16-bit residual "
             "window of up to 127 tokens, counted at its mean (HQQ holds the same bytes at the same bits; "
             "`evaluation.methods.hf_cache_nbytes`). Source: the published configs bundled in "
             "`kvarn_mla/archs.py`.\n", header, "|---|---|" + "---|" * len(BYTES_METHODS)]
    for name in ARCHITECTURES:
        config = load_config(name)
        family = family_label(config)
        cells, numbers[name] = [], {}
        for method in BYTES_METHODS:
            per_token = parse_method(method).bytes_per_token(config, CAPACITY_CONTEXT)
            capacity = CAPACITY_BUDGET_GIB * 2**30 / per_token
            numbers[name][method] = per_token
            cells.append(f"{per_token:,.0f} ({capacity / 1e6:.2f}M)")
        rows.append((name, numbers[name]))
        lines.append(f"| {name} | {family} | " + " | ".join(cells) + " |")
    bar_chart(rows, BYTES_METHODS, out / "bytes_per_token.png")
    lines.append("\n![bytes per token](bytes_per_token.png)\n")
    return lines, numbers


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


ACCUMULATION_TEXTS = {  # results file suffix -> what the run read
    "accumulation": "2,048 tokens of held-out code (greedy: 1,024 tokens from its first 512)",
    "accumulation-reasoning": "1,024 tokens of held-out reasoning items back to back (greedy: a whole 48-row chain, "
                              "913 tokens)",
    "accumulation-long": "16,384 tokens of held-out code (greedy: 1,024 tokens from its first 512)",
    "accumulation-retrieval": "one held-out 16,384-token retrieval item written out, prompt and answer (greedy: "
                              "1,024 tokens from its first 512)",
}


def _accumulation_lines(family: str, model: str, suite: str, rows: dict, out: Path) -> list[str]:
    """Table and per-bit-width KL charts of one accumulation run."""
    charts = []
    for bits in (2, 3, 4):
        curves = {m: (row["kl_curve"], row.get("kl_curve_static")) for m, row in rows.items()
                  if "kl_curve" in row and _bits_class(m) == f"{bits}-bit" and "rope_bits" not in m}
        if curves:
            charts.append(f"{suite}_{model}_{bits}bit.png")
            curve_chart(curves, f"{family} reference model, {suite}: KL at {bits} bits", out / charts[-1])
    lines = [f"### {family}: {suite} (`accuracy/{model}-{suite}.json`)\n",
             f"Text: {ACCUMULATION_TEXTS[suite]}.\n",
             "| method | bits | KL last chunk | KL last chunk, static | KL mean | top-1 mean "
             "| greedy: first divergence | greedy: agreement | bytes/token (4K, all layers) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, row in rows.items():
        if "kl_last" not in row:
            continue
        static = row.get("kl_last_static")
        lines.append(f"| {method} | {_bits_class(method)} | {row['kl_last']:.4f} | "
                     f"{'-' if static is None else f'{static:.4f}'} | {row['kl_mean']:.4f} | "
                     f"{row['top1_mean']:.3f} | {row.get('first_divergence', '-')} | "
                     f"{row.get('agreement', float('nan')):.3f} | {_fmt_bytes(method_bytes(model, method, row))} |")
    return lines + [""] + [f"![{chart[:-4]}]({chart})\n" for chart in charts]


def method_bytes(model: str, method: str, row: dict) -> float | None:
    """Bytes per token at `REPORT_CONTEXT` of ``method`` in a summary row of reference model ``model``: the value
    the run recorded, or for rows written before transformers' quanto/HQQ caches were counted (None), counted now
    from the method's name and the bundled model's config."""
    recorded = row.get("bytes_per_token_4k")
    if recorded is not None or not method.startswith("hf-"):
        return recorded
    from transformers import AutoConfig

    from .. import reference_models
    from ..evaluation.methods import parse_method

    config = AutoConfig.from_pretrained(reference_models.path(model))
    return parse_method(method).bytes_per_token(config, REPORT_CONTEXT)


def _reasoning_lines(family: str, model: str, rows: dict) -> tuple[list[str], list[tuple[str, str, float, float]]]:
    """Exact-match table of the reasoning suite, and its (family, method, bytes, accuracy) points."""
    lines = [f"### {family}: reasoning (`accuracy/{model}-reasoning.json`)\n",
             "| method | exact match | 95% CI | answer only | bytes/token (4K, all layers) |", "|---|---|---|---|---|"]
    points = []
    for method, row in rows.items():
        exact = row.get("exact")
        if exact is None:
            continue
        answer = row.get("answer", {}).get("accuracy")
        per_token = method_bytes(model, method, row)
        lines.append(f"| {method} | {exact['accuracy']:.1%} ({exact['correct']}/{row['n']}) | "
                     f"{exact['ci95'][0]:.1%}–{exact['ci95'][1]:.1%} | "
                     f"{'-' if answer is None else f'{answer:.1%}'} | {_fmt_bytes(per_token)} |")
        if per_token:
            points.append((family, method, per_token, exact["accuracy"]))
    return lines + [""], points


def _paired_lines(family: str, model: str, suite: str, records: Path) -> list[str]:
    """Paired statistics of a generation suite from its records: each method against KVarN and rotation-only at
    its bit width (`evaluation.paired`)."""
    from ..evaluation.paired import PARTNERS, load_verdicts, paired_rows

    rows = paired_rows(load_verdicts(records))
    lines = [f"#### {family}: {suite}, paired (`accuracy/{records.name}`)\n",
             "Items right with the method minus items right with the partner at the same bit width, on the same "
             "items, and the exact McNemar p-value of the items where they disagree (p < 0.05 in bold).\n",
             "| method | exact match (95% CI) | " + " | ".join(f"vs {p}-B: items (p)" for p in PARTNERS) + " |",
             "|---|---|" + "---|" * len(PARTNERS)]
    for row in rows:
        cells = [comparison_cell(next((c for c in row.comparisons if c.partner.startswith(f"{family_name}-")), None))
                 for family_name in PARTNERS]
        lines.append(f"| {row.method} | {row.accuracy:.1%} ({row.correct}/{row.n}; {row.ci95[0]:.1%}–"
                     f"{row.ci95[1]:.1%}) | " + " | ".join(cells) + " |")
    return lines + [""]


def _worst_lines(family: str, model: str, rows: dict) -> list[str]:
    """The worst-vectors diagnostic: how much of the KL the largest-error vectors explain."""
    lines = [f"### {family}: worst vectors (`accuracy/{model}-worst-vectors.json`)\n",
             "KL with every cached vector quantized, and the share of it removed by restoring the 1/5/10% of vectors "
             "with the largest error (with the share of the squared error they hold); magnitude share: the part of "
             "the error along the exact vector (scale) rather than across it (direction).\n",
             "| method | KL | 1%: KL explained (error share) | 5% | 10% | magnitude share |",
             "|---|---|---|---|---|---|"]
    for method, row in rows.items():
        if "fractions" not in row:
            continue
        cells = [f"{f['kl_explained']:.0%} ({f['error_share']:.0%})" for f in row["fractions"].values()]
        lines.append(f"| {method} | {row['kl']:.4f} | " + " | ".join(cells) + f" | {row['magnitude_share']:.0%} |")
    return lines + [""]


def accuracy_section(results: Path, out: Path) -> tuple[list[str], dict]:
    """Accumulation curves per family, reasoning accuracy vs bytes and worst vectors, from ``results/accuracy``."""
    accuracy = results / "accuracy"
    lines = ["## 2. Accuracy of the reference models\n",
             "The reference models (`benchmarks/models/README.md`) share data, tokenizer and shapes and differ in "
             "attention; the checkpoints table at the top says which checkpoint each model's records measured. "
             "Accumulation: KL divergence of next-token distributions against the unquantized cache per 128-token "
             "chunk, when each chunk's K/V inherit the quantized past (solid) and when the past is quantized from "
             "the unquantized forward pass (static, dashed). Reasoning: exact match of the whole scratchpad on "
             "held-out long-chain problems, greedy, with 95% Wilson intervals. The unquantized reference is "
             "labelled by the dtype the model ran in (`fp32`, `bf16`, `fp16`); summaries written before that label "
             "it `bf16` whatever the dtype (the sweep runs float32). Bytes per token count 16-bit elements "
             "wherever a cache keeps full precision, as a bf16 deployment holds them.\n"]
    numbers: dict = {}
    points = []
    for model in ("mha", "gqa", "mla"):
        found = {suite: _load(accuracy / f"{model}-{suite}.json")
                 for suite in (*ACCUMULATION_TEXTS, "reasoning", "worst-vectors")}
        found = {suite: data["methods"] for suite, data in found.items() if data}
        if not found:
            continue
        family = FAMILY_OF[model]
        numbers[model] = found
        for suite in ACCUMULATION_TEXTS:
            if suite in found:
                lines += _accumulation_lines(family, model, suite, found[suite], out)
        if "reasoning" in found:
            table, model_points = _reasoning_lines(family, model, found["reasoning"])
            lines += table
            points += model_points
            records = accuracy / f"{model}-reasoning.jsonl"
            if records.is_file():
                lines += _paired_lines(family, model, "reasoning", records)
        if "worst-vectors" in found:
            lines += _worst_lines(family, model, found["worst-vectors"])
    if points:
        pareto_chart(points, out / "pareto.png")
        lines.append("![reasoning accuracy vs bytes per token](pareto.png)\n")
    if not numbers:
        lines.append("No accuracy results found under `accuracy/` (run `kvarn-mla report --rerun`).\n")
    return lines, numbers


@functools.lru_cache(maxsize=None)
def bundled_digest(model: str) -> str | None:
    """`evaluation.runner.model_identity` digest of the bundled reference model ``model`` as the sweep loads it
    (float32), or None when this installation does not ship it."""
    from ..evaluation.runner import model_identity
    from ..reference_models import load

    try:
        return model_identity(load(model)[0])["digest"]
    except (OSError, ValueError):  # FileNotFoundError is an OSError
        return None


def checkpoint_lines(accuracy: Path) -> list[str]:
    """Which checkpoint each reference model's records come from (the weights digest every summary under
    ``accuracy`` names), against the checkpoint this installation bundles: records of an earlier checkpoint stay
    readable, and say so."""
    seen: dict[str, set[str]] = {}
    for path in sorted(accuracy.glob("*.json")):
        model = path.name.split("-", 1)[0]
        digest = ((_load(path) or {}).get("run") or {}).get("model", {}).get("digest")
        if model in FAMILY_OF and digest:
            seen.setdefault(model, set()).add(digest)
    if not seen:
        return []
    lines = ["Checkpoints: the weights digest the records name (`evaluation.runner.model_identity`, float32), and "
             "the bundled checkpoint's. Records of a checkpoint that is no longer bundled measure that checkpoint, "
             "not the bundled one.\n",
             "| model | records of | bundled | same |", "|---|---|---|---|"]
    for model, family in FAMILY_OF.items():
        if model in seen:
            bundled = bundled_digest(model)
            same = "yes" if seen[model] == {bundled} else "**no**"
            lines.append(f"| {family} (`{model}`) | {', '.join(f'`{d}`' for d in sorted(seen[model]))} | "
                         f"{f'`{bundled}`' if bundled else 'none'} | {same} |")
    return lines + [""]


def _bits_class(method: str) -> str:
    match = re.search(r"-(\d)(?:\+|$)", method)
    return f"{match.group(1)}-bit" if match else "-"


def _fmt_bytes(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def speed_section(results: Path, out: Path) -> tuple[list[str], dict]:
    """Decode ms per step vs context, patched vs stock, from ``kvarn-mla bench`` (and GPU results if present)."""
    rows = _load(results / "bench_cpu.json") or _load(results / "bench_decode_cpu.json") or []
    source = "bench_cpu.json" if (results / "bench_cpu.json").exists() else "bench_decode_cpu.json"
    lines = ["## 3. Decode speed\n"]
    if not rows:
        lines.append("No speed results found (run `kvarn-mla bench`).\n")
        return lines, {}
    speed_chart(rows, out / "decode_speed.png")
    lines += [f"CPU, 2-layer models with DeepSeek-V2-Lite (MLA), Llama-3-8B (GQA) and Llama-2-7B (MHA) attention, "
              f"random bf16 weights, batch 1 (`{source}`).\n",
              "| family | context | stock ms/step | k4v2 ms/step | speedup | attention speedup |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['context']} | {r['stock_decode_ms']:.1f} | {r['k4v2_decode_ms']:.1f} | "
                     f"{r['decode_speedup']:.2f}x | {r.get('attention_speedup', float('nan')):.2f}x |")
    gpu = results / "bench_decode_gpu.csv"
    lines.append("\n![decode speed](decode_speed.png)\n")
    lines.append("GPU results: `bench_decode_gpu.csv`.\n" if gpu.exists()
                 else "GPU results: none in the results directory (`benchmarks/gpu_check.sh` measures them on a CUDA "
                      "machine).\n")
    return lines, {"rows": rows}


def discussion(byte_numbers: dict, accuracy: dict, speed: dict, long_context: Sequence[str] = ()) -> list[str]:
    """A short, factual discussion per family, every number from the sections above; ``long_context``: the
    accuracy-vs-context lines (`long_context.context_discussion`), last."""
    lines = ["## 4. Discussion\n"]
    llama, v3 = byte_numbers.get("llama-3-8b"), byte_numbers.get("deepseek-v3")
    if llama and v3:
        lines.append(
            f"- Bytes: a 16-bit GQA cache (Llama-3-8B) holds {llama['bf16']:,.0f} B/token and DeepSeek-V3's MLA "
            f"{v3['bf16']:,.0f} B/token (section 1). KVarN k4v2 brings them to {llama['k4v2']:,.0f} "
            f"({llama['bf16'] / llama['k4v2']:.2f}×) and {v3['k4v2']:,.0f} ({v3['bf16'] / v3['k4v2']:.2f}×): MLA "
            f"starts {llama['bf16'] / v3['bf16']:.1f}× smaller and quantizes less, because the 16-bit RoPE key "
            f"stays and the latent has no values to take to 2 bits; with the RoPE key at 8 bits (k4v2-r8) it reaches "
            f"{v3['k4v2-r8']:,.0f} ({v3['bf16'] / v3['k4v2-r8']:.2f}×).")
    for model, data in accuracy.items():
        family = FAMILY_OF[model]
        rea = data.get("reasoning") or {}
        ref = reference_row(rea).get("exact", {}).get("accuracy")
        if ref is None:
            continue
        drops = []
        for bits in (4, 3, 2):
            for method in (f"kvarn-{bits}", f"kivi-{bits}", f"rot-{bits}"):
                acc = rea.get(method, {}).get("exact", {}).get("accuracy")
                if acc is not None:
                    drops.append(f"{method} {100 * (acc - ref):+.1f}")
        kl = ""
        for suite, text in (("accumulation", "code"), ("accumulation-reasoning", "reasoning text")):
            acc_rows = data.get(suite) or {}
            kv2, ki2 = acc_rows.get("kvarn-2", {}).get("kl_last"), acc_rows.get("kivi-2", {}).get("kl_last")
            if kv2 is not None and ki2 is not None:
                kl += (f" On {text}, the last accumulation chunk at 2 bits ends at KL {kv2:.4f} (KVarN) vs "
                       f"{ki2:.4f} (KIVI-style).")
        lines.append(f"- {family} reference model: unquantized-cache exact match {ref:.1%}; change in points: "
                     f"{', '.join(drops) or 'n/a'} (section 2).{kl}")
    if speed.get("rows"):
        mla = [r for r in speed["rows"] if r["family"] == "mla"]
        gqa = [r for r in speed["rows"] if r["family"] == "gqa"]
        mha = [r for r in speed["rows"] if r["family"] == "mha"]
        if mla and gqa:
            lines.append(f"- Speed on CPU (section 3): the absorbed MLA path never expands the latent, so its "
                         f"advantage grows with context: {mla[-1]['decode_speedup']:.1f}× per step at "
                         f"{mla[-1]['context']:,} tokens; dense GQA reads fewer bytes than 16-bit SDPA "
                         f"({gqa[-1]['decode_speedup']:.2f}× at {gqa[-1]['context']:,})"
                         + (f"; with one kv head per query head (MHA) the unpacking outweighs the bytes saved "
                            f"({mha[-1]['decode_speedup']:.2f}× at {mha[-1]['context']:,})." if mha else "."))
    return [*lines, *long_context, ""]


def build_report(results: Path, out: Path, rerun: bool = False) -> Path:
    """Write ``out/report.md`` and ``out/report.html`` (with the PNG charts) from ``results``.

    Args:
        results: The results directory (the CLI's default: `checkout_results`).
        out: Output directory.
        rerun: Recompute the benchmark and accuracy results into ``results`` first (slow).

    Raises:
        ValueError: ``results`` holds none of the files the report reads (`result_files`): a report of nothing
            measured is an error, not an empty success.
    """
    if rerun:
        from ..evaluation.bench import run_bench
        from ..evaluation.sweep import sweep

        run_bench(["mla", "gqa", "mha"], [1024, 4096, 8192, 16384], 3, results)
        sweep(results / "accuracy")
    if not result_files(results):
        where = "does not exist" if not results.exists() else "holds none of them"
        raise ValueError(f"no results to report in {results} ({where}): the report reads accuracy/<mha|gqa|mla>-"
                         f"<suite>.json summaries and {' or '.join(BENCH_FILES)}; pass --results DIR with them")
    out.mkdir(parents=True, exist_ok=True)
    byte_lines, byte_numbers = bytes_section(out)
    accuracy_lines, accuracy = accuracy_section(results, out)
    context_lines, _, context_discussion = long_context_section(results / "accuracy", out, method_bytes)
    speed_lines, speed = speed_section(results, out)
    body = ["# kvarn_mla: MHA vs GQA vs MLA under KV-cache quantization\n",
            f"Generated by `kvarn-mla report` from `{display_path(results)}`; the files named below lie under it.\n",
            *checkpoint_lines(results / "accuracy"), *byte_lines, *accuracy_lines, *context_lines, *speed_lines,
            *discussion(byte_numbers, accuracy, speed, context_discussion)]
    text = "\n".join(body)
    (out / "report.md").write_text(text)
    (out / "report.html").write_text(markdown_to_html(text))
    return out / "report.md"


def display_path(path: Path) -> str:
    """``path`` relative to the checkout the package runs from (``benchmarks/results``) when it lies inside it, else
    relative to the working directory when it lies there, else as given: a committed report never names a directory
    of the machine that built it."""
    path = Path(path).resolve()
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix() or "."
    return str(path)


def markdown_to_html(text: str) -> str:
    """The report's Markdown as a standalone HTML page (Python-Markdown with its tables extension)."""
    import markdown

    body = markdown.markdown(text, extensions=["tables"], output_format="html")
    return ("<!doctype html>\n<html><head><meta charset='utf-8'><title>kvarn_mla report</title></head><body>\n"
            f"{body}\n</body></html>\n")
