"""The project's bundled reference models, trained here on real text (see benchmarks/models/README.md).

Three small decoder LMs that differ only in attention, trained identically on Python-stdlib code and the
long-chain reasoning task of :mod:`kvarn_mla.evaluation.reasoning`:

- ``"mla"``: ``DeepseekV3ForCausalLM`` (latent ``c_kv`` + decoupled RoPE key),
- ``"gqa"``: ``LlamaForCausalLM`` with 4 query heads per kv head,
- ``"mha"``: ``LlamaForCausalLM`` with one kv head per query head.

Checkpoints (bf16 safetensors, config, tokenizer) ship as package data, so loading works offline:

>>> from kvarn_mla import reference_models
>>> model, tokenizer = reference_models.load("mla")  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch/transformers are imported lazily: listing paths must stay cheap
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["NAMES", "load", "path"]

NAMES: tuple[str, ...] = ("mla", "gqa", "mha")
_ROOT = Path(__file__).resolve().parent


def path(name: str) -> Path:
    """Directory of the bundled checkpoint ``name``.

    Args:
        name: ``"mla"``, ``"gqa"`` or ``"mha"``.

    Returns:
        The directory holding ``config.json``, ``model.safetensors`` and the tokenizer files.

    Raises:
        ValueError: ``name`` is not one of :data:`NAMES`.
        FileNotFoundError: the checkpoint is not present (e.g. not trained yet in this checkout).
    """
    if name not in NAMES:
        raise ValueError(f"unknown reference model {name!r}; expected one of {', '.join(NAMES)}")
    p = _ROOT / name
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"reference model {name!r} is missing at {p}; train it with "
            f"`python benchmarks/models/train_reference.py {name}`"
        )
    return p


def load(
    name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load a bundled reference model and its tokenizer, offline, in eval mode.

    Args:
        name: ``"mla"``, ``"gqa"`` or ``"mha"``.
        dtype: parameter dtype (default ``torch.float32``; the weights are stored in bf16).
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``; ``tokenizer.eos_token`` ends a reasoning answer and separates documents. The MLA
        attends through ``"sdpa_pad_v"`` (`kvarn_mla.use_padded_sdpa`: the fused SDPA kernel despite its narrower
        value head), as it was trained.
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from ..patch import use_padded_sdpa

    p = path(name)
    dtype = torch.float32 if dtype is None else dtype
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(p, local_files_only=True)
    use_padded_sdpa(model)
    return model.to(device).eval(), tokenizer
