"""`kvarn-mla lm-eval` offline: two local lm-eval tasks (generate_until, multiple_choice) over a JSONL file of
held-out code, on the bundled MLA model, 16-bit and k4v2; and the chunked scoring against token-by-token decoding.

Needs lm-evaluation-harness (``pip install ".[lm-eval]"``); skipped without it.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval", reason='lm-evaluation-harness is not installed: pip install ".[lm-eval]"')

from kvarn_mla import cli, patch, reference_models  # noqa: E402
from kvarn_mla.cache import KVarNCache  # noqa: E402
from kvarn_mla.evaluation.data import read_code_files  # noqa: E402
from kvarn_mla.evaluation.lm_harness import tile_chunks  # noqa: E402

PROMPT_CHARS = 1400  # ~400 tokens: past k4v2's sink + one tile (256 tokens), so some of the context is quantized
TASK_COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: '{{{{prompt}}}}'
target_delimiter: ''
"""
GEN_TASK = """task: kvarn_local_gen
output_type: generate_until
doc_to_target: '{{answer}}'
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""
MC_TASK = """task: kvarn_local_mc
output_type: multiple_choice
doc_to_choice: '{{choices}}'
doc_to_target: label
metric_list:
  - metric: acc
"""


def write_tasks(root, n: int = 4):
    """``n`` items of held-out code (the prompt, then its next line) and the two task YAMLs over them."""
    items = []
    for code in read_code_files("held_out"):
        lines = code.text.splitlines(keepends=True)
        cut = next((i for i in range(len(lines)) if len("".join(lines[: i + 1])) >= PROMPT_CHARS), None)
        rest = [line for line in lines[cut + 1:] if line.strip()] if cut is not None else []
        if rest:
            items.append({"prompt": "".join(lines[: cut + 1]), "answer": rest[0].rstrip("\n")})
        if len(items) == n:
            break
    for i, item in enumerate(items):  # multiple choice: the true next line or another file's
        item["choices"], item["label"] = [item["answer"], items[(i + 1) % n]["answer"]], 0
    data = root / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    common = TASK_COMMON.format(data=data)
    (root / "gen.yaml").write_text(GEN_TASK + common)
    (root / "mc.yaml").write_text(MC_TASK + common)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{preset: results JSON}`` of one CLI run per preset; lm-eval and datasets kept off the network."""
    root = tmp_path_factory.mktemp("lm_eval")
    write_tasks(root)
    results = {}
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                            "HF_DATASETS_CACHE": str(root / "datasets")}.items():
            env.setenv(name, value)
        for preset in ("none", "k4v2"):
            out = root / f"{preset}.json"
            status = cli.main(["lm-eval", "--model", "mla", "--preset", preset, "--tasks",
                               "kvarn_local_gen,kvarn_local_mc", "--include-path", str(root), "--limit", "2",
                               "--threads", "1", "--log-samples", "--out", str(out)])
            assert status == 0
            results[preset] = json.loads(out.read_text())
    return results


def test_tasks_report_their_metrics(runs):
    for preset, result in runs.items():
        assert result["results"]["kvarn_local_gen"]["exact_match,none"] in (0.0, 0.5, 1.0), preset
        assert result["results"]["kvarn_local_mc"]["acc,none"] in (0.0, 0.5, 1.0), preset
        assert result["kvarn"]["preset"] == preset


def test_patched_run_goes_through_the_kvarn_cache(runs):
    stats = runs["k4v2"]["kvarn"]
    assert stats["scored_calls"] > 0 and stats["generate_calls"] == 2
    assert 0 < stats["max_cache_nbytes"] < stats["max_cache_dense_nbytes"], stats
    assert runs["none"]["kvarn"]["scored_calls"] == 0 and runs["none"]["kvarn"]["config"] is None


def test_patched_scores_differ_from_16_bit(runs):
    """The contexts pass sink + one tile, so the continuations are scored against a quantized cache."""

    def loglikelihoods(result):
        return [float(resp[0][0]) for sample in result["samples"]["kvarn_local_mc"] for resp in sample["resps"]]

    reference, quantized = loglikelihoods(runs["none"]), loglikelihoods(runs["k4v2"])
    assert len(reference) == len(quantized) == 4
    assert reference != quantized
    assert max(abs(a - b) for a, b in zip(reference, quantized)) < 5.0, (reference, quantized)  # close, not broken


def test_tile_chunks():
    assert tile_chunks(100, 128, 128) == [(0, 100)]
    assert tile_chunks(256, 128, 128) == [(0, 256)]
    assert tile_chunks(300, 128, 128) == [(0, 256), (256, 300)]
    assert tile_chunks(200, 0, 64) == [(0, 64), (64, 128), (128, 192), (192, 200)]


def test_chunked_scoring_matches_token_by_token_decoding():
    """Chunks ending on tile boundaries leave each token the cache greedy decoding would: same logits."""
    torch.manual_seed(0)
    model, _ = reference_models.load("mla", dtype=torch.float32)
    patch(model, "k4v2", tile_size=64, sink_tokens=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 150))
    with torch.no_grad():
        cache = KVarNCache(model)
        chunked = torch.cat([model(ids[:, s:e], cache=cache, use_cache=True).logits
                             for s, e in tile_chunks(ids.shape[1], 0, 64)], 1)
        cache = KVarNCache(model)
        stepped = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits
                             for t in range(ids.shape[1])], 1)
        cache = KVarNCache(model)
        one_pass = model(ids, cache=cache, use_cache=True).logits  # a prefill attends in full precision
    torch.testing.assert_close(chunked, stepped, atol=2e-4, rtol=1e-4)
    assert (one_pass[:, 64:] - stepped[:, 64:]).abs().max() > 1e-3  # what plain HFLM scoring would miss
