"""Teacher-forced scoring (`kvarn-mla eval --mode teacher-forced`) gives greedy exact match's verdict."""

from types import SimpleNamespace

import pytest
import torch

from kvarn_mla import reference_models
from kvarn_mla.evaluation import reasoning
from kvarn_mla.evaluation.methods import backend_problem, parse_method
from kvarn_mla.evaluation.runner import check_mode, run
from kvarn_mla.evaluation.tasks import (
    GenerationItem,
    _record_updates,
    generate_items,
    target_chunks,
    teacher_forced_grid,
    teacher_forced_items,
)

SMALL_TILES = "+tile_size=64+sink_tokens=0"  # short items cross one or two tile boundaries
METHODS = ["fp32", f"k4v2{SMALL_TILES}", f"k2v2{SMALL_TILES}", f"kivi-2{SMALL_TILES}", f"rot-2{SMALL_TILES}",
           f"kvarnvn-2{SMALL_TILES}", "hf-fp8", "hf-quanto-2"]


def short_items(tokenizer, task: reasoning.Task, count: int) -> list[GenerationItem]:
    """Held-out reasoning items of 3-6 rows (60-120 target tokens), checked as the reasoning suite checks them."""
    items = []
    for item in reasoning.held_out_items(count, task=task, min_rows=3, max_rows=6):
        budget = len(tokenizer(item.target, add_special_tokens=False).input_ids) + 8
        check = {"exact": lambda text, item=item: reasoning.check(item, text)}
        items.append(GenerationItem(f"r{item.index}", item.prompt, check, budget, item.target))
    return items


def test_target_chunks_end_where_decoding_changes_the_cache():
    kvarn = parse_method("k4v2+tile_size=64+sink_tokens=32")
    assert target_chunks(kvarn, None, 40, 240) == [(40, 96), (96, 160), (160, 224), (224, 240)]
    assert target_chunks(kvarn, None, 10, 90) == [(10, 90)]  # the first tile completes at 96
    assert target_chunks(kvarn, None, 96, 160) == [(96, 160)]  # a prompt ending on a boundary
    residual = SimpleNamespace(layers=[SimpleNamespace(residual_length=128)])
    quanto = parse_method("hf-quanto-2")
    assert target_chunks(quanto, residual, 300, 600) == [(300, 428), (428, 556), (556, 600)]
    fp8 = SimpleNamespace(layers=[SimpleNamespace()])  # quantizes each token on arrival: any chunking
    assert target_chunks(parse_method("hf-fp8"), fp8, 300, 600) == [(300, 600)]
    assert target_chunks(parse_method("fp32"), None, 300, 600) == [(300, 600)]
    assert target_chunks(parse_method("fp32"), None, 300, 300) == []


def test_teacher_forced_verdict_equals_greedy_exact_match():
    """Per item and method, on the MLA and GQA reference models, unpadded greedy generation's exact match equals the
    teacher-forced verdict; the sample holds both right and wrong items (the GQA model fails at 2 bits, the MLA model
    does not on items this short), and a wrong item's first miss is where greedy first differs."""
    verdicts = []
    for name in ("mla", "gqa"):
        model, tokenizer = reference_models.load(name, dtype=torch.float32)
        items = short_items(tokenizer, reasoning.task_of(model.config), 5)
        for method_name in METHODS:
            method = parse_method(method_name)
            if method.kind == "hf" and backend_problem(method.backend):
                continue
            greedy = {r["id"]: r for r in generate_items(model, tokenizer, items, method, batch_size=1)}
            forced = {r["id"]: r for r in teacher_forced_items(model, tokenizer, items, method)}
            for item in items:
                assert greedy[item.id]["exact"] == forced[item.id]["exact"], (name, method_name, item.id)
                verdicts.append(forced[item.id]["exact"])
                if not forced[item.id]["exact"]:  # greedy's text leaves the target at the first miss
                    eos = [tokenizer.eos_token_id]
                    target = tokenizer(item.target, add_special_tokens=False).input_ids + eos
                    made = tokenizer(greedy[item.id]["text"], add_special_tokens=False).input_ids + eos
                    miss = forced[item.id]["first_miss"]
                    assert made[:miss] == target[:miss] and made[miss : miss + 1] != target[miss : miss + 1]
    assert any(verdicts) and not all(verdicts), verdicts  # the sample separates methods


def test_teacher_forced_run_records_and_refusals(tmp_path):
    model, tokenizer = reference_models.load("mla", dtype=torch.float32)
    items = short_items(tokenizer, reasoning.task_of(model.config), 2)
    methods = [parse_method("fp32"), parse_method(f"k4v2{SMALL_TILES}")]
    summary = run(model, tokenizer, methods, "reasoning", tmp_path / "tf.json", items=items, mode="teacher-forced")
    row = summary["methods"]["fp32"]
    assert row["n"] == 2 and set(row) == {"n", "exact", "mean_new_tokens", "bytes_per_token_4k"}
    assert summary["run"]["settings"]["mode"] == "teacher-forced"
    with pytest.raises(ValueError, match="another configuration.*mode"):  # greedy records never mix with these
        run(model, tokenizer, methods, "reasoning", tmp_path / "tf.json", items=items, mode="greedy")
    with pytest.raises(ValueError, match="suite 'jsonl'"):
        check_mode("teacher-forced", "jsonl", {"do_sample": False})
    with pytest.raises(ValueError, match="with sampling"):
        check_mode("teacher-forced", "reasoning", {"do_sample": True})
    with pytest.raises(ValueError, match="unknown mode 'beam'"):
        check_mode("beam", "reasoning", {"do_sample": False})
    no_target = [GenerationItem("u", "1+1=", {"exact": lambda text: text == "2"}, 4)]
    with pytest.raises(ValueError, match="has no target"):
        list(teacher_forced_items(model, tokenizer, no_target, methods[0]))


