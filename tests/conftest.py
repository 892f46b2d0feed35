"""Shared fixtures: tiny models of the real transformers classes, built from configs (no downloads)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import torch  # (does not import triton)

# Without a GPU the Triton kernels run in Triton's interpreter; the flag must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Kernel tests run compiled on CUDA when there is a GPU, in Triton's interpreter otherwise.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.set_num_threads(min(2, torch.get_num_threads()))

_DENSE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              vocab_size=128, max_position_embeddings=1024)
_MLA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=128,
            intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, max_position_embeddings=1024)
_DSA = dict(index_n_heads=2, index_head_dim=16, index_topk=16)

# One tiny config per supported model type (the registry test checks this table is complete).
TINY_CONFIGS: dict[str, dict] = {
    "llama": _DENSE,
    "mistral": dict(_DENSE, sliding_window=None),
    "qwen2": _DENSE,
    "qwen3": dict(_DENSE, head_dim=16),
    "deepseek_v2": dict(_MLA, topk_method="group_limited_greedy"),
    "deepseek_v3": _MLA,
    "kimi_k25": dict(text_config=dict(_MLA, model_type="deepseek_v3"),
                     vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, patch_size=14)),
    "glm4_moe_lite": dict(_MLA, n_group=1),
    "minicpm3": _MLA,
    "longcat_flash": dict(_MLA, num_layers=1, head_dim=8),
    "deepseek_v32": dict(_MLA, **_DSA),
    "glm_moe_dsa": dict(_MLA, n_group=1, **_DSA),
}
# Realistic attention widths, one model per family: MLA 512 + 64 (nope 128, v 128) and dense head_dim 128.
WIDE_CONFIGS: dict[str, tuple[str, dict]] = {
    "mla-512+64": ("deepseek_v3", dict(_MLA, num_hidden_layers=1, hidden_size=128, num_attention_heads=2,
                                       num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=96, qk_nope_head_dim=128,
                                       qk_rope_head_dim=64, v_head_dim=128)),
    "gqa-128": ("llama", dict(_DENSE, num_hidden_layers=1, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=128)),
}


def build_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random model of ``model_type`` in eval mode (float32), generating to ``max_new_tokens`` (no EOS)."""
    kwargs = dict(TINY_CONFIGS[model_type], **overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    if model_type == "kimi_k25":
        from transformers import Kimi_K25ForConditionalGeneration

        model = Kimi_K25ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    return _no_eos(model)


def build_wide(name: str, seed: int = 0) -> torch.nn.Module:
    model_type, kwargs = WIDE_CONFIGS[name]
    torch.manual_seed(seed)
    return _no_eos(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs)))


def _no_eos(model):
    # A random model may emit its EOS id; generation would then stop and pad, which is not what the tests compare.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when identical)."""
    reference, other = reference.double(), other.double()
    noise = (reference - other).norm()
    return float("inf") if noise == 0 else float(20 * torch.log10(reference.norm() / noise))


@torch.no_grad()
def teacher_forced_logits(
    model, ids: torch.Tensor, prompt_len: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Prefill ``ids[:, :prompt_len]``, then decode the remaining ids one by one (teacher forcing).

    With an ``attention_mask [B, T]`` (left padding), positions count real tokens only, as in ``generate``.

    Returns:
        ``[B, 1 + len(decoded), vocab]`` logits: the prefill's last position, then each decode step.
    """
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids[:, :prompt_len], attention_mask=mask[:, :prompt_len], position_ids=positions[:, :prompt_len],
                use_cache=True)
    cache, logits = out.cache, [out.logits[:, -1]]
    for t in range(prompt_len, ids.shape[1]):
        out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=positions[:, t : t + 1],
                    cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@torch.no_grad()
def assert_greedy_choices(model, sequences: torch.Tensor, prompt_len: int, tie: float = 1e-3) -> None:
    """Every token after ``prompt_len`` is a greedy choice of ``model`` (run unpatched, teacher-forced on the same
    sequence), up to exact ties: its logit is within ``tie`` of the maximum."""
    logits = model(sequences).logits[:, prompt_len - 1 : -1]
    chosen = logits.gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)
    gap = logits.amax(-1) - chosen
    assert (gap <= tie).all(), f"non-greedy tokens, logit gaps {gap[gap > tie].tolist()}"


@pytest.fixture
def tiny():
    return build_model


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
