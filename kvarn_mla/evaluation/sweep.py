"""The accuracy sweep behind the committed results: every reference model × method × bit width.

For each bundled reference model (MHA, GQA, MLA) it runs

- ``accumulation``: 2,048 tokens of held-out code in 128-token chunks, plus 1,024 tokens of free-running greedy
  decoding from its first 512 tokens;
- ``accumulation-reasoning``: the same protocol on 1,024 tokens of held-out reasoning items back to back (the
  models' reasoning length; their code distributions are near unigram, so the code run says little), and greedy
  decoding of a whole chain of the task's most rows (48 rows, 913 tokens, for the version-1 models);
- ``reasoning``: the first ``items`` held-out long-chain problems, greedy, exact match;
- ``worst-vectors``: the diagnostic on the reasoning text (896 cached tokens, 128 scored);

and, for the long-context (version-2) models:

- ``retrieval-N`` for N in `CONTEXTS`: ``long_items`` held-out retrieval items of N tokens from `SWEEP_SEED`,
  teacher-forced exact match (the greedy verdict; `tasks.teacher_forced_grid`, one prefill per item shared by the
  KVarN methods);
- ``reasoning-tf``: the first ``long_items`` held-out long-chain items, teacher-forced (the report bins them by
  scratchpad length; ``reasoning`` stays the greedy subset);
- ``accumulation-long``: the accumulation protocol on `LONG_TOKENS` tokens of held-out code, and
  ``accumulation-retrieval`` on one held-out retrieval item of `LONG_TOKENS` tokens written out (prompt and answer);

for KVarN, KIVI-style RTN and rotation-only at 2, 3 and 4 bits, transformers' quantized caches where they install,
and for MLA the latent-bits × RoPE-bits grid. Results land in ``OUT/{model}-{suite}.json`` (+ ``.jsonl`` records,
resumable for the same configuration only: see `kvarn_mla.evaluation.runner`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import QUANTIZERS
from . import reasoning
from .methods import backend_problem, parse_methods
from .runner import load_model, run
from .tasks import reasoning_chain_prompt, reasoning_items, reasoning_text, retrieval_items

BITS = (2, 3, 4)
CONTEXTS = (2048, 4096, 8192, 16384)  # retrieval contexts of the long-context suites
LONG_SUITES = (*(f"retrieval-{n}" for n in CONTEXTS), "reasoning-tf", "accumulation-long", "accumulation-retrieval")
SUITES = ("accumulation", "accumulation-reasoning", "reasoning", "worst-vectors", *LONG_SUITES)
REASONING_TOKENS = 1024  # the reasoning rows the reference models were trained on were at most this long
SWEEP_SEED = 20_261_130  # held-out retrieval seed of the sweep (outside retrieval.TRAIN_SEEDS; not a probe's seed)
LONG_TOKENS = 16384  # held-out code tokens of the accumulation-long suite


def quantizers(bits=BITS) -> list[str]:
    """Every quantizer of the method grammar (KVarN, KIVI-style, rotation-only, keys rotation-only + values KVarN)
    at each bit width."""
    return [f"{family}-{b}" for b in bits for family in QUANTIZERS]


def mla_grid(bits=BITS) -> list[str]:
    """MLA latent bits (``bits``) x RoPE-key bits (4, 8, 16); latent-b + RoPE 16 is ``kvarn-b`` itself."""
    return [f"kvarn-{latent}+rope_bits={rope}" for latent in bits for rope in (4, 8)]


def transformers_baselines(bits=BITS) -> tuple[list[str], dict[str, str]]:
    """transformers' own quantized caches that can run here (at ``bits`` among 2 and 4), and why the others cannot."""
    runnable, missing = ["hf-fp8"], {}
    for backend in ("quanto", "hqq"):
        problem = backend_problem(backend)
        if problem is None:
            runnable += [f"hf-{backend}-{b}" for b in bits if b in (2, 4)]
        else:
            missing[f"hf-{backend}"] = problem
    return runnable, missing


