"""Tensor parallelism: patched greedy decoding under ``torchrun --nproc-per-node 2`` (transformers'
``tp_plan="auto"``, gloo on CPU) equals the single-process patched run token for token, and each rank's cache holds
half the bytes of a dense model (its kv heads) and all of an MLA model's (the latent is replicated)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import build_model

sys.path.insert(0, str(Path(__file__).parent))
from tp_worker import run  # noqa: E402

MODELS = ("llama", "qwen3", "deepseek_v2", "deepseek_v3")
DENSE = ("llama", "qwen3")

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with the gloo backend is not available in this torch build"),
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                       reason="transformers' tp_plan needs accelerate: pip install '.[distributed]'"),
]


def test_tensor_parallel_patched_generate_matches_single_process(tmp_path):
    for model_type in MODELS:
        build_model(model_type).save_pretrained(tmp_path / f"model-{model_type}")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).parent / "tp_worker.py"), str(tmp_path), "k8v8"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for model_type in MODELS:
        single = run(tmp_path / f"model-{model_type}", "k8v8", tensor_parallel=False)
        for rank in ranks:
            parallel = rank[f"model-{model_type}"]
            assert parallel["tokens"] == single["tokens"], model_type
            expected = single["nbytes"] // 2 if model_type in DENSE else single["nbytes"]
            assert parallel["nbytes"] == expected, (model_type, parallel["nbytes"], single["nbytes"])
