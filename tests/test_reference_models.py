"""Bundled reference checkpoints load offline and solve the reasoning task; the training script runs."""

import json
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
        assert cfg.kv_lora_rank == 4 * cfg.qk_nope_head_dim and cfg.qk_rope_head_dim * 2 == cfg.qk_nope_head_dim
    else:
        assert cfg.model_type == "llama"
        assert cfg.num_attention_heads // cfg.num_key_value_heads == (4 if name == "gqa" else 1)
    # Digits are single tokens and the format strings are special tokens.
    assert tok.tokenize("1234") == ["1", "2", "3", "4"]
    assert all(len(tok(s, add_special_tokens=False)["input_ids"]) == 1 for s in R.SPECIAL_TOKENS)
    # Teacher-forced greedy: the argmax at every target position is the reference token, which is what
    # greedy decoding needs to reproduce the whole scratchpad (one forward pass instead of ~600 steps).
    item = R.make_item(0, "held_out")
    prompt = tok(item.prompt, add_special_tokens=False)["input_ids"]
    target = tok(item.target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1]
    wrong = (logits.argmax(-1) != torch.tensor(target)).sum().item()
    assert wrong == 0, f"{name}: {wrong} of {len(target)} target tokens mispredicted"


def _train_reference():
    sys.path.insert(0, str(REPO / "benchmarks" / "models"))
    try:
        import train_reference
    finally:
        sys.path.pop(0)
    return train_reference


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


def test_openings_rows_are_item_prefixes_and_start_at_openings_from():
    # The openings phase packs the opening of each item (prompt + first rows) into every other row: each
    # document must be exactly a prefix of its item's tokens, the token after an opening (the next document's
    # first) no target, and steps before the phase keep whole items.
    tr = _train_reference()
    tok = AutoTokenizer.from_pretrained(reference_models.path("gqa"))
    recipe = tr.Recipe()
    data = tr.Data(tok, recipe, max_files=10)
    for step in (recipe.openings_from - 1, recipe.openings_from):
        ids, kind, doc = data.batch(step)
        for row in range(recipe.batch_rows):
            opening = step >= recipe.openings_from and row % 2 == 1
            first = (step * recipe.batch_rows + row) * 128
            for j in range(int(doc[row].max()) + 1):
                tokens = ids[row][doc[row] == j].tolist()
                if tokens[0] == tok.pad_token_id:
                    break  # the padding after the last item
                item = R.make_item(first + j, "train", min_rows=1, max_rows=recipe.train_max_rows)
                prompt, target = data.encode_item(item)
                want = prompt + (target[: recipe.opening_tokens] if opening else target)
                assert tokens == want, (step, row, j)
                if j > 0:
                    start = int((doc[row] == j).nonzero()[0])
                    assert int(kind[row, start]) == (tr.NO_LOSS if opening else tr.PROMPT), (step, row, j)


def test_training_script_smoke(tmp_path):
    train_reference = _train_reference()
    results = tmp_path / "mla.json"
    metrics = train_reference.main(
        [
            "mla",
            "--smoke",
            "--eval-items",
            "2",
            "--monitor-every",
            "0",
            "--out-dir",
            str(tmp_path / "ckpt"),
            "--results",
            str(results),
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    smoke = train_reference.SMOKE
    # task, task, mixed, polish, anneal, openings
    assert metrics["steps_done"] == smoke.steps == 6 and results.exists()
    assert [h["lr"] for h in metrics["history"][3:]] == [smoke.polish_lr, smoke.anneal_lr, smoke.openings_lr]
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    assert metrics["held_out_code"]["tokens_scored"] > 0 and metrics["held_out_reasoning"]["n"] == 2
    # Resuming from the saved state at the last step trains nothing more and gives the same weights.
    again = train_reference.main(
        [
            "mla",
            "--smoke",
            "--resume",
            "--eval-items",
            "1",
            "--monitor-every",
            "0",
            "--out-dir",
            str(tmp_path / "ckpt2"),
            "--results",
            str(tmp_path / "again.json"),
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert again["history"] == metrics["history"]


def test_accumulation_texts_of_the_reasoning_task():
    from kvarn_mla.evaluation.tasks import reasoning_chain_prompt, reasoning_text

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reference_models.path("gqa"))
    text = reasoning_text(tok, 1024)
    first = tok(R.make_item(0).text, add_special_tokens=False).input_ids
    assert text.shape == (1, 1024) and text[0, : len(first)].tolist() == first  # items back to back, in order
    prompt, target_tokens = reasoning_chain_prompt(tok, rows=48)
    item = R.make_item(0, min_rows=48, max_rows=48)
    assert tok.decode(prompt[0]) == item.prompt
    assert target_tokens == 48 * R.ROW_TOKENS + 1  # digits and the row break are single tokens; answer mark + digit


def test_error_probe_places_every_target_token():
    sys.path.insert(0, str(REPO / "benchmarks" / "models"))
    try:
        from probe_errors import place
    finally:
        sys.path.pop(0)
    row = R.ROW_TOKENS
    assert [place(i, 2) for i in (0, 1, 2, row - 2, row - 1)] == [
        "first row counter", "first row counter", "first row cell", "first row cell", "first row break"]
    assert place(row, 2) == "later row counter" and place(2 * row - 1, 2) == "later row break"  # <|answer|>
    assert place(2 * row, 2) == place(2 * row + 1, 2) == "answer / end of text"
