"""The accuracy sweep behind the committed results: every reference model × method × bit width.

For each bundled reference model (MHA, GQA, MLA) it runs the accumulation suite (2,048 tokens of held-out code,
128-token chunks, plus 1,024 tokens of free-running greedy decoding), the reasoning suite (the first ``items``
held-out long-chain problems, greedy) and the worst-vectors diagnostic, for KVarN, KIVI-style RTN and
rotation-only at 2, 3 and 4 bits, transformers' quantized caches where they install, and for MLA the latent-bits
× RoPE-bits grid. Results land in ``OUT/{model}-{suite}.json`` (+ ``.jsonl`` records, resumable).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from .methods import parse_methods
from .runner import load_model, run
from .tasks import reasoning_items

BITS = (2, 3, 4)


def quantizers(bits=BITS) -> list[str]:
    """KVarN, KIVI-style and rotation-only at each bit width."""
    return [f"{family}-{b}" for b in bits for family in ("kvarn", "kivi", "rot")]


def mla_grid(bits=BITS) -> list[str]:
    """MLA latent bits (``bits``) x RoPE-key bits (4, 8, 16); latent-b + RoPE 16 is ``kvarn-b`` itself."""
    return [f"kvarn-{latent}+rope_bits={rope}" for latent in bits for rope in (4, 8)]


def transformers_baselines(bits=BITS) -> tuple[list[str], dict[str, str]]:
    """transformers' own quantized caches that can run here (at ``bits`` among 2 and 4), and why the others cannot."""
    runnable, missing = ["hf-fp8"], {}
    for backend, package in (("quanto", "optimum.quanto"), ("hqq", "hqq")):
        try:
            found = importlib.util.find_spec(package) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            runnable += [f"hf-{backend}-{b}" for b in bits if b in (2, 4)]
        else:
            missing[f"hf-{backend}"] = f"python package {package!r} is not installed"
    return runnable, missing


def sweep(out: Path, models=("mla", "gqa", "mha"), items: int = 100, suites=("accumulation", "reasoning",
          "worst-vectors"), batch_size: int = 16, bits=BITS) -> dict:
    """Run the sweep (resumable) and return ``{model: {suite: summary}}``.

    ``bits`` restricts the bit widths (a time-boxed run can do 2 and 4 first; a later run with all three adds
    3 bits to the same files and redoes nothing).
    """
    out.mkdir(parents=True, exist_ok=True)
    baselines, missing = transformers_baselines(bits)
    results = {"_missing_baselines": missing}
    for name in models:
        model, tokenizer = load_model(name, torch.float32)
        grid = mla_grid(bits) if name == "mla" else []
        methods = {
            "accumulation": parse_methods(",".join(quantizers(bits) + baselines + grid)),
            "reasoning": parse_methods(",".join(quantizers(bits) + baselines + grid)),
            "worst-vectors": parse_methods("kvarn-2,kivi-2,rot-2,kvarn-4,kivi-4"),
        }
        results[name] = {}
        for suite in suites:
            work = reasoning_items(tokenizer, items) if suite == "reasoning" else None
            results[name][suite] = run(model, tokenizer, methods[suite], suite, out / f"{name}-{suite}.json",
                                       items=work, batch_size=batch_size)
    return results
