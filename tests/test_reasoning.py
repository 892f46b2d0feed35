"""The reasoning task: deterministic, splits disjoint, generator and checker agree, and versions recorded with a
checkpoint (version 1 for a config that records none, so the first reference models keep their items)."""

import random

import pytest
from transformers import LlamaConfig

from kvarn_mla.evaluation import reasoning as R

# Item 0 of each version's held-out split, pinned: a change to the generator (which would silently change the
# benchmark, or the items a shipped checkpoint is scored on) fails loudly.
PINNED = {
    1: ("<|problem|>317555400455664872<|scratchpad|>", 31, "<|scratchpad|>000561162044513523<|answer|>3"),
    2: ("<|problem|>2596832917992411908086<|scratchpad|>", 25, "<|scratchpad|>0020324452303420112230<|answer|>0"),
}
EXAMPLES = {  # the module docstring's example for version 2, and the same start cut to 16 cells for version 1
    1: (
        "3141592653589793",
        "023412024314235503<|scratchpad|>013013352563516440<|scratchpad|>003340313103121522<|answer|>2",
    ),
    2: (
        "31415926535897932384",
        "0234120243142355035126<|scratchpad|>0130133525635164405610<|scratchpad|>0033403131031215220600<|answer|>0",
    ),
}
TASKS = pytest.mark.parametrize("task", [R.V1, R.V2], ids=["v1", "v2"])


@TASKS
def test_items_are_deterministic_and_pinned(task):
    assert R.make_item(3, "held_out", task=task) == R.make_item(3, "held_out", task=task)
    assert R.make_item(3, "train", task=task) == R.make_item(3, "train", task=task)
    assert R.held_out_items(5, task=task) == [R.make_item(i, "held_out", task=task) for i in range(5)]
    prompt, rows, end = PINNED[task.version]
    item = R.make_item(0, "held_out", task=task)
    assert item.prompt == prompt and item.num_rows == rows and item.target.endswith(end)


def test_versions_and_the_default():
    assert (R.V1.width, R.V1.min_rows, R.V1.max_rows, R.V1.row_tokens) == (16, 16, 48, 19)
    assert (R.V2.width, R.V2.min_rows, R.V2.max_rows, R.V2.row_tokens) == (20, 16, 96, 23)
    assert R.TASKS == {1: R.V1, 2: R.V2} and R.LATEST is R.V2
    assert R.make_item(7) == R.make_item(7, task=R.LATEST)
    with pytest.raises(TypeError, match="reasoning.Task"):
        R.make_item(0, task=2)


def test_a_checkpoint_records_its_version_and_one_that_records_none_is_version_1(tmp_path):
    config = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    assert R.task_of(config) is R.V1 and R.task_of({}) is R.V1  # the first reference models record nothing
    R.record_task(config, R.V2)
    config.save_pretrained(tmp_path)
    assert R.task_of(LlamaConfig.from_pretrained(tmp_path)) is R.V2
    saved = (tmp_path / "config.json").read_text()
    assert '"reasoning_task"' in saved and '"width": 20' in saved
    assert R.task_of({"reasoning_task": 1}) is R.V1  # a bare version number
    with pytest.raises(ValueError, match="unknown reasoning task version"):
        R.task_of({"reasoning_task": {"version": 9}})
    with pytest.raises(ValueError, match="differs from version 2"):
        R.task_of({"reasoning_task": {**R.V2.to_dict(), "width": 16}})


@TASKS
def test_splits_never_share_a_starting_row(task):
    held = R.held_out_items(300, task=task)
    train = R.train_items(3000, task=task, min_rows=1, max_rows=4)
    assert all(R.instance_split(it.rows[0]) == "held_out" for it in held)
    assert all(R.instance_split(it.rows[0]) == "train" for it in train)
    assert not {it.rows[0] for it in held} & {it.rows[0] for it in train}
    assert len({it.rows[0] for it in held}) == len(held)


