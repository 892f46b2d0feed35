"""The accuracy harness: methods, checkers, task files, the accumulation protocol, worst vectors, resuming."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_model, load_benchmark
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DynamicCache, PreTrainedTokenizerFast

import kvarn_mla
from kvarn_mla.adapters import adapter_for
from kvarn_mla.cli import main
from kvarn_mla.evaluation import runner, tasks
from kvarn_mla.evaluation.accumulation import accumulation_curve, greedy_divergence, kl_divergence, reference_greedy
from kvarn_mla.evaluation.checkers import (
    check_boxed,
    check_exact,
    check_last_number,
    last_boxed,
    load_tasks,
    wilson_interval,
)
from kvarn_mla.evaluation.methods import parse_method, parse_methods
from kvarn_mla.evaluation.worst import error_split, worst_vectors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over 126 symbols, for the 128-token tiny models."""
    symbols = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<eos>": 0, "<pad>": 1, **{s: i + 2 for i, s in enumerate(symbols)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")


# ---- methods --------------------------------------------------------------------------------------------------------
def test_parse_methods():
    assert parse_method("k4v2").config == kvarn_mla.PRESETS["k4v2"]
    grid = parse_method("k4v2+latent_bits=2+rope_bits=8+hadamard=False")
    assert (grid.config.latent_bits, grid.config.rope_bits, grid.config.hadamard) == (2, 8, False)
    assert parse_method("hf-quanto-2").cache_kwargs == {"nbits": 2} and parse_method("hf-fp8").nbits is None
    assert [m.name for m in parse_methods("k2v2, hf-fp8")] == ["reference", "k2v2", "hf-fp8"]
    three = parse_method("kivi-3").config
    assert (three.key_bits, three.value_bits, three.latent_bits, three.rope_bits, three.method) == (3, 3, 3, 16, "rtn")
    assert parse_method("rot-2+rope_bits=8").config.rope_bits == 8 and parse_method("kvarn-4").config.method == "kvarn"
    vn = parse_method("kvarnvn-3").config
    assert (vn.key_bits, vn.value_bits, vn.method) == (3, 3, "rotation/kvarn")
    assert vn.scheme("latent").varnorm_iters == 0 and vn.scheme("value").varnorm_iters == 8
    assert parse_method("k4v2+value_varnorm_iters=2+key_varnorm_iters=None").config.scheme("value").varnorm_iters == 2
    assert parse_method("kvarn-vn-k4v2").config == kvarn_mla.PRESETS["kvarn-vn-k4v2"]
    with pytest.raises(ValueError, match="key_bits must be one of"):
        parse_method("kvarn-5")
    with pytest.raises(ValueError, match="unknown method 'k9'"):
        parse_method("k9")
    with pytest.raises(ValueError, match="'bits=2' is not field=value"):
        parse_method("k4v2+bits=2")
    with pytest.raises(ValueError, match="latent_bits must be one of"):
        parse_method("k4v2+latent_bits=5")
    with pytest.raises(ValueError, match=r"the quanto backend takes bits \(2, 4\), got 8"):
        parse_method("hf-quanto-8")
    with pytest.raises(ValueError, match="unknown transformers cache backend"):
        parse_method("hf-gptq-4")


