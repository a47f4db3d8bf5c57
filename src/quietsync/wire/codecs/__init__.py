"""Codecs: the pure tensor math under the replicators (DCT-II blocks, top-k, sign, casts, packing, low-bit
block quantizers).

Nothing here communicates or keeps state beyond caches; everything is vectorised over all
parameters of a step.
"""

from .dct import BlockGroup, BlockLayout, BlockWorkspace, dct_basis
from .lowbit import LOWBIT_FORMATS, BlockQuantizer, LowBitFormat, lowbit_format
from .pack import nbytes, pack, unpack
from .quantize import TRANSFER_DTYPES, apply_sign, transfer_dtype
from .topk import densify, index_dtype, scatter_mean, topk_per_block, topk_picks, topk_positions

__all__ = [
    "BlockGroup",
    "BlockLayout",
    "BlockWorkspace",
    "dct_basis",
    "LOWBIT_FORMATS",
    "BlockQuantizer",
    "LowBitFormat",
    "lowbit_format",
    "nbytes",
    "pack",
    "unpack",
    "TRANSFER_DTYPES",
    "apply_sign",
    "transfer_dtype",
    "densify",
    "index_dtype",
    "scatter_mean",
    "topk_per_block",
    "topk_picks",
    "topk_positions",
]
