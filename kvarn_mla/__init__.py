"""kvarn_mla: KVarN KV-cache quantization for Hugging Face transformers MHA, GQA and MLA models.

    import kvarn_mla
    kvarn_mla.patch(model, "k4v2")      # or a KVarNConfig; "k4v2" if omitted
    out = model.generate(ids, max_new_tokens=256, return_dict_in_generate=True)
    out.cache.nbytes(), out.cache.dense_nbytes()
    kvarn_mla.unpatch(model)

Nothing is patched or registered at import time.
"""

from .adapters import supported_model_types
from .cache import KVarNCache, KVarNIndexedLayer, KVarNLayer
from .config import DEFAULT_PRESET, PRESETS, KVarNConfig, resolve_config
from .patch import is_patched, patch, patched, unpatch
from .quant.fake import fake_quantize
from .quant.scheme import TileScheme

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PRESET", "KVarNCache", "KVarNConfig", "KVarNIndexedLayer", "KVarNLayer", "PRESETS", "fake_quantize",
    "TileScheme", "is_patched", "patch", "patched", "resolve_config", "supported_model_types", "unpatch", "__version__",
]
