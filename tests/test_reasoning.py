"""The reasoning task: deterministic, splits disjoint, and generator and checker agree."""

import random

import pytest

from kvarn_mla.evaluation import reasoning as R


def test_items_are_deterministic():
    assert R.make_item(3, "held_out") == R.make_item(3, "held_out")
    assert R.make_item(3, "train") == R.make_item(3, "train")
    assert R.held_out_items(5) == [R.make_item(i, "held_out") for i in range(5)]
    # pinned, so a change to the generator (which would silently change the benchmark) fails loudly
    item = R.make_item(0, "held_out")
    assert item.prompt == "<|problem|>317555400455664872<|scratchpad|>" and item.num_rows == 31
    assert item.target.endswith("<|scratchpad|>000561162044513523<|answer|>3")


def test_splits_never_share_a_starting_row():
    held = R.held_out_items(300)
    train = R.train_items(3000)
    assert all(R.instance_split(it.rows[0]) == "held_out" for it in held)
    assert all(R.instance_split(it.rows[0]) == "train" for it in train)
    assert not {it.rows[0] for it in held} & {it.rows[0] for it in train}
    assert len({it.rows[0] for it in held}) == len(held)


def test_item_structure():
    for it in R.held_out_items(50):
        assert R.MIN_ROWS <= it.num_rows <= R.MAX_ROWS
        assert all(len(r) == R.WIDTH for r in it.rows)
        for above, row in zip(it.rows, it.rows[1:]):
            for j, cell in enumerate(row):
                assert cell == ((row[j - 1] if j else 0) + above[j]) % R.MODULUS
        assert it.answer == str(it.rows[-1][-1])
        g = it.num_rows
        assert it.prompt == R.PROBLEM + f"{g:02d}" + "".join(map(str, it.rows[0])) + R.SCRATCHPAD
        lines = it.target.split(R.ANSWER)[0].split(R.SCRATCHPAD)
        assert lines == [f"{g - i:02d}" + "".join(map(str, r)) for i, r in enumerate(it.rows[1:], 1)]
        assert it.text == it.prompt + it.target + R.EOS
        # several hundred generated tokens: digits are single tokens, 19 per row with counter and row break
        assert R.ROW_TOKENS == 19 and len(it.target) >= 19 * R.MIN_ROWS


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


def test_checker_accepts_reference_and_rejects_corruptions_on_every_held_out_item():
    rng = random.Random(0)
    for it in R.held_out_items(200):
        assert R.check(it, it.target)
        assert R.check(it, it.target + R.EOS + "junk after the end")
        assert R.check(it, " " + it.target + "\n")
        assert R.check_answer(it, it.target)
        for bad in _corruptions(it.target, rng, 3):
            assert not R.check(it, bad)


def test_check_answer_is_the_loose_variant():
    it = R.make_item(1, "held_out")
    rows, ans = it.target.split(R.ANSWER)
    broken = rows.replace(R.SCRATCHPAD, R.SCRATCHPAD * 2, 1) + R.ANSWER + ans  # a broken scratchpad with the right answer
    assert R.check_answer(it, broken) and not R.check(it, broken)
    assert R.parse_answer(broken + R.EOS) == it.answer
    assert R.parse_answer("no answer here") is None


def test_solve_and_render_match_the_docstring_example():
    rows = R.solve(tuple(int(c) for c in "3141592653589793"), 3)
    prompt, target = R.render(rows)
    assert prompt == "<|problem|>033141592653589793<|scratchpad|>"
    assert target == "023412024314235503<|scratchpad|>013013352563516440<|scratchpad|>003340313103121522<|answer|>2"


@pytest.mark.parametrize("kwargs", [{"split": "test"}, {"index": -1}, {"min_rows": 0}, {"modulus": 11}])
def test_bad_arguments_raise(kwargs):
    args = {"index": 0, "split": "train", **kwargs}
    with pytest.raises(ValueError):
        R.make_item(**args)


def test_item_tokens_counts_prompt_and_target_without_building_the_item():
    for it in R.held_out_items(30):
        # digits and format strings are single tokens: prompt and target (with end of text) counted from the text
        assert R.item_tokens(it.index) == (2 + R.COUNTER + R.WIDTH, it.num_rows * R.ROW_TOKENS + 2)
    assert R.item_tokens(5, "train", min_rows=1, max_rows=3)[1] == R.make_item(5, "train", min_rows=1,
                                                                                 max_rows=3).num_rows * R.ROW_TOKENS + 2