# ---- checkers and task files ---------------------------------------------------------------------------------------
def test_checkers_on_fixed_examples():
    assert check_exact("  42\n", "42") and not check_exact("42.", "42")
    assert check_last_number("so the total is 1,234 apples", "1234")
    assert check_last_number("x = -3.50", "-3.5") and not check_last_number("7 then 8", "7")
    assert not check_last_number("no number here", "3")
    assert last_boxed(r"a \boxed{\frac{1}{2}} b \boxed{x^{2}}") == "x^{2}"
    assert check_boxed(r"thus $\boxed{\frac{1}{2}}$", r"\frac{1}{2}")
    assert check_boxed(r"\boxed{ 3 }", r"\boxed{3}") and not check_boxed(r"\boxed{3", "3")
    assert wilson_interval(50, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "answer": "b"', "not valid JSON"),
    ('["prompt", "answer"]', "expected a JSON object"),
    ('{"prompt": "a"}', "'answer' must be a string"),
    ('{"prompt": 3, "answer": "b"}', "'prompt' must be a string"),
    ('{"prompt": "a", "answer": "b", "checker": "regex"}', "unknown checker 'regex'"),
    ('{"id": "one", "prompt": "a", "answer": "b"}', "duplicate id 'one'"),
])
def test_task_loader_rejects_malformed_lines_with_the_line_number(tmp_path, line, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": "one", "prompt": "1+1=", "answer": "2"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"tasks.jsonl:3: {message}"):
        load_tasks(path)


def test_task_loader_reads_checkers(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "p", "answer": "\\\\boxed{4}", "checker": "boxed"}\n'
    )
    loaded = load_tasks(path, checker="last-number")
    assert [t.checker for t in loaded] == ["last-number", "boxed"] and [t.id for t in loaded] == ["1", "2"]
    assert loaded[0].check("it is 2") and loaded[1].check("so \\boxed{4}")


# ---- the accumulation protocol --------------------------------------------------------------------------------------
def _fake_quantized(model, cache: DynamicCache, config) -> DynamicCache:
    """A DynamicCache holding every cached vector after the quantize-dequantize round trip."""
    specs = adapter_for(model.config).stream_specs(model.config.get_text_config(decoder=True), config)
    tile = dict(tile_size=config.tile_size, sink_tokens=config.sink_tokens, varnorm_iters=config.varnorm_iters,
                hadamard=config.hadamard)
    out = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        pair = [kvarn_mla.fake_quantize(x, s.bits, s.axis, **tile) if s.bits < 16 else x.clone()
                for x, s in zip((layer.keys, layer.values), specs)]
        out.update(*pair, index)
    return out


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
@torch.no_grad()
def test_accumulation_equals_a_hand_computed_case(model_type):
    """Three chunks, no sink: chunk 1 attends quantized chunk 0; chunk 2 attends quantized chunks 0-1, whose chunk-1
    K/V came from the quantized forward (accumulated) or from the 16-bit forward (static). Rebuilt here with
    fake-quantized DynamicCaches and the stock attention."""
    model = build_model(model_type)
    ids = torch.randint(0, 128, (1, 192), generator=torch.Generator().manual_seed(0))
    method = parse_method("k2v2+tile_size=64+sink_tokens=0")
    curve = accumulation_curve(model, ids, method, chunk=64)
    assert [row["start"] for row in curve] == [0, 64, 128]

    reference = DynamicCache(config=model.config)
    ref_logits = [model(ids[:, s : s + 64], cache=reference).logits for s in (0, 64, 128)]
    first = DynamicCache(config=model.config)
    model(ids[:, :64], cache=first)
    hand = _fake_quantized(model, first, method.config)  # chunk 0 quantized
    chunk1 = model(ids[:, 64:128], cache=hand).logits  # appends chunk 1's accumulated K/V (exact) to `hand`
    new = DynamicCache(config=model.config)
    for index, layer in enumerate(hand.layers):
        new.update(layer.keys[:, :, 64:], layer.values[:, :, 64:], index)
    new = _fake_quantized(model, new, method.config)  # chunk 1 quantized once, like chunk 0
    accumulated = DynamicCache(config=model.config)
    for index, (old, fresh) in enumerate(zip(hand.layers, new.layers)):
        accumulated.update(torch.cat([old.keys[:, :, :64], fresh.keys], 2),
                           torch.cat([old.values[:, :, :64], fresh.values], 2), index)
    chunk2 = model(ids[:, 128:], cache=accumulated).logits
    static_cache = DynamicCache(config=model.config)
    for index, layer in enumerate(reference.layers):
        static_cache.update(layer.keys[:, :, :128], layer.values[:, :, :128], index)
    chunk2_static = model(ids[:, 128:], cache=_fake_quantized(model, static_cache, method.config)).logits

    assert curve[0]["kl"] == 0 and curve[0]["top1"] == 1.0  # the first chunk is a full-precision prefill
    expected = {1: (chunk1, chunk1), 2: (chunk2, chunk2_static)}
    for index, (acc, static) in expected.items():
        for key, logits in (("kl", acc), ("kl_static", static)):
            kl = float(kl_divergence(ref_logits[index], logits).mean())
            assert curve[index][key] == pytest.approx(kl, rel=1e-3, abs=1e-7), (index, key)
    assert curve[2]["kl"] != pytest.approx(curve[2]["kl_static"], rel=1e-6)  # inheritance made a difference
    assert len(curve[2]["attn_err"]) == model.config.num_hidden_layers and curve[2]["attn_err"][0] > 0


