"""Pure-torch KVarN reference: Hadamard rotation, variance normalization, RTN and packing, tiles, attention.

Everything here is the reference of record: the Triton kernels in `kvarn_mla.kernels` must match it (integer codes
and packing exactly, products within stated tolerances). Nothing here holds runtime state: the cache's growable
stores live in `kvarn_mla.store` and hand their tensors to this package as `StreamView`.
"""

from .attention import StreamView, tiled_attention_reference
from .folded import tile_scores, tile_values
from .hadamard import hadamard_matrix, rotate
from .rtn import pack, packed_width, quantize_rows, unpack
from .tile import QuantizedTile, dequantize_tile, quantize_tile, store_tiles_reference
from .varnorm import imbalance, variance_normalize

__all__ = [
    "QuantizedTile", "StreamView", "dequantize_tile", "hadamard_matrix", "imbalance", "pack", "packed_width",
    "quantize_rows", "quantize_tile", "rotate", "store_tiles_reference", "tile_scores", "tile_values",
    "tiled_attention_reference", "unpack", "variance_normalize",
]
