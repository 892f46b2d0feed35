"""lm-evaluation-harness tasks on a patched model: a thin wrapper around lm-eval's ``HFLM``.

``run_lm_eval`` loads the model once, patches it with `kvarn_mla.patch` (or leaves it on the 16-bit cache), wraps
the instance in `KVarNHFLM` (``HFLM(pretrained=model, tokenizer=tokenizer)``) and calls
``lm_eval.simple_evaluate``. lm-eval is an optional extra (``pip install ".[lm-eval]"``), imported only here.

What the two request kinds see on a patched model:

* ``generate_until``: HFLM calls ``model.generate(input_ids, attention_mask, use_cache=True, ...)`` with no cache;
  `KVarNHFLM` passes a fresh `KVarNCache` as ``cache=`` (what the patched ``generate`` would build itself), so
  its bytes can be reported. The prompt is prefilled in full precision, as in deployment; each generated token
  attends the quantized tiles.
* ``loglikelihood`` / ``loglikelihood_rolling``: HFLM scores ``[B, T]`` right-padded ids with one
  ``model(ids)``. A prefill over an empty cache attends in full precision, so that one call would score exactly
  like the 16-bit cache whatever the preset. `KVarNHFLM._model_call` instead runs the ids through a `KVarNCache`
  in chunks whose ends fall on tile boundaries (the first chunk ``sink_tokens + tile_size`` tokens, then one
  tile each): every token then attends what greedy decoding would have left in the cache at its position (sink
  and tail in full precision, the completed tiles quantized). Sequences up to ``sink_tokens + tile_size`` tokens
  are never quantized, in decoding as here, and score as with the 16-bit cache. Right padding sits after every
  real token, so it never reaches a real token's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..cache import KVarNCache
from ..patch import STATE_ATTR, is_patched, patch
from .methods import parse_method
from .runner import load_model
from .tasks import chunk_spans

INSTALL_HINT = 'pip install ".[lm-eval]"'


def require_lm_eval():
    """The ``lm_eval`` module.

    Raises:
        ValueError: lm-eval is not installed (one line naming the extra to install).
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (HFLM needs more than the top-level package)
    except ImportError as error:
        raise ValueError(f"lm-evaluation-harness is not installed: {INSTALL_HINT} ({error})") from None
    return lm_eval


def tile_chunks(length: int, sink_tokens: int, tile_size: int) -> list[tuple[int, int]]:
    """``(start, end)`` spans covering ``range(length)`` that end where decoding completes a tile: the first at
    ``sink_tokens + tile_size``, then every ``tile_size`` tokens."""
    return chunk_spans(0, length, sink_tokens + tile_size, tile_size)


class CacheStats:
    """What the patched runs held: calls through a `KVarNCache` and the largest cache's bytes (quantized and as an
    unquantized cache in the model dtype would hold them)."""

    def __init__(self) -> None:
        self.scored_calls = 0
        self.generate_calls = 0
        self.max_nbytes = 0
        self.max_dense_nbytes = 0

    def add(self, cache: KVarNCache) -> None:
        nbytes = cache.nbytes()
        if nbytes > self.max_nbytes:
            self.max_nbytes, self.max_dense_nbytes = nbytes, cache.dense_nbytes()

    def as_dict(self) -> dict:
        return {"scored_calls": self.scored_calls, "generate_calls": self.generate_calls,
                "max_cache_nbytes": self.max_nbytes, "max_cache_dense_nbytes": self.max_dense_nbytes}


