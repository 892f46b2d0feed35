"""Patched vs unpatched logits for every supported model type and several presets (tiny random models).

For each model type a tiny model of the real transformers class is built from a config, a 256-token prompt is
prefilled and 32 tokens are decoded teacher-forced (tiles of 64, sink 64, so 3-4 tiles are quantized per stream).
Reported per preset: SQNR (dB) of the decode-step logits against the unpatched model, and top-1 agreement of those
logits. Random weights give near-uniform attention, so these numbers guard the plumbing and regressions; accuracy
on trained models is measured by the accuracy harness.

    python benchmarks/patched_vs_stock.py > benchmarks/results/patched_vs_stock.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import TINY_CONFIGS, WIDE_CONFIGS, build_model, build_wide, sqnr, teacher_forced_logits  # noqa: E402

import kvarn_mla  # noqa: E402

PRESETS = ("k8v8", "k4v4", "k4v2", "k4v2-r8", "k2v2", "kivi-k2v2", "rot-k2v2")
DSA = {"deepseek_v32", "glm_moe_dsa"}


def row(name: str, model, prompt: int = 256, decode: int = 32) -> str:
    ids = torch.randint(0, 128, (2, prompt + decode), generator=torch.Generator().manual_seed(1))
    reference = teacher_forced_logits(model, ids, prompt)[:, 1:]
    cells = []
    for preset in PRESETS:
        kvarn_mla.patch(model, preset, tile_size=64, sink_tokens=64)
        logits = teacher_forced_logits(model, ids, prompt)[:, 1:]
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
        cells.append(f"{sqnr(reference, logits):.1f} / {agree:.2f}")
    kvarn_mla.unpatch(model)
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    torch.set_num_threads(1)
    print("SQNR of decode logits vs unpatched (dB) / top-1 agreement; 256-token prompt + 32 teacher-forced steps, "
          "tile 64, sink 64. DSA models use an indexer top-k above the context length so selection cannot flip.")
    print("Written by `python benchmarks/patched_vs_stock.py`.\n")
    print("| model | " + " | ".join(PRESETS) + " |")
    print("|---|" + "---|" * len(PRESETS))
    for model_type in sorted(TINY_CONFIGS):
        overrides = dict(index_topk=2048) if model_type in DSA else {}
        print(row(model_type, build_model(model_type, **overrides)), flush=True)
    for name in WIDE_CONFIGS:
        print(row(name, build_wide(name), prompt=300, decode=24), flush=True)


if __name__ == "__main__":
    main()
