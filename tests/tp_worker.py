"""Run under ``torchrun --nproc-per-node N`` by `test_distributed.py`: each model loaded with ``tp_plan="auto"``
(gloo on CPU), patched, greedy-decoded; every rank writes what it generated and the bytes its cache holds."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import kvarn_mla

PROMPT_TOKENS, NEW_TOKENS = 300, 8


def run(model_dir: Path, preset: str, tensor_parallel: bool) -> dict:
    """Greedy tokens and per-process cache bytes of the patched model (tile 64, sink 64)."""
    kwargs = dict(tp_plan="auto") if tensor_parallel else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    kvarn_mla.patch(model, preset, tile_size=64, sink_tokens=64)
    ids = torch.randint(1, 128, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    return dict(tokens=out.sequences[0, PROMPT_TOKENS:].tolist(), nbytes=out.cache.nbytes())


if __name__ == "__main__":
    root, preset = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    results = {path.name: run(path, preset, tensor_parallel=True) for path in sorted(root.glob("model-*"))}
    (root / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