@torch.no_grad()
def test_accumulation_with_transformers_quantized_cache_and_static_guard():
    model = build_model("llama")
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(1))
    curve = accumulation_curve(model, ids, parse_method("hf-fp8"), chunk=64, static=False)
    assert len(curve) == 4 and all(row["kl"] >= 0 for row in curve) and "kl_static" not in curve[0]
    with pytest.raises(ValueError, match="static variant needs a KVarN method"):
        accumulation_curve(model, ids, parse_method("hf-fp8"), chunk=64)
    with pytest.raises(ValueError, match="chunk == tile_size"):
        accumulation_curve(model, ids, parse_method("k4v2"), chunk=64)


@torch.no_grad()
def test_greedy_divergence():
    model = build_model("deepseek_v3")
    prompt = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    exact = greedy_divergence(model, prompt, parse_method("k4v2+sink_tokens=4096"), 40, chunk=64)
    assert exact == {"first_divergence": 40, "agreement": 1.0, "reference_tokens": 40, "method_tokens": 40}
    lossy = greedy_divergence(model, prompt, parse_method("k2v2+tile_size=64+sink_tokens=0"), 40, chunk=64)
    assert 0 <= lossy["first_divergence"] <= 40 and 0 < lossy["agreement"] <= 1
    reference = reference_greedy(model, prompt, 40)  # given once, the 16-bit run is not redone per method
    method = parse_method("k2v2+tile_size=64+sink_tokens=0")
    assert greedy_divergence(model, prompt, method, 40, chunk=64, reference=reference) == lossy
    # A different reference changes the result: the given one is really used.
    assert greedy_divergence(model, prompt, method, 40, 64, reference=reference.flip(0))["first_divergence"] < 40


# ---- worst vectors --------------------------------------------------------------------------------------------------
def test_error_split_sums_to_the_squared_error():
    exact, restored = torch.randn(5, 32), torch.randn(5, 32)
    magnitude, direction = error_split(exact, restored)
    assert torch.allclose(magnitude + direction, (exact - restored).square().sum(-1), rtol=1e-5)


@torch.no_grad()
def test_worst_vectors():
    model = build_model("llama")
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    result = worst_vectors(model, ids, parse_method("k2v2+tile_size=64+sink_tokens=0"), 160, fractions=(0.05, 0.5, 1.0))
    assert result["kl"] > 0
    kls = [result["fractions"][k]["kl"] for k in ("0.05", "0.5", "1")]
    assert kls[0] < result["kl"] and kls[2] == pytest.approx(0, abs=1e-9)
    shares = [result["fractions"][k]["error_share"] for k in ("0.05", "0.5", "1")]
    assert 0 < shares[0] < shares[1] < shares[2] == pytest.approx(1)
    assert 0 <= result["magnitude_share"] <= 1


# ---- the runner: resume, summary, CLI -----------------------------------------------------------------------------
def _items(count: int) -> list[tasks.GenerationItem]:
    return [tasks.GenerationItem(f"t{i}", f"{i}+{i}=", {"exact": lambda text: text == "x"}, 4) for i in range(count)]


