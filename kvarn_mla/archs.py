"""Attention-relevant architecture numbers of well-known checkpoints (published configs; no weights)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

# name -> (model_type, config fields). Numbers are those of the public config.json files.
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama-2-7b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32000)),
    "llama-3-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)),
    "deepseek-v2-lite": ("deepseek_v2", dict(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                                             num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                             intermediate_size=10944, moe_intermediate_size=1408,
                                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                                             first_k_dense_replace=1, vocab_size=102400)),
    "deepseek-v3": ("deepseek_v3", dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                                        num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                                        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                                        vocab_size=129280)),
}


def load_config(name_or_path: str) -> PretrainedConfig:
    """A model config from a bundled architecture name, a ``config.json`` file or a model directory.

    Raises:
        ValueError: when it is none of these (the message lists the bundled names).
    """
    if name_or_path in ARCHITECTURES:
        model_type, fields = ARCHITECTURES[name_or_path]
        return AutoConfig.for_model(model_type, **fields)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        fields = json.loads(path.read_text())
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    raise ValueError(
        f"unknown model {name_or_path!r}: give a config.json, a model directory, or one of {sorted(ARCHITECTURES)}"
    )
