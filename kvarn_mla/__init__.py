"""kvarn_mla: KVarN KV-cache quantization for Hugging Face transformers MHA, GQA and MLA models.

    import kvarn_mla
    kvarn_mla.patch(model, "k4v2")      # or a KVarNConfig; "k4v2" if omitted
    out = model.generate(ids, max_new_tokens=256, return_dict_in_generate=True)
    out.cache.nbytes(), out.cache.dense_nbytes()
    kvarn_mla.unpatch(model)

Nothing is patched or registered at import time, and nothing heavy is imported either: the public names below are
loaded from their modules on first use (PEP 562), so ``import kvarn_mla`` and ``kvarn-mla --help`` do not import
torch or transformers.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "supported_model_types": "adapters",
    "KVarNCache": "cache", "KVarNIndexedLayer": "cache", "KVarNLayer": "cache",
    "DEFAULT_PRESET": "config", "PRESETS": "config", "KVarNConfig": "config", "resolve_config": "config",
    "is_patched": "patch", "patch": "patch", "patched": "patch", "unpatch": "patch",
    "use_padded_sdpa": "patch",
    "fake_quantize": "quant.fake",
    "TileScheme": "quant.scheme",
}

__all__ = [
    "DEFAULT_PRESET", "KVarNCache", "KVarNConfig", "KVarNIndexedLayer", "KVarNLayer", "PRESETS", "fake_quantize",
    "TileScheme", "is_patched", "patch", "patched", "resolve_config", "supported_model_types", "unpatch",
    "use_padded_sdpa", "__version__",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these come from __getattr__
    from .adapters import supported_model_types
    from .cache import KVarNCache, KVarNIndexedLayer, KVarNLayer
    from .config import DEFAULT_PRESET, PRESETS, KVarNConfig, resolve_config
    from .patch import is_patched, patch, patched, unpatch, use_padded_sdpa
    from .quant.fake import fake_quantize
    from .quant.scheme import TileScheme


def __getattr__(name: str):
    """Load a public name from its module on first access (then it is a plain module attribute), or a submodule
    (``kvarn_mla.plan`` after ``import kvarn_mla``, as an eager package would have it)."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    if name.startswith("__"):  # probes such as __path__ or __wrapped__ are never submodules
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":  # the submodule exists but something it imports does not
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


class _Package(types.ModuleType):
    """The package's module type: importing the submodule ``kvarn_mla.patch`` binds it as an attribute of the
    package, which would hide the function `kvarn_mla.patch` (an eager ``from .patch import patch`` used to rebind
    it). The function stays the attribute; the module is in ``sys.modules["kvarn_mla.patch"]``."""

    def __setattr__(self, name: str, value) -> None:
        if name == "patch" and isinstance(value, types.ModuleType):
            value = value.patch
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
