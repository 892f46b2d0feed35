"""Train one of the project's reference models (MLA, GQA or MHA) on stdlib code + long-chain reasoning.

The three models differ only in attention; tokenizer, data order, steps, schedule and seed are shared, so
any difference in their cache behaviour comes from the attention family. Everything is rebuilt from
what ships with Python (the stdlib sources) and from :mod:`kvarn_mla.evaluation.reasoning`; nothing is
downloaded.

Reproduce (see benchmarks/models/README.md for the measured numbers)::

    python benchmarks/models/train_reference.py mla
    python benchmarks/models/train_reference.py gqa
    python benchmarks/models/train_reference.py mha

Each run writes the checkpoint (bf16 safetensors, config, tokenizer) to
``kvarn_mla/reference_models/<name>/``, metrics to ``benchmarks/models/results/<name>.json``, and its
log and resumable training state to ``runs/<name>/``. ``--smoke`` trains a tiny model for a few steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
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
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402

from kvarn_mla.evaluation import reasoning  # noqa: E402
from kvarn_mla.evaluation.data import corpus_info, read_code_files  # noqa: E402

MODEL_NAMES = ("mla", "gqa", "mha")
DEFAULT_TOKENIZER_DIR = REPO / "runs" / "tokenizer"
DEFAULT_OUT_ROOT = REPO / "kvarn_mla" / "reference_models"
DEFAULT_RESULTS = REPO / "benchmarks" / "models" / "results"
DEFAULT_RUNS = REPO / "runs"
NO_LOSS, REASONING, CODE, PROMPT = 0, 1, 2, 3  # kind of each target token in a training row
MONITOR_START = 100_000  # monitoring evals use held-out items from here, disjoint from the reported set


@dataclass(frozen=True)
class Recipe:
    """Everything that defines a training run (shared by the three models)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4  # head_dim 64: MLA's decoupled RoPE key is then 32 wide (16 frequencies); with 8
    #   heads (RoPE key 16 wide) the MLA model never learned the 17-back lookup (probe: cell accuracy 0.19 after
    #   250 steps, against 0.98 with 4 heads)
    intermediate_size: int = 768
    context: int = 2048
    batch_rows: int = 4  # sequences per optimizer step
    code_every: int = 4  # every code_every-th row (counted over the whole run) is a pure code row; the
    #   others pack whole reasoning items from the start and are topped up with code
    train_max_rows: int = 48  # training items have 1..48 generated rows (held-out: 16..48)
    prompt_loss: bool = True  # also train on prompt tokens (the random starting row is not predictable,
    #   but this keeps the objective plain next-token prediction over the whole item)
    task_steps: int = 700  # the run opens with reasoning-only rows (no code, padding without loss): mixed with
    #   code from step 0, the one-row-back lookup never formed within 270 steps
    task_short_steps: int = 300  # ... the first of them short: task_context tokens, items of 1..task_max_rows
    #   rows (the lookup forms at ~150-200 steps); then task_long_context tokens, items of 1..train_max_rows
    task_context: int = 512
    task_max_rows: int = 16
    task_long_context: int = 1024
    mixed_steps: int = 100  # then mixed code + reasoning at the full context
    anneal_from: int = 1000  # then polish: reasoning-only rows of task_long_context tokens at a low lr up to
    #   here (after the mixed phase the models had 0.999 teacher-forced cell accuracy but 46% exact match) ...
    polish_lr: float = 5e-4
    openings_from: int = 1400  # ... and a second, lower cosine from anneal_lr up to here (same rows): after the
    #   polish the teacher-forced cell accuracy was 0.9999, yet MHA solved only 77% of the long items
    anneal_lr: float = 2e-4
    steps: int = 1600  # then "openings" to the end: every other row packs item openings (prompt and the first
    #   opening_tokens target tokens of a training item) at openings_lr. After the anneal every held-out failure
    #   was the first generated row's counter (GQA never borrowed there: 39 for 29; later rows 0 errors in 6,351),
    #   and a packed row of whole items holds one to three first rows, a row of openings eighteen
    openings_lr: float = 2e-4
    opening_tokens: int = 2 * reasoning.ROW_TOKENS
    lr: float = 2e-3  # task phase; the mixed phase decays from mixed_lr by a cosine to min_lr_ratio * mixed_lr
    mixed_lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    bf16_autocast: bool = True
    compile: bool = True  # torch.compile of the training forward (~1.3x on this CPU)
    doc_mask: bool = True  # packed documents attend only to themselves and restart their positions at 0
    #   (several items share a row and reuse the same key tokens: without the mask a lookup would also
    #   match the previous item's keys; with it, training positions match generation's)


