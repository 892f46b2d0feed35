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
    assert len(item.values) == 105 and item.target.endswith("<|k105|>8>3<|answer|>3")


def test_splits_never_share_an_instance():
    held = R.held_out_items(300)
    train = R.train_items(3000)
    assert all(R.instance_split(it.values) == "held_out" for it in held)
    assert all(R.instance_split(it.values) == "train" for it in train)
    assert not {it.values for it in held} & {it.values for it in train}
    assert len({it.values for it in held}) == len(held)


def test_item_structure():
    for it in R.held_out_items(50):
        assert R.MIN_LEN <= len(it.values) <= R.MAX_LEN
        s = 0
        for a, got in zip(it.values, it.sums):
            s = (s + a) % R.MODULUS
            assert got == s
        assert it.answer == str(it.sums[-1])
        assert it.prompt.startswith(R.PROBLEM) and it.prompt.endswith(R.SCRATCHPAD)
        steps = it.target.split(R.ANSWER)[0]
        assert steps == "".join(f"<|k{i}|>{a}>{s}" for i, (a, s) in enumerate(zip(it.values, it.sums), 1))
        assert it.text == it.prompt + it.target + R.EOS
        # several hundred generated tokens: 4 per step (key, digit, '>', digit) + answer
        assert R.KEYS[len(it.values) - 1] in it.target and 4 * len(it.values) >= 200


def _corruptions(target: str, rng: random.Random, k: int) -> list[str]:
    digits = [i for i, c in enumerate(target) if c.isdigit()]
    out = []
    for pos in rng.sample(digits, k):
        bad = str((int(target[pos]) + rng.randrange(1, 10)) % 10)
        out.append(target[:pos] + bad + target[pos + 1 :])
    out.append(target[:-1])  # truncated answer
    out.append(target.split(R.ANSWER)[0])  # no answer at all
    out.append(target.replace(">", "", 1))  # format slip
    out.append(target.replace("<|k2|>", "<|k3|>", 1))  # wrong key
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
    steps, ans = it.target.split(R.ANSWER)
    broken = steps.replace(">", ">>", 1) + R.ANSWER + ans  # a broken scratchpad with the right answer
    assert R.check_answer(it, broken) and not R.check(it, broken)
    assert R.parse_answer(broken + R.EOS) == it.answer
    assert R.parse_answer("no answer here") is None


@pytest.mark.parametrize("kwargs", [{"split": "test"}, {"index": -1}, {"max_len": 201}, {"modulus": 11}])
def test_bad_arguments_raise(kwargs):
    args = {"index": 0, "split": "train", **kwargs}
    with pytest.raises(ValueError):
        R.make_item(**args)
