"""Train one of the project's reference models (MLA, GQA or MHA) on stdlib code, long-chain reasoning and
long-context retrieval.

The three models differ only in attention; tokenizer, data order, steps, schedule and seed are shared, so
any difference in their cache behaviour comes from the attention family. Everything is rebuilt from
what ships with Python (the stdlib sources), :mod:`kvarn_mla.evaluation.reasoning` and
:mod:`kvarn_mla.evaluation.retrieval`; nothing is downloaded.

Reproduce (see benchmarks/models/README.md for the measured numbers)::

    python benchmarks/models/train_reference.py mla --threads 1
    python benchmarks/models/train_reference.py gqa --threads 1
    python benchmarks/models/train_reference.py mha --threads 1

Each run writes the checkpoint (bf16 safetensors, config, tokenizer) to
``kvarn_mla/reference_models/<name>/``, metrics to ``benchmarks/models/results/<name>.json``, and its
log and resumable training state to ``runs/<name>/``. ``--smoke`` trains a tiny model for a few steps.

A leg from a bundled checkpoint runs another phase table on its weights (fresh optimizer) and writes everything into
``runs/<recipe>-<name>/`` (checkpoint in ``model/``, metrics in ``results.json``); ``ship.py`` installs it::

    python benchmarks/models/train_reference.py gqa --recipe lookup --init gqa --threads 1

The recipe is a table of phases (:class:`Phase`); every step of every phase holds code (code rows, code
filler of the retrieval items, and code topping up the reasoning rows). Training runs in float32: this CPU
(AVX2, no AVX-512) has no native bf16 matmul, and bf16 autocast measured 14x slower than float32
(86 against 1,192 tokens/s at 2,048 tokens, one thread, eager; 77 tokens/s compiled).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    AttentionMaskInterface,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.masking_utils import sdpa_mask  # noqa: E402

from kvarn_mla import reference_models, use_padded_sdpa  # noqa: E402
from kvarn_mla.adapters.base import PADDED_SDPA, padded_sdpa_attention  # noqa: E402
from kvarn_mla.evaluation import reasoning, retrieval  # noqa: E402
from kvarn_mla.evaluation.data import corpus_info, read_code_files  # noqa: E402

MODEL_NAMES = ("mla", "gqa", "mha")
DEFAULT_TOKENIZER_DIR = REPO / "runs" / "tokenizer"
DEFAULT_OUT_ROOT = REPO / "kvarn_mla" / "reference_models"
DEFAULT_RESULTS = REPO / "benchmarks" / "models" / "results"
DEFAULT_RUNS = REPO / "runs"
# Kind of each target token in a training row: no loss, a reasoning target, code (code rows, the filler of a
# retrieval item, the code topping up a reasoning row), a reasoning prompt, a retrieval target.
NO_LOSS, REASONING, CODE, PROMPT, RETRIEVAL = 0, 1, 2, 3, 4
KIND_NAMES = {REASONING: "reasoning", CODE: "code", PROMPT: "prompt", RETRIEVAL: "retrieval"}
MONITOR_START = 100_000  # monitoring evals use held-out reasoning items from here, disjoint from the reported set
MONITOR_SEED = 10_000  # retrieval monitoring seed (held out); the reported evaluations use other seeds
EVAL_SEED = 20_000  # retrieval seed of the final evaluation (held out)
TASK = reasoning.V2  # the reasoning task's version (row width, held-out rows) trained on; recorded in the checkpoint
LONG_SCRATCHPAD = 2000  # generated tokens that make a reasoning item "long" in the reports
ROW_KINDS = {
    "r": "reasoning items topped up with code",
    "o": "reasoning openings",
    "c": "one code window",
    "k": "retrieval items",
    "y": "copy documents (the induction task: a random sequence, then the same sequence as the target)",
    "a": "associative recall documents (facts only, no filler; at most Phase.facts facts)",
}


# Retrieval density of a phase that sets none: the held-out items' as these recipes were first run (up to four queries
# an item; held-out items ask one since 2026-12-02, see the retrieval module), so the committed recipes keep their data
_HELD_OUT_DENSITY = ((retrieval.MIN_CHAINS, retrieval.MAX_CHAINS), 4, retrieval.TOKENS_PER_FACT)


@dataclass(frozen=True)
class Phase:
    """A stretch of training steps with one row layout and one learning-rate curve.

    Attributes:
        name: label in logs and results.
        steps: optimizer steps in the phase.
        context: tokens per row.
        mix: one letter per row of a step (its length is the rows per step): ``r`` packs whole reasoning items
            of 1..``max_rows`` rows and tops the row up with code, ``o`` packs item openings (the prompt and the
            first ``opening_rows`` rows) and tops up with code, ``c`` is one window of the code stream, ``k``
            packs retrieval items (training seeds) of the lengths in ``retrieval`` and tops up with code, ``y`` and
            ``a`` pack copy and recall documents (:class:`LookupDocs`) and top up with code.
        lr: peak learning rate; ``final_lr``: the cosine's end (equal to ``lr``: constant after the warm-up).
        warmup: linear warm-up steps at the start of the phase.
        max_rows: most generated rows of a packed reasoning item.
        retrieval: retrieval item lengths in tokens, drawn uniformly per item (each at most ``context``).
        span: position interpolation by skipped positions (as PoSE): a retrieval item's position ids are
            spread over up to ``span`` positions by one or two random jumps (0: contiguous positions).
        weights: weights of the reasoning, code and retrieval groups in the loss (see :func:`training_loss`).
        chains, queries, tokens_per_fact: density of the retrieval items (see :func:`retrieval.make_item`; the
            default is the held-out items' as the first recipes were run, a drill packs more lookups into an item).
        rope_theta: RoPE base from this phase on (None: the previous phase's), for length extension by raising it.
        rope_scaling: ``(factor, original_context)`` from this phase on (None: the previous phase's): transformers'
            ``llama3`` RoPE, which keeps the frequencies of wavelengths up to a quarter of ``original_context``,
            slows those beyond ``original_context`` ``factor`` times and blends between; short-range position
            heads (the reasoning lookup) keep their angles while the slow pairs stop turning over long distances.
        facts: most facts in a recall document (``a`` rows), drawn uniformly from 1.
        word_values: chain recall documents (``a`` rows): the chance that a fact's value is the next fact's key
            (:meth:`LookupDocs.recall`; 0: numbers only, as every recipe before `words`).
        until: ``(monitor key, threshold)``: ``steps`` is then a cap and the phase ends at the first monitor point in
            it whose record has ``key >= threshold`` (the v5 lookup phases ended by count, MHA's before its lookup
            had formed). The steps a gated phase ran are kept in the training state, so a resumed run has them too.
    """

    name: str
    steps: int
    context: int
    mix: str
    lr: float
    final_lr: float
    warmup: int = 0
    max_rows: int = TASK.max_rows
    retrieval: tuple[int, ...] = (512,)
    span: int = 0
    weights: tuple[float, float, float] = (1.0, 1.0, 1.0)  # loss weight of reasoning, code, retrieval (per kind)
    chains: tuple[int, int] = _HELD_OUT_DENSITY[0]  # (the field ``retrieval`` shadows the module in this body)
    queries: int = _HELD_OUT_DENSITY[1]
    tokens_per_fact: int = _HELD_OUT_DENSITY[2]
    rope_theta: float | None = None
    facts: int = 16
    word_values: float = 0.0
    rope_scaling: tuple[float, int] | None = None
    until: tuple[str, float] | None = None

    @property
    def rows(self) -> int:
        return len(self.mix)


def rope_at(r: "Recipe", step: int) -> dict[str, object]:
    """The model's ``rope_parameters`` at optimizer step ``step``: the RoPE base and scaling of the last phase up to it
    that sets one (else the recipe's base, unscaled)."""
    theta, scaling, done = r.rope_theta, None, 0
    for p in r.phases:
        if done > step:
            break
        theta = p.rope_theta if p.rope_theta is not None else theta
        scaling = p.rope_scaling if p.rope_scaling is not None else scaling
        done += p.steps
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    factor, original_context = scaling
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": float(factor),
        "original_max_position_embeddings": int(original_context),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s weights (the CPU for a module without any, such as a test's stand-in)."""
    return next(model.parameters(), torch.empty(0)).device


def set_rope(model: PreTrainedModel, rope_parameters: dict[str, object]) -> None:
    """Give ``model`` these RoPE parameters (config and the rotary embedding's frequencies)."""
    if model.config.rope_parameters != rope_parameters:
        model.config.rope_parameters = dict(rope_parameters)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(model_device(model))


@dataclass(frozen=True)
class Recipe:
    """Everything that defines a training run (shared by the three models)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4  # head_dim = hidden_size / num_heads; GQA has num_heads / 4 key/value heads
    mla_rope_head_dim: int | None = None  # MLA's shared RoPE key (None: a head's width); the first MLA model's,
    #   16 wide with 8 heads, never learned the reasoning lookup, a 32-wide one stalled it (v2), 64 formed it (v3)
    mla_nope_head_dim: int | None = None  # MLA's content (no-RoPE) key per head (None: a head's width); the value
    #   and the latent stay a head's width and 4 x it, so the cache is the same size whatever this is
    intermediate_size: int = 768
    rope_theta: float = 10_000.0  # RoPE base of the short phases (a phase may raise it, see Phase.rope_theta)
    max_positions: int = 16384
    phases: tuple[Phase, ...] = field(default_factory=tuple)
    opening_rows: int = 2  # rows of an item kept in an openings row
    loss_per_kind: bool = True  # the loss is the mean over kinds of each kind's mean token loss, so the few
    #   retrieval target tokens of a row weigh as much as its code
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    doc_mask: bool = True  # packed documents attend only to themselves and restart their positions at 0

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def ended_early(self, ran: dict[str, int]) -> "Recipe":
        """This recipe with the gated phases named in ``ran`` cut to the steps they ran (``{phase name: steps}``)."""
        unknown = set(ran) - {p.name for p in self.phases if p.until is not None}
        if unknown:
            raise ValueError(
                f"no gated phase named {sorted(unknown)}; gated: {[p.name for p in self.phases if p.until is not None]}"
            )
        return replace(self, phases=tuple(replace(p, steps=ran.get(p.name, p.steps)) for p in self.phases))

    def phase_at(self, step: int) -> tuple[Phase, int]:
        """The phase of optimizer step ``step`` (0-based) and the step's index within it."""
        for p in self.phases:
            if step < p.steps:
                return p, step
            step -= p.steps
        raise ValueError(f"step beyond the recipe's {self.steps} steps")

    def lr_at(self, step: int) -> float:
        """Linear warm-up to the phase's ``lr``, then a cosine to its ``final_lr`` at its last step."""
        p, i = self.phase_at(step)
        if i < p.warmup:
            return p.lr * (i + 1) / p.warmup
        t = (i - p.warmup) / max(1, p.steps - 1 - p.warmup)
        return p.final_lr + (p.lr - p.final_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


FULL = Recipe(
    phases=(
        # The fixed-offset lookup of the reasoning task forms first (~150-300 steps): reasoning rows, code top-up at a
        # tenth of the weight (pilots: with retrieval rows at equal weight, or a RoPE base of 1e5 or 5e5, the MLA
        # model had not formed it after 350-400 steps)
        Phase("warm", 300, 512, "rrrr", 2e-3, 2e-3, warmup=50, max_rows=16, weights=(1.0, 0.1, 1.0)),
        # then a retrieval drill: dense items (12-20 chains, up to 16 queries); pilots at the default density learned
        # no lookup in 300-375 steps (only the format tokens), a few dozen lookups a step being too few
        Phase(
            "drill",
            300,
            1024,
            "rkkk",
            2e-3,
            2e-3,
            max_rows=40,
            retrieval=(1024,),
            weights=(1.0, 0.3, 1.0),
            chains=(12, 20),
            queries=16,
            tokens_per_fact=32,
        ),
        Phase("main", 450, 2560, "rk", 1.5e-3, 2e-4, max_rows=99, retrieval=(1024, 1536, 2560)),
        # No length-extension phase: both variants tried broke the reasoning lookup, which needs every cell right. From
        # GQA's step-1050 state (held-out cell accuracy 1.000, 8/8 items of up to 96 rows whole): 60 steps of 8,192-
        # token code + retrieval rows at a RoPE base raised to 2e5, a 60-step reasoning re-warm and 200 anneal steps
        # ended at greedy exact match 0/100; at the unchanged base, 30 such steps gave cell 0.987 and 0/8 whole. The
        # model already holds code at 16K tokens at base 1e4 (NLL 5.65 on 8K, 5.51 on 16K tokens of held-out code at
        # step 1050; 30 long steps: 5.62 / 5.46), and the anneal's retrieval items still reach 16,384 positions by
        # position skips. So the anneal trains the main phase's rows at a falling learning rate.
        Phase("anneal", 200, 2560, "rk", 2e-4, 2e-5, max_rows=99, retrieval=(1024, 2560), span=16384),
    )
)

# A fine-tune leg from a bundled v2 checkpoint (GQA, MHA: same shapes and RoPE base as FULL), which reasons but never
# formed the content lookup retrieval needs. The lookup pilots (README, "Why no model retrieves") formed it with copy
# documents first (recall alone sat near chance for 2,500 steps), then recall with up to 16 facts at a lower rate;
# here reasoning and code rows ride along so the model keeps them, then retrieval items with code filler carry the
# lookup over to the real task, at 1K and then out to 2.5K tokens with position skips to 16K. Measured (README, "The
# lookup leg"): MHA formed the lookup and retrieves 10/100 at 2K, 4/100 at 8K; GQA did not form it; both lost
# reasoning (55 and 46 of 100, from 93 and 60).
LOOKUP = Recipe(
    phases=(
        Phase("copy", 800, 512, "yyyyyyrc", 3e-3, 3e-3, warmup=20, max_rows=16, weights=(1.0, 0.3, 2.0)),
        Phase("recall", 500, 512, "aaaaaarc", 1e-3, 1e-3, warmup=20, max_rows=16, weights=(1.0, 0.3, 2.0), facts=16),
        # retrieval items at twice the held-out density (one fact per 32 tokens, 6-12 chains) next to recall rows
        Phase(
            "filler",
            400,
            512,
            "kkkkaarc",
            1e-3,
            1e-3,
            max_rows=16,
            weights=(1.0, 0.3, 2.0),
            chains=(6, 12),
            tokens_per_fact=32,
        ),
        # out to 2.5K tokens with position skips to 16K (a masked 4 x 2,560-token step costs ~7 s here, 5x a 512 step);
        # half the rows reasoning: at lr 3e-3 the copy phase took held-out cell accuracy from 1.00 to 0.49-0.76
        Phase(
            "long",
            200,
            2560,
            "rrkk",
            1e-3,
            5e-5,
            max_rows=99,
            retrieval=(1024, 1536, 2560),
            span=16384,
            chains=(8, 16),
            queries=8,
            tokens_per_fact=32,
        ),
        # a second leg (appended: --resume continues the first): items out to 4K, one reasoning row next to each
        Phase(
            "long4k",
            200,
            4096,
            "rk",
            5e-4,
            3e-5,
            warmup=10,
            max_rows=99,
            retrieval=(2048, 3072, 4096),
            span=16384,
            chains=(8, 16),
            queries=8,
            tokens_per_fact=32,
        ),
    )
)


def _leg_after_lookup(rope_theta: float = 1e4, rope_scaling: tuple[float, int] | None = None) -> Recipe:
    """LOOKUP and a third leg of real 4K-token rows (``--resume`` continues a LOOKUP state) under these RoPE settings.

    At base 1e4 (head_dim 64) only the slowest two or three frequency pairs turn less than ~1 rad over 8K tokens,
    so a content match between a query and a needle 8K back rests on few dimensions. Raising the base to 5e5 leaves
    eight pairs under 0.5 rad over 8K but changes every pair's angle but the fastest (the reasoning lookup, 17-19
    tokens back, must be learnt again); llama3-style scaling by 32 from 512 keeps the eleven fastest pairs exactly
    and leaves ten under 0.6 rad. The legs differ only in these settings (an A/B/C of the lever).
    """
    long4k = LOOKUP.phases[-1]  # the same rows, longer and at a higher rate
    ext = replace(
        long4k,
        name="ext",
        steps=360,
        lr=5e-4,
        final_lr=5e-5,
        warmup=20,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )
    return replace(LOOKUP, phases=LOOKUP.phases + (ext,))


LOOKUP_EXT = _leg_after_lookup(rope_theta=5e5)
LOOKUP_EXT_SCALED = _leg_after_lookup(rope_scaling=(32.0, 512))
LOOKUP_EXT_CONTROL = _leg_after_lookup()


# A fourth leg, from the scaled one: items of one query, as held out since 2026-12-02 (the scaled leg trained on up
# to 8 queries an item, and its models write more facts after the first chain instead of the end of text).
LOOKUP_ONE_QUERY = replace(
    LOOKUP_EXT_SCALED,
    phases=LOOKUP_EXT_SCALED.phases
    + (
        replace(
            LOOKUP_EXT_SCALED.phases[-1],
            name="one-query",
            steps=200,
            lr=3e-4,
            final_lr=3e-5,
            warmup=10,
            retrieval=(1024, 2048, 4096),
            queries=1,
            rope_theta=None,
            rope_scaling=None,
        ),
    ),
)


# Version 4: one run from random weights that puts every lesson of the legs above in one order, so the three models
# share data, steps and seed again (the legs started from v2 GQA/MHA weights that MLA never had). Measured on one core:
# the 512-token phases take 2.0-2.6 s a step (GQA) and 2.9-3.6 s (MLA). The long phases train on denser retrieval items
# than the held-out ones (a fact per 32 tokens, 8-16 chains), up to 4 queries an item in the first and one (as held
# out) after it: the one-query leg taught MHA to stop.
_LONG_RETRIEVAL = dict(span=16384, chains=(8, 16), queries=1, tokens_per_fact=32, max_rows=99)
V4 = Recipe(
    phases=(
        # the reasoning task's fixed-offset lookup first, on short rows at base 1e4 (MLA formed it only this way)
        Phase("warm", 300, 512, "rrrr", 2e-3, 2e-3, warmup=50, max_rows=16, weights=(1.0, 0.1, 1.0)),
        # the content lookup: copy documents in nearly every row (GQA, one kv head, formed it from 8 copy rows of 8 and
        # not from 6), then recall with 1-4 facts before 1-16 (GQA needed the small stage; MHA did not)
        Phase("copy", 600, 512, "yyyyyyyr", 3e-3, 3e-3, warmup=20, max_rows=16, weights=(1.0, 0.3, 2.0)),
        Phase("recall4", 250, 512, "aaaaaarc", 2e-3, 2e-3, max_rows=16, weights=(1.0, 0.3, 2.0), facts=4),
        # As first run, copy 600 then recall4 300: GQA's copy loss was still falling at the end of the copy phase
        # (5.9 -> 4.4 nats; MHA from v2 weights: 0.07) and 250 recall steps later it matched no key (value accuracy
        # 0.35 / 0.16 at 2 / 4 facts, below copying a random fact's value); copy first is what formed the match in the
        # pilots, so the copy phase continues here
        Phase("copy2", 400, 512, "yyyyyyyr", 3e-3, 3e-3, max_rows=16, weights=(1.0, 0.3, 2.0)),
        # 275 steps in, GQA matched keys at 2 facts (0.77, from 0.52 125 steps before) but not yet at 4 (0.31): 200 more
        Phase("recall4b", 500, 512, "aaaaaarc", 2e-3, 2e-3, max_rows=16, weights=(1.0, 0.3, 2.0), facts=4),
        Phase("recall16", 300, 512, "aaaaaarc", 1e-3, 1e-3, max_rows=16, weights=(1.0, 0.3, 2.0), facts=16),
        # the lookup leg's filler phase: retrieval items with code filler carry the lookup over to the real task
        # (recall alone did not)
        LOOKUP.phases[2],
        # long items under llama3-style RoPE scaling (x32 from 512: the reasoning lookup's fast pairs keep their
        # angles, the slow pairs stop turning over 16K), one query an item as held out, whole reasoning items of up to
        # 99 rows next to each retrieval row
        Phase(
            "main",
            450,
            2560,
            "rk",
            1.5e-3,
            2e-4,
            warmup=20,
            retrieval=(1024, 1536, 2560),
            rope_scaling=(32.0, 512),
            **{**_LONG_RETRIEVAL, "queries": 4},  # more lookups a row while the long-range match forms
        ),
        Phase("long4k", 300, 4096, "rk", 5e-4, 5e-5, warmup=20, retrieval=(2048, 3072, 4096), **_LONG_RETRIEVAL),
        Phase("anneal", 200, 4096, "rk", 1e-4, 1e-5, retrieval=(1024, 2048, 4096), **_LONG_RETRIEVAL),
    )
)


# Version 5: v4's phases for models of 8 heads of 32 (GQA 4:1 with two key/value heads instead of one, MLA's RoPE key
# kept 64 wide), because v4's GQA and MLA never matched keys well enough to carry the lookup into code filler: GQA's
# recall probe read 0.90 / 0.48 / 0.37 at 2 / 4 / 8 facts at the end of filler and its retrieval items 0.0-0.14 (first
# value token), and 375 main steps later its key match was gone (0.40 / 0.26 / 0.13: retrieval had given no gradient
# to keep it); MLA's stayed at the random-fact level (0.56 / 0.39 / 0.29 in filler). A GQA with one key/value head
# is multi-query attention: one key space per layer for the previous-token head, the key match, the reasoning
# lookups and code. Phases changed from v4, each for a measured reason: one 1,000-step copy phase (v4 needed a second
# one: GQA's copy loss was 4.45 nats after 600 steps, 2.97 after 1,000); recall with 1-16 facts for 600 steps (the
# pilot from v2 GQA weights reached 1.00 at 8 facts only after 600); recall rows in the main phase, so the key
# match keeps a gradient while the long-range lookup forms.
V5 = Recipe(
    num_heads=8,
    mla_rope_head_dim=64,
    phases=(
        V4.phases[0],
        replace(V4.phases[1], steps=1000),
        replace(V4.phases[4], name="recall4"),
        replace(V4.phases[5], steps=600),
        *V4.phases[6:7],
        replace(V4.phases[7], mix="rka"),
        *V4.phases[8:],
    ),
)

# Version 6 (MLA): v5 with MLA's content key twice a head's width (64; RoPE key 64, value 32, latent 128 as v5, so
# the cache is unchanged). At v5's step 2,900 MLA had no lookup head: split at the answer's lookup, the content part
# of its logits (32 channels) spread over less than one logit in most heads of layers 1-3 while the shared RoPE part
# spread over 1.2-6.4 (`probe_errors.py --logits`), so its attention was positional and the content lookup the
# retrieval task needs had no channel it used. DeepSeek-V3 has the content key twice the RoPE key (128 : 64); v5 had
# it half. Llama models do not read the field: for GQA and MHA v6 is v5.
V6 = replace(V5, mla_nope_head_dim=64)

# A leg for the v5 MHA (`--init mha`), whose lookup phases ended by step count before its lookup had formed: it
# retrieves 6/100 at 8K, and its recall probe (`pilot_lookup.py --steps 0`, state 3,550) matches keys at 0.90 / 0.82 /
# 0.76 with 2 / 4 / 8 facts, where the v5 GQA's reads 1.00 at each. So the recall phase runs until the probe
# reads >= 0.98 at 8 facts (800 steps at most), then v5's filler, then v5's main until every 4K monitor item is
# right (450 at most) and shorter long4k and anneal phases (the weights have had both once). The whole leg keeps
# the RoPE the model was last trained under (llama3 x32 from 512). Run for 425 steps: the probe did not move
# (0.92 / 0.81 / 0.77 at step 400), and its key match (the first value digit, `recall_accuracy`) is 0.33 at 8
# facts: this MHA copies digits after the first but does not match keys, and recall rows alone do not teach it.
RELOOKUP = replace(
    V5,
    phases=(
        replace(V5.phases[3], steps=800, warmup=20, rope_scaling=(32.0, 512), until=("recall_8_value_acc", 0.98)),
        V5.phases[4],
        replace(V5.phases[5], until=("retrieval_4096_tf_all", 1.0)),
        replace(V5.phases[6], steps=200),
        V5.phases[7],
    ),
)

# The key match, measured (`recall_accuracy`, README "The key match"): the v5 MHA and the v6 MLA
# write a value's later digits by matching the digit before them but pick its first digit from a random fact (key
# match 0.33-0.34 at 8 facts; GQA 1.00): their last-layer heads spread over every fact's first digit, because no
# earlier head carries the key word into it (GQA moves it with a two-back head). From the v5 MHA weights a pilot of
# 300 copy and 300 recall steps with 1-4 facts at lr 3e-3 formed the match (0.99 at 4 facts, 0.86 at 8), where 425
# recall steps with 1-16 facts at lr 1e-3 (`relookup`) moved nothing. So this leg repeats the lookup curriculum with
# each recall phase ending on the key match, not on a count, then v5's filler, main (ending when every 4K monitor
# item is right), and shorter long4k and anneal phases. For `--init mha` (v6 is v5 for Llama models) and for the
# paused v6 MLA (`--init states/v6-mla-step2825.pt`); the leg keeps the RoPE both were last trained under.
KEYMATCH = replace(
    V6,
    phases=(
        replace(V4.phases[1], steps=300, rope_scaling=(32.0, 512)),
        replace(V5.phases[2], steps=600, lr=3e-3, final_lr=3e-3, until=("recall_4_key_acc", 0.95)),
        replace(V5.phases[3], until=("recall_8_key_acc", 0.95)),
        V5.phases[4],
        replace(V5.phases[5], until=("retrieval_4096_tf_all", 1.0)),
        replace(V5.phases[6], steps=200),
        V5.phases[7],
    ),
)

# A leg for the finished keymatch MHA (`--init benchmarks/models/states/keymatch-mha-step1750.pt`), which matches keys
# (1.00 at 8 facts) and retrieves 49/100 at 8K: its `main` ran to its cap (450 steps) without meeting the gate, and
# teacher-forced at 8K most of its misses are a chain's next key (15 of 18 at step 1,375). So `main` again, until
# every 4K monitor item is right (600 at most), then long4k 200 and anneal 200, as in `keymatch`.
CHAINS = replace(
    V6,
    phases=(
        replace(V5.phases[5], steps=600, until=("retrieval_4096_tf_all", 1.0)),
        replace(V5.phases[6], steps=200),
        V5.phases[7],
    ),
)

# The key match for the v6 MLA (`--init benchmarks/models/states/v6-mla-step2825.pt`). In `keymatch` it did not form
# (0.27 at 8 facts after 300 copy and 600 recall steps); a pilot of recall rows alone at lr 3e-3 from the same weights,
# no copy phase, formed it by another route than the GQA's: layer-1 heads put the key word on `<|value|>` (0.99), a
# layer-2 head carries that on to the first digit, and the last layer reads it (0.92 / 0.74 / 0.47 at 2 / 4 / 8 facts
# after 300 steps, README "Fifth session"). So this leg is `keymatch` without its copy phase, with the first recall
# phase on recall rows but one code row (the pilot had recall rows only; code stays in every phase) and a higher cap.
KEYMATCH_MLA = replace(
    KEYMATCH,
    phases=(
        replace(KEYMATCH.phases[1], steps=1200, mix="aaaaaaac", warmup=20, rope_scaling=(32.0, 512)),
        *KEYMATCH.phases[2:],
    ),
)

# Version 7: one run from random weights for all three models again, with v6's shapes and each lookup phase of v5
# ending on what the legs above measured, not on a count: recall with 1-4 facts at lr 3e-3 (the rate that formed the
# key match in the MHA's `keymatch` leg and in the MLA's pilot; v5 had 2e-3) until the key match reads >= 0.95 at 4
# facts, recall with 1-16 facts until it reads >= 0.95 at 8, and `main` until every 4K monitor item is right (the
# keymatch MHA's 450 capped steps left it at 49/100 at 8K; 600 more `chains` steps raised its 4K monitor from 0.38 to
# 0.62). The caps are several times what any leg needed, which a GPU affords (`--device cuda`): the three models share
# data, seed and phases, and a phase's length is where its gate passed, recorded per model.
V7 = replace(
    V6,
    phases=(
        V5.phases[0],  # warm
        V5.phases[1],  # copy
        replace(V5.phases[2], steps=2000, lr=3e-3, final_lr=3e-3, until=("recall_4_key_acc", 0.95)),
        replace(V5.phases[3], steps=1500, until=("recall_8_key_acc", 0.95)),
        V5.phases[4],  # filler
        replace(V5.phases[5], steps=1200, until=("retrieval_4096_tf_all", 1.0)),
        V5.phases[6],  # long4k
        V5.phases[7],  # anneal
    ),
)

# A leg for the v7 models (`--init DIR`, a v7 checkpoint): the v7 GQA and MLA retrieve one-fact chains at 8K (0.89 and
# 0.98 of them) but no chain of two or three facts (0 of 45), where the v7 MHA retrieves 0.92 of those. Teacher-forced
# on 20 held-out two- and three-fact items at 2K, the GQA's first error is always the restated key after `<|key|>`
# (the word it has just written as a value, two tokens back: 19 of 20) and the MLA's the first lookup whose value
# is a word, not digits (it writes a digit: 19 of 20). Held-out-like items (one query, every chain length) at 512 to
# 1,024 tokens, with reasoning and code rows, until every 1K monitor item is right; the RoPE of v7's later phases.
HOPS = replace(
    V7,
    phases=(
        Phase(
            "hops",
            300,
            1024,
            "kkrc",
            5e-4,
            5e-5,
            warmup=10,
            max_rows=40,
            retrieval=(512, 1024),
            weights=(1.0, 0.3, 2.0),
            queries=1,
            tokens_per_fact=32,
            rope_scaling=(32.0, 512),
            until=("retrieval_1024_tf_all", 1.0),
        ),
    ),
)

# Version 8: v7 with v5's recall16 (600 steps, no gate). The v5 GQA restates chain keys (93/100 at 8K) and the v7
# GQA does not (33 of 33 restated keys missed at 2K; 0/45 items of two- and three-fact chains at 8K); of what differs
# between the two runs for that architecture, recall16 is the phase whose rows hold the most facts to chain through,
# and v7 ended it after 100 steps (its gate passed at the first monitor point), v5 after 600. `v8-main450` also caps
# `main` at v5's 450 steps (the v7 GQA's ran to its 1,200 cap), so an A/B of the two on one GPU separates the causes.
# Not yet run (no GPU since): `train_gpu.sh OUT v8,v8-main450` with MODELS="gqa mla" and, for a matched set, MHA on v8.
V8 = replace(V7, phases=(*V7.phases[:3], V5.phases[3], *V7.phases[4:]))
V8_MAIN450 = replace(V8, phases=(*V8.phases[:5], replace(V8.phases[5], steps=450), *V8.phases[6:]))

# A leg for the v7 MLA (`--init benchmarks/models/states/v7-mla`), which retrieves one-fact chains at 8K (54/55) and
# no longer one (0/45). Its first error on a chain is the first lookup whose value is a word (19 of 20 items at 2K),
# and the chain probe isolates it: on recall documents whose facts form chains (`chain_accuracy`) it looks numbers up
# (0.97-1.00) and word values not at all (0.00-0.01 at 4 and 8 facts), where the v7 MHA and GQA read 0.91-0.98. Every
# recall row it trained on had number values only, and the `main` rows hold about one word lookup in a thousand
# tokens. So: recall rows of chains (half the facts link to the next) until the probe reads >= 0.95 for words at 8
# facts, then v7's `main` with chain rows, gated as in v7, and shorter long4k and anneal phases; v7's late RoPE.
WORDS = replace(
    V7,
    phases=(
        replace(
            V7.phases[3],
            name="words",
            steps=600,
            facts=8,
            word_values=0.5,
            warmup=20,
            rope_scaling=(32.0, 512),
            until=("chain_8_word_acc", 0.95),
        ),
        replace(V7.phases[5], steps=400, lr=5e-4, final_lr=1e-4, word_values=0.5),
        replace(V7.phases[6], steps=150),
        replace(V7.phases[7], steps=100),
    ),
)

# A leg for the three words-leg models (`--init benchmarks/models/states/words-gqa`, `words-mha`, and `--init mla`,
# the bundled MLA), so that one recipe (v7, words, this) makes all three. The words GQA follows chains (chain key
# 0/33 wrong at 2K) but loses 2- and 3-fact chains at 8K (0.79 / 0.62 of them; v5 0.96 / 0.71: 86/100 there). The
# words leg ended on long4k at 5e-4 with no chain rows, which shook the MLA's chain probe (words at 4 facts 1.00 ->
# 0.66) before its anneal brought it back. So: words' `main` rows (chain recall rows, four queries an item) at a low
# rate, then a short anneal at 4K; fixed step counts and no gates, so the three take the same steps.
WORDS_SETTLE = replace(
    WORDS,
    phases=(
        replace(WORDS.phases[1], name="chains", steps=100, lr=2e-4, final_lr=2e-5, warmup=10, until=None),
        replace(WORDS.phases[3], steps=50, lr=5e-5, final_lr=5e-6),
    ),
)

SMOKE = Recipe(
    vocab_size=512,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=64,
    max_positions=2048,
    phases=(
        Phase("warm", 2, 640, "rkc", 2e-3, 2e-3, warmup=1, max_rows=3, retrieval=(640,)),
        Phase("main", 2, 1280, "kr", 1e-3, 1e-4, max_rows=3, retrieval=(640,), span=2048),
        Phase("anneal", 2, 640, "oya", 2e-4, 2e-5, max_rows=3, facts=4),
    ),
)

RECIPES = {
    "full": FULL,
    "lookup": LOOKUP,
    "lookup-ext": LOOKUP_EXT,
    "lookup-ext-scaled": LOOKUP_EXT_SCALED,
    "lookup-ext-control": LOOKUP_EXT_CONTROL,
    "lookup-1q": LOOKUP_ONE_QUERY,
    "v4": V4,
    "v5": V5,
    "v6": V6,
    "relookup": RELOOKUP,
    "keymatch": KEYMATCH,
    "chains": CHAINS,
    "words": WORDS,
    "words-settle": WORDS_SETTLE,
    "keymatch-mla": KEYMATCH_MLA,
    "v7": V7,
    "hops": HOPS,
    "v8": V8,
    "v8-main450": V8_MAIN450,
    "smoke": SMOKE,
}


# --------------------------------------------------------------------------------------------- tokenizer
SPECIAL_TOKENS: tuple[str, ...] = reasoning.SPECIAL_TOKENS + retrieval.SPECIAL_TOKENS


def build_tokenizer(out_dir: Path, vocab_size: int, max_files: int | None = None) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the train split of the stdlib code and save it to ``out_dir``.

    Digits are split off one by one before BPE, so numbers are always single-digit tokens (the reasoning
    task's arithmetic is then learnable); the tasks' format strings are special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = read_code_files("train")[:max_files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=reasoning.EOS,
        bos_token=reasoning.EOS,
        pad_token=reasoning.PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (reasoning.EOS, reasoning.PAD)],
        model_max_length=1 << 30,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def load_or_build_tokenizer(tok_dir: Path, vocab_size: int, max_files: int | None = None) -> PreTrainedTokenizerFast:
    if (tok_dir / "tokenizer.json").exists():
        tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        single = all(len(tok(t, add_special_tokens=False)["input_ids"]) == 1 for t in SPECIAL_TOKENS)
        if len(tok) != vocab_size or not single:
            raise ValueError(f"{tok_dir} holds a tokenizer that does not fit this recipe/task; delete it")
        return tok
    print(f"building tokenizer in {tok_dir}", flush=True)
    return build_tokenizer(tok_dir, vocab_size, max_files)


# --------------------------------------------------------------------------------------------- models
def build_config(name: str, r: Recipe, tok: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Config of reference model ``name``; the three differ only in attention.

    MLA: ``kv_lora_rank`` = 4 x ``qk_nope_head_dim`` (DeepSeek-V3's 512 : 128), ``v_head_dim`` =
    ``qk_nope_head_dim``, no q low-rank (as DeepSeek-V2-Lite) and dense MLPs everywhere (``first_k_dense_replace``
    = layers). Its shared RoPE key is as wide as a head (64), not DeepSeek-V3's half (64 : 128): with a 32-wide one
    the reasoning task's purely positional lookup (1 and 23 tokens back) formed several times slower than in the
    GQA/MHA models (64-wide rotary keys per kv head) and stalled at cell accuracy 0.76 (v2 MLA, 1,250 steps);
    64 wide, cell accuracy at step 200 was 0.51 instead of 0.16 (GQA: 0.78).
    """
    head_dim = r.hidden_size // r.num_heads
    common = dict(
        vocab_size=r.vocab_size,
        hidden_size=r.hidden_size,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_layers,
        num_attention_heads=r.num_heads,
        max_position_embeddings=r.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-6,
        rope_parameters=rope_at(r, 0),
    )
    if name == "mla":
        return DeepseekV3Config(
            **common,
            num_key_value_heads=r.num_heads,
            kv_lora_rank=4 * head_dim,
            q_lora_rank=None,
            qk_nope_head_dim=r.mla_nope_head_dim or head_dim,
            qk_rope_head_dim=r.mla_rope_head_dim or head_dim,
            v_head_dim=head_dim,
            first_k_dense_replace=r.num_layers,
            n_routed_experts=4,  # unused (no MoE layer) but the config wants consistent values
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=r.intermediate_size // 2,
            num_mtp_layers=0,
        )
    if name == "gqa":
        return LlamaConfig(**common, num_key_value_heads=r.num_heads // 4, head_dim=head_dim)
    if name == "mha":
        return LlamaConfig(**common, num_key_value_heads=r.num_heads, head_dim=head_dim)
    raise ValueError(f"unknown model {name!r}; expected one of {MODEL_NAMES}")


def build_model(config: PretrainedConfig) -> PreTrainedModel:
    cls = DeepseekV3ForCausalLM if isinstance(config, DeepseekV3Config) else LlamaForCausalLM
    return cls(config)


# Training attends through the library's padded sdpa (exact): MLA's value head is narrower than its query head, which
# sends plain CPU SDPA to its math path (`kvarn_mla.adapters.base.padded_sdpa_attention`).
AttentionInterface.register(PADDED_SDPA, padded_sdpa_attention)
AttentionMaskInterface.register(PADDED_SDPA, sdpa_mask)


# --------------------------------------------------------------------------------------------- data
ROW_STRIDE = 64  # global row id = step * ROW_STRIDE + row (at most this many rows per step)


class LookupDocs:
    """Documents that teach content-addressed lookup (an induction circuit), built from token ids.

    The retrieval task needs the model to find an earlier token by content and copy what follows it; the reasoning
    task only ever looks a fixed number of tokens back, and the v2 models never formed the content lookup from
    retrieval items alone (``README.md``, "Why no model retrieves"). Two documents form it (the lookup pilots):

    - copy: ``<|query|> t1 .. tL<|answer|> t1 .. tL<|endoftext|>``, L in 4..24 random words and digits;
    - recall: 1..F facts in the retrieval task's own text (``<|key|> w<|value|>dddd``, :func:`retrieval.fact_text`),
      then ``<|query|>``, some of their keys and ``<|answer|>``; the target writes the queried facts in order.
      Values are training values only (:func:`retrieval.value_split`), distinct within a document. With
      ``word_values`` the facts form the retrieval task's chains instead (a value is the next fact's key word:
      ``<|key|> w1<|value|> w2``, ..., the last one a number), shown in random order; the query names chain heads
      and the target writes each queried chain, as a retrieval answer does. The v7 MLA looks numbers up but not
      word values (README, "The words leg"): digit-only recall never asked it to copy a word found by its key.

    And one that drills a part of the recall circuit alone:

    - echo: ``<|query|>`` then 2..12 groups ``<|key|> w<|value|>d w`` (w a key word, d a digit), trained on the
      repeated ``w``, which only the token two back predicts: the route that carries a key into its value's first
      digit in the recall format (README, "The key match").

    Args:
        tok: the reference models' tokenizer.
        max_facts: most facts in a recall document (at least 1).
        separator: keep ``<|value|>`` between a key and its value (the retrieval task's format).
        words: the first this many key words of :data:`retrieval.WORDS` (None: all of them).
    """

    def __init__(self, tok: PreTrainedTokenizerFast, max_facts: int, separator: bool = True, words: int | None = None):
        if max_facts < 1:
            raise ValueError(f"max_facts must be >= 1, got {max_facts}")
        ids = tok.convert_tokens_to_ids
        self.key, self.value, self.query = (ids(t) for t in (retrieval.KEY, retrieval.VALUE, retrieval.QUERY))
        self.answer, self.eos = ids(reasoning.ANSWER), tok.eos_token_id
        self.words = [tok(" " + w, add_special_tokens=False).input_ids[0] for w in retrieval.WORDS[:words]]
        self.digits = [ids(str(d)) for d in range(10)]
        self.copy_vocab = self.words + self.digits
        every = (f"{i:0{retrieval.VALUE_DIGITS}d}" for i in range(10**retrieval.VALUE_DIGITS))
        self.train_values = [v for v in every if retrieval.value_split(v) == "train"]  # never a held-out answer
        self.max_facts, self.separator = max_facts, separator

    def fact(self, word: int, value: str | int, separator: bool | None = None) -> list[int]:
        """A fact's token ids, with ``<|value|>`` after the key if ``separator`` (None: the instance's format); the
        value is a number's digits or one key word's token id (a chain's hop)."""
        separator = self.separator if separator is None else separator
        tail = [value] if isinstance(value, int) else [self.digits[int(d)] for d in value]
        return [self.key, word] + ([self.value] if separator else []) + tail

    def recall(
        self, rng: random.Random, facts: int, separator: bool | None = None, word_values: float = 0.0
    ) -> tuple[list[int], list[int]]:
        """A recall document with ``facts`` facts (format as :meth:`fact`): token ids and a 0/1 target mask (1 =
        trained on). ``word_values`` > 0: chain documents (the class docstring), each fact but a chain's last linked
        to the next with that probability, chains of at most ``retrieval.MAX_HOPS`` facts."""
        words = rng.sample(self.words, facts)
        values = rng.sample(self.train_values, facts)  # distinct: a wrong key never gives the right value
        if word_values > 0:
            return self._chain_document(rng, words, values, separator, word_values)
        ids = [t for w, v in zip(words, values) for t in self.fact(w, v, separator)]
        queried = rng.sample(range(facts), rng.randint(1, facts))
        ids += [self.query] + [words[i] for i in queried] + [self.answer]
        target = [t for i in queried for t in self.fact(words[i], values[i], separator)] + [self.eos]
        return ids + target, [0] * len(ids) + [1] * len(target)

    def _chain_document(
        self, rng: random.Random, words: list[int], numbers: list[str], separator: bool | None, link: float
    ) -> tuple[list[int], list[int]]:
        chains = [[words[0]]]
        for w in words[1:]:
            if len(chains[-1]) < retrieval.MAX_HOPS and rng.random() < link:
                chains[-1].append(w)
            else:
                chains.append([w])
        value_of = {}
        for chain, number in zip(chains, numbers):
            value_of |= dict(zip(chain, chain[1:] + [number]))  # each hop names the next key, the last a number
        shown = rng.sample(words, len(words))
        ids = [t for w in shown for t in self.fact(w, value_of[w], separator)]
        queried = rng.sample(chains, rng.randint(1, len(chains)))
        ids += [self.query] + [chain[0] for chain in queried] + [self.answer]
        target = [t for chain in queried for w in chain for t in self.fact(w, value_of[w], separator)] + [self.eos]
        return ids + target, [0] * len(ids) + [1] * len(target)

    def copy(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """A copy document: token ids and a 0/1 target mask."""
        seq = [rng.choice(self.copy_vocab) for _ in range(rng.randint(4, 24))]
        ids = [self.query] + seq + [self.answer]
        return ids + seq + [self.eos], [0] * len(ids) + [1] * (len(seq) + 1)

    def echo(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """An echo document: token ids and a 0/1 target mask (the repeated key words and the end)."""
        ids, mask = [self.query], [0]
        for _ in range(rng.randint(2, 12)):
            word = rng.choice(self.words)
            ids += [self.key, word, self.value, rng.choice(self.digits), word]
            mask += [0, 0, 0, 0, 1]
        return ids + [self.eos], mask + [1]

    def document(
        self,
        task: str,
        rng: random.Random,
        max_facts: int | None = None,
        separator: bool | None = None,
        word_values: float = 0.0,
    ) -> tuple[list[int], list[int]]:
        """A ``"copy"``, ``"echo"`` or ``"recall"`` document (1..``max_facts`` facts, default the instance's; format
        as :meth:`fact`; ``word_values`` as :meth:`recall`) drawn from ``rng``."""
        if task == "recall":
            return self.recall(rng, rng.randint(1, max_facts or self.max_facts), separator, word_values)
        if task == "copy":
            return self.copy(rng)
        if task == "echo":
            return self.echo(rng)
        raise ValueError(f"task must be 'recall', 'copy' or 'echo', got {task!r}")


@dataclass
class Row:
    """One training row: token ids, the kind of each token (what it is trained as), its document id, its position
    offset (skipped positions), and where each document came from: ``("code", start)`` in the code stream,
    ``("reasoning", index, target_tokens)`` or ``("retrieval", context, seed, index)``."""

    ids: list[int]
    kind: list[int]
    doc: list[int]
    offset: list[int]
    sources: list[tuple]


def code_stream(tok: PreTrainedTokenizerFast, max_files: int | None = None) -> np.ndarray:
    """The train split's code as one token stream ``[N]`` int64: every file's ids, each followed by end-of-text."""
    files = read_code_files("train")[:max_files]
    ids = tok([f.text for f in files], add_special_tokens=False)["input_ids"]
    return np.fromiter((t for doc in ids for t in (*doc, tok.eos_token_id)), dtype=np.int64)


class Data:
    """Deterministic batches: ``batch(step)`` is a pure function of the step, so resuming is exact.

    Rows follow the step's :class:`Phase`: reasoning rows pack whole training items (or their openings) from
    the start and are topped up with a code window; retrieval rows pack retrieval items (training seeds) and
    are topped up the same way; a code row is one window of the packed train split (files joined by
    ``<|endoftext|>``).
    """

    def __init__(self, tok: PreTrainedTokenizerFast, r: Recipe, max_files: int | None = None) -> None:
        self.tok, self.r = tok, r
        self.eos = tok.eos_token_id
        self.code = code_stream(tok, max_files)
        longest = max(p.context for p in r.phases)
        if len(self.code) <= longest + 1:
            raise ValueError(f"code stream too short ({len(self.code)} tokens) for rows of {longest}")
        self.lookup = LookupDocs(tok, max_facts=1)  # each row draws up to its phase's ``facts``
        self.key_id = tok.convert_tokens_to_ids(retrieval.KEY)
        self.value_id = tok.convert_tokens_to_ids(retrieval.VALUE)
        self.query_id = tok.convert_tokens_to_ids(retrieval.QUERY)
        # Reasoning text is digits and format tokens, each one token: encode it by lookup (the tokenizer call costs
        # ~2 ms an item, most of a step's data time), checked against the tokenizer here.
        self._single = {t: tok.convert_tokens_to_ids(t) for t in reasoning.SPECIAL_TOKENS}
        self._single.update({d: tok.convert_tokens_to_ids(d) for d in "0123456789"})
        item = reasoning.make_item(0, "train", task=TASK, min_rows=2, max_rows=2)
        if self.encode_item(item) != self._tokenizer_encode(item):
            raise ValueError("the tokenizer does not keep the reasoning task's digits and format strings as one token")

    def _code_start(self, n: int, key: tuple[int, ...]) -> int:
        rng = np.random.default_rng((self.r.seed, *key))
        return int(rng.integers(0, len(self.code) - n))

    def _tokenizer_encode(self, item: reasoning.Item | retrieval.Item) -> tuple[list[int], list[int]]:
        prompt = self.tok(item.prompt, add_special_tokens=False)["input_ids"]
        target = self.tok(item.target, add_special_tokens=False)["input_ids"] + [self.eos]
        return prompt, target

    def encode_item(self, item: reasoning.Item | retrieval.Item) -> tuple[list[int], list[int]]:
        """Token ids of prompt and of target + end-of-text, encoded separately as at generation time."""
        if isinstance(item, retrieval.Item):
            return self._tokenizer_encode(item)
        ids = []
        for text in (item.prompt, item.target):
            out, i = [], 0
            while i < len(text):
                if text[i] == "<":
                    j = text.index(">", i) + 1
                    out.append(self._single[text[i:j]])
                    i = j
                else:
                    out.append(self._single[text[i]])
                    i += 1
            ids.append(out)
        return ids[0], ids[1] + [self.eos]

    def retrieval_kinds(self, item: retrieval.Item, prompt: list[int]) -> list[int]:
        """Kind of each prompt token of a retrieval item: the code filler is ``CODE``; the facts (random keys and
        values) and the query (random keys) are ``NO_LOSS``."""
        kinds = [CODE] * len(prompt)
        facts = iter(item.facts)
        i = 0
        while i < len(prompt):
            if prompt[i] == self.query_id:
                kinds[i:] = [NO_LOSS] * (len(prompt) - i)
                break
            if prompt[i] == self.key_id:
                n = len(self.tok(next(facts).text, add_special_tokens=False)["input_ids"])
                kinds[i : i + n] = [NO_LOSS] * n
                i += n
                continue
            i += 1
        return kinds

    def _positions(self, n: int, span: int, rng: random.Random) -> list[int]:
        """Position offsets of a document of ``n`` tokens: contiguous for half of the documents, otherwise one
        or two random jumps that spread its positions over up to ``span`` (position interpolation by skips)."""
        if span <= n or rng.random() < 0.5:
            return [0] * n
        jumps = sorted(rng.sample(range(1, n), rng.choice((1, 2))))
        total = rng.randint(0, span - n)
        cuts = sorted(rng.randint(0, total) for _ in range(len(jumps) - 1)) + [total]
        sizes = [b - a for a, b in zip([0] + cuts[:-1], cuts)]
        out, extra, k = [], 0, 0
        for i in range(n):
            while k < len(jumps) and jumps[k] == i:
                extra += sizes[k]
                k += 1
            out.append(extra)
        return out

    def row(self, step: int, row: int, phase: Phase) -> Row:
        """Row ``row`` of step ``step`` (``phase.context + 1`` tokens)."""
        n = phase.context + 1
        letter = phase.mix[row]
        out = Row([], [], [], [], [])
        g = step * ROW_STRIDE + row  # global row id: disjoint items per row

        def add(p: list[int], k: list[int], source: tuple, o: list[int] | None = None) -> None:
            if out.kind:  # the first token of a later document is not predictable from the one before
                k = [NO_LOSS] + k[1:]
            out.doc.extend([out.doc[-1] + 1 if out.doc else 0] * len(p))
            out.ids.extend(p)
            out.kind.extend(k)
            out.offset.extend(o or [0] * len(p))
            out.sources.append(source)

        if letter == "c":
            start = self._code_start(n, (step, row, 0))
            add(self.code[start : start + n].tolist(), [CODE] * n, ("code", start))
        elif letter in "ro":
            first = g * 128
            cap = self.r.opening_rows * TASK.row_tokens if letter == "o" else n  # openings: a prefix of the target
            for j in range(128):
                if n - len(out.ids) < TASK.prompt_tokens + TASK.row_tokens + 2:
                    break  # not even a one-row item fits
                size = reasoning.item_tokens(first + j, "train", task=TASK, min_rows=1, max_rows=phase.max_rows)
                if len(out.ids) + size[0] + min(size[1], cap) > n:
                    continue  # try the next (maybe shorter) item; the rest of the row is topped up with code
                item = reasoning.make_item(first + j, "train", task=TASK, min_rows=1, max_rows=phase.max_rows)
                p, t = self.encode_item(item)
                t = t[:cap]  # every token of an opening is still right
                add(p + t, [PROMPT] * len(p) + [REASONING] * len(t), ("reasoning", item.index, len(t)))
        elif letter == "k":
            rng = random.Random(f"retrieval-row/{self.r.seed}/{g}")
            seed = retrieval.TRAIN_SEEDS[g % len(retrieval.TRAIN_SEEDS)]
            for j in range(64):
                fits = [c for c in phase.retrieval if c + 1 <= n - len(out.ids)]
                if not fits:
                    break
                item = retrieval.make_item(
                    self.tok,
                    rng.choice(fits),
                    seed,
                    g // len(retrieval.TRAIN_SEEDS) * 64 + j,
                    chains=phase.chains,
                    max_queries=phase.queries,
                    tokens_per_fact=phase.tokens_per_fact,
                )
                p, t = self.encode_item(item)
                add(
                    p + t,
                    self.retrieval_kinds(item, p) + [RETRIEVAL] * len(t),
                    ("retrieval", item.context, item.seed, item.index),
                    self._positions(len(p) + len(t), phase.span, rng),
                )
        elif letter in "ya":
            rng = random.Random(f"lookup-row/{self.r.seed}/{g}")
            task = "copy" if letter == "y" else "recall"
            while True:
                ids, mask = self.lookup.document(task, rng, phase.facts, word_values=phase.word_values)
                if len(out.ids) + len(ids) > n:
                    break  # the rest of the row is topped up with code
                add(ids, [RETRIEVAL if m else NO_LOSS for m in mask], (task, g))
        else:
            raise ValueError(f"unknown row kind {letter!r}; expected one of {sorted(ROW_KINDS)}")
        fill = n - len(out.ids)
        if fill > 0:
            start = self._code_start(fill - 1, (step, row, 1)) if fill > 1 else 0
            add([self.eos] + self.code[start : start + fill - 1].tolist(), [CODE] * fill, ("code", start))
        return out

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, per-token kinds, document ids and position offsets, each ``[rows, context + 1]``, for
        optimizer step ``step`` (0-based)."""
        phase, _ = self.r.phase_at(step)
        rows = [self.row(step, row, phase) for row in range(phase.rows)]
        return (
            torch.tensor([r.ids for r in rows]),
            torch.tensor([r.kind for r in rows]),
            torch.tensor([r.doc for r in rows]),
            torch.tensor([r.offset for r in rows]),
        )


def doc_mask_and_positions(doc: torch.Tensor, offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diagonal causal mask and per-document positions for packed rows.

    Args:
        doc: ``[batch, seq]`` document id of each token (non-decreasing along a row).
        offset: ``[batch, seq]`` added to each token's position (skipped positions), or None.

    Returns:
        ``mask [batch, 1, seq, seq]`` (bool, True = may attend) and ``position_ids [batch, seq]``.
    """
    ar = torch.arange(doc.shape[1], device=doc.device)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    start = torch.cummax(torch.where(first, ar, 0), dim=1).values
    mask = (doc[:, :, None] == doc[:, None, :]) & (ar[:, None] >= ar[None, :])
    positions = ar - start
    return mask[:, None], positions if offset is None else positions + offset


# --------------------------------------------------------------------------------------------- eval
def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion ``k / n``."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


@torch.no_grad()
def eval_reasoning(
    model: PreTrainedModel,
    data: Data,
    items: list[reasoning.Item],
    batch_size: int = 50,
    max_new_tokens: int | None = None,
) -> dict[str, object]:
    """Greedy generation (batched, left padding, DynamicCache) and exact-match check of every item.

    ``max_new_tokens`` caps generation (smoke tests only; a capped item cannot pass).
    """
    tok = data.tok
    model.eval()
    device = model_device(model)
    order = sorted(range(len(items)), key=lambda i: items[i].num_rows)  # similar lengths share a batch
    correct = answer_ok = 0
    failures: list[int] = []
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        enc = [data.encode_item(items[i]) for i in idx]
        width = max(len(p) for p, _ in enc)
        ids = torch.full((len(idx), width), tok.pad_token_id)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for row, (p, _) in enumerate(enc):
            ids[row, width - len(p) :] = torch.tensor(p)
            att[row, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=att.to(device),
            max_new_tokens=min(max(len(t) for _, t in enc) + 8, max_new_tokens or 1 << 30),
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        for row, i in enumerate(idx):
            text = tok.decode(out[row, width:].tolist(), skip_special_tokens=False)
            ok = reasoning.check(items[i], text)
            correct += ok
            answer_ok += reasoning.check_answer(items[i], text)
            if not ok:
                failures.append(items[i].index)
    n = len(items)
    lo, hi = wilson(correct, n)
    target_tokens = [len(data.encode_item(it)[1]) - 1 for it in items]  # without the end-of-text token
    long = [it.index for it, t in zip(items, target_tokens) if t >= LONG_SCRATCHPAD]
    return {
        "n": n,
        "exact_match": correct / n,
        "correct": correct,
        "wilson95": [lo, hi],
        "final_answer_acc": answer_ok / n,
        "failed_indices": sorted(failures),
        "mean_target_tokens": float(np.mean(target_tokens)),
        "max_target_tokens": max(target_tokens),
        "mean_prompt_tokens": float(np.mean([len(data.encode_item(it)[0]) for it in items])),
        f"items_{LONG_SCRATCHPAD}_plus_tokens": len(long),
        f"correct_{LONG_SCRATCHPAD}_plus_tokens": sum(i not in failures for i in long),
    }


@torch.no_grad()
def target_hits(model: PreTrainedModel, prompt: list[int], target: list[int]) -> list[bool]:
    """For each target token: is it the argmax given the prompt and the reference target before it."""
    ids = torch.tensor([prompt + target], device=model_device(model))
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return [p == t for p, t in zip(logits.argmax(-1).tolist(), target)]


@torch.no_grad()
def teacher_forced(model: PreTrainedModel, data: Data, items: list[reasoning.Item]) -> dict[str, float]:
    """Cheap progress signal: argmax accuracy on the target tokens given the reference prefix.

    Returns ``tf_acc_cell`` (digits of the generated rows), ``tf_acc_row_start`` (first digit of each row:
    only the cell above, one row back, is needed) and ``tf_items_all_right`` (items with every target
    token right, which is what greedy decoding needs to solve them).
    """
    model.eval()
    hits: dict[str, list[bool]] = {"cell": [], "row_start": []}
    all_right = 0
    for it in items:
        row = reasoning.COUNTER + it.width + 1  # counter, cells, row break
        ok = target_hits(model, *data.encode_item(it))
        all_right += all(ok)
        for j, o in enumerate(ok[: row * it.num_rows - 1]):
            if reasoning.COUNTER <= j % row < reasoning.COUNTER + it.width:
                hits["cell"].append(o)
                if j % row == reasoning.COUNTER:
                    hits["row_start"].append(o)
    out = {f"tf_acc_{k}": sum(v) / max(1, len(v)) for k, v in hits.items()}
    out["tf_items_all_right"] = all_right / len(items)
    return out


RECALL_PROBE_FACTS = (2, 4, 8)  # facts per probe document


@torch.no_grad()
def recall_accuracy(model: PreTrainedModel, docs: LookupDocs, facts: int, documents: int = 40) -> dict[str, float]:
    """Argmax accuracy, teacher-forced, on ``documents`` fresh recall documents of ``facts`` facts (fixed seed): the
    content lookup apart from code filler and length.

    Returns ``value_acc``, over every value digit written, and ``key_acc``, over the first digit of each value only.
    The first digit is the key match itself: the later ones can be copied by matching the digit before them, which
    the v5 MHA does (0.99 on the third digit) while matching keys no better than a random fact's value would
    (``1 / facts`` plus a tenth of the rest, for a shared first digit).
    """
    model.eval()
    rng, hit, total, key_hit, keys = random.Random(f"pilot-probe/{facts}"), 0, 0, 0, 0
    for _ in range(documents):
        ids, mask = docs.recall(rng, facts)
        pred = model(input_ids=torch.tensor([ids], device=model_device(model))).logits[0].argmax(-1).tolist()
        for i in range(1, len(ids)):
            if mask[i] and ids[i] in docs.digits:
                ok = int(pred[i - 1] == ids[i])
                hit, total = hit + ok, total + 1
                if ids[i - 1] not in docs.digits:  # a value's first digit (after <|value|>, or the key without one)
                    key_hit, keys = key_hit + ok, keys + 1
    return {"value_acc": hit / total, "key_acc": key_hit / keys}


CHAIN_PROBE_FACTS = (4, 8)  # facts per chain probe document
CHAIN_PROBE_LINK = 0.5  # each fact linked to the next with this chance: about half the lookups find a word


@torch.no_grad()
def chain_accuracy(model: PreTrainedModel, docs: LookupDocs, facts: int, documents: int = 40) -> dict[str, float]:
    """Argmax accuracy, teacher-forced, on the first value token of every fact the target writes, in ``documents``
    fresh chain recall documents of ``facts`` facts (:meth:`LookupDocs.recall` with ``word_values``, fixed seed):
    ``word_acc`` where the value is a key word (a chain's hop, the lookup the v7 MLA misses), ``number_acc`` where it
    is a number's first digit."""
    model.eval()
    rng, hits = random.Random(f"chain-probe/{facts}"), {"word": [0, 0], "number": [0, 0]}
    for _ in range(documents):
        ids, mask = docs.recall(rng, facts, word_values=CHAIN_PROBE_LINK)
        pred = model(input_ids=torch.tensor([ids], device=model_device(model))).logits[0].argmax(-1).tolist()
        for i in range(1, len(ids)):
            if mask[i] and ids[i - 1] == docs.value:  # the token after <|value|>: the looked-up value
                h = hits["number" if ids[i] in docs.digits else "word"]
                h[0], h[1] = h[0] + int(pred[i - 1] == ids[i]), h[1] + 1
    return {f"{kind}_acc": right / max(1, total) for kind, (right, total) in hits.items()}


@torch.no_grad()
def retrieval_teacher_forced(model: PreTrainedModel, data: Data, items: list[retrieval.Item]) -> dict[str, float]:
    """Cheap retrieval progress signal: share of items whose every target token is the argmax given the prompt and
    the reference target before it (what greedy decoding needs), the per-token accuracy, and the accuracy on the
    first token of each written fact's value (the lookup itself; the rest of a target is mostly format)."""
    model.eval()
    right = tokens = whole = first = lookups = 0
    for it in items:
        prompt, target = data.encode_item(it)
        ok = target_hits(model, prompt, target)
        right, tokens, whole = right + sum(ok), tokens + len(ok), whole + all(ok)
        for j in range(1, len(target)):  # the token after <|value|>: the looked-up value (not format)
            if target[j - 1] == data.value_id:
                first, lookups = first + ok[j], lookups + 1
    return {
        "tf_items_all_right": whole / len(items),
        "tf_token_acc": right / tokens,
        "tf_first_value_acc": first / max(1, lookups),
    }


@torch.no_grad()
def eval_retrieval(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerFast,
    context: int,
    seed: int,
    count: int,
    max_new_tokens: int | None = None,
) -> dict[str, object]:
    """Greedy generation (one item at a time: no padding, the flash attention path) over ``count`` held-out retrieval
    items of ``context`` tokens from ``seed``, scored by exact match of the whole target.

    ``max_new_tokens`` caps generation (smoke tests only; a capped item cannot pass).
    """
    model.eval()
    records = []
    t0 = time.time()
    device = model_device(model)
    for it in retrieval.held_out_items(tok, context, seed, count):
        ids = tok(it.prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=min(it.target_tokens + 4, max_new_tokens or 1 << 30),
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        text = tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=False)
        records.append(
            {
                "index": it.index,
                "exact": retrieval.check(it, text),
                "answers": retrieval.check_answers(it, text),
                "queries": len(it.queries),
                "max_hops": max(len(c) for c in it.chains),
                "answer_depths": [round(d, 4) for d in it.answer_depths],
                "prompt_tokens": it.prompt_tokens,
            }
        )
    n = len(records)
    correct = sum(r["exact"] for r in records)
    lo, hi = wilson(correct, n)
    by_hops = Counter(r["max_hops"] for r in records)
    return {
        "context": context,
        "seed": seed,
        "task_version": retrieval.VERSION,
        "n": n,
        "exact_match": correct / n,
        "correct": correct,
        "wilson95": [lo, hi],
        "answer_acc": float(np.mean([r["answers"] for r in records])),
        "exact_by_max_hops": {
            h: sum(r["exact"] for r in records if r["max_hops"] == h) / k for h, k in sorted(by_hops.items())
        },
        "mean_prompt_tokens": float(np.mean([r["prompt_tokens"] for r in records])),
        "answer_depth_deciles": retrieval.depth_histogram(retrieval.held_out_items(tok, context, seed, count)),
        "seconds": time.time() - t0,
        "items": records,
    }


@torch.no_grad()
def eval_code(model: PreTrainedModel, data: Data, window: int, max_tokens: int | None) -> dict[str, object]:
    """Held-out code NLL per token over non-overlapping ``window``-token windows, against two unigram baselines on
    the same predicted tokens: the held-out text's own unigram entropy (its empirical token distribution, the
    target's yardstick) and the cross-entropy of an add-one smoothed unigram fitted on the train code stream."""
    tok = data.tok
    model.eval()
    files = read_code_files("held_out")
    ids = tok([f.text for f in files], add_special_tokens=False)["input_ids"]
    stream = torch.tensor([t for doc in ids for t in (*doc, data.eos)])
    n_windows = max(1, len(stream) // (window + 1))
    if max_tokens is not None:
        n_windows = max(1, min(n_windows, max_tokens // window))
    counts = np.bincount(data.code, minlength=len(tok)).astype(np.float64) + 1.0
    device = model_device(model)
    log_uni = torch.from_numpy(np.log(counts / counts.sum()))
    nll = uni = 0.0
    scored: list[torch.Tensor] = []
    for w in range(n_windows):
        chunk = stream[w * (window + 1) : (w + 1) * (window + 1)]
        logits = model(input_ids=chunk[None, :-1].to(device)).logits.float()[0]
        nll += float(F.cross_entropy(logits, chunk[1:].to(device), reduction="sum"))
        uni -= float(log_uni[chunk[1:]].sum())
        scored.append(chunk[1:])
    targets = torch.cat(scored)
    n = len(targets)
    p = torch.bincount(targets).double()
    p = p[p > 0] / n
    own_entropy = float(-(p * p.log()).sum())
    return {
        "files": len(files),
        "tokens_available": len(stream),
        "tokens_scored": n,
        "window": window,
        "nll_per_token": nll / n,
        "own_unigram_entropy": own_entropy,
        "nll_over_own_unigram_entropy": nll / n / own_entropy,
        "train_unigram_cross_entropy": uni / n,
        "perplexity": math.exp(nll / n),
        "unigram_perplexity": math.exp(uni / n),
    }


# --------------------------------------------------------------------------------------------- train
def count_params(model: PreTrainedModel) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    emb = model.get_input_embeddings().weight.numel()
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


def initial_weights(init: str | Path) -> dict[str, torch.Tensor]:
    """Float32 weights to start from: a bundled model name (its checkpoint), a checkpoint directory (config and
    safetensors, as ``save_checkpoint`` writes), a state dict file, or a ``state.pt`` (which holds the model under
    ``"model"``)."""
    bundled = str(init) in MODEL_NAMES
    if bundled or Path(init).is_dir():
        path = reference_models.path(str(init)) if bundled else Path(init)
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    weights = torch.load(init, weights_only=False)
    return weights.get("model", weights)


def _retrieval_suite(result: dict) -> tuple[int, int, int]:
    """(task version, context, seed) of a held-out retrieval result (results before versions were recorded: 1)."""
    return result.get("task_version", 1), result["context"], result["seed"]


def recipe_of_state(state: dict) -> Recipe:
    """The recipe a training state (``state.pt``) was written under."""
    saved = state["recipe"]
    return Recipe(**{**saved, "phases": tuple(Phase(**_phase(p)) for p in saved["phases"])})


def rope_of_state(state: dict) -> dict[str, object]:
    """The RoPE parameters a training state's weights were last trained under (``state.pt``: its recipe and step)."""
    return rope_at(recipe_of_state(state), max(0, state["step"] - 1))


def save_checkpoint(model: PreTrainedModel, tok: PreTrainedTokenizerFast, out_dir: Path) -> int:
    """Write bf16 safetensors + config + tokenizer to ``out_dir`` (replaced); returns its size in bytes."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    bf16 = build_model(model.config)
    bf16.load_state_dict(model.state_dict())
    bf16.to(torch.bfloat16)
    bf16.config.dtype = torch.bfloat16
    bf16.config._attn_implementation = "sdpa"
    bf16.generation_config.do_sample = False
    reasoning.record_task(bf16.config, TASK)  # evaluations pick the task version from the config
    bf16.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())


def training_loss(
    nll: torch.Tensor, kind: torch.Tensor, per_kind: bool, weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's loss from per-token NLL ``[rows, seq]`` and kinds ``[rows, seq]``, and each group's mean.

    Groups: reasoning (targets and prompts), code, retrieval targets. ``per_kind``: the weighted mean of the groups'
    means (``weights`` in that order; groups absent from the batch are left out); otherwise the mean over all loss
    tokens.
    """
    groups = {"reasoning": (kind == REASONING) | (kind == PROMPT), "code": kind == CODE, "retrieval": kind == RETRIEVAL}
    means = {g: (nll * m).sum() / m.sum() for g, m in groups.items() if m.any()}
    if per_kind:
        w = dict(zip(groups, weights))
        loss = sum(w[g] * v for g, v in means.items()) / sum(w[g] for g in means)
    else:
        keep = kind != NO_LOSS
        loss = (nll * keep).sum() / keep.sum()
    return loss, {g: float(v.detach()) for g, v in means.items()}


def recipe_json(r: Recipe) -> dict:
    """``r`` as the plain data a state or a results file holds (``asdict`` through JSON: tuples become lists)."""
    return json.loads(json.dumps(asdict(r)))


def same_schedule(saved: dict, r: Recipe, steps: int) -> bool:
    """Whether a state saved under recipe ``saved`` (``asdict``, through JSON) after ``steps`` steps continues under
    ``r``: everything but the phases equal, and the phases the same up to that step (a later phase may change, and
    phases may be added, as the recipe grows in legs)."""
    now = recipe_json(r)
    # a field added to Recipe after the state was written reads as its default, as for Phase below
    then = recipe_json(Recipe(**_phase({k: v for k, v in saved.items() if k != "phases"})))
    if {k: v for k, v in then.items() if k != "phases"} != {k: v for k, v in now.items() if k != "phases"}:
        return False
    done = 0
    for old, new in zip(saved["phases"], now["phases"]):
        # a field added to Phase after the state was written reads as its default, which keeps the old behaviour
        old = json.loads(json.dumps(asdict(Phase(**_phase(old)))))
        if done + old["steps"] >= steps:  # the phase the state is in: same layout, same schedule up to the state
            same_lr = all(
                Recipe(phases=(Phase(**_phase(old)),)).lr_at(i) == Recipe(phases=(Phase(**_phase(new)),)).lr_at(i)
                for i in range(steps - done)
            )
            return same_lr and {k: v for k, v in old.items() if k not in ("steps", "final_lr")} == {
                k: v for k, v in new.items() if k not in ("steps", "final_lr")
            }
        if old != new:
            return False
        done += old["steps"]
    return done >= steps


def _phase(d: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def evaluate(model: PreTrainedModel, data: Data, args: argparse.Namespace, smoke: bool) -> dict[str, object]:
    """Final held-out evaluation of the shipped checkpoint: code NLL, reasoning and retrieval exact match.

    Attention runs through ``sdpa_pad_v`` (exact): with plain SDPA, MLA's narrower v sends the CPU to the math path,
    which at 16,384 tokens took 139 CPU-s an item and ~10 GB (GQA: 11.5 s).
    """
    model.config._attn_implementation = "sdpa_pad_v"
    out: dict[str, object] = {}
    t0 = time.time()
    if args.eval_code_window:
        cap = 4 * args.eval_code_window if smoke else args.eval_code_tokens
        out["held_out_code"] = eval_code(model, data, args.eval_code_window, cap)
        print(f"[{args.name}] code: {json.dumps(out['held_out_code'])}", flush=True)
    if args.eval_items:
        task = reasoning.task_of(model.config)  # the version the checkpoint records (this recipe's: TASK)
        items = reasoning.held_out_items(args.eval_items, task=task)
        out["held_out_reasoning"] = {
            **eval_reasoning(model, data, items, max_new_tokens=16 if smoke else None),
            "task": task.to_dict(),
            "decoding": "greedy, batched with left padding, DynamicCache, bf16 checkpoint computed in float32",
        }
        r = out["held_out_reasoning"]
        print(
            f"[{args.name}] reasoning EM {r['exact_match']:.3f} ({r['correct']}/{r['n']}), "
            f"{LONG_SCRATCHPAD}+ tokens {r[f'correct_{LONG_SCRATCHPAD}_plus_tokens']}/"
            f"{r[f'items_{LONG_SCRATCHPAD}_plus_tokens']}",
            flush=True,
        )
    runs = []
    for context in args.eval_contexts:
        if args.eval_retrieval_items:
            res = eval_retrieval(
                model, data.tok, context, args.eval_seed, args.eval_retrieval_items, max_new_tokens=4 if smoke else None
            )
            runs.append(res)
            print(
                f"[{args.name}] retrieval @{context}: EM {res['exact_match']:.3f} ({res['correct']}/{res['n']}), "
                f"answers {res['answer_acc']:.3f}, {res['seconds']:.0f}s",
                flush=True,
            )
    if runs:
        out["held_out_retrieval"] = runs
    out["eval_seconds"] = time.time() - t0
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=MODEL_NAMES)
    ap.add_argument("--max-steps", type=int, help="stop after this many steps (the schedule is the recipe's)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny data slice, a few steps (tests)")
    ap.add_argument(
        "--recipe", choices=[k for k in RECIPES if k != "smoke"], default="full", help="the phase table (default full)"
    )
    ap.add_argument(
        "--init",
        help="start from these weights: a bundled model name (its checkpoint and tokenizer) or a float32 state dict "
        "(pilot_lookup.py --save, or a state.pt); the optimizer starts fresh (default: random weights)",
    )
    ap.add_argument("--out-dir", type=Path, help="checkpoint dir (default kvarn_mla/reference_models/<name>)")
    ap.add_argument("--results", type=Path, help="metrics JSON (default benchmarks/models/results/<name>.json)")
    ap.add_argument("--run-dir", type=Path, help="log/resume dir (default runs/<name>)")
    ap.add_argument(
        "--tokenizer-dir", type=Path, help="tokenizer cache (default runs/tokenizer; --eval-only: the checkpoint's)"
    )
    ap.add_argument("--resume", action="store_true", help="continue from run-dir/state.pt if present")
    ap.add_argument(
        "--eval-only",
        action="store_true",
        help="evaluate the checkpoint in --out-dir and merge the evaluations into --results (no training)",
    )
    ap.add_argument("--eval-items", type=int, default=100, help="held-out reasoning items (0: skip)")
    ap.add_argument("--eval-retrieval-items", type=int, default=100, help="held-out retrieval items per context")
    ap.add_argument(
        "--eval-contexts",
        type=lambda s: [int(c) for c in s.split(",") if c],
        default=[2048, 4096, 8192, 16384],
        help="retrieval contexts, comma-separated (default 2048,4096,8192,16384; empty: skip)",
    )
    ap.add_argument("--eval-seed", type=int, default=EVAL_SEED, help="held-out retrieval seed")
    ap.add_argument("--eval-code-window", type=int, default=2048, help="tokens per code window (0: skip)")
    ap.add_argument("--eval-code-tokens", type=int, help="cap on held-out code tokens scored (default all)")
    ap.add_argument("--monitor-every", type=int, default=100, help="steps between quick held-out evals (0: off)")
    ap.add_argument("--monitor-items", type=int, default=16)
    ap.add_argument(
        "--monitor-contexts",
        type=lambda s: [int(c) for c in s.split(",") if c],
        default=[1024, 4096],
        help="retrieval contexts of the quick evals",
    )
    ap.add_argument("--save-every", type=int, default=25, help="steps between resumable states")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--device",
        default="cpu",
        help="torch device of training and evaluation (default cpu; cuda: float32 weights, TF32 matmuls)",
    )
    ap.add_argument(
        "--deadline-minutes",
        type=float,
        help="stop training after this much wall time since the start, save and evaluate what it reached (the "
        "results record the steps done; a recipe cut short is not the recipe's model)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":  # matmuls in TF32 on the tensor cores (~1e-3 relative), as GPU training does
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    recipe_name = "smoke" if args.smoke else args.recipe
    r = RECIPES[recipe_name]
    max_files = 40 if args.smoke else None
    # a leg other than the full recipe writes into its run directory: shipping it is ship.py's decision
    label = args.name if recipe_name == "full" else f"{recipe_name}-{args.name}"
    run_dir = args.run_dir or DEFAULT_RUNS / label
    out_dir = args.out_dir or (DEFAULT_OUT_ROOT / args.name if recipe_name == "full" else run_dir / "model")
    results = args.results or (
        DEFAULT_RESULTS / f"{args.name}.json" if recipe_name == "full" else run_dir / "results.json"
    )
    bundled = args.init in MODEL_NAMES
    tok_dir = args.tokenizer_dir or (
        out_dir
        if args.eval_only
        else reference_models.path(args.init)
        if bundled
        else run_dir / "tokenizer"
        if args.smoke
        else DEFAULT_TOKENIZER_DIR
    )  # --eval-only: the checkpoint's own tokenizer; --init with a bundled model: that model's
    run_dir.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(r.seed)
    t_setup = time.time()
    tok = load_or_build_tokenizer(tok_dir, r.vocab_size, max_files)
    data = Data(tok, r, max_files)
    if args.eval_only:
        shipped = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device)
        use_padded_sdpa(shipped)
        metrics = json.loads(results.read_text()) if results.exists() else {"name": args.name}
        evaluation = evaluate(shipped, data, args, args.smoke)
        for key, value in evaluation.items():
            if key == "held_out_retrieval":  # merge: an eval-only run may cover some contexts, seeds or versions
                merged = {_retrieval_suite(res): res for res in metrics.get(key, []) + value}
                value = [merged[k] for k in sorted(merged)]
            metrics[key] = value
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(metrics, indent=1, default=str) + "\n")
        return metrics
    config = build_config(args.name, r, tok)
    model = build_model(config)
    if args.init:  # strict: the weights must have exactly this recipe's shapes
        model.load_state_dict(initial_weights(args.init))
    model.to(device)
    model.config._attn_implementation = "sdpa_pad_v"
    params = count_params(model)
    print(
        f"[{args.name}] params {params} | code train tokens {len(data.code):,} | setup {time.time() - t_setup:.1f}s",
        flush=True,
    )

    # One weight-decay group over all parameters: with norm gains and biases exempted (the usual split) the
    # first models' reasoning lookup never formed in two task-phase runs, while every probe with one group did.
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr_at(0), betas=(0.9, 0.95), eps=1e-8, weight_decay=r.weight_decay)
    state_path = run_dir / "state.pt"
    start, train_seconds, history, ended_early = 0, 0.0, [], {}
    seen = {"input_tokens": 0, "loss_tokens": 0} | {f"{k}_tokens": 0 for k in KIND_NAMES.values()}
    if args.resume and state_path.exists():
        st = torch.load(state_path, weights_only=False)
        ended_early = st.get("ended_early", {})
        r = data.r = r.ended_early(ended_early)
        if not same_schedule(st["recipe"], r, st["step"]):
            raise ValueError(
                f"{state_path} was written by a recipe whose first {st['step']} steps differ: {st['recipe']}"
            )
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])  # moves the moments to the parameters' device
        start, train_seconds, history, seen = st["step"], st["train_seconds"], st["history"], st["seen"]
        torch.set_rng_state(st["torch_rng"])
        print(f"[{args.name}] resumed at step {start}", flush=True)

    monitor = reasoning.held_out_items(args.monitor_items, start=MONITOR_START, task=TASK)
    monitor_retrieval = {
        c: retrieval.held_out_items(tok, c, MONITOR_SEED, args.monitor_items // 2) for c in args.monitor_contexts
    }
    monitor_keys = {"tf_acc_cell", "tf_items_all_right"}
    monitor_keys |= {f"recall_{f}_{m}" for f in RECALL_PROBE_FACTS for m in ("value_acc", "key_acc")}
    monitor_keys |= {f"chain_{f}_{m}" for f in CHAIN_PROBE_FACTS for m in ("word_acc", "number_acc")}
    monitor_keys |= {f"retrieval_{c}_tf_{m}" for c in monitor_retrieval for m in ("all", "token", "value")}
    for p in r.phases:
        if p.until is not None and (not args.monitor_every or p.until[0] not in monitor_keys):
            raise ValueError(
                f"phase {p.name!r} ends on {p.until[0]!r}, which the monitor does not measure "
                f"(--monitor-every {args.monitor_every}; measured: {sorted(monitor_keys)})"
            )

    def last_step(recipe: Recipe) -> int:
        return min(recipe.steps, args.max_steps) if args.max_steps is not None else recipe.steps

    stop, step, deadline_hit = last_step(r), start, False
    while step < stop:
        if args.deadline_minutes is not None and time.time() - t_start > 60 * args.deadline_minutes:
            deadline_hit, stop = True, step
            print(f"[{args.name}] deadline of {args.deadline_minutes} min reached at step {step}", flush=True)
            break
        model.train()
        t0 = time.time()
        phase, in_phase = r.phase_at(step)
        set_rope(model, rope_at(r, step))
        for g in opt.param_groups:
            g["lr"] = r.lr_at(step)
        seq, kind, doc, offset = data.batch(step)
        kind_cpu, packed = kind[:, 1:], bool((doc[:, :-1] > 0).any())  # read on the host: no device sync
        seq, kind, doc, offset = (t.to(device, non_blocking=True) for t in (seq, kind, doc, offset))
        inputs, targets, kind = seq[:, :-1], seq[:, 1:], kind[:, 1:]
        doc, offset = doc[:, :-1], offset[:, :-1]
        if r.doc_mask and packed:
            mask, positions = doc_mask_and_positions(doc, offset)
        else:  # one document per row: plain causal attention (the fused kernel), positions 0.. plus the jumps
            mask, positions = None, torch.arange(inputs.shape[1], device=device) + offset
        logits = model(input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=False).logits
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        loss, means = training_loss(nll, kind, r.loss_per_kind, phase.weights)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.time() - t0
        train_seconds += dt
        seen["input_tokens"] += inputs.numel()
        seen["loss_tokens"] += int((kind_cpu != NO_LOSS).sum())
        for k, name in KIND_NAMES.items():
            seen[f"{name}_tokens"] += int((kind_cpu == k).sum())
        rec = {
            "step": step + 1,
            "phase": phase.name,
            "loss": float(loss.detach()),
            **{f"loss_{g}": v for g, v in means.items()},
            "lr": r.lr_at(step),
            "grad_norm": gnorm,
            "sec": dt,
        }
        if args.monitor_every and (step + 1) % args.monitor_every == 0:
            t_mon = time.time()
            rec.update(teacher_forced(model, data, monitor))
            for c, items in monitor_retrieval.items():
                m = retrieval_teacher_forced(model, data, items)
                rec[f"retrieval_{c}_tf_all"], rec[f"retrieval_{c}_tf_token"], rec[f"retrieval_{c}_tf_value"] = (
                    m["tf_items_all_right"],
                    m["tf_token_acc"],
                    m["tf_first_value_acc"],
                )
            for f in RECALL_PROBE_FACTS:
                rec.update({f"recall_{f}_{m}": v for m, v in recall_accuracy(model, data.lookup, f).items()})
            for f in CHAIN_PROBE_FACTS:
                rec.update({f"chain_{f}_{m}": v for m, v in chain_accuracy(model, data.lookup, f).items()})
            rec["monitor_sec"] = time.time() - t_mon
        gate_passed = phase.until is not None and rec.get(phase.until[0], -math.inf) >= phase.until[1]
        if gate_passed and in_phase + 1 < phase.steps:  # the rest of the phase is skipped; its steps are recorded
            ended_early[phase.name] = in_phase + 1
            r = data.r = r.ended_early(ended_early)
            stop = last_step(r)
        history.append(rec)
        print(
            f"[{args.name}] step {step + 1}/{r.steps} {phase.name} loss {rec['loss']:.3f} ("
            + " ".join(f"{g} {v:.3f}" for g, v in means.items())
            + f") lr {rec['lr']:.2e} gn {gnorm:.2f} {dt:.2f}s ({inputs.numel() / dt:.0f} tok/s) "
            f"train {train_seconds / 60:.1f}min"
            + (
                f" | reasoning tf cell {rec['tf_acc_cell']:.3f} all {rec['tf_items_all_right']:.3f} | retrieval tf "
                + " ".join(
                    f"@{c} {rec[f'retrieval_{c}_tf_all']:.2f}/{rec[f'retrieval_{c}_tf_token']:.3f}"
                    f"/{rec[f'retrieval_{c}_tf_value']:.3f}"
                    for c in monitor_retrieval
                )
                + " | recall value/key "
                + " ".join(
                    f"{rec[f'recall_{f}_value_acc']:.2f}/{rec[f'recall_{f}_key_acc']:.2f}" for f in RECALL_PROBE_FACTS
                )
                + " | chain word/number "
                + " ".join(
                    f"{rec[f'chain_{f}_word_acc']:.2f}/{rec[f'chain_{f}_number_acc']:.2f}" for f in CHAIN_PROBE_FACTS
                )
                + f" ({rec['monitor_sec']:.0f}s)"
                + (f" | {phase.name} ends: {phase.until[0]} >= {phase.until[1]}" if gate_passed else "")
                if "monitor_sec" in rec
                else ""
            ),
            flush=True,
        )
        if (step + 1) % args.save_every == 0 or step + 1 == stop or gate_passed:
            tmp = state_path.with_suffix(".tmp")
            torch.save(
                {
                    "recipe": recipe_json(r),
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step + 1,
                    "train_seconds": train_seconds,
                    "history": history,
                    "seen": seen,
                    "torch_rng": torch.get_rng_state(),
                    "ended_early": ended_early,
                },
                tmp,
            )
            os.replace(tmp, state_path)
        step += 1

    # Final evaluation runs on the checkpoint as shipped: bf16 weights, loaded back in float32.
    ckpt_bytes = save_checkpoint(model, tok, out_dir)
    shipped = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device)
    use_padded_sdpa(shipped)
    evaluation = evaluate(shipped, data, args, args.smoke)
    metrics = {
        "name": args.name,
        "architecture": type(model).__name__,
        "recipe_name": recipe_name,
        "recipe": asdict(r),
        "init": args.init,
        "steps_done": stop,
        "stopped_at_deadline": deadline_hit,
        "params": params,
        "config": {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")},
        "tokens_seen": seen,
        "train_seconds": train_seconds,
        "final_train_loss_mean_last_20": float(np.mean([h["loss"] for h in history[-20:]])) if history else None,
        **evaluation,
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_files": {p.name: p.stat().st_size for p in sorted(out_dir.iterdir())},
        "environment": {
            **corpus_info(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": platform.machine(),
            "threads": args.threads,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "command": "python benchmarks/models/train_reference.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "history": history,
    }
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(metrics, indent=1, default=str) + "\n")
    print(f"[{args.name}] checkpoint {ckpt_bytes / 2**20:.2f} MiB | wrote {results}", flush=True)
    return metrics


if __name__ == "__main__":
    main()
