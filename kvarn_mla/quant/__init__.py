"""Pure-torch KVarN reference: Hadamard rotation, variance normalization, RTN and packing, tiles and stores.

Everything here is the reference of record: the Triton kernels in `kvarn_mla.kernels` must match it (integer codes
and packing exactly, products within stated tolerances).
"""

from .folded import folded_scores, folded_values
from .hadamard import hadamard_matrix, rotate
from .rtn import pack, packed_width, quantize_rows, unpack
from .store import DenseStream, StreamSpec, TiledStream, make_stream
from .tile import QuantizedTile, dequantize_tile, quantize_tile, store_tiles_reference
from .varnorm import imbalance, variance_normalize

__all__ = [
    "DenseStream", "QuantizedTile", "StreamSpec", "TiledStream", "dequantize_tile", "folded_scores", "folded_values",
    "hadamard_matrix", "imbalance", "make_stream", "pack", "packed_width", "quantize_rows", "quantize_tile",
    "rotate", "store_tiles_reference", "unpack", "variance_normalize",
]