def retrieval_text(tokenizer, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids of one held-out retrieval item of ``tokens`` tokens (from `SWEEP_SEED`) written out: the
    prompt and its answer, cut to ``tokens``."""
    item = retrieval_items(tokenizer, tokens, SWEEP_SEED, 1)[0]
    ids = tokenizer(item.prompt + item.target, add_special_tokens=False).input_ids
    return torch.tensor([ids[:tokens]])


def select(names: list[str], families: tuple[str, ...] | None) -> list[str]:
    """The method names that start with one of ``families`` (all of them for ``None``); a family ending in ``$`` is
    a whole name (``kvarn-2$`` picks ``kvarn-2`` but not ``kvarn-2+rope_bits=4``)."""
    if families is None:
        return list(names)
    exact = {f[:-1] for f in families if f.endswith("$")}
    prefixes = tuple(f for f in families if not f.endswith("$"))
    return [n for n in names if n in exact or n.startswith(prefixes)]


def sweep(out: Path, models=("mla", "gqa", "mha"), items: int = 100, suites=SUITES, batch_size: int = 16,
          bits=BITS, compute: bool = True, families: tuple[str, ...] | None = None, long_items: int = 200,
          long_slice: slice | None = None) -> dict:
    """Run the sweep (resumable) and return ``{model: {suite: summary}}``.

    ``models`` are bundled names (``mla``, ``gqa``, ``mha``) or ``name=DIR`` for a checkpoint directory of that
    family (e.g. a training run's model before it is installed), whose results are filed under ``name``.

    ``bits`` restricts the bit widths (a time-boxed run can do 2 and 4 first; a later run with all three adds
    3 bits to the same files and redoes nothing). ``families`` restricts the methods to those whose name starts
    with one of them (``("hf-",)``: transformers' caches only), so two processes can share a model's sweep; the
    16-bit reference always runs. ``compute=False`` only rewrites the summaries from the records there (the
    tables of a run that was stopped). ``long_items``: items of each retrieval context and of ``reasoning-tf``
    (200: a 10-point paired difference is then usually significant, 100 often is not). ``long_slice``: score
    only these of them (one grid over several processes, each with its own ``out``, gathered by
    `runner.merge_records`; item ids do not depend on the slice).
    """
    out.mkdir(parents=True, exist_ok=True)
    baselines, missing = transformers_baselines(bits)
    results = {"_missing_baselines": missing}
    for spec in models:
        name, _, path = spec.partition("=")  # "gqa" (bundled) or "gqa=DIR" (a checkpoint of that family)
        model, tokenizer = load_model(path or name, torch.float32)
        grid = mla_grid(bits) if name == "mla" else []
        names = select(quantizers(bits) + grid + baselines, families)
        compared = parse_methods(",".join(names))
        worst = parse_methods(",".join(select(quantizers(bits), families)))
        # the long-context grids also score the published default, whose standing the report discusses (for MLA it
        # stores what kvarn-4 stores: the latent at 4 bits, the RoPE key at 16)
        long = compared + parse_methods(",".join(select(["k4v2"], families)))
        task = reasoning.task_of(model.config)  # the version the checkpoint was trained on
        text = reasoning_text(tokenizer, REASONING_TOKENS, task=task)
        chain, chain_tokens = reasoning_chain_prompt(tokenizer, task=task)
        arguments = {
            "accumulation": dict(suite="accumulation", methods=compared),
            "accumulation-reasoning": dict(suite="accumulation", methods=compared, text_ids=text,
                                           greedy_prompt=chain, greedy_tokens=chain_tokens),
            "reasoning": dict(suite="reasoning", methods=compared, items=reasoning_items(tokenizer, items, task=task),
                              batch_size=batch_size),
            "worst-vectors": dict(suite="worst-vectors", methods=worst, text_ids=text,
                                  context=REASONING_TOKENS - 128),
            "reasoning-tf": dict(suite="reasoning", methods=long, mode="teacher-forced",
                                 items=lambda: reasoning_items(tokenizer, long_items, task=task)),
            "accumulation-long": dict(suite="accumulation", methods=long, tokens=LONG_TOKENS),
            "accumulation-retrieval": dict(suite="accumulation", methods=long,
                                           text_ids=lambda: retrieval_text(tokenizer, LONG_TOKENS)),
            **{f"retrieval-{n}": dict(suite="retrieval", methods=long, mode="teacher-forced", batch_size=1,
                                      context=n, seed=SWEEP_SEED,
                                      items=lambda n=n: retrieval_items(tokenizer, n, SWEEP_SEED, long_items))
               for n in CONTEXTS},
        }
        results[name] = {}
        for suite in suites:
            if suite not in arguments:
                raise ValueError(f"unknown suite {suite!r}; allowed: {SUITES}")
            if not compute and not (out / f"{name}-{suite}.jsonl").exists():
                continue
            settings = dict(arguments[suite])
            for lazy in ("items", "text_ids"):  # made only for the suites that run (long retrieval items take time)
                if callable(settings.get(lazy)):
                    settings[lazy] = settings[lazy]()
            if long_slice is not None and settings.get("mode") == "teacher-forced":
                settings["items"] = settings["items"][long_slice]
            results[name][suite] = run(model, tokenizer, out=out / f"{name}-{suite}.json", compute=compute, **settings)
    return results