def test_generation_suite_resumes_after_an_interruption(tmp_path, monkeypatch):
    model, tokenizer = build_model("qwen3"), char_tokenizer()
    methods = parse_methods("k4v2+tile_size=64")
    out = tmp_path / "run.json"
    real = tasks.generate_items
    calls = []

    def interrupted(model, tokenizer, items, method, **kwargs):
        for number, record in enumerate(real(model, tokenizer, items, method, **kwargs)):
            if method.kind == "kvarn" and number == 2:
                raise KeyboardInterrupt
            calls.append((method.name, record["id"]))
            yield record

    monkeypatch.setattr(tasks, "generate_items", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run(model, tokenizer, methods, "jsonl", out, items=_items(5), batch_size=1)
    log_lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert len(log_lines) == 5 + 2 and not out.exists()
    partial = runner.run(model, tokenizer, methods, "jsonl", out, items=_items(5), batch_size=1, compute=False)
    assert partial["methods"]["fp32"]["n"] == 5 and partial["methods"]["k4v2+tile_size=64"]["n"] == 2
    assert (tmp_path / "run.jsonl").read_text().splitlines() == log_lines  # summarizing generated nothing
    with (tmp_path / "run.jsonl").open("a") as f:
        f.write('{"suite": "reasoning", "method": "k4v2+ti')  # a record cut short by the interruption
    monkeypatch.setattr(tasks, "generate_items", real)
    summary = runner.run(model, tokenizer, methods, "jsonl", out, items=_items(5), batch_size=1)
    assert summary["methods"]["fp32"]["n"] == summary["methods"]["k4v2+tile_size=64"]["n"] == 5
    assert json.loads(out.read_text())["settings"]["sampling"] == {"do_sample": False}
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines() if line.endswith("}")]
    assert sorted(r["key"] for r in records) == sorted([f"t{i}" for i in range(5)] * 2)  # nothing generated twice
    assert {r["suite"] for r in records} == {"jsonl"}  # labelled by its own suite (was "reasoning")


def test_resume_refuses_records_of_another_configuration(tmp_path, monkeypatch):
    model, tokenizer = build_model("qwen3"), char_tokenizer()
    reference = parse_methods("")  # the reference alone
    out = tmp_path / "run.json"
    runner.run(model, tokenizer, reference, "jsonl", out, items=_items(2), batch_size=1, tasks_digest="a")
    records = (tmp_path / "run.jsonl").read_text()

    def nothing_left(model, tokenizer, items, method, **kwargs):
        assert not items, f"recomputed {[it.id for it in items]}"
        yield from ()

    monkeypatch.setattr(tasks, "generate_items", nothing_left)
    summary = runner.run(model, tokenizer, reference, "jsonl", out, items=_items(2), batch_size=1, tasks_digest="a")
    assert summary["methods"]["fp32"]["n"] == 2  # the same configuration resumes
    for change, named in [
        (dict(model=build_model("qwen3", seed=1)), "model.digest"),
        (dict(model=build_model("qwen3").to(torch.bfloat16)), "model.dtype"),
        (dict(tasks_digest="b"), "settings.tasks: 'a' -> 'b'"),
        (dict(batch_size=2), "settings.batch_size: 1 -> 2"),
        (dict(sampling={"do_sample": True, "temperature": 0.7}, seed=5), "settings.seed: None -> 5"),
        (dict(suite="reasoning"), "suite: 'jsonl' -> 'reasoning'"),
    ]:
        arguments = {**dict(model=model, suite="jsonl", batch_size=1, tasks_digest="a"), **change}
        with pytest.raises(ValueError, match="holds results of another configuration") as error:
            runner.run(arguments.pop("model"), tokenizer, reference, arguments.pop("suite"), out, items=_items(2),
                       **arguments)
        assert named in str(error.value) and "another --out" in str(error.value)
    changed = [tasks.GenerationItem("t1", "another prompt", {"exact": lambda text: True}, 4)]
    with pytest.raises(ValueError, match="item 't1' was recorded for another prompt"):
        runner.run(model, tokenizer, reference, "jsonl", out, items=changed, batch_size=1, tasks_digest="a")
    (tmp_path / "run.jsonl").write_text(records.replace('"method_spec": "', '"method_spec": "0'))
    with pytest.raises(ValueError, match="method 'fp32' was recorded with another definition"):
        runner.run(model, tokenizer, reference, "jsonl", out, items=_items(2), batch_size=1, tasks_digest="a")
    assert (tmp_path / "run.jsonl").read_text() == records.replace('"method_spec": "', '"method_spec": "0')


