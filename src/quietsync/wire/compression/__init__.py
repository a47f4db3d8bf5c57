"""Compression as a chain of parts a sender holds: select (chunk-wise top-k), quantize (a cast, or a low-bit
block quantizer), error feedback (transmitted + residual = accumulated).

Every :class:`Compressor` turns a flat fp32 tensor into one ``uint8`` payload (what goes into the collective,
so the meter counts exactly what is packed) and decodes one payload, or a ``(workers, bytes)`` stack of them
(an all-gather's output), back to dense fp32. The math lives in :mod:`quietsync.wire.codecs` (pure functions);
what lives here is what a sender keeps from one step to the next -- a seeded generator for stochastic
rounding, the error-feedback residual -- with ``state_dict``/``load_state_dict``/``memory_report`` like every
part a strategy holds.

``Chain(select=TopK(chunk=64, density=0.02), quantize=Quantize("int2"))`` is SparseLoCo's message;
``ErrorFeedback(chain, numel, decay=β)`` its per-worker accumulator.
"""

from .chain import Chain, Compressor
from .error_feedback import ErrorFeedback
from .quantize import CAST_DTYPES, Cast, Quantize
from .select import TopK

__all__ = ["Chain", "Compressor", "ErrorFeedback", "CAST_DTYPES", "Cast", "Quantize", "TopK"]