@TASKS
def test_item_structure(task):
    for it in R.held_out_items(50, task=task):
        assert task.min_rows <= it.num_rows <= task.max_rows
        assert all(len(r) == task.width for r in it.rows) and it.width == task.width
        for above, row in zip(it.rows, it.rows[1:]):
            for j, cell in enumerate(row):
                assert cell == ((row[j - 1] if j else 0) + above[j]) % R.MODULUS
        assert it.answer == str(it.rows[-1][-1])
        g = it.num_rows
        assert it.prompt == R.PROBLEM + f"{g:02d}" + "".join(map(str, it.rows[0])) + R.SCRATCHPAD
        lines = it.target.split(R.ANSWER)[0].split(R.SCRATCHPAD)
        assert lines == [f"{g - i:02d}" + "".join(map(str, r)) for i, r in enumerate(it.rows[1:], 1)]
        assert it.text == it.prompt + it.target + R.EOS
        # digits are single tokens: counter, cells and row break make a row
        assert task.row_tokens == R.COUNTER + task.width + 1 and len(it.target) >= task.row_tokens * task.min_rows


def _corruptions(target: str, rng: random.Random, k: int) -> list[str]:
    digits = [i for i, c in enumerate(target) if c.isdigit()]
    out = []
    for pos in rng.sample(digits, k):
        bad = str((int(target[pos]) + rng.randrange(1, 10)) % 10)
        out.append(target[:pos] + bad + target[pos + 1 :])
    out.append(target[:-1])  # truncated answer
    out.append(target.split(R.ANSWER)[0])  # no answer at all
    out.append(target.replace(R.SCRATCHPAD, "", 1))  # a missing row break
    out.append(target.split(R.SCRATCHPAD, 1)[1])  # a missing row
    return out


@TASKS
def test_checker_accepts_reference_and_rejects_corruptions_on_every_held_out_item(task):
    rng = random.Random(0)
    for it in R.held_out_items(100, task=task):
        assert R.check(it, it.target)
        assert R.check(it, it.target + R.EOS + "junk after the end")
        assert R.check(it, " " + it.target + "\n")
        assert R.check_answer(it, it.target)
        for bad in _corruptions(it.target, rng, 3):
            assert not R.check(it, bad)


def test_check_answer_is_the_loose_variant():
    it = R.make_item(1, "held_out")
    rows, ans = it.target.split(R.ANSWER)
    broken = rows.replace(R.SCRATCHPAD, R.SCRATCHPAD * 2, 1) + R.ANSWER + ans  # broken scratchpad, right answer
    assert R.check_answer(it, broken) and not R.check(it, broken)
    assert R.parse_answer(broken + R.EOS) == it.answer
    assert R.parse_answer("no answer here") is None


@TASKS
def test_solve_and_render_match_the_docstring_example(task):
    start, target = EXAMPLES[task.version]
    rows = R.solve(tuple(int(c) for c in start), 3)
    assert R.render(rows) == (f"<|problem|>03{start}<|scratchpad|>", target)


@pytest.mark.parametrize("kwargs", [{"split": "test"}, {"index": -1}, {"min_rows": 0}, {"modulus": 11}])
def test_bad_arguments_raise(kwargs):
    args = {"index": 0, "split": "train", **kwargs}
    with pytest.raises(ValueError):
        R.make_item(**args)


@TASKS
def test_item_tokens_counts_prompt_and_target_without_building_the_item(task):
    items = R.held_out_items(100, task=task)
    sizes = [R.item_tokens(it.index, task=task) for it in items]
    # digits and format strings are single tokens: prompt and target (with end of text) counted from the text
    assert all(p == task.prompt_tokens and t == it.num_rows * task.row_tokens + 2 for it, (p, t) in zip(items, sizes))
    assert task.prompt_tokens == 2 + R.COUNTER + task.width
    small = R.make_item(5, "train", task=task, min_rows=1, max_rows=3)
    assert R.item_tokens(5, "train", task=task, min_rows=1, max_rows=3)[1] == small.num_rows * task.row_tokens + 2
    long = sum(t - 1 >= 2000 for _, t in sizes)  # generated tokens, without the end of text
    if task is R.V2:
        assert long >= 8 and max(it.num_rows for it in items) <= 96  # items of 87+ rows write 2,000+ tokens
    else:
        assert long == 0 and max(t for _, t in sizes) <= 48 * 19 + 2