def test_a_grid_split_over_processes_merges_into_one_run(tmp_path):
    # two --out directories with the reference in both (each process scores it) gather into what one run writes
    model, tokenizer = build_model("qwen3"), char_tokenizer()
    split = {"a": "k4v2+tile_size=64", "b": "kivi-2"}
    for name, method in split.items():
        runner.run(model, tokenizer, parse_methods(method), "jsonl", tmp_path / name / "run.json", items=_items(3),
                   batch_size=1)
    into, source = tmp_path / "a" / "run.jsonl", tmp_path / "b" / "run.jsonl"
    assert runner.merge_records(into, source) == (3, 3)  # kivi-2 added; the fp32 records agree
    assert runner.merge_records(into, source) == (0, 6)  # merging again adds nothing
    both = parse_methods(",".join(split.values()))
    summary = runner.run(model, tokenizer, both, "jsonl", tmp_path / "a" / "run.json", items=_items(3), batch_size=1,
                         compute=False)
    assert {m: row["n"] for m, row in summary["methods"].items()} == {"fp32": 3, **{m: 3 for m in split.values()}}
    before = into.read_text()
    record = json.loads(source.read_text().splitlines()[0])
    (tmp_path / "odd.jsonl").write_text(json.dumps({**record, "exact": not record["exact"]}) + "\n")
    with pytest.raises(ValueError, match=f"{record['method']} on {record['key']} differs .* in exact"):
        runner.merge_records(into, tmp_path / "odd.jsonl")
    other = {**record, "run": {**record["run"], "settings": {**record["run"]["settings"], "batch_size": 2}}}
    (tmp_path / "other.jsonl").write_text(json.dumps(other) + "\n")
    with pytest.raises(ValueError, match="different configurations: settings.batch_size: 1 -> 2"):
        runner.merge_records(into, tmp_path / "other.jsonl")
    assert into.read_text() == before  # a refused merge writes nothing
    with into.open("a") as f:
        f.write('{"suite": "jsonl", "method": "kiv')  # a record cut short by an interruption
    assert runner.merge_records(into, source) == (0, 6)  # skipped, as resuming skips it
    assert into.read_text() == before + '{"suite": "jsonl", "method": "kiv\n'  # the next append starts a fresh line


def test_legacy_records_summarize_but_are_never_resumed(tmp_path):
    from pathlib import Path

    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "accuracy" / "mla-reasoning.jsonl"
    lines = committed.read_text().splitlines()
    legacy = [line for line in lines if json.loads(line)["method"] in ("bf16", "kvarn-2")]
    legacy = [line for line in legacy if json.loads(line)["key"] in ("reasoning-11", "reasoning-54", "reasoning-88")]
    assert len(legacy) == 6 and all('"run"' not in line for line in legacy)
    (tmp_path / "old.jsonl").write_text("\n".join(legacy) + "\n")
    model, tokenizer = build_model("deepseek_v3"), char_tokenizer()
    methods = parse_methods("kvarn-2")
    summary = runner.run(model, tokenizer, methods, "reasoning", tmp_path / "old.json", compute=False)
    assert set(summary["methods"]) == {"bf16", "kvarn-2"}  # as the legacy records label the reference
    assert summary["methods"]["bf16"]["n"] == summary["methods"]["kvarn-2"]["n"] == 3
    assert summary["settings"]["legacy_records"] is True and summary["run"] is None
    with pytest.raises(ValueError, match="holds 6 legacy records"):
        runner.run(model, tokenizer, methods, "reasoning", tmp_path / "old.json", items=_items(1))
    assert (tmp_path / "old.jsonl").read_text() == "\n".join(legacy) + "\n"


def test_reference_is_labelled_by_the_model_dtype():
    from kvarn_mla.evaluation.methods import reference_label, with_reference_label

    assert [reference_label(d) for d in (torch.float32, torch.bfloat16, "float16")] == ["fp32", "bf16", "fp16"]
    for name in ("reference", "bf16", "fp32", "fp16"):
        assert parse_method(name).kind == "reference"
    methods = with_reference_label(parse_methods("k2v2,bf16,fp32"), torch.float32)
    assert [m.name for m in methods] == ["k2v2", "fp32"]  # one reference, named for what it runs in
    assert [m.name for m in with_reference_label(parse_methods("k2v2"), torch.bfloat16)] == ["bf16", "k2v2"]
    with pytest.raises(ValueError, match="no reference label for model dtype 'float64'"):
        reference_label(torch.float64)