SMOKE = Recipe(
    vocab_size=512,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=64,
    context=256,
    batch_rows=2,
    code_every=2,
    train_max_rows=3,
    task_steps=2,
    mixed_steps=1,
    task_short_steps=1,
    task_context=64,
    task_max_rows=2,
    task_long_context=128,
    anneal_from=4,
    openings_from=5,
    steps=6,
    warmup=1,
    compile=False,
)


# --------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(out_dir: Path, vocab_size: int, max_files: int | None = None) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the train split of the stdlib code and save it to ``out_dir``.

    Digits are split off one by one before BPE, so numbers are always single-digit tokens (the reasoning
    task's arithmetic is then learnable); the task's format strings are special tokens.
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
        special_tokens=list(reasoning.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=reasoning.EOS,
        bos_token=reasoning.EOS,
        pad_token=reasoning.PAD,
        additional_special_tokens=[t for t in reasoning.SPECIAL_TOKENS if t not in (reasoning.EOS, reasoning.PAD)],
        model_max_length=1 << 30,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def load_or_build_tokenizer(tok_dir: Path, vocab_size: int, max_files: int | None = None) -> PreTrainedTokenizerFast:
    if (tok_dir / "tokenizer.json").exists():
        tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        single = all(len(tok(t, add_special_tokens=False)["input_ids"]) == 1 for t in reasoning.SPECIAL_TOKENS)
        if len(tok) != vocab_size or not single:
            raise ValueError(f"{tok_dir} holds a tokenizer that does not fit this recipe/task; delete it")
        return tok
    print(f"building tokenizer in {tok_dir}", flush=True)
    return build_tokenizer(tok_dir, vocab_size, max_files)


# --------------------------------------------------------------------------------------------- models
def build_config(name: str, r: Recipe, tok: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Config of reference model ``name``; the three differ only in attention.

    MLA keeps DeepSeek-V3's ratios: ``kv_lora_rank`` = 4 x ``qk_nope_head_dim`` (512 : 128) and
    ``qk_rope_head_dim`` = ``qk_nope_head_dim`` / 2 (64 : 128), ``v_head_dim`` = ``qk_nope_head_dim``; no
    q low-rank (as DeepSeek-V2-Lite) and dense MLPs everywhere (``first_k_dense_replace`` = layers).
    """
    head_dim = r.hidden_size // r.num_heads
    common = dict(
        vocab_size=r.vocab_size,
        hidden_size=r.hidden_size,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_layers,
        num_attention_heads=r.num_heads,
        max_position_embeddings=r.context,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if name == "mla":
        return DeepseekV3Config(
            **common,
            num_key_value_heads=r.num_heads,
            kv_lora_rank=4 * head_dim,
            q_lora_rank=None,
            qk_nope_head_dim=head_dim,
            qk_rope_head_dim=head_dim // 2,
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


def _sdpa_pad_v(module, query, key, value, attention_mask, **kwargs):
    # CPU SDPA only has a fused (flash) kernel when q/k and v share a head dim; MLA's v (32) is narrower
    # than q/k (48), which drops it to the math path, ~10x slower at 2k tokens. Zero-padding v is exact.
    dv = value.shape[-1]
    if dv < query.shape[-1]:
        value = F.pad(value, (0, query.shape[-1] - dv))
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out[..., :dv], weights


AttentionInterface.register("sdpa_pad_v", _sdpa_pad_v)
AttentionMaskInterface.register("sdpa_pad_v", sdpa_mask)


# --------------------------------------------------------------------------------------------- data
class Data:
    """Deterministic batches: ``batch(step)`` is a pure function of the step, so resuming is exact.

    Task, polish and anneal phases: reasoning rows only (``task_context`` tokens for the first
    ``task_short_steps``, ``task_long_context`` after), padded without loss; the openings phase packs item
    openings instead of whole items into every other row. Mixed phase: a reasoning row packs whole training items
    from the start and is topped up with a code window; a code row (every ``code_every``-th) is one window of
    the packed train split (files joined by ``<|endoftext|>``).
    """

    def __init__(self, tok: PreTrainedTokenizerFast, r: Recipe, max_files: int | None = None) -> None:
        self.tok, self.r = tok, r
        self.eos = tok.eos_token_id
        files = read_code_files("train")[:max_files]
        ids = tok([f.text for f in files], add_special_tokens=False)["input_ids"]
        self.code = np.fromiter((t for doc in ids for t in (*doc, self.eos)), dtype=np.int64)
        if len(self.code) <= r.context + 1:
            raise ValueError(f"code stream too short ({len(self.code)} tokens) for context {r.context}")

    def _code_window(self, n: int, key: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng((self.r.seed, *key))
        start = int(rng.integers(0, len(self.code) - n))
        return self.code[start : start + n]

    def encode_item(self, item: reasoning.Item) -> tuple[list[int], list[int]]:
        """Token ids of prompt and of target + end-of-text, encoded separately as at generation time."""
        prompt = self.tok(item.prompt, add_special_tokens=False)["input_ids"]
        target = self.tok(item.target, add_special_tokens=False)["input_ids"] + [self.eos]
        return prompt, target

    def _reasoning_row(
        self, step: int, row: int, context: int, max_rows: int, top_up: bool, opening: bool = False
    ) -> tuple[list[int], list[int], list[int]]:
        n = context + 1
        ids: list[int] = []
        kind: list[int] = []
        doc: list[int] = []
        first = (step * self.r.batch_rows + row) * 128  # disjoint item ranges per row
        for j in range(128):
            item = reasoning.make_item(first + j, "train", min_rows=1, max_rows=max_rows)
            p, t = self.encode_item(item)
            if opening:
                t = t[: self.r.opening_tokens]  # a prefix of the item's text: every token is still right
            if len(ids) + len(p) + len(t) > n:
                if not top_up:
                    break  # task phase: the rest of the row is padding without loss
                continue  # try the next (maybe shorter) item; the rest of the row is topped up with code
            p_kind = [PROMPT if self.r.prompt_loss else NO_LOSS] * len(p)
            if opening and kind:
                # The previous opening stops mid-item, so this document's first token is no target (kind[i] is
                # the loss of predicting ids[i]): a first try that kept it taught the models to stop after two rows.
                p_kind = [NO_LOSS] + p_kind[1:]
            doc += [doc[-1] + 1 if doc else 0] * (len(p) + len(t))
            ids += p + t
            kind += p_kind + [REASONING] * len(t)
        fill = n - len(ids)
        if fill > 0:
            if top_up:
                ids += [self.eos] + self._code_window(fill - 1, (step, row, 1)).tolist() if fill > 1 else [self.eos]
                kind += [CODE] * fill
            else:
                ids += [self.tok.pad_token_id] * fill
                kind += [NO_LOSS] * fill
            doc += [doc[-1] + 1 if doc else 0] * fill
        return ids, kind, doc

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, per-token kinds (``NO_LOSS``, ``REASONING``, ``CODE``, ``PROMPT``) and document ids, each
        ``[batch_rows, context + 1]``, for optimizer step ``step``."""
        rows, kinds, docs = [], [], []
        mixed = self.r.task_steps <= step < self.r.task_steps + self.r.mixed_steps
        short = step < self.r.task_short_steps
        context = self.r.task_context if short else self.r.task_long_context
        max_rows = self.r.task_max_rows if short else self.r.train_max_rows
        openings = step >= self.r.openings_from
        for row in range(self.r.batch_rows):
            if not mixed:
                ids, kind, doc = self._reasoning_row(step, row, context, max_rows, False, openings and row % 2 == 1)
            elif (step * self.r.batch_rows + row) % self.r.code_every != self.r.code_every - 1:
                ids, kind, doc = self._reasoning_row(step, row, self.r.context, self.r.train_max_rows, True)
            else:
                ids = self._code_window(self.r.context + 1, (step, row, 0)).tolist()
                kind, doc = [CODE] * len(ids), [0] * len(ids)
            rows.append(ids)
            kinds.append(kind)
            docs.append(doc)
        return torch.tensor(rows), torch.tensor(kinds), torch.tensor(docs)


def doc_mask_and_positions(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diagonal causal mask and per-document positions for packed rows.

    Args:
        doc: ``[batch, seq]`` document id of each token (non-decreasing along a row).

    Returns:
        ``mask [batch, 1, seq, seq]`` (bool, True = may attend) and ``position_ids [batch, seq]``.
    """
    ar = torch.arange(doc.shape[1])
    first = torch.ones_like(doc, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    start = torch.cummax(torch.where(first, ar, 0), dim=1).values
    mask = (doc[:, :, None] == doc[:, None, :]) & (ar[:, None] >= ar[None, :])
    return mask[:, None], ar - start


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
            input_ids=ids,
            attention_mask=att,
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
    return {
        "n": n,
        "exact_match": correct / n,
        "correct": correct,
        "wilson95": [lo, hi],
        "final_answer_acc": answer_ok / n,
        "failed_indices": sorted(failures),
        "mean_target_tokens": float(np.mean([len(data.encode_item(it)[1]) for it in items])),
        "mean_prompt_tokens": float(np.mean([len(data.encode_item(it)[0]) for it in items])),
    }


@torch.no_grad()
def target_hits(model: PreTrainedModel, prompt: list[int], target: list[int]) -> list[bool]:
    """For each target token: is it the argmax given the prompt and the reference target before it."""
    logits = model(input_ids=torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1]
    return (logits.argmax(-1) == torch.tensor(target)).tolist()


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
    row = reasoning.ROW_TOKENS  # counter, cells, row break
    for it in items:
        ok = target_hits(model, *data.encode_item(it))
        all_right += all(ok)
        for j, o in enumerate(ok[: row * it.num_rows - 1]):
            if reasoning.COUNTER <= j % row < reasoning.COUNTER + reasoning.WIDTH:
                hits["cell"].append(o)
                if j % row == reasoning.COUNTER:
                    hits["row_start"].append(o)
    out = {f"tf_acc_{k}": sum(v) / max(1, len(v)) for k, v in hits.items()}
    out["tf_items_all_right"] = all_right / len(items)
    return out


@torch.no_grad()
def eval_code(model: PreTrainedModel, data: Data, max_tokens: int | None) -> dict[str, object]:
    """Held-out code perplexity over non-overlapping context windows, and a unigram baseline on the same
    predicted tokens (add-one smoothed unigram fitted on the whole train code stream)."""
    tok, ctx = data.tok, data.r.context
    model.eval()
    files = read_code_files("held_out")
    ids = tok([f.text for f in files], add_special_tokens=False)["input_ids"]
    stream = torch.tensor([t for doc in ids for t in (*doc, data.eos)])
    n_windows = max(1, len(stream) // (ctx + 1))
    if max_tokens is not None:
        n_windows = max(1, min(n_windows, max_tokens // ctx))
    counts = np.bincount(data.code, minlength=len(tok)).astype(np.float64) + 1.0
    log_uni = torch.from_numpy(np.log(counts / counts.sum()))
    nll = uni = 0.0
    n = 0
    for w in range(n_windows):
        chunk = stream[w * (ctx + 1) : (w + 1) * (ctx + 1)]
        logits = model(input_ids=chunk[None, :-1]).logits.float()[0]
        nll += float(F.cross_entropy(logits, chunk[1:], reduction="sum"))
        uni -= float(log_uni[chunk[1:]].sum())
        n += len(chunk) - 1
    return {
        "files": len(files),
        "tokens_available": len(stream),
        "tokens_scored": n,
        "window": ctx,
        "perplexity": math.exp(nll / n),
        "unigram_perplexity": math.exp(uni / n),
        "bits_per_token": nll / n / math.log(2),
    }


# --------------------------------------------------------------------------------------------- train
def lr_at(step: int, r: Recipe) -> float:
    """Task phase: linear warmup to ``lr``, then constant. Mixed, polish, anneal and openings phases: each a cosine
    from its peak (``mixed_lr``, ``polish_lr``, ``anneal_lr``, ``openings_lr``) to ``min_lr_ratio`` times it at the
    phase's last step."""
    if step < r.task_steps:
        return r.lr * min(1.0, (step + 1) / r.warmup)
    mixed_end = r.task_steps + r.mixed_steps
    if step < mixed_end:
        peak, start, end = r.mixed_lr, r.task_steps, mixed_end
    elif step < r.anneal_from:
        peak, start, end = r.polish_lr, mixed_end, r.anneal_from
    elif step < r.openings_from:
        peak, start, end = r.anneal_lr, r.anneal_from, r.openings_from
    else:
        peak, start, end = r.openings_lr, r.openings_from, r.steps
    t = (step - start) / max(1, end - start)
    return peak * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def count_params(model: PreTrainedModel) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    emb = model.get_input_embeddings().weight.numel()
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


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
    bf16.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=MODEL_NAMES)
    ap.add_argument("--steps", type=int, help="optimizer steps (default: the recipe's)")
    ap.add_argument("--max-steps", type=int, help="stop after this many steps (schedule still uses --steps)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny data slice, a few steps (tests)")
    ap.add_argument("--out-dir", type=Path, help="checkpoint dir (default kvarn_mla/reference_models/<name>)")
    ap.add_argument("--results", type=Path, help="metrics JSON (default benchmarks/models/results/<name>.json)")
    ap.add_argument("--run-dir", type=Path, help="log/resume dir (default runs/<name>)")
    ap.add_argument("--tokenizer-dir", type=Path, help="tokenizer cache (default runs/tokenizer)")
    ap.add_argument("--resume", action="store_true", help="continue from run-dir/state.pt if present")
    ap.add_argument("--eval-items", type=int, default=200, help="held-out reasoning items for the final eval")
    ap.add_argument("--eval-code-tokens", type=int, help="cap on held-out code tokens scored (default all)")
    ap.add_argument("--monitor-every", type=int, default=100, help="steps between quick held-out evals (0: off)")
    ap.add_argument("--monitor-items", type=int, default=16)
    ap.add_argument("--save-every", type=int, default=50, help="steps between resumable states")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    r = SMOKE if args.smoke else Recipe()
    if args.steps is not None:
        r = Recipe(**{**asdict(r), "steps": args.steps})
    max_files = 40 if args.smoke else None
    run_dir = args.run_dir or DEFAULT_RUNS / (f"smoke-{args.name}" if args.smoke else args.name)
    out_dir = args.out_dir or DEFAULT_OUT_ROOT / args.name
    results = args.results or DEFAULT_RESULTS / f"{args.name}.json"
    tok_dir = args.tokenizer_dir or (run_dir / "tokenizer" if args.smoke else DEFAULT_TOKENIZER_DIR)
    run_dir.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(r.seed)
    t_setup = time.time()
    tok = load_or_build_tokenizer(tok_dir, r.vocab_size, max_files)
    data = Data(tok, r, max_files)
    config = build_config(args.name, r, tok)
    model = build_model(config)
    model.config._attn_implementation = "sdpa_pad_v"
    params = count_params(model)
    print(
        f"[{args.name}] params {params} | code train tokens {len(data.code):,} | setup {time.time() - t_setup:.1f}s",
        flush=True,
    )

    # One weight-decay group over all parameters: with norm gains and biases exempted (the usual split) the
    # lookup never formed in two task-phase runs, while every probe with this single group learned it.
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=r.weight_decay)
    state_path = run_dir / "state.pt"
    start, train_seconds, history = 0, 0.0, []
    seen = {"input_tokens": 0, "loss_tokens": 0, "reasoning_loss_tokens": 0}
    if args.resume and state_path.exists():
        st = torch.load(state_path, weights_only=False)
        # A state written by the recipe before the openings phase existed (it ended at openings_from) continues
        # into that phase: every step it took is the same under this recipe.
        before = {**asdict(r), "steps": r.openings_from}
        del before["openings_from"], before["openings_lr"], before["opening_tokens"]
        if st["recipe"] != asdict(r) and not (st["recipe"] == before and st["step"] <= r.openings_from):
            raise ValueError(f"{state_path} was written by a different recipe: {st['recipe']}")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start, train_seconds, history, seen = st["step"], st["train_seconds"], st["history"], st["seen"]
        print(f"[{args.name}] resumed at step {start}", flush=True)

    monitor = reasoning.held_out_items(args.monitor_items, start=MONITOR_START)
    # Compiled forward for training only; generation and checkpoints use the plain module (same weights).
    forward = torch.compile(model, dynamic=False) if r.compile else model
    stop = min(r.steps, args.max_steps) if args.max_steps is not None else r.steps
    for step in range(start, stop):
        model.train()
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        seq, kind, doc = data.batch(step)
        inputs, targets, kind = seq[:, :-1], seq[:, 1:], kind[:, 1:]
        mask, positions = doc_mask_and_positions(doc[:, :-1]) if r.doc_mask else (None, None)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=r.bf16_autocast):
            logits = forward(input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=False).logits
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        n_reason, n_code = int((kind == REASONING).sum()), int((kind == CODE).sum())
        n_loss = int((kind != NO_LOSS).sum())
        loss = (nll * (kind != NO_LOSS)).sum() / n_loss
        loss.backward()
        loss = loss.detach()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.time() - t0
        train_seconds += dt
        seen["input_tokens"] += inputs.numel()
        seen["loss_tokens"] += n_loss
        seen["reasoning_loss_tokens"] += n_reason
        with torch.no_grad():
            loss_r = float((nll * (kind == REASONING)).sum() / max(n_reason, 1))
            loss_c = float((nll * (kind == CODE)).sum() / max(n_code, 1))
        rec = {
            "step": step + 1,
            "loss": loss.item(),
            "loss_reasoning": loss_r,
            "loss_code": loss_c,
            "lr": lr_at(step, r),
            "grad_norm": gnorm,
            "sec": dt,
        }
        if args.monitor_every and (step + 1) % args.monitor_every == 0:
            t_mon = time.time()
            m = eval_reasoning(model, data, monitor, args.monitor_items, 16 if args.smoke else None)
            rec["monitor_exact_match"] = m["exact_match"]
            rec["monitor_final_answer_acc"] = m["final_answer_acc"]
            rec.update(teacher_forced(model, data, monitor))
            rec["monitor_sec"] = time.time() - t_mon
        history.append(rec)
        print(
            f"[{args.name}] step {step + 1}/{r.steps} loss {loss:.3f} (reason {loss_r:.3f} code {loss_c:.3f}) "
            f"lr {rec['lr']:.2e} gn {gnorm:.2f} "
            f"{dt:.2f}s ({inputs.numel() / dt:.0f} tok/s) train {train_seconds / 60:.1f}min"
            + (
                f" | monitor EM {rec['monitor_exact_match']:.3f} ans {rec['monitor_final_answer_acc']:.3f} "
                f"tf cell {rec['tf_acc_cell']:.3f} row start {rec['tf_acc_row_start']:.3f} "
                f"all {rec['tf_items_all_right']:.3f} ({rec['monitor_sec']:.0f}s)"
                if "monitor_exact_match" in rec
                else ""
            ),
            flush=True,
        )
        if (step + 1) % args.save_every == 0 or step + 1 == stop:
            tmp = state_path.with_suffix(".tmp")
            torch.save(
                {
                    "recipe": asdict(r),
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step + 1,
                    "train_seconds": train_seconds,
                    "history": history,
                    "seen": seen,
                },
                tmp,
            )
            os.replace(tmp, state_path)

    # Final evaluation runs on the checkpoint as shipped: bf16 weights, loaded back in float32.
    ckpt_bytes = save_checkpoint(model, tok, out_dir)
    shipped = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    t_eval = time.time()
    code = eval_code(shipped, data, 4 * r.context if args.smoke else args.eval_code_tokens)
    items = reasoning.held_out_items(args.eval_items)
    reason = eval_reasoning(shipped, data, items, max_new_tokens=16 if args.smoke else None)
    eval_seconds = time.time() - t_eval
    metrics = {
        "name": args.name,
        "architecture": type(model).__name__,
        "recipe": asdict(r),
        "steps_done": stop,
        "params": params,
        "config": {k: v for k, v in config.to_diff_dict().items() if not k.startswith("_")},
        "tokens_seen": seen,
        "train_seconds": train_seconds,
        "final_train_loss_mean_last_20": float(np.mean([h["loss"] for h in history[-20:]])) if history else None,
        "eval_seconds": eval_seconds,
        "held_out_code": code,
        "held_out_reasoning": {
            **reason,
            "task": {
                "modulus": reasoning.MODULUS,
                "width": reasoning.WIDTH,
                "min_rows": reasoning.MIN_ROWS,
                "max_rows": reasoning.MAX_ROWS,
            },
            "decoding": "greedy, batched with left padding, DynamicCache, bf16 checkpoint computed in float32",
        },
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_files": {p.name: p.stat().st_size for p in sorted(out_dir.iterdir())},
        "environment": {
            **corpus_info(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": platform.machine(),
            "threads": args.threads,
        },
        "command": "python benchmarks/models/train_reference.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "history": history,
    }
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(metrics, indent=1, default=str) + "\n")
    print(
        f"[{args.name}] code ppl {code['perplexity']:.3f} (unigram {code['unigram_perplexity']:.1f}) | reasoning EM "
        f"{reason['exact_match']:.3f} ({reason['correct']}/{reason['n']}, 95% CI {reason['wilson95'][0]:.3f}-"
        f"{reason['wilson95'][1]:.3f}) | checkpoint {ckpt_bytes / 2**20:.2f} MiB | wrote {results}",
        flush=True,
    )
    return metrics


if __name__ == "__main__":
    main()