def make_hflm(model, tokenizer, batch_size: int | str = 1, max_length: int | None = None):
    """``KVarNHFLM`` (an lm-eval ``HFLM``) around a loaded, optionally patched, model instance."""
    from lm_eval.models.huggingface import HFLM

    class KVarNHFLM(HFLM):
        """HFLM whose requests go through the patched model's `KVarNCache` (see the module docstring)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kvarn_stats = CacheStats()

        def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
            if not is_patched(self.model) or attn_mask is not None or labels is not None:
                return super()._model_call(inps, attn_mask, labels)
            config = self.model.__dict__[STATE_ATTR].config
            cache = KVarNCache(self.model)
            with torch.no_grad():
                logits = torch.cat([self.model(inps[:, s:e], cache=cache, use_cache=True).logits
                                    for s, e in tile_chunks(inps.shape[1], config.sink_tokens, config.tile_size)], 1)
            self.kvarn_stats.scored_calls += 1
            self.kvarn_stats.add(cache)
            return logits

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            if not is_patched(self.model) or "cache" in generation_kwargs:
                return super()._model_generate(context, max_length, stop, **generation_kwargs)
            cache = KVarNCache(self.model)
            out = super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)
            self.kvarn_stats.generate_calls += 1
            self.kvarn_stats.add(cache)
            return out

    device = str(next(model.parameters()).device)
    return KVarNHFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                     max_length=max_length, device=device)


def run_lm_eval(model_name: str, preset: str | None, tasks: list[str], *, dtype: torch.dtype = torch.float32,
                limit: float | None = None, num_fewshot: int | None = None, batch_size: int | str = 1,
                include_path: str | None = None, gen_kwargs: str | None = None, max_length: int | None = None,
                log_samples: bool = False, seed: int = 0) -> dict:
    """Run lm-eval ``tasks`` on ``model_name`` patched with ``preset`` (None or ``"none"``: the 16-bit cache).

    Args:
        model_name: ``mla``, ``gqa``, ``mha`` (bundled), a model directory, or a hub name in the local cache.
        preset: A KVarN method as `kvarn-mla eval` takes it (``k4v2``, ``k4v2+tile_size=64``, ``kvarn-3``, ...),
            or None / ``"none"`` / a reference name for the unquantized cache.
        tasks: lm-eval task or group names (those under ``include_path`` included).
        limit, num_fewshot, gen_kwargs, log_samples, seed: passed to ``lm_eval.simple_evaluate``.
        batch_size, max_length: passed to ``HFLM``.
        include_path: A directory of local task YAMLs.

    Returns:
        lm-eval's results dict, plus ``"kvarn"``: the preset, its config and `CacheStats` of the patched run.

    Raises:
        ValueError: lm-eval missing, an unknown task, preset or model.
    """
    lm_eval = require_lm_eval()
    from lm_eval.tasks import TaskManager

    method = parse_method("reference" if preset in (None, "none") else preset)
    if method.kind == "hf":
        raise ValueError(f"--preset {preset!r}: lm-eval runs KVarN presets or none (16-bit); transformers' "
                         "quantized caches are baselines of `kvarn-mla eval` only")
    task_manager = None
    if include_path:  # indexing lm-eval's own task YAMLs takes tens of seconds: only when a task is not local
        task_manager = TaskManager(include_path=include_path, include_defaults=False)
    if task_manager is None or any(t not in task_manager.all_tasks for t in tasks):
        task_manager = TaskManager(include_path=include_path)
    missing = [t for t in tasks if t not in task_manager.all_tasks]
    if missing:
        where = f" (with --include-path {include_path})" if include_path else " (local YAMLs need --include-path DIR)"
        raise ValueError(f"unknown lm-eval tasks {missing}{where}")
    model, tokenizer = load_model(model_name, dtype)
    if method.kind == "kvarn":
        patch(model, method.config)
    hflm = make_hflm(model, tokenizer, batch_size=batch_size, max_length=max_length)
    results = lm_eval.simple_evaluate(model=hflm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                      gen_kwargs=gen_kwargs, task_manager=task_manager, log_samples=log_samples,
                                      random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                      fewshot_random_seed=seed)
    results["kvarn"] = {"model": model_name, "preset": method.name if method.kind == "kvarn" else "none",
                        "config": repr(method.config) if method.config else None, **hflm.kvarn_stats.as_dict()}
    return results


def write_results(results: dict, out: Path) -> None:
    """lm-eval's results as JSON (``handle_non_serializable`` turns what JSON cannot hold into strings)."""
    from lm_eval.utils import handle_non_serializable

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=handle_non_serializable))