def test_eval_refuses_a_missing_baseline_before_any_work(tmp_path, monkeypatch, capsys):
    from kvarn_mla.evaluation import methods

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the missing baseline was found")

    import transformers.cache_utils

    for module in (methods, transformers.cache_utils):  # as if the baselines extra were not installed
        monkeypatch.setattr(module, "is_optimum_quanto_available", lambda: False, raising=False)
        monkeypatch.setattr(module, "is_hqq_available", lambda: False, raising=False)
    monkeypatch.setattr(runner, "load_model", no_model)
    assert main(["eval", "--model", "mla", "--suite", "reasoning", "--presets", "k4v2,hf-quanto-2,hf-hqq-4,hf-fp8",
                 "--out", str(tmp_path / "r.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ('kvarn-mla: error: cannot run hf-quanto-2: optimum-quanto is not installed (pip install '
                     '"kvarn-mla[baselines]"); hf-hqq-4: hqq is not installed (pip install "kvarn-mla[baselines]")')
    assert not list(tmp_path.iterdir())


def test_eval_cli_end_to_end(tmp_path, capsys):
    model, tokenizer = build_model("llama"), char_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=", "answer": "6"}\n')
    code = main(["eval", "--model", str(tmp_path / "model"), "--suite", "jsonl", "--tasks",
                 str(tmp_path / "tasks.jsonl"), "--checker", "last-number", "--presets", "k4v2,hf-fp8",
                 "--max-new-tokens", "4", "--out", str(tmp_path / "out.json")])
    assert code == 0
    summary = json.loads((tmp_path / "out.json").read_text())
    assert set(summary["methods"]) == {"fp32", "k4v2", "hf-fp8"}  # the reference is labelled by --dtype float32
    assert summary["methods"]["k4v2"]["last-number"]["ci95"][1] <= 1
    assert summary["methods"]["fp32"]["bytes_per_token_4k"] > summary["methods"]["k4v2"]["bytes_per_token_4k"]
    fp8, fp32 = summary["methods"]["hf-fp8"]["bytes_per_token_4k"], summary["methods"]["fp32"]["bytes_per_token_4k"]
    assert fp8 == pytest.approx(fp32 / 2, rel=1e-4) and fp8 > fp32 / 2  # one byte an element, plus its scales
    assert summary["run"]["suite"] == "jsonl" and summary["run"]["model"]["name"] == str(tmp_path / "model")
    assert main(["eval", "--model", "nowhere/model", "--suite", "reasoning", "--out", str(tmp_path / "x.json")]) == 2
    assert "cannot load model 'nowhere/model' offline" in capsys.readouterr().err

    # The same --out with another model and another task file: refused, naming both, nothing computed or mixed.
    other = build_model("llama", seed=1)
    other.save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    (tmp_path / "other.jsonl").write_text('{"prompt": "5+5=", "answer": "10"}\n')
    records = (tmp_path / "out.jsonl").read_text()
    assert main(["eval", "--model", str(tmp_path / "other"), "--suite", "jsonl", "--tasks",
                 str(tmp_path / "other.jsonl"), "--checker", "last-number", "--presets", "k4v2,hf-fp8",
                 "--max-new-tokens", "4", "--out", str(tmp_path / "out.json")]) == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # one line
    assert error.startswith("kvarn-mla: error: ") and "holds results of another configuration" in error
    assert "model.digest" in error and "settings.tasks" in error and "another --out" in error
    assert (tmp_path / "out.jsonl").read_text() == records


def test_demo_runs_end_to_end_on_a_short_setting(tmp_path, capsys):
    model, tokenizer = build_model("deepseek_v3"), char_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert main(["demo", "--model", str(tmp_path), "--max-new-tokens", "12", "--prompt-tokens", "150",
                 "--presets", "k4v2+tile_size=64+sink_tokens=64,k2v2+tile_size=64+sink_tokens=0"]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = [line for line in table if line.startswith("code (")]
    assert [row.split()[2] for row in rows] == ["bf16", "k4v2+tile_size=64+sink_tokens=64",
                                                "k2v2+tile_size=64+sink_tokens=0"]
    assert "100.0%" in rows[0] and " 1.00x" in rows[0]  # the reference agrees with itself, 16-bit cache
    assert float(rows[2].split()[4].rstrip("x")) > 1.0  # the 2-bit cache holds fewer bytes


def test_sweep_method_lists_follow_the_bit_selection():
    from kvarn_mla.evaluation.methods import parse_methods
    from kvarn_mla.evaluation.sweep import mla_grid, quantizers, select, transformers_baselines

    assert quantizers((2, 4)) == ["kvarn-2", "kivi-2", "rot-2", "kvarnvn-2", "kvarn-4", "kivi-4", "rot-4", "kvarnvn-4"]
    grid = parse_methods(",".join(mla_grid((3,))))[1:]  # [0] is the bf16 reference
    assert [(m.config.latent_bits, m.config.rope_bits) for m in grid] == [(3, 4), (3, 8)]
    runnable, missing = transformers_baselines((3,))  # transformers' caches have no 3-bit setting here
    assert runnable == ["hf-fp8"] and set(missing) <= {"hf-quanto", "hf-hqq"}
    names = quantizers((2,)) + mla_grid((2,)) + ["hf-fp8", "hf-quanto-2"]
    assert select(names, ("hf-",)) == ["hf-fp8", "hf-quanto-2"]  # one process for transformers' caches ...
    assert select(names, ("kvarn", "kivi", "rot")) == names[:6]  # ... one for ours
    assert select(names, None) == names
    assert select(names, ("kvarn-2$", "kivi-")) == ["kvarn-2", "kivi-2"]  # "$": that name, not its RoPE-bits grid


def _held_bytes(obj, seen: set) -> int:
    """Bytes of the tensors in ``obj`` (tensor subclasses such as quanto's packed codes by their inner tensors;
    each storage once)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            return sum(_held_bytes(getattr(obj, name), seen) for name in obj.__tensor_flatten__()[0])
        if obj.numel() == 0 or obj.data_ptr() in seen:
            return 0
        seen.add(obj.data_ptr())
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_held_bytes(value, seen) for value in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_held_bytes(value, seen) for value in obj)
    return 0


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("method", ["hf-quanto-2", "hf-quanto-4", "hf-hqq-2", "hf-fp8"])
def test_hf_cache_bytes_match_what_the_cache_holds(model_type, method):
    """`hf_cache_nbytes` counts transformers' quantized caches (codes, scales, zero points, residual window)
    exactly: 200 prefilled tokens, then 50 decoded (a residual of 50; the flush comes at 128). The tiny MLA
    latent and RoPE key are 64 wide, one quantization group, as in real models (quanto pads narrower rows)."""
    from transformers.cache_utils import QuantizedCache

    from kvarn_mla.evaluation.methods import backend_problem, hf_cache_nbytes

    parsed = parse_method(method)
    if backend_problem(parsed.backend):
        pytest.skip(backend_problem(parsed.backend))
    model = build_model(model_type, **({"kv_lora_rank": 64, "qk_rope_head_dim": 64} if model_type != "llama" else {}))
    cache = QuantizedCache(backend=parsed.backend, config=model.config, **parsed.cache_kwargs)
    ids = torch.randint(0, model.config.vocab_size, (1, 250))
    with torch.no_grad():
        model(ids[:, :200], cache=cache, use_cache=True)
        for t in range(200, 250):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    seen: set = set()
    held = sum(_held_bytes([layer._quantized_keys, layer._quantized_values, layer.keys, layer.values], seen)
               for layer in cache.layers)
    assert held == hf_cache_nbytes(model.config, parsed.backend, parsed.nbits, 250, element_size=4, residual=50)


def test_mcnemar_exact_by_hand():
    from kvarn_mla.evaluation.checkers import mcnemar_exact

    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(5, 0) == mcnemar_exact(0, 5) == 2 / 32  # all five discordant items one way
    assert mcnemar_exact(10, 2) == 2 * (1 + 12 + 66) / 4096


def test_paired_rows_pair_items_at_each_bit_width(tmp_path):
    from kvarn_mla.evaluation.paired import bits_of, load_verdicts, paired_rows

    assert [bits_of(m) for m in ("kvarn-3", "rot-2+rope_bits=8", "hf-quanto-4", "k4v2", "fp32", "hf-fp8")] == \
        [3, 2, 4, None, None, None]
    outcomes = {"kvarn-4": [1, 1, 1, 0, 0, 1], "rot-4": [1, 0, 0, 0, 1, 1], "kivi-4": [0, 0, 0, 0, 0, 1],
                "fp32": [1, 1, 1, 1, 1, 1]}
    records = tmp_path / "r.jsonl"
    records.write_text("".join(json.dumps({"method": m, "key": f"i{k}", "exact": bool(v), "text": "x"}) + "\n"
                               for m, values in outcomes.items() for k, v in enumerate(values)))
    rows = {row.method: row for row in paired_rows(load_verdicts(records))}
    assert rows["fp32"].comparisons == () and rows["fp32"].correct == 6
    kvarn_vs_rot = rows["kvarn-4"].comparisons
    assert [(c.partner, c.only_method, c.only_partner, c.difference) for c in kvarn_vs_rot] == [("rot-4", 2, 1, 1)]
    kivi = {c.partner: c for c in rows["kivi-4"].comparisons}
    assert (kivi["kvarn-4"].only_method, kivi["kvarn-4"].only_partner, kivi["kvarn-4"].p_value) == (0, 3, 0.25)
    assert rows["kivi-4"].ci95 == pytest.approx((0.0301, 0.5635), abs=1e-4)


def test_sweep_files_a_checkpoint_directory_under_its_family_name(tmp_path):
    """``NAME=DIR`` runs the checkpoint in DIR (a training run's model before it is installed) and files its results
    under NAME; the bundled model of that name is not loaded."""
    from kvarn_mla.evaluation.sweep import sweep

    model, tokenizer = build_model("llama"), char_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    results = sweep(tmp_path / "out", models=(f"gqa={tmp_path / 'model'}",), suites=("accumulation",), bits=(2,),
                    families=("kvarn-",), items=1)
    assert list(results["gqa"]["accumulation"]["methods"]) == ["kvarn-2"]
    record = json.loads((tmp_path / "out" / "gqa-accumulation.jsonl").read_text().splitlines()[0])
    assert record["run"]["model"]["digest"] == runner.model_identity(model)["digest"]


def test_a_long_grid_sliced_over_two_processes_gathers_into_one(tmp_path, capsys):
    """accuracy.py --long-slice scores part of a long suite's items into its own --out; --merge-from gathers the
    parts, and the summary rebuilt from them counts every item once."""
    accuracy = load_benchmark("accuracy")
    common = ["--models", "gqa", "--suites", "retrieval-2048", "--long-items", "3", "--bits", "2", "--families",
              "kvarn-2", "--threads", "1"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert accuracy.main([*common, "--out", str(a), "--long-slice", ":2"]) == 0
    assert accuracy.main([*common, "--out", str(b), "--long-slice", "2:"]) == 0
    ids = lambda d: {json.loads(line)["id"][-2:] for line in (d / "gqa-retrieval-2048.jsonl").read_text().splitlines()}  # noqa: E731
    assert ids(a) == {"-0", "-1"} and ids(b) == {"-2"}
    assert accuracy.main([*common, "--out", str(a), "--merge-from", str(b), "--no-run"]) == 0
    assert "gqa-retrieval-2048.jsonl: 2 records added, 0 already there and equal" in capsys.readouterr().out
    summary = json.loads((a / "gqa-retrieval-2048.json").read_text())
    assert {m: row["n"] for m, row in summary["methods"].items()} == {"fp32": 3, "kvarn-2": 3}
    with pytest.raises(SystemExit):
        accuracy.main([*common, "--out", str(a), "--long-slice", "two"])
    assert "'two' is not START:STOP" in capsys.readouterr().err
