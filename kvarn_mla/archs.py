"""Architecture numbers of well-known checkpoints (their published config.json; no weights) and `load_config`."""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from transformers import AutoConfig, PretrainedConfig

# name -> (model_type, config fields). Numbers are those of the public config.json of the checkpoint in SOURCES
# (architecture fields only: rope scaling, token ids and dtypes do not change bytes or parameter counts).
_DEEPSEEK_V3 = dict(hidden_size=7168, num_hidden_layers=61, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048,
                    n_shared_experts=1, num_experts_per_tok=8)
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama-2-7b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                                 max_position_embeddings=4096)),
    "llama-3-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                 max_position_embeddings=8192)),
    "llama-3-70b": ("llama", dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                  num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                                  max_position_embeddings=8192)),
    "qwen3-32b": ("qwen3", dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                                head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False,
                                use_sliding_window=False, max_position_embeddings=40960)),
    # v0.3 (32768-token vocabulary, no sliding window: every layer is full attention). v0.1 used a 4096-token window.
    "mistral-7b": ("mistral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=32768,
                                   sliding_window=None, max_position_embeddings=32768)),
    "deepseek-v2-lite": ("deepseek_v2", dict(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                                             num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                             intermediate_size=10944, moe_intermediate_size=1408,
                                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                                             first_k_dense_replace=1, vocab_size=102400,
                                             max_position_embeddings=163840)),
    # The multi-token-prediction layer of the checkpoint (num_nextn_predict_layers=1) is not part of the
    # transformers class, so the parameter count is the 671B of the main model.
    "deepseek-v3": ("deepseek_v3", dict(_DEEPSEEK_V3, num_attention_heads=128, num_key_value_heads=128,
                                        n_routed_experts=256, first_k_dense_replace=3, n_group=8, topk_group=4,
                                        vocab_size=129280, max_position_embeddings=163840)),
    # The checkpoint says model_type "kimi_k2" (remote code); the architecture is DeepSeek-V3's with 64 heads,
    # 384 experts, one dense layer and ungrouped routing.
    "kimi-k2": ("deepseek_v3", dict(_DEEPSEEK_V3, num_attention_heads=64, num_key_value_heads=64,
                                    n_routed_experts=384, first_k_dense_replace=1, n_group=1, topk_group=1,
                                    vocab_size=163840, max_position_embeddings=131072)),
    "glm-4.7-flash": ("glm4_moe_lite", dict(hidden_size=2048, num_hidden_layers=47, num_attention_heads=20,
                                            num_key_value_heads=20, kv_lora_rank=512, q_lora_rank=768,
                                            qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                                            intermediate_size=10240, moe_intermediate_size=1536, n_routed_experts=64,
                                            n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
                                            n_group=1, topk_group=1, vocab_size=154880, tie_word_embeddings=False,
                                            max_position_embeddings=202752)),
    # The config.json has no v_head_dim (the class derives hidden_size / heads = 64) and no tie_word_embeddings
    # (the default, True: the checkpoint has no lm_head.weight).
    "minicpm3-4b": ("minicpm3", dict(hidden_size=2560, num_hidden_layers=62, num_attention_heads=40,
                                     num_key_value_heads=40, kv_lora_rank=256, q_lora_rank=768, qk_nope_head_dim=64,
                                     qk_rope_head_dim=32, intermediate_size=6400, vocab_size=73448,
                                     tie_word_embeddings=True, max_position_embeddings=32768)),
}
# The Hugging Face checkpoint each bundled architecture is taken from.
SOURCES: dict[str, str] = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "mistral-7b": "mistralai/Mistral-7B-v0.3",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
    "glm-4.7-flash": "zai-org/GLM-4.7-Flash",
    "minicpm3-4b": "openbmb/MiniCPM3-4B",
}


# Checkpoints whose config.json names a remote-code model type that transformers knows under another name.
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def load_config(name_or_path: str, cache_dir: str | Path | None = None) -> PretrainedConfig:
    """A model config from a bundled architecture name, a ``config.json``, a model directory or a cached hub name.

    Tried in this order: a bundled name (case-insensitive, e.g. ``"Llama-3-8B"``), a local file or directory, then
    a Hugging Face hub name (``"deepseek-ai/DeepSeek-V3"``) whose ``config.json`` is already in the local cache.
    Nothing is downloaded.

    Args:
        name_or_path: What to load.
        cache_dir: The Hugging Face hub cache to look in; None uses the default (``HF_HUB_CACHE``).

    Raises:
        ValueError: when it is none of these (the message lists the bundled names), or when the config's
            ``model_type`` is unknown to the installed transformers.
    """
    if name_or_path.lower() in ARCHITECTURES:
        model_type, fields = ARCHITECTURES[name_or_path.lower()]
        return AutoConfig.for_model(model_type, **fields)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        path = _cached_hub_config(name_or_path, cache_dir)
    if path is None:
        raise ValueError(f"unknown model {name_or_path!r}: " + _not_found_hint(name_or_path, cache_dir))
    return _config_from_file(path)


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _cached_hub_config(repo_id: str, cache_dir: str | Path | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    if not _is_repo_id(repo_id):
        return None
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    # A str is the cached file; None means never fetched, and a sentinel object means "known not to exist".
    return Path(found) if isinstance(found, str) else None


def _not_found_hint(name: str, cache_dir: str | Path | None) -> str:
    from huggingface_hub import constants

    hint = (f"not a bundled architecture {sorted(ARCHITECTURES)}, not a config.json or model directory, "
            f"and not a hub name with its config.json in the local Hugging Face cache "
            f"({cache_dir or constants.HF_HUB_CACHE})")
    if _is_repo_id(name):
        hint += f"; nothing is downloaded: fetch it first with `hf download {name} config.json`"
        same = [key for key, source in SOURCES.items() if source.lower() == name.lower()]
        if same:
            hint += f", or use the bundled {same[0]!r}, the same architecture"
    return hint


def _config_from_file(path: Path) -> PretrainedConfig:
    try:
        fields = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"{path} has no model_type; expected a transformers config.json")
    model_type = fields.pop("model_type")
    model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (KeyError, ValueError):  # transformers' message lists every model type it knows, hundreds of them
        raise ValueError(f"{path}: model_type {model_type!r} is not known to transformers {transformers.__version__}") \
            from None