def contextual_items(tokenizer, task: reasoning.Task, count: int) -> list[GenerationItem]:
    """Short held-out items, each after two whole earlier items in its prompt (hundreds of prompt tokens), so a prefill
    with 64-token tiles quantizes several tiles and the target attends them."""
    items = []
    for item in reasoning.held_out_items(count + 2, task=task, min_rows=3, max_rows=6)[2:]:
        before = "".join(reasoning.make_item(item.index - k, task=task).text for k in (2, 1))
        budget = len(tokenizer(item.target, add_special_tokens=False).input_ids) + 8
        check = {"exact": lambda text, item=item: reasoning.check(item, text)}
        items.append(GenerationItem(f"c{item.index}", before + item.prompt, check, budget, item.target))
    return items


TINY_TILES = "+tile_size=64+sink_tokens=4"


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b is None or (a is not None and b is not None and torch.equal(a, b))
SHARED = [f"k4v2{TINY_TILES}", f"k2v2{TINY_TILES}", f"kivi-2{TINY_TILES}", f"rot-2{TINY_TILES}",
          f"kvarnvn-2{TINY_TILES}", f"kvarn-2+rope_bits=4{TINY_TILES}"]


@pytest.mark.parametrize("name", ["mla", "gqa"])
def test_shared_prefill_equals_separate_prefills(name):
    """One recorded prefill replayed into another KVarN config's cache leaves the cache that config's own patched
    prefill leaves (every dequantized tile and tail bit-equal, the same first prediction), and the grid's records
    equal per-method `teacher_forced_items` records, the reference and transformers' fp8 cache included."""
    model, tokenizer = reference_models.load(name, dtype=torch.float32)
    items = contextual_items(tokenizer, reasoning.task_of(model.config), 2)
    methods = [parse_method(m) for m in ["fp32", *SHARED, "hf-fp8"] if name == "mla" or "rope_bits" not in m]
    prompt = tokenizer(items[0].prompt, add_special_tokens=False, return_tensors="pt").input_ids
    first = methods[1]
    with first.applied(model):
        recorded = first.new_cache(model)
        states = _record_updates(recorded)
        model(prompt, cache=recorded, use_cache=True)
    assert [len(calls) for calls in states] == [1] * model.config.num_hidden_layers
    for method in methods[2:-1]:
        with method.applied(model):
            own = method.new_cache(model)
            model(prompt, cache=own, use_cache=True)
            replayed = method.new_cache(model)
            for layer, calls in zip(replayed.layers, states):
                layer.update(*calls[0])
            replayed.flush()
        for a, b in zip(own.layers, replayed.layers):
            assert a.streams[0].num_tiles > 0  # the prefill quantized tiles
            for x, y in zip(a.streams, b.streams):  # codes, scales, zero points, gammas; sink and tail
                assert all(map(same, x.tiles.parts(), y.tiles.parts())), method.name
                assert same(x.view().sink, y.view().sink) and same(x.view().tail, y.view().tail), method.name
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), method.name
    grid = {(m.name, r["id"]): r for m, r in teacher_forced_grid(model, tokenizer, items, methods)}
    assert len(grid) == len(items) * len(methods)
    for method in methods:
        for record in teacher_forced_items(model, tokenizer, items, method):
            assert grid[(method.name, record["id"])] == record, (method.name, record["id"])
    skipped = list(teacher_forced_grid(model, tokenizer, items[:1], methods, skip=lambda m, it: m.kind != "kvarn"))
    assert {m.name for m, _ in skipped} == {m.name for m in methods if m.kind == "kvarn"}


@pytest.mark.parametrize("shares", [True, False])
def test_kvarn_methods_replay_the_references_prefill_once_it_is_shown_equal(shares, monkeypatch):
    """The grid records the reference's prefill; once one item shows it bit-equal to a KVarN prefill, later items
    prefill once (the reference), not twice; where it differs (simulated), each item's first KVarN method prefills.
    The records are the same either way."""
    from kvarn_mla.evaluation import tasks

    model, tokenizer = reference_models.load("gqa", dtype=torch.float32)
    items = contextual_items(tokenizer, reasoning.task_of(model.config), 3)
    methods = [parse_method(m) for m in ["fp32", *SHARED[:3]]]
    checks, recorded = [], []
    same_prefill, record_updates = tasks._same_prefill, tasks._record_updates

    def checked(a, b):
        checks.append(same_prefill(a, b))
        return shares and checks[-1]

    def counted(cache):
        recorded.append(type(cache).__name__)
        return record_updates(cache)

    monkeypatch.setattr(tasks, "_same_prefill", checked)
    monkeypatch.setattr(tasks, "_record_updates", counted)
    grid = {(m.name, r["id"]): r for m, r in teacher_forced_grid(model, tokenizer, items, methods)}
    assert checks == [True]  # checked once, on the first item: the unpatched and the patched prefill agree
    kvarn_prefills = recorded.count("KVarNCache")
    assert recorded.count("DynamicCache") == len(items) and kvarn_prefills == (1 if shares else len(items))
    for method in methods:
        for record in teacher_forced_items(model, tokenizer, items, method):
            assert grid[(method.name, record["id"])] == record, (method.name, record["id"])
