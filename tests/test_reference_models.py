"""Bundled reference checkpoints load offline and solve the reasoning task; the training script runs."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvarn_mla import reference_models
from kvarn_mla.evaluation import reasoning as R

REPO = Path(__file__).resolve().parents[1]


def test_unknown_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="mla, gqa, mha"):
        reference_models.path("llama")


@pytest.mark.parametrize("name", reference_models.NAMES)
def test_checkpoint_is_bundled_and_small(name):
    p = reference_models.path(name)
    files = {f.name for f in p.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert sum(f.stat().st_size for f in p.iterdir()) < 16 * 2**20
    assert json.loads((p / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("name", reference_models.NAMES)
def test_load_offline_and_solve_a_held_out_item(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = reference_models.load(name)
    cfg = model.config
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    if name == "mla":
        assert cfg.model_type == "deepseek_v3"
        # the latent is four heads wide; content and RoPE key: a head and half a head (DeepSeek-V3's ratio) in the v1
        # checkpoint, two heads each from v6 on (the shipped words leg of v7)
        head = cfg.hidden_size // cfg.num_attention_heads
        assert cfg.kv_lora_rank == 4 * head
        assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim) in {(head, head // 2), (2 * head, 2 * head)}
    else:
        assert cfg.model_type == "llama"
        assert cfg.num_attention_heads // cfg.num_key_value_heads == (4 if name == "gqa" else 1)
    # Digits are single tokens and the format strings are special tokens.
    assert tok.tokenize("1234") == ["1", "2", "3", "4"]
    assert all(len(tok(s, add_special_tokens=False)["input_ids"]) == 1 for s in R.SPECIAL_TOKENS)
    # Teacher-forced greedy: the argmax at every target position is the reference token, which is what
    # greedy decoding needs to reproduce the whole scratchpad (one forward pass instead of ~600 steps), on an item
    # of the task version the checkpoint records (version 1 when it records none).
    item = R.make_item(0, "held_out", task=R.task_of(cfg))
    prompt = tok(item.prompt, add_special_tokens=False)["input_ids"]
    target = tok(item.target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1]
    wrong = (logits.argmax(-1) != torch.tensor(target)).sum().item()
    assert wrong == 0, f"{name}: {wrong} of {len(target)} target tokens mispredicted"


def _benchmark_module(name: str):
    """A script of benchmarks/models imported as a module (it imports its neighbours by name)."""
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks" / "models"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _train_reference():
    return _benchmark_module("train_reference")


@pytest.mark.parametrize("name", ["mla", "gqa"])
def test_packed_documents_do_not_see_each_other(name):
    # Training packs several items per row; with the document mask and restarted positions each one gets
    # exactly the logits it would get alone (as at generation time).
    tr = _train_reference()
    tok = type("Tok", (), {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1})()
    model = tr.build_model(tr.build_config(name, tr.SMOKE, tok)).eval()
    model.config._attn_implementation = "sdpa_pad_v"
    a, b = torch.randint(2, 512, (1, 7)), torch.randint(2, 512, (1, 5))
    mask, positions = tr.doc_mask_and_positions(torch.tensor([[0] * 7 + [1] * 5]))
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b], 1), attention_mask=mask, position_ids=positions).logits
        alone = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def smoke_tokenizer(tmp_path_factory):
    tr = _train_reference()
    return tr.build_tokenizer(tmp_path_factory.mktemp("tok"), tr.SMOKE.vocab_size, max_files=40)


def test_recipe_phases_and_learning_rate():
    tr = _train_reference()
    r = tr.FULL
    assert r.steps == sum(p.steps for p in r.phases) and r.phase_at(0) == (r.phases[0], 0)
    first, second = r.phases[:2]
    assert r.phase_at(first.steps) == (second, 0) and r.phase_at(r.steps - 1)[0] is r.phases[-1]
    with pytest.raises(ValueError):
        r.phase_at(r.steps)
    assert r.lr_at(0) == pytest.approx(first.lr / first.warmup) and r.lr_at(first.warmup) == pytest.approx(first.lr)
    assert r.lr_at(first.steps) == pytest.approx(second.lr)  # a cosine phase starts at its peak ...
    assert r.lr_at(first.steps + second.steps - 1) == pytest.approx(second.final_lr)  # ... and ends at final_lr
    for recipe in tr.RECIPES.values():
        assert all(p.context >= max(p.retrieval) for p in recipe.phases if "k" in p.mix)
        # code in every phase: a code row, or retrieval / reasoning rows (code filler and top-up)
        assert all(set(p.mix) <= set(tr.ROW_KINDS) and set(p.mix) & set("rock") for p in recipe.phases)


def test_rope_base_raised_by_a_phase():
    from dataclasses import replace

    tr = _train_reference()
    a, b = tr.SMOKE.phases[:2]
    r = replace(tr.SMOKE, rope_theta=1e4, phases=(a, replace(b, rope_theta=5e5), tr.SMOKE.phases[2]))
    thetas = [tr.rope_at(r, i)["rope_theta"] for i in range(r.steps)]
    assert thetas == [1e4] * a.steps + [5e5] * (r.steps - a.steps)
    tok = type("Tok", (), {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1})()
    model = tr.build_model(tr.build_config("gqa", r, tok)).eval()
    ids = torch.randint(2, 512, (1, 64))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        tr.set_rope(model, tr.rope_at(r, a.steps))
        after = model(input_ids=ids).logits
        fresh = tr.build_model(tr.build_config("gqa", replace(r, rope_theta=5e5), tok)).eval()
        fresh.load_state_dict(model.state_dict())
        torch.testing.assert_close(after, fresh(input_ids=ids).logits)  # same as a model built with that base
    assert model.config.rope_parameters["rope_theta"] == 5e5 and not torch.allclose(before, after)


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_rope_scaling_slows_only_the_long_wavelengths(name):
    from dataclasses import replace

    tr = _train_reference()
    a, b = tr.SMOKE.phases[:2]
    r = replace(tr.SMOKE, phases=(a, replace(b, rope_scaling=(16.0, 256)), tr.SMOKE.phases[2]))
    assert tr.rope_at(r, a.steps - 1)["rope_type"] == "default" and tr.rope_at(r, r.steps - 1)["rope_type"] == "llama3"
    tok = type("Tok", (), {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1})()
    model = tr.build_model(tr.build_config(name, r, tok)).eval()
    plain = model.model.rotary_emb.inv_freq.clone()
    tr.set_rope(model, tr.rope_at(r, a.steps))
    scaled = model.model.rotary_emb.inv_freq
    wavelength = 2 * math.pi / plain
    short, long = wavelength < 256 / 4, wavelength > 256
    assert short.any() and long.any()
    torch.testing.assert_close(scaled[short], plain[short])  # short-range position heads keep their angles
    torch.testing.assert_close(scaled[long], plain[long] / 16)  # the slow pairs turn 16 times slower
    with torch.no_grad():  # the whole model runs with it
        assert torch.isfinite(model(input_ids=torch.randint(2, 512, (1, 64))).logits).all()


def test_rows_of_every_kind(smoke_tokenizer):
    # Every document of a row is exactly what its source says (an item's tokens, an opening's prefix of them, a
    # code window); kinds mark what is trained on; position jumps stay within the phase's span.
    from kvarn_mla.evaluation import retrieval as RT

    tr = _train_reference()
    tok, recipe = smoke_tokenizer, tr.SMOKE
    data = tr.Data(tok, recipe, max_files=40)
    seen = set()
    for step in range(recipe.steps):
        phase, _ = recipe.phase_at(step)
        ids, kind, doc, offset = data.batch(step)
        assert ids.shape == kind.shape == doc.shape == offset.shape == (phase.rows, phase.context + 1)
        for r in range(phase.rows):
            row = data.row(step, r, phase)
            assert row.ids == ids[r].tolist() and len(row.sources) == int(doc[r].max()) + 1
            for j, source in enumerate(row.sources):
                at = (doc[r] == j).nonzero()[:, 0]
                tokens, kinds, off = ids[r, at].tolist(), kind[r, at].tolist(), offset[r, at].tolist()
                assert kinds[0] == (tr.NO_LOSS if j else kinds[0])  # not predictable from the document before
                if source[0] == "code":
                    body = tokens[1:] if j else tokens  # a top-up opens with end-of-text
                    assert (
                        body == data.code[source[1] : source[1] + len(body)].tolist() and tokens[0] != tok.pad_token_id
                    )
                    assert set(kinds[1:]) == {tr.CODE} and set(off) == {0}
                elif source[0] == "reasoning":
                    item = R.make_item(source[1], "train", task=tr.TASK, min_rows=1, max_rows=phase.max_rows)
                    prompt, target = data.encode_item(item)
                    assert tokens == prompt + target[: source[2]]
                    assert kinds[1:] == ([tr.PROMPT] * len(prompt) + [tr.REASONING] * source[2])[1:]
                    if phase.mix[r] == "o":
                        assert source[2] == min(len(target), recipe.opening_rows * tr.TASK.row_tokens)
                elif source[0] == "copy":  # <|query|> seq<|answer|> seq<|endoftext|>, the second seq trained on
                    length = (len(tokens) - 3) // 2
                    seq = tokens[1 : 1 + length]
                    assert tokens == [data.query_id, *seq, data.lookup.answer, *seq, tok.eos_token_id]
                    assert kinds[length + 2 :] == [tr.RETRIEVAL] * (length + 1) and set(kinds[1 : length + 2]) == {0}
                elif source[0] == "recall":  # facts, the queried keys, then exactly the queried facts, trained on
                    cut = tokens.index(data.lookup.answer) + 1
                    facts, query, target = tokens[: tokens.index(data.query_id)], tokens[:cut], tokens[cut:]
                    written = tok.decode(target[:-1]).split(RT.KEY)[1:]
                    assert 1 <= len(written) <= facts.count(data.key_id) <= phase.facts
                    assert all(RT.KEY + w in tok.decode(facts) for w in written) and target[-1] == tok.eos_token_id
                    assert set(kinds[1:cut]) == {tr.NO_LOSS} and kinds[cut:] == [tr.RETRIEVAL] * len(target)
                    # the query is <|query|>, one key per written fact, <|answer|>
                    assert len(query) - len(facts) - 2 == len(written)
                else:
                    context, seed, index = source[1:]
                    assert seed in RT.TRAIN_SEEDS
                    item = RT.make_item(
                        tok,
                        context,
                        seed,
                        index,
                        chains=phase.chains,
                        max_queries=phase.queries,
                        tokens_per_fact=phase.tokens_per_fact,
                    )
                    prompt, target = data.encode_item(item)
                    assert tokens == prompt + target and item.split == "train" and context in phase.retrieval
                    assert kinds[len(prompt) :] == [tr.RETRIEVAL] * len(target)
                    assert tr.CODE in kinds and set(kinds[prompt.index(data.query_id) : len(prompt)]) == {tr.NO_LOSS}
                    key_at = prompt.index(data.key_id)
                    assert kinds[key_at] == tr.NO_LOSS and off == sorted(off)
                    assert off[-1] + len(tokens) <= max(phase.span, len(tokens))
                seen.add(phase.mix[r] if source[0] != "code" else "code")
    assert seen == {"code", "r", "o", "k", "y", "a"}


class _NextToken(torch.nn.Module):
    """A stand-in model for the probes: its argmax is the document's own next token, passed through ``rewrite(ids,
    next_ids)`` (a model that misses some kind of token)."""

    def __init__(self, rewrite=None) -> None:
        super().__init__()
        self.rewrite = rewrite

    def forward(self, input_ids):
        ids = input_ids[0]
        nxt = torch.cat([ids[1:], ids[:1]])
        nxt = nxt if self.rewrite is None else self.rewrite(ids, nxt)
        return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, 4096).float()[None]})()


def test_recall_probe_tells_key_match_from_digit_copying():
    # A model that writes every value digit but the first scores high on value digits and 0 on the key match.
    tr = _train_reference()
    docs = tr.LookupDocs(AutoTokenizer.from_pretrained(reference_models.path("gqa")), max_facts=8)

    def miss_first_digit(ids, nxt):
        after_value = torch.cat([ids[:-1] == docs.value, torch.tensor([False])])
        return torch.where(after_value, torch.where(nxt == docs.digits[0], docs.digits[1], docs.digits[0]), nxt)

    assert tr.recall_accuracy(_NextToken(), docs, 4, documents=5) == {"value_acc": 1.0, "key_acc": 1.0}
    copier = tr.recall_accuracy(_NextToken(miss_first_digit), docs, 4, documents=5)
    assert copier["key_acc"] == 0.0 and copier["value_acc"] == 0.75  # four digits a value, the first one missed


def test_pilot_bridge_drops_the_separator_from_a_share_of_training_documents():
    # pilot_lookup --without-separator-share: that share of training recall documents has no <|value|>; the probe's
    # documents (``recall``) keep the task's format.
    import random

    pilot = _benchmark_module("pilot_lookup")
    tok = AutoTokenizer.from_pretrained(reference_models.path("gqa"))
    every, half = pilot.Docs(tok, 4, without_separator=1.0), pilot.Docs(tok, 4, without_separator=0.5)
    rng = random.Random(0)
    assert all(every.value not in every.document("recall", rng)[0] for _ in range(20))
    assert every.separator and every.value in every.recall(rng, 2)[0]
    with_value = sum(half.value in half.document("recall", rng)[0] for _ in range(200))
    assert 70 < with_value < 130


def test_gated_phase_ends_at_its_monitor_and_resumes_so(tmp_path, monkeypatch):
    # A phase with ``until`` ends at the first monitor point that meets it; the steps it ran are in the state, so a
    # resumed run keeps that schedule (and refuses a gate it does not know).
    tr = _train_reference()
    warm, main, anneal = tr.SMOKE.phases
    gated = dataclasses.replace(tr.SMOKE, phases=(dataclasses.replace(warm, until=("tf_acc_cell", 0.0)), main, anneal))
    assert gated.ended_early({"warm": 1}).steps == 5 and gated.ended_early({}) == gated
    with pytest.raises(ValueError, match="no gated phase named \\['main'\\]"):
        gated.ended_early({"main": 1})
    monkeypatch.setitem(tr.RECIPES, "smoke", gated)

    def args(run: str) -> list[str]:
        out = ["gqa", "--smoke", "--eval-items", "0", "--eval-contexts", "", "--eval-code-window", "0"]
        out += ["--monitor-every", "1", "--monitor-items", "2", "--monitor-contexts", "640"]
        return out + ["--run-dir", str(tmp_path / run), "--out-dir", str(tmp_path / run / "ckpt")]

    metrics = tr.main(args("met"))
    assert [h["phase"] for h in metrics["history"]] == ["warm", "main", "main", "anneal", "anneal"]
    assert metrics["steps_done"] == 5
    assert all(0 <= h[f"recall_8_{m}"] <= 1 for h in metrics["history"] for m in ("value_acc", "key_acc"))
    assert torch.load(tmp_path / "met" / "state.pt", weights_only=False)["ended_early"] == {"warm": 1}
    assert tr.main(args("met") + ["--resume"])["history"] == metrics["history"]
    # a gate that is never met leaves the phase its full length
    never = dataclasses.replace(gated, phases=(dataclasses.replace(warm, until=("tf_acc_cell", 2.0)), main, anneal))
    monkeypatch.setitem(tr.RECIPES, "smoke", never)
    assert tr.main(args("never"))["steps_done"] == 6
    unknown = dataclasses.replace(gated, phases=(dataclasses.replace(warm, until=("nonsense", 0.0)), main, anneal))
    monkeypatch.setitem(tr.RECIPES, "smoke", unknown)
    with pytest.raises(ValueError, match="'nonsense', which the monitor does not measure"):
        tr.main(args("unknown"))


def test_deadline_stops_training_and_init_from_a_checkpoint_dir(tmp_path):
    # --deadline-minutes cuts the run where it stands and still writes and evaluates the checkpoint (the results say
    # so); --init takes that checkpoint directory and starts from its weights
    tr = _train_reference()
    base = ["gqa", "--smoke", "--eval-items", "0", "--eval-contexts", "", "--monitor-every", "0"]
    cut = tr.main(base + ["--run-dir", str(tmp_path / "cut"), "--deadline-minutes", "0"])
    assert cut["steps_done"] == 0 and cut["stopped_at_deadline"] and cut["history"] == []
    assert cut["held_out_code"]["tokens_scored"] > 0 and cut["environment"]["device"] == "cpu"
    ckpt = tmp_path / "cut" / "model"
    again = tr.main(base + ["--run-dir", str(tmp_path / "again"), "--init", str(ckpt), "--deadline-minutes", "0"])
    assert again["held_out_code"]["nll_per_token"] == pytest.approx(cut["held_out_code"]["nll_per_token"], rel=1e-6)
    full = tr.main(base + ["--run-dir", str(tmp_path / "full"), "--init", str(ckpt), "--eval-code-window", "0"])
    assert full["steps_done"] == tr.SMOKE.steps and not full["stopped_at_deadline"]


def test_v7_gates_are_measured_and_capped():
    # v7 is v6's shapes and v5's phases; its lookup phases end on monitor keys that train_reference measures
    tr = _train_reference()
    assert [p.name for p in tr.V7.phases] == [p.name for p in tr.V5.phases]
    assert {k: v for k, v in dataclasses.asdict(tr.V7).items() if k != "phases"} == {
        k: v for k, v in dataclasses.asdict(tr.V6).items() if k != "phases"
    }
    gated = {p.name: p.until for p in tr.V7.phases if p.until is not None}
    assert gated == {
        "recall4": ("recall_4_key_acc", 0.95),
        "recall16": ("recall_8_key_acc", 0.95),
        "main": ("retrieval_4096_tf_all", 1.0),
    }
    for new, old in zip(tr.V7.phases, tr.V5.phases):
        assert new.steps >= old.steps and new.context == old.context and new.mix == old.mix


def test_v8_is_v7_with_v5s_recall16():
    # the A/B of the next GPU run: v8 changes one phase of v7, v8-main450 one more
    tr = _train_reference()
    changed = [n.name for n, o in zip(tr.V8.phases, tr.V7.phases) if n != o]
    assert changed == ["recall16"] and tr.V8.phases[3] == tr.V5.phases[3] and tr.V8.phases[3].until is None
    changed = [(n.name, n.steps) for n, o in zip(tr.V8_MAIN450.phases, tr.V8.phases) if n != o]
    assert changed == [("main", tr.V5.phases[5].steps)]
    assert tr.RECIPES["v8"] is tr.V8 and tr.RECIPES["v8-main450"] is tr.V8_MAIN450


def test_chain_recall_documents_link_word_values_to_the_next_key():
    # word_values: a fact's value is the next fact's key word, a chain ends on a training number, the target writes
    # each queried chain hop by hop (the retrieval task's answer); without it no value is a word.
    import random

    from kvarn_mla.evaluation import retrieval

    tr = _train_reference()
    docs = tr.LookupDocs(AutoTokenizer.from_pretrained(reference_models.path("gqa")), max_facts=8)
    rng, word_hops, number_hops = random.Random(0), 0, 0
    for _ in range(50):
        ids, mask = docs.recall(rng, 8, word_values=0.5)
        prompt, target = ids[: mask.index(1)], ids[mask.index(1) :]
        assert set(mask[len(prompt) :]) == {1} and target[-1] == docs.eos
        facts = {}  # key word -> value tokens, as the prompt defines them
        for at in (i for i, t in enumerate(prompt) if t == docs.key):
            end = next((j for j in range(at + 1, len(prompt)) if prompt[j] in (docs.key, docs.query)), len(prompt))
            assert prompt[at + 2] == docs.value and prompt[at + 1] not in facts
            facts[prompt[at + 1]] = prompt[at + 3 : end]
        assert len(facts) == 8
        heads = prompt[prompt.index(docs.query) + 1 : prompt.index(docs.answer)]
        written = []
        for head in heads:
            key = head
            for _ in range(retrieval.MAX_HOPS):
                value = facts[key]
                if len(value) == 1:  # a word: the next key of the chain
                    assert value[0] in facts and value[0] in docs.words
                    written, key, word_hops = written + docs.fact(key, value[0]), value[0], word_hops + 1
                    continue
                number = "".join(str(docs.digits.index(d)) for d in value)
                assert len(number) == retrieval.VALUE_DIGITS and retrieval.value_split(number) == "train"
                written, number_hops = written + docs.fact(key, number), number_hops + 1
                break
            else:
                raise AssertionError(f"a chain from {head} is longer than {retrieval.MAX_HOPS} facts")
        assert written + [docs.eos] == target
    assert word_hops > 50 and number_hops > 50
    plain, _ = docs.recall(random.Random(0), 8)
    assert all(plain[i + 1] in docs.digits for i, t in enumerate(plain) if t == docs.value)


def test_chain_probe_tells_word_lookups_from_number_lookups():
    # A model that writes every token but a word value (the v7 MLA's one miss) reads 0 on words and 1 on numbers.
    tr = _train_reference()
    docs = tr.LookupDocs(AutoTokenizer.from_pretrained(reference_models.path("gqa")), max_facts=8)
    words = torch.tensor(docs.words)

    def miss_word_values(ids, nxt):
        word_next = torch.cat([ids[:-1] == docs.value, torch.tensor([False])]) & torch.isin(nxt, words)
        return torch.where(word_next, docs.digits[0], nxt)

    assert tr.chain_accuracy(_NextToken(), docs, 8, documents=5) == {"word_acc": 1.0, "number_acc": 1.0}
    assert tr.chain_accuracy(_NextToken(miss_word_values), docs, 8, documents=5) == {"word_acc": 0.0, "number_acc": 1.0}


def test_words_leg_trains_chain_recall_until_word_lookups_form():
    # the v7 MLA's leg: chain recall rows gated on the chain probe, then v7's later phases with chain rows
    tr = _train_reference()
    words, main, long4k, anneal = tr.WORDS.phases
    assert words.until == ("chain_8_word_acc", 0.95) and words.word_values > 0 and "a" in words.mix
    assert main.word_values > 0 and "a" in main.mix and main.until == tr.V7.phases[5].until
    assert (long4k.name, anneal.name) == ("long4k", "anneal") and tr.RECIPES["words"] is tr.WORDS
    assert all(p.word_values == 0 for recipe in (tr.V7, tr.V8) for p in recipe.phases)


def test_words_settle_leg_takes_the_same_steps_on_every_model():
    # one recipe for the three: no gate may end a phase early on one architecture and not on another
    tr = _train_reference()
    chains, anneal = tr.WORDS_SETTLE.phases
    assert all(p.until is None for p in tr.WORDS_SETTLE.phases) and tr.RECIPES["words-settle"] is tr.WORDS_SETTLE
    assert chains.word_values > 0 and "a" in chains.mix and chains.lr < tr.WORDS.phases[1].lr
    assert anneal.context == 4096 and anneal.lr <= tr.WORDS.phases[3].lr


def test_training_script_smoke(tmp_path):
    train_reference = _train_reference()
    results = tmp_path / "mla.json"
    common = [
        "--smoke",
        "--eval-items",
        "2",
        "--eval-retrieval-items",
        "1",
        "--eval-contexts",
        "640",
        "--monitor-every",
        "0",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    metrics = train_reference.main(["mla", *common, "--out-dir", str(tmp_path / "ckpt"), "--results", str(results)])
    smoke = train_reference.SMOKE
    assert metrics["steps_done"] == smoke.steps == 6 and results.exists()
    assert [h["phase"] for h in metrics["history"]] == [p.name for p in smoke.phases for _ in range(p.steps)]
    assert [h["lr"] for h in metrics["history"]] == [smoke.lr_at(i) for i in range(6)]
    assert all({"loss_code", "loss_reasoning"} <= set(h) for h in metrics["history"])
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    # the checkpoint records the task version it was trained on, and the evaluation used it
    assert R.task_of(json.loads((tmp_path / "ckpt" / "config.json").read_text())) is train_reference.TASK is R.V2
    assert metrics["held_out_reasoning"]["task"] == R.V2.to_dict()
    code = metrics["held_out_code"]
    assert code["tokens_scored"] > 0 and code["own_unigram_entropy"] > 0
    assert code["nll_over_own_unigram_entropy"] == code["nll_per_token"] / code["own_unigram_entropy"]
    assert metrics["held_out_reasoning"]["n"] == 2 and metrics["held_out_retrieval"][0]["n"] == 1
    # Resuming from the saved state at the last step trains nothing more and gives the same history.
    again = train_reference.main(
        [
            "mla",
            *common,
            "--resume",
            "--out-dir",
            str(tmp_path / "ckpt2"),
            "--results",
            str(tmp_path / "again.json"),
            "--eval-code-window",
            "0",
            "--eval-contexts",
            "",
        ]
    )
    assert again["history"] == metrics["history"]
    # --eval-only merges new retrieval contexts into the results file.
    eval_args = [
        "mla",
        *common,
        "--eval-only",
        "--out-dir",
        str(tmp_path / "ckpt"),
        "--results",
        str(results),
        "--eval-items",
        "0",
        "--eval-code-window",
        "0",
        "--eval-contexts",
        "320",
    ]
    merged = train_reference.main(eval_args)
    assert [r["context"] for r in merged["held_out_retrieval"]] == [320, 640]
    # a result of task version 1 (recorded without a version) stays beside the same context's current one
    first = json.loads(results.read_text())
    first["held_out_retrieval"] = [
        {k: v for k, v in r.items() if k != "task_version"} for r in merged["held_out_retrieval"]
    ]
    (tmp_path / "v1.json").write_text(json.dumps(first))
    eval_640 = [str(tmp_path / "v1.json") if a == str(results) else "640" if a == "320" else a for a in eval_args]
    both = train_reference.main(eval_640)
    versions = [(r.get("task_version", 1), r["context"]) for r in both["held_out_retrieval"]]
    assert versions == [(1, 320), (1, 640), (train_reference.retrieval.VERSION, 640)]
    # --init starts from saved weights (here the run's last state; a fresh optimizer): no step, the same weights out.
    skip = ["--eval-items", "0", "--eval-retrieval-items", "0", "--eval-code-window", "0", "--max-steps", "0"]
    started = train_reference.main(
        ["mla", *common, *skip, "--init", str(tmp_path / "run" / "state.pt"), "--run-dir", str(tmp_path / "init")]
    )
    assert started["init"] == str(tmp_path / "run" / "state.pt") and started["steps_done"] == 0
    assert (tmp_path / "init" / "model" / "model.safetensors").read_bytes() == (
        tmp_path / "ckpt" / "model.safetensors"
    ).read_bytes()
    _ship_the_smoke_run(tmp_path, results)


def _ship_the_smoke_run(tmp_path, results):
    # ship.py installs a finished run: the checkpoint with the recipe's reasoning task recorded (also when the run's
    # checkpoint records none, as the version-2 runs' do not), the metrics next to it; refusals name the reason.
    sys.path.insert(0, str(REPO / "benchmarks" / "models"))
    try:
        import ship
    finally:
        sys.path.pop(0)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config[R.TASK_KEY]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    where = ["--run-dir", str(tmp_path), "--checkpoint", str(tmp_path / "ckpt"), "--run-results", str(results)]
    where += ["--package", str(tmp_path / "pkg"), "--results-dir", str(tmp_path / "res"), "--smoke"]
    assert ship.main(["mla", *where, "--contexts", "320,640", "--check"]) == 0 and not (tmp_path / "pkg").exists()
    assert ship.main(["mla", *where, "--contexts", "320,640"]) == 0
    installed = json.loads((tmp_path / "pkg" / "mla" / "config.json").read_text())
    assert R.task_of(installed) is R.V2 and installed["dtype"] == "bfloat16"
    shipped = json.loads((tmp_path / "res" / "mla.json").read_text())
    assert (
        shipped["held_out_reasoning"]["task"] == R.V2.to_dict()
        and shipped["history"] == json.loads(results.read_text())["history"]
    )
    assert shipped["checkpoint_bytes"] == sum(f.stat().st_size for f in (tmp_path / "pkg" / "mla").iterdir())
    assert ship.main(["mla", *where, "--contexts", "320,640,960", "--no-evaluate"]) == 1  # the missing one named
    # a run of a recipe this checkout does not have, or one that stopped early, is refused with the reason
    for change, reason in (
        ({"recipe": {"phases": []}}, "none of train_reference.py's"),
        ({"steps_done": 1}, "step 1"),
        ({"stopped_at_deadline": True}, "--deadline-minutes"),
    ):
        assert any(reason in p for p in ship.problems({**shipped, **change}, tmp_path / "ckpt", smoke=True))
    assert ship.recipe_of({"recipe": dataclasses.asdict(ship.T.LOOKUP)}) == "lookup"
    # a gated phase that ended early is its recipe's (the steps it ran are the run's); past its cap it is not
    v7 = ship.T.V7
    ran = v7.ended_early({"recall4": 100, "main": 600})
    assert (
        ship.recipe_of({"recipe": dataclasses.asdict(ran)}) == "v7" and ship._as_run(v7, ship.T.recipe_json(ran)) == ran
    )
    over = dataclasses.replace(
        v7, phases=(*v7.phases[:2], dataclasses.replace(v7.phases[2], steps=5000), *v7.phases[3:])
    )
    assert ship.recipe_of({"recipe": dataclasses.asdict(over)}) is None
    assert ship.main(["mla", *where, "--contexts", "320,640,960", "--items", "1"]) == 0  # ... or run on the install
    evaluated = json.loads((tmp_path / "res" / "mla.json").read_text())
    assert [r["context"] for r in evaluated["held_out_retrieval"]] == [320, 640, 960]
    assert evaluated["held_out_reasoning"] == shipped["held_out_reasoning"]  # the run's, kept
    partial = json.loads(results.read_text()) | {"steps_done": 3}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    assert ship.main(["mla", *where, "--run-results", str(tmp_path / "partial.json")]) == 2
    # a run stopped in its final evaluation: metrics from its last state, every evaluation named as missing
    stopped = [*where, "--run-dir", str(tmp_path / "run"), "--run-results", str(tmp_path / "none.json")]
    assert ship.main(["mla", *stopped, "--contexts", "320", "--no-evaluate"]) == 1
    rebuilt = json.loads((tmp_path / "res" / "mla.json").read_text())
    assert rebuilt["history"] == shipped["history"] and rebuilt["steps_done"] == 6 and "held_out_code" not in rebuilt
    assert rebuilt["params"] == shipped["params"] and rebuilt["tokens_seen"] == shipped["tokens_seen"]
    (tmp_path / "res" / "mla.json").write_text(json.dumps(shipped))
    _summarize_the_shipped_run(tmp_path / "res")


def _summarize_the_shipped_run(results):
    # summarize.py --readme fills a template's table lines from the results and refuses placeholders left for prose
    sys.path.insert(0, str(REPO / "benchmarks" / "models"))
    try:
        import summarize
    finally:
        sys.path.pop(0)
    for name in ("gqa", "mha"):
        (results / f"{name}.json").write_text((results / "mla.json").read_text())
    runs = summarize.load_runs(results)
    page = summarize.fill("# Models\n\nTABLE_MODELS\n\n## Recipe\n\nRECIPE\n\nRESULTS\n", runs)
    assert page.startswith("# Models\n\n| model | class |") and "| warm | 2 | 3 x 640 |" in page
    assert "reasoning exact match" in page and "retrieval @ 320 tokens" in page and "RESULTS" not in page
    with pytest.raises(ValueError, match="placeholder: 'PILOTS'"):
        summarize.fill("RESULTS\n\nPILOTS\n", runs)
    with pytest.raises(ValueError, match="results missing: mha"):
        summarize.fill("RESULTS\n", {n: m for n, m in runs.items() if n != "mha"})
    subset = summarize.load_runs(results, ("gqa", "mha"))  # a bundle whose MLA is of another recipe
    assert list(subset) == ["gqa", "mha"]
    assert "| mla |" not in summarize.fill("TABLE_MODELS\n", subset, ("gqa", "mha"))
    v1 = json.loads((results / "mla.json").read_text())  # the bundled v1 MLA's metrics have no code or retrieval counts
    v1["tokens_seen"] = {"input_tokens": 1, "loss_tokens": 1, "reasoning_loss_tokens": 1}
    (results / "mla.json").write_text(json.dumps(v1))
    assert list(summarize.load_runs(results)) == ["gqa", "mha"]


def test_monitor_table_from_a_training_log():
    # summarize.py --monitor: the lookup loss is the mean of the retrieval group over the window up to a monitored step
    # (a resumed step counts once, as last logged); contexts not monitored in a log are "-"
    sys.path.insert(0, str(REPO / "benchmarks" / "models"))
    try:
        import summarize
    finally:
        sys.path.pop(0)
    step = (
        "[gqa] step {}/90 copy loss 1.0 (reasoning 0.5 code 4.0 retrieval {}) lr 1e-3 gn 0.5 1.0s (9 tok/s) train 1min"
    )
    mon = " | reasoning tf cell 0.512 all 0.062 | retrieval tf @1024 0.00/0.345/0.071 (9s)"
    log = [step.format(1, 9.0), step.format(2, 5.0), step.format(2, 3.0), step.format(3, 1.0) + mon]
    rows = summarize.monitor_rows(log, [1024, 4096], window=2)
    assert rows == [["gqa", "3", "copy", "2.00", "0.512 / 0.06", "0.34 / 0.07", "-", "-"]]
    assert summarize.monitor_rows(log, [1024], window=3)[0][3] == f"{(9 + 3 + 1) / 3:.2f}"
    # logs since the recall probe: its key match at 2 / 4 / 8 facts in the last column
    key = mon.replace(" (9s)", " | recall value/key 0.98/0.97 0.90/0.81 0.80/0.62 (9s)")
    assert summarize.monitor_rows([step.format(4, 1.0) + key], [1024])[0][-2:] == ["0.34 / 0.07", "0.97 / 0.81 / 0.62"]


def test_accumulation_texts_of_the_reasoning_task():
    from kvarn_mla.evaluation.tasks import reasoning_chain_prompt, reasoning_text

    path = reference_models.path("gqa")
    tok = AutoTokenizer.from_pretrained(path)
    task = R.task_of(json.loads((path / "config.json").read_text()))
    text = reasoning_text(tok, 1024, task=task)
    first = tok(R.make_item(0, task=task).text, add_special_tokens=False).input_ids
    assert text.shape == (1, 1024) and text[0, : len(first)].tolist() == first  # items back to back, in order
    prompt, target_tokens = reasoning_chain_prompt(tok, task=task)  # a chain of the task's most rows
    item = R.make_item(0, task=task, min_rows=task.max_rows, max_rows=task.max_rows)
    assert tok.decode(prompt[0]) == item.prompt
    # digits and the row break are single tokens; answer mark + digit
    assert target_tokens == task.max_rows * task.row_tokens + 1


def test_error_probe_places_every_target_token():
    sys.path.insert(0, str(REPO / "benchmarks" / "models"))
    try:
        from probe_errors import place
    finally:
        sys.path.pop(0)
    row = R.V2.row_tokens
    assert [place(i, 2, R.V2) for i in (0, 1, 2, row - 2, row - 1)] == [
        "first row counter",
        "first row counter",
        "first row cell",
        "first row cell",
        "first row break",
    ]
    assert place(row, 2, R.V2) == "later row counter" and place(2 * row - 1, 2, R.V2) == "later row break"  # answer
    assert place(2 * row, 2, R.V2) == place(2 * row + 1, 2, R.V2) == "answer / end of text"
    assert place(R.V1.row_tokens, 2, R.V1) == "later row counter"


def test_lookup_pilot_documents():
    # The pilot's recall documents are the retrieval task's facts (same text), its targets are exactly the queried
    # facts, it never uses a held-out value, and a step's batch is a pure function of the step.
    import random

    from kvarn_mla.evaluation import retrieval as RT

    P = _benchmark_module("pilot_lookup")
    _, tok = reference_models.load("gqa")
    docs = P.Docs(tok, max_facts=4)
    ids, mask = docs.recall(random.Random(0), 3)
    text = tok.decode(ids, skip_special_tokens=False)
    prompt, target = tok.decode(ids[: mask.index(1)]), tok.decode(ids[mask.index(1) :])
    facts = prompt.split(RT.QUERY)[0]
    parsed = [f.split(RT.VALUE) for f in facts.split(RT.KEY)[1:]]
    assert len(parsed) == 3 and facts == "".join(RT.fact_text(k.strip(), v) for k, v in parsed), text
    queried = prompt.split(RT.QUERY)[1].removesuffix(R.ANSWER).split()
    value = {k.strip(): v for k, v in parsed}
    assert target == "".join(RT.fact_text(k, value[k]) for k in queried) + tok.eos_token
    assert mask == sorted(mask) and all(RT.value_split(v) == "train" for v in value.values())
    bare = P.Docs(tok, max_facts=4, separator=False).recall(random.Random(0), 3)[0]
    assert docs.value not in bare and len(bare) == len(ids) - ids.count(docs.value) == len(ids) - 3 - len(queried)
    seq, m, doc = docs.batch("recall", 7, rows=2, context=256)
    assert seq.shape == m.shape == doc.shape == (2, 257)
    assert all(torch.equal(a, b) for a, b in zip((seq, m, doc), docs.batch("recall", 7, rows=2, context=256)))
    assert bool((doc[:, 1:] >= doc[:, :-1]).all()) and int(m.sum()) > 0
    with pytest.raises(ValueError, match="'recall', 'copy' or 'echo'"):
        docs.batch("lookup", 0, rows=1, context=256)
    with pytest.raises(ValueError, match="context=16"):
        P.Docs(tok, max_facts=8).batch("recall", 0, rows=1, context=16)
    # echo: every trained token but the end repeats the key word two before the digit it is predicted at; nothing
    # else is trained on
    ids, mask = docs.echo(random.Random(1))
    trained = [i for i, m in enumerate(mask) if m]
    assert trained[-1] == len(ids) - 1 and ids[-1] == tok.eos_token_id and len(ids) == 1 + 5 * (len(trained) - 1) + 1
    assert all(ids[i] == ids[i - 3] in docs.words and ids[i - 2] == docs.value for i in trained[:-1])
    assert all(ids[i - 1] in docs.digits and ids[i - 4] == docs.key for i in trained[:-1])
    mixed = {docs.document("recall+echo", random.Random(seed))[0][0] for seed in range(20)}
    assert mixed == {docs.key, docs.query}  # echo documents open with <|query|>, recall ones with a fact
    for flags in (["--freeze-layers", "0,4"], ["--echo-exit-layer", "3"]):  # the bundled GQA has layers 0..3
        with pytest.raises(SystemExit):
            P.main(["gqa", "--steps", "0", *flags])
    docs._code = torch.arange(1000)  # the code task's windows (the train split's stream; a stand-in here)
    seq, m, doc = docs.batch("code", 3, rows=2, context=16)
    assert seq.shape == (2, 17) and bool(m.all()) and not bool(doc.any())
    assert bool((seq[:, 1:] - seq[:, :-1] == 1).all())
    assert torch.equal(seq, docs.batch("code", 3, rows=2, context=16)[0])
    # the retrieval task: one training item of the real task a row, trained on exactly its answer and end of text
    seq, m, doc = docs.batch("retrieval", 5, rows=2, context=256)
    assert seq.shape == m.shape == (2, 257) and not bool(doc.any())
    assert torch.equal(seq, docs.batch("retrieval", 5, rows=2, context=256)[0])
    for row_ids, row_mask in zip(seq.tolist(), m.tolist()):
        start, end = row_mask.index(1), len(row_mask) - row_mask[::-1].index(1)
        assert sum(row_mask) == end - start and row_ids[start - 1] == tok.convert_tokens_to_ids(R.ANSWER)
        assert tok.decode(row_ids[start : end - 1]).startswith(RT.KEY) and row_ids[end - 1] == tok.eos_token_id
        assert RT.QUERY in tok.decode(row_ids[:start]) and len(tok.decode(row_ids[:start])) > 500  # code filler


def test_lookup_pilot_scratch_models_are_the_recipes():
    # A scratch pilot (--scratch --heads/--kv-heads/--rope-dim) builds the architecture the v5 recipe trains.
    tr = _train_reference()
    P = _benchmark_module("pilot_lookup")
    _, tok = reference_models.load("gqa")
    v5_pilots = {"gqa": dict(heads=8, kv_heads=2), "mha": dict(heads=8), "mla": dict(heads=8, rope_dim=64)}
    for name, kwargs in v5_pilots.items():
        assert P.scratch_config(name, tok, **kwargs).to_dict() == tr.build_config(name, tr.V5, tok).to_dict(), name
    assert P.scratch_config("gqa", tok, heads=8, kv_heads=4).num_key_value_heads == 4  # v5 GQA's 8 / 4 is 2 anyway
    with pytest.raises(SystemExit, match="--kv-heads is for the Llama models"):
        P.scratch_config("mla", tok, kv_heads=2)


def test_widening_the_mla_content_key_keeps_the_outputs():
    # The pilot's --widen-content-key: an MLA model widened from 32 to 64 content-key channels gives the same logits.
    tr = _train_reference()
    P = _benchmark_module("pilot_lookup")
    _, tok = reference_models.load("gqa")
    torch.manual_seed(0)
    model = tr.build_model(tr.build_config("mla", dataclasses.replace(tr.V5, num_layers=2), tok)).eval()
    wide = P.widen_content_key(model, 64).eval()
    assert (model.config.qk_nope_head_dim, wide.config.qk_nope_head_dim, wide.config.qk_head_dim) == (32, 64, 128)
    ids = torch.randint(0, len(tok), (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(wide(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(SystemExit, match="narrower"):
        P.widen_content_key(model, 16)


def test_a_state_continues_under_appended_phases_only():
    # --resume accepts a recipe that grew after the state's step (a new leg), never one whose steps so far changed.
    import dataclasses as dc

    tr = _train_reference()
    saved = json.loads(json.dumps(dc.asdict(tr.LOOKUP)))
    extra = tr.Phase("more", 10, 512, "rk", 1e-4, 1e-5)
    grown = dc.replace(tr.LOOKUP, phases=(*tr.LOOKUP.phases, extra))
    assert tr.same_schedule(saved, grown, tr.LOOKUP.steps) and tr.same_schedule(saved, tr.LOOKUP, 900)
    first, *rest = tr.LOOKUP.phases
    changed = dc.replace(tr.LOOKUP, phases=(dc.replace(first, lr=1e-3), *rest))
    assert not tr.same_schedule(saved, changed, 900) and not tr.same_schedule(saved, changed, 10)
    later = dc.replace(tr.LOOKUP, phases=(first, dc.replace(rest[0], mix="aaaaaarr"), *rest[1:]))
    assert tr.same_schedule(saved, later, first.steps) and not tr.same_schedule(saved, later, first.steps + 1)
    # a state written before a Phase field existed reads it as its default
    older = dict(saved, phases=[{k: v for k, v in p.items() if k != "rope_scaling"} for p in saved["phases"]])
    assert tr.same_schedule(older, grown, tr.LOOKUP.steps)
    # ... and so does a Recipe field (mla_rope_head_dim came after the v4 states), but a changed one refuses
    assert tr.same_schedule({k: v for k, v in saved.items() if k != "mla_rope_head_dim"}, tr.LOOKUP, 900)
    assert not tr.same_schedule(dict(saved, mla_rope_head_dim=64), tr.LOOKUP, 900)


def test_v5_architectures():
    # v5: 8 heads of 32; GQA keeps 4 query heads per key/value head (two groups), MLA's RoPE key stays 64 wide
    tr = _train_reference()
    _, tok = reference_models.load("gqa")
    gqa, mha, mla = (tr.build_config(n, tr.V5, tok) for n in ("gqa", "mha", "mla"))
    assert (gqa.num_attention_heads, gqa.num_key_value_heads, gqa.head_dim) == (8, 2, 32)
    assert (mha.num_attention_heads, mha.num_key_value_heads, mha.head_dim) == (8, 8, 32)
    assert (mla.num_attention_heads, mla.qk_nope_head_dim, mla.v_head_dim) == (8, 32, 32)
    assert (mla.qk_rope_head_dim, mla.kv_lora_rank) == (64, 128)
    assert tr.build_config("mla", tr.V4, tok).qk_rope_head_dim == 64  # None: a head's width, as v4 ran


def test_v6_widens_only_mla_content_key():
    # v6: MLA's content key 64 wide (twice a head); its cache (latent 128 + RoPE key 64) and the Llama models as v5
    tr = _train_reference()
    _, tok = reference_models.load("gqa")
    v5, v6 = (tr.build_config("mla", r, tok) for r in (tr.V5, tr.V6))
    assert (v6.qk_nope_head_dim, v6.qk_rope_head_dim, v6.v_head_dim) == (64, 64, 32)
    assert (v6.kv_lora_rank, v6.qk_rope_head_dim) == (v5.kv_lora_rank, v5.qk_rope_head_dim)
    for name in ("gqa", "mha"):
        assert tr.build_config(name, tr.V6, tok).to_dict() == tr.build_config(name, tr.V5, tok).to_dict()
    # a v5 state (saved before the field existed) does not continue under v6: the architecture differs
    saved = json.loads(json.dumps(tr.recipe_json(tr.V5)))
    saved.pop("mla_nope_head_dim")
    assert tr.same_schedule(saved, tr.V5, 2900) and not tr.same_schedule(saved, tr.V6, 2900)


def test_compare_legs_pairs_the_same_items(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "benchmarks" / "models"))
    try:
        import compare_legs
    finally:
        sys.path.pop(0)

    def record(right: list[int], seed: int = 20000) -> dict:
        items = [{"index": i, "exact": i in right} for i in range(10)]
        return {
            "held_out_reasoning": {"n": 4, "failed_indices": [0, 1]},
            "held_out_retrieval": [{"context": 2048, "seed": seed, "items": items}],
        }

    paths = {}
    for label, rec in {"a": record([0, 1]), "b": record([1, 2, 3, 4, 5, 6, 7, 8]), "c": record([1], seed=7)}.items():
        paths[label] = tmp_path / f"{label}.json"
        paths[label].write_text(json.dumps(rec))
    compare_legs.main([f"{k}={v}" for k, v in list(paths.items())[:2]])
    out = capsys.readouterr().out
    # b wins 7 items a lost and loses item 0: exact McNemar 2 * P[X <= 1], X ~ Bin(8, 1/2) = 18 / 256
    assert "| retrieval v1 @2048 (seed 20000) | 2/10 (0.06-0.51) | 8/10 (0.49-0.94); vs a +7 -1, p = 0.07 |" in out
    assert "vs a +0 -0, p = 1" in out  # reasoning: the same two items right
    compare_legs.main([f"{k}={v}" for k, v in paths.items()])
    assert "retrieval" not in capsys.readouterr().out  # another seed: other items, not paired


def test_error_probe_loads_a_state_of_its_own_architecture(tmp_path, capsys):
    # probe_errors --state builds the state's recipe's architecture (the v5 MLA is not the bundled MLA's shape) and
    # counts every target token of a retrieval item once, with the right first value tokens' probabilities.
    tr = _train_reference()
    probe = _benchmark_module("probe_errors")
    tok_dir = reference_models.path("gqa")
    _, tok = reference_models.load("gqa")
    torch.manual_seed(0)
    model = tr.build_model(tr.build_config("mla", tr.V5, tok))
    state = tmp_path / "state.pt"
    torch.save({"model": model.state_dict(), "recipe": tr.recipe_json(tr.V5), "step": 1}, state)
    threads = torch.get_num_threads()
    try:
        probe.main(["mla", "--state", str(state), "--tokenizer-dir", str(tok_dir), "--context", "512", "--items", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    from kvarn_mla.evaluation import retrieval

    item = retrieval.held_out_items(tok, 512, 20000, 1)[0]
    places = probe.retrieval_places(item)
    totals = [int(line.split(" / ")[1].replace(",", "")) for line in out.splitlines()[1:] if " / " in line]
    assert sum(totals) == len(places)
    p = float(out.split("right one ")[1].split()[0])
    assert 0.0 <= p < 0.5  # random weights: no lookup


def test_fact_attention_finds_the_shipped_gqa_lookup_head():
    # probe_errors --attention: the shipped v5 GQA looks the queried fact up with one head of its last layer (nearly
    # all of that head's weight on the fact's tokens); weights of random MLA attend nowhere in particular; the model's
    # attention implementation comes back as it was.
    tr = _train_reference()
    probe = _benchmark_module("probe_errors")
    model, tok = reference_models.load("gqa")
    implementation = model.config._attn_implementation
    mass, n = probe.fact_attention(model, tok, 2, 512, 30000)
    assert n == 2 and mass.shape == (model.config.num_hidden_layers, model.config.num_attention_heads)
    assert float(mass[-1].max()) > 0.9 and float(mass[:-1].max()) < 0.5
    assert model.config._attn_implementation == implementation
    torch.manual_seed(0)
    mla = tr.build_model(tr.build_config("mla", tr.V5, tok)).eval()
    mass, _ = probe.fact_attention(mla, tok, 1, 512, 30000)
    assert mass.shape == (4, 8) and float(mass.max()) < 0.2 and float(mass.min()) >= 0.0
    with pytest.raises(SystemExit):  # --attention without --context: an error naming the missing flag
        probe.main(["gqa", "--attention"])


def test_recall_circuit_finds_the_shipped_gqa_key_match():
    # probe_errors --recall: the shipped v5 GQA's last layer puts nearly all of a head's weight on the queried fact's
    # first digit and next to none on the other facts'; a layer-1 head carries each key word two positions on.
    probe = _benchmark_module("probe_errors")
    model, tok = reference_models.load("gqa")
    implementation = model.config._attn_implementation
    parts = probe.recall_circuit(model, tok, facts=4, documents=3)
    right, other = parts["lookup: right first digit"], parts["lookup: other first digits"]
    assert right.shape == (model.config.num_hidden_layers, model.config.num_attention_heads)
    assert float(right[-1].max()) > 0.9 and float(other[-1, right[-1].argmax()]) < 0.1
    assert float((right + other).max()) <= 1 + 1e-5 and float(parts["first digit -> key word"][1].max()) > 0.5
    back1, back2 = parts["any token -> 1 back"], parts["any token -> 2 back"]
    assert float((back1 + back2).max()) <= 1 + 1e-5 and float(back1[1].max()) > 0.5  # layer 1: previous-token heads
    assert model.config._attn_implementation == implementation


def test_probes_print_the_shipped_gqa_key_match_and_word_lookups(capsys):
    # probe_errors --probes: the monitor's recall and chain probes on a checkpoint; the shipped v5 GQA matches keys
    # and follows chains (93/100 at 8K), so both its number and its word lookups read high
    probe = _benchmark_module("probe_errors")
    probe.main(["gqa", "--probes"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 3 + 2 and lines[0].startswith("gqa:")
    read = {
        line.split(":")[0].strip(): [float(x.split()[-1]) for x in line.split(":")[1].split(",")] for line in lines[1:]
    }
    assert set(read) == {"recall, 2 facts", "recall, 4 facts", "recall, 8 facts", "chains, 4 facts", "chains, 8 facts"}
    assert all(0.9 <= acc <= 1 for accs in read.values() for acc in accs), read


@pytest.mark.parametrize(
    "model_type, overrides", [("llama", {}), ("deepseek_v3", {}), ("deepseek_v3", {"rope_interleave": False})]
)
def test_logit_parts_add_up_to_the_models_attention(tiny, model_type, overrides):
    # probe_errors --logits: the parts it splits a layer's logits into (MLA: content + RoPE) are the model's own logits:
    # their causal softmax is the attention the model computes (eager); the hooks are removed afterwards.
    probe = _benchmark_module("probe_errors")
    model = tiny(model_type, **overrides)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    captured, handles = [], []
    for layer in model.model.layers:
        handles.append(
            layer.self_attn.register_forward_pre_hook(
                lambda attention, args, kwargs: captured.append(
                    probe.logit_parts(attention, kwargs["hidden_states"], kwargs["position_embeddings"])
                ),
                with_kwargs=True,
            )
        )
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    for handle in handles:
        handle.remove()
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    for parts, attention in zip(captured, attentions, strict=True):
        assert set(parts) == ({"content", "rope", "total"} if model_type == "deepseek_v3" else {"total"})
        if model_type == "deepseek_v3":
            torch.testing.assert_close(parts["content"] + parts["rope"], parts["total"])
        weights = torch.softmax(parts["total"].masked_fill(~causal, float("-inf")), -1)
        torch.testing.assert_close(weights, attention[0], atol=1e-5, rtol=1e-4)


def test_fact_logits_single_out_the_fact_in_the_shipped_gqa_lookup_layer():
    probe = _benchmark_module("probe_errors")
    model, tok = reference_models.load("gqa")
    parts = probe.fact_logits(model, tok, 2, 512, 30000)
    assert set(parts) == {"total"}
    stats = parts["total"]
    assert stats["std"].shape == stats["z"].shape == (model.config.num_hidden_layers, model.config.num_attention_heads)
    last, below = float(stats["z"][-1].max()), float(stats["z"][:-1].max())
    assert last > 3.5 and last > below + 1.0  # the fact stands out most in the last layer's lookup heads
    assert not any(layer.self_attn._forward_pre_hooks for layer in model.model.layers)
    with pytest.raises(SystemExit):
        probe.main(["gqa", "--logits"])
