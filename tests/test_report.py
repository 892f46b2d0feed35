"""`kvarn-mla report` builds from a small results set made by the real harness on tiny models."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_model
from test_evaluation import char_tokenizer

from kvarn_mla.cli import main
from kvarn_mla.evaluation import runner, tasks
from kvarn_mla.evaluation.bench import measure
from kvarn_mla.evaluation.methods import parse_methods

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    for name, model_type in (("gqa", "llama"), ("mla", "deepseek_v3")):
        model, tokenizer = build_model(model_type), char_tokenizer()
        methods = parse_methods("kvarn-2+tile_size=64+sink_tokens=0,kivi-2+tile_size=64+sink_tokens=0")
        ids = torch.randint(0, 128, (1, 192), generator=torch.Generator().manual_seed(0))
        runner.run(model, tokenizer, methods, "accumulation", root / "accuracy" / f"{name}-accumulation.json",
                   text_ids=ids, chunk=64, greedy_tokens=16)
        runner.run(model, tokenizer, methods, "accumulation", root / "accuracy" / f"{name}-accumulation-reasoning.json",
                   text_ids=ids[:, :128], chunk=64, greedy_tokens=8, greedy_prompt=ids[:, :10])
        runner.run(model, tokenizer, methods, "worst-vectors", root / "accuracy" / f"{name}-worst-vectors.json",
                   text_ids=ids, context=128)
        items = [tasks.GenerationItem(f"t{i}", f"{i}+1=", {"exact": lambda text: text.startswith("1")}, 3)
                 for i in range(4)]
        runner.run(model, tokenizer, methods, "reasoning", root / "accuracy" / f"{name}-reasoning.json", items=items)
    rows = [measure(build_model(t), family, 200, steps=1, prefill=False) for family, t in (("mla", "deepseek_v3"),
                                                                                         ("gqa", "llama"))]
    (root / "bench_cpu.json").write_text(json.dumps(rows))
    return root


def test_report_builds_every_chart(results, tmp_path):
    out = tmp_path / "report"
    assert main(["report", "--out", str(out), "--results", str(results)]) == 0
    for name in ("report.md", "report.html", "bytes_per_token.png", "accumulation_gqa_2bit.png",
                 "accumulation_mla_2bit.png", "accumulation-reasoning_gqa_2bit.png", "pareto.png", "decode_speed.png"):
        assert (out / name).stat().st_size > 0, name
    text = (out / "report.md").read_text()
    for heading in ("## 1. Bytes per token", "## 2. Accuracy", "## 3. Decode speed", "## 4. Discussion"):
        assert heading in text
    assert "| llama-3-8b | GQA |" in text and "| deepseek-v3 | MLA |" in text
    for source in ("gqa-reasoning.json", "gqa-accumulation-reasoning.json", "mla-worst-vectors.json"):
        assert f"results/accuracy/{source}" in text  # numbers name their source
    html = (out / "report.html").read_text()
    assert html.count("<img") == text.count("![") and "<table>" in html


def test_report_bytes_match_the_planner(tmp_path):
    from kvarn_mla.archs import load_config
    from kvarn_mla.plan import expected_nbytes

    main(["report", "--out", str(tmp_path), "--results", str(tmp_path / "none")])
    text = (tmp_path / "report.md").read_text()
    llama = load_config("llama-3-8b")
    k4v2 = expected_nbytes(llama, "k4v2", 32768) / 32768
    assert f"{k4v2:,.0f} (" in text.split("| llama-3-8b |")[1].split("\n")[0]
    assert "No accuracy results found" in text and "No speed results found" in text
