"""The long-context retrieval task: deterministic, held-out by construction, depths spread, generator and checker
agree."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvarn_mla.evaluation import data as D
from kvarn_mla.evaluation import reasoning as R
from kvarn_mla.evaluation import retrieval as RT

HELD_OUT_SEED = 12_345


@pytest.fixture(scope="module")
def tok():
    # A small byte-level BPE with the tasks' special tokens (same pre-tokenization as the reference models'),
    # trained on a few held-out files: the generator only needs token counts from it.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=[*R.SPECIAL_TOKENS, *RT.SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([f.text for f in D.read_code_files("held_out")[:20]] + [" ".join(RT.WORDS)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=R.EOS,
        pad_token=R.PAD,
        additional_special_tokens=[*R.SPECIAL_TOKENS[2:], *RT.SPECIAL_TOKENS],
    )


def _follow(item: RT.Item, key: str) -> list[str]:
    values = {f.key: f.value for f in item.facts}
    chain = [key]
    while not values[chain[-1]].isdigit():
        chain.append(values[chain[-1]])
    return chain


def test_items_are_deterministic_and_fill_the_context(tok):
    a = RT.make_item(tok, 1024, HELD_OUT_SEED, 3)
    assert a == RT.make_item(tok, 1024, HELD_OUT_SEED, 3)
    assert a != RT.make_item(tok, 1024, HELD_OUT_SEED, 4) and a != RT.make_item(tok, 1024, HELD_OUT_SEED + 1, 3)
    for context in (512, 1024, 3000):
        for index in range(4):
            it = RT.make_item(tok, context, HELD_OUT_SEED, index)
            prompt = tok(it.prompt, add_special_tokens=False).input_ids
            target = tok(it.target, add_special_tokens=False).input_ids
            assert (len(prompt), len(target)) == (it.prompt_tokens, it.target_tokens)
            assert context - 8 <= it.prompt_tokens + it.target_tokens <= context


def test_structure_chains_and_unique_lookups(tok):
    for index in range(30):
        it = RT.make_item(tok, 2048, HELD_OUT_SEED, index)
        keys = [f.key for f in it.facts]
        assert len(set(keys)) == len(keys) and set(keys) <= set(RT.WORDS)
        assert RT.MIN_CHAINS <= sum(f.value.isdigit() for f in it.facts) <= RT.MAX_CHAINS
        assert 1 <= len(it.queries) <= RT.MAX_QUERIES
        assert it.prompt.endswith(RT.QUERY + "".join(" " + q for q in it.queries) + R.ANSWER)
        for q, chain, answer in zip(it.queries, it.chains, it.answers):
            assert list(chain) == _follow(it, q) and len(chain) <= RT.MAX_HOPS
            assert {f.key: f.value for f in it.facts}[chain[-1]] == answer and len(answer) == RT.VALUE_DIGITS
        # The target writes every fact on the way, in query order; each lookup's token sequence (key marker, key,
        # value marker) occurs exactly once before it, in the prompt.
        want = "".join(
            RT.fact_text(k, v) for chain, a in zip(it.chains, it.answers) for k, v in zip(chain, [*chain[1:], a])
        )
        assert it.target == want
        key_id, value_id = tok.convert_tokens_to_ids(RT.KEY), tok.convert_tokens_to_ids(RT.VALUE)
        prompt = tok(it.prompt, add_special_tokens=False).input_ids
        for chain in it.chains:
            for k in chain:
                lookup = [key_id, *tok(" " + k, add_special_tokens=False).input_ids, value_id]
                hits = [i for i in range(len(prompt)) if prompt[i : i + len(lookup)] == lookup]
                assert len(hits) == 1, (index, k)


def test_generator_and_checker_agree(tok):
    rng = random.Random(0)
    for index in range(20):
        it = RT.make_item(tok, 1024, HELD_OUT_SEED, index)
        assert RT.check(it, it.target) and RT.check(it, " " + it.target + R.EOS + "<|key|> junk")
        assert RT.check_answers(it, it.target) == 1.0 and RT.parse_answers(it.target) == list(it.answers)
        digits = [i for i, c in enumerate(it.target) if c.isdigit()]
        pos = rng.choice(digits)
        bad = it.target[:pos] + str((int(it.target[pos]) + rng.randrange(1, 10)) % 10) + it.target[pos + 1 :]
        assert not RT.check(it, bad) and RT.check_answers(it, bad) == pytest.approx(1 - 1 / len(it.answers))
        assert not RT.check(it, it.target[:-1]) and not RT.check(it, it.target + RT.KEY)
        first = RT.fact_text(it.chains[0][0], it.chains[0][1] if len(it.chains[0]) > 1 else it.answers[0])
        assert not RT.check(it, it.target[len(first) :])  # a missing fact
        assert RT.check_answers(it, "") == 0.0


def test_seeds_outside_the_training_range_are_held_out_by_construction(tok):
    assert RT.seed_split(0) == RT.seed_split(RT.TRAIN_SEEDS[-1]) == "train"
    assert RT.seed_split(RT.TRAIN_SEEDS[-1] + 1) == RT.seed_split(-1) == "held_out"
    with pytest.raises(ValueError, match="training seed"):
        RT.held_out_items(tok, 1024, 7, 2)
    held = RT.held_out_items(tok, 1024, HELD_OUT_SEED, 20) + RT.held_out_items(tok, 1024, 10**9, 5)
    train = [RT.make_item(tok, 1024, seed, index) for seed in (0, 999) for index in range(10)]
    assert all(it.split == "held_out" for it in held) and all(it.split == "train" for it in train)
    numbers = lambda items: {f.value for it in items for f in it.facts if f.value.isdigit()}  # noqa: E731
    assert all(RT.value_split(v) == "held_out" for v in numbers(held))
    assert all(RT.value_split(v) == "train" for v in numbers(train))
    # Every number of a held-out item is a held-out value, which no training item can contain.
    assert not numbers(held) & set(RT._values("train"))
    assert not set(RT._values("train")) & set(RT._values("held_out"))
    assert abs(len(RT._values("held_out")) / 10**RT.VALUE_DIGITS - RT.HELD_OUT_VALUE_PERCENT / 100) < 0.02
    # Filler comes from the split's own code files: with the facts and the query taken out, a held-out prompt is a
    # contiguous run of the held-out code stream (files never trained on, see tests/test_data.py).
    held_code, _ = RT._code_stream("held_out")
    for it in held[:5]:
        filler = it.prompt[: it.prompt.rindex(RT.QUERY)]
        for fact in it.facts:
            filler = filler.replace(fact.text, "", 1)
        assert RT.KEY not in filler and held_code.startswith(filler, it.code_start)


def test_denser_training_items_and_short_contexts(tok):
    # A drill packs more chains and queries into an item; short contexts hold at most one fact per tokens_per_fact.
    for index in range(10):
        dense = RT.make_item(tok, 1024, 5, index, chains=(8, 16), max_queries=12, tokens_per_fact=40)
        assert 8 <= sum(f.value.isdigit() for f in dense.facts) <= 16 and len(dense.facts) <= 1024 // 40
        assert 1 <= len(dense.queries) <= 12 and RT.check(dense, dense.target)
        short = RT.make_item(tok, 256, HELD_OUT_SEED, index)
        assert len(short.facts) <= max(RT.MIN_CHAINS, 256 // RT.TOKENS_PER_FACT)


def test_depths_spread_over_the_whole_context(tok):
    items = [RT.make_item(tok, 1024, HELD_OUT_SEED, i) for i in range(50)]
    deciles = RT.depth_histogram(items)
    assert all(count > 0 for count in deciles), deciles
    answers = [d for it in items for d in it.answer_depths]
    assert min(answers) < 0.05 and max(answers) > 0.9 and 0.4 < sum(answers) / len(answers) < 0.6
    # A fact's depth is the token position of its key marker over the prompt length.
    key_id = tok.convert_tokens_to_ids(RT.KEY)
    for it in items[:5]:
        prompt = tok(it.prompt, add_special_tokens=False).input_ids
        positions = [i for i, t in enumerate(prompt) if t == key_id]
        assert [round(f.depth * len(prompt)) for f in it.facts] == positions


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="context"):
        RT.make_item(tok, 100, HELD_OUT_SEED, 0)
    with pytest.raises(ValueError, match="index"):
        RT.make_item(tok, 1024, HELD_OUT_SEED, -1)
    with pytest.raises(ValueError, match="chains"):
        RT.make_item(tok, 1024, HELD_OUT_SEED, 0, chains=(5, 4))
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    with pytest.raises(ValueError, match="one token"):
        RT.make_item(plain, 1024, HELD_OUT_SEED, 0)


def test_eval_cli_scores_fresh_held_out_items(tok, tmp_path, capsys):
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvarn_mla.cli import main
    from kvarn_mla.evaluation.tasks import retrieval_items

    items = retrieval_items(tok, 512, HELD_OUT_SEED, 3)
    item = RT.make_item(tok, 512, HELD_OUT_SEED, 1)
    assert [it.id for it in items] == [f"retrieval-512-{HELD_OUT_SEED}-{i}" for i in range(3)]
    assert items[1].prompt == item.prompt and items[1].max_new_tokens == item.target_tokens + 4
    assert items[1].checks["exact"](item.target) and items[1].checks["numbers"](item.target)
    assert not items[1].checks["numbers"](item.target.replace(RT.VALUE + item.answers[-1], RT.VALUE + "x"))

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "retrieval.json"
    args = [
        "eval",
        "--model",
        str(tmp_path / "model"),
        "--suite",
        "retrieval",
        "--context",
        "512",
        "--limit",
        "2",
        "--presets",
        "bf16",
        "--out",
        str(out),
    ]
    assert main([*args, "--seed", "3"]) == 2  # a training seed is refused
    assert "training seed" in capsys.readouterr().err
    assert main([*args, "--seed", str(HELD_OUT_SEED)]) == 0
    row = json.loads(out.read_text())["methods"]["fp32"]
    assert row["n"] == 2 and row["exact"]["correct"] == 0 and set(row) >= {"exact", "numbers"}  # random weights
    records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    # items are batched by new-token budget and prompt length (tasks.generate_items), in that order
    assert sorted(r["key"] for r in records) == [f"retrieval-512-{HELD_OUT_SEED}-{i}" for i in range(2)]

    # teacher-forced, as the sweep scores its retrieval grids: every (method, item) once, KVarN prefills shared
    tiles = "+tile_size=64+sink_tokens=0"
    presets = ["--presets", f"bf16,k4v2{tiles},k2v2{tiles},rot-2{tiles}"]
    assert main([*args[:-4], *presets, "--out", str(tmp_path / "tf.json"), "--seed", str(HELD_OUT_SEED), "--mode",
                 "teacher-forced"]) == 0
    records = [json.loads(line) for line in (tmp_path / "tf.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["key"]) for r in records) == sorted(
        (m, f"retrieval-512-{HELD_OUT_SEED}-{i}") for m in ("fp32", f"k4v2{tiles}", f"k2v2{tiles}", f"rot-2{tiles}")
        for i in range(2))
    assert all(r["first_miss"] is not None and not r["exact"] for r in records)  # random weights


def test_sweep_retrieval_text_is_a_held_out_item_written_out(tok):
    from kvarn_mla.evaluation.sweep import SWEEP_SEED, retrieval_text

    assert RT.seed_split(SWEEP_SEED) == "held_out"
    item = RT.make_item(tok, 512, SWEEP_SEED, 0)
    ids = retrieval_text(tok, 512)
    assert ids.shape == (1, 512)
    assert ids[0].tolist() == tok(item.prompt + item.target, add_special_tokens=False).input_ids[:512]


def test_demo_has_a_long_context_retrieval_prompt(tok):
    from kvarn_mla.evaluation.demo import DEMO_RETRIEVAL_CONTEXT, DEMO_RETRIEVAL_SEED, demo_prompts

    prompts = {p.name.split()[0]: p for p in demo_prompts(tok, None, 150, R.V2)}
    item = RT.make_item(tok, DEMO_RETRIEVAL_CONTEXT, DEMO_RETRIEVAL_SEED, 0)
    assert set(prompts) == {"reasoning", "retrieval", "code"} and item.split == "held_out"
    p = prompts["retrieval"]
    assert p.ids.shape[1] == item.prompt_tokens and p.new_tokens == item.target_tokens + 4
    assert p.check(item.target) and not p.check(item.target[:-1])
