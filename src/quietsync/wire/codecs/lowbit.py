"""4-bit and 2-bit block quantizers, packed on the wire: the element-wise part of the low-bit codecs.

A flat tensor is cut into blocks of ``block`` elements (the last one may be shorter). Every block gets one
**absmax scale** ``s = max|x| / qmax`` (``qmax`` = the format's largest level), each element ``x`` is mapped
to a level ``l`` of the format's grid (``x ≈ l·s``), and the level's code travels in ``bits`` bits.

======== ===== ============================================ ==========================================
format   bits  levels (in units of the block's scale)       code of a level
======== ===== ============================================ ==========================================
fp4      4     ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (OCP FP4 E2M1)  sign·8 + magnitude index (the E2M1 bits)
fp4_e3m0 4     ±{0, 0.25, 0.5, 1, 2, 4, 8, 16} (E3M0)       sign·8 + magnitude index (the E3M0 bits)
int4     4     −7 … 7 (symmetric)                           two's complement nibble (``l & 0xF``)
int2     2     ±0.5, ±1.5 (symmetric, mid-rise)             level index 0..3 (``l = code − 1.5``)
======== ===== ============================================ ==========================================

``int2`` has no zero level: four levels spaced evenly over ``[−max, max]`` halve the worst error of a
ternary ``{−1, 0, 1}`` grid (``max/3`` instead of ``max/2``), which matters for what it is used for -- the
large values a top-k selection kept (SparseLoCo sends 2-bit values of top-k entries).

**Rounding.** ``nearest``: the nearest level; a tie goes to the level whose magnitude index is even (for the
fp formats the one with an even mantissa bit, as IEEE round-to-nearest-even; for int4 the even integer, as
``torch.round``) and, where both are even (``int2`` at 0), up. ``stochastic``: between the two neighbouring
levels ``lo ≤ v ≤ hi`` up with probability ``(v − lo)/(hi − lo)``, so the decoded value is unbiased; the
draws come from a ``torch.Generator`` the caller passes (seeded, so a run repeats).

**Scales** are stored in ``scale_dtype`` (``bf16`` by default: 2 bytes per block, fp32's range, so no block
over- or underflows) rounded *up* to the next representable value, so ``|x|/s ≤ qmax`` holds for every
element and no element is clipped; a block of zeros stores scale 0 and decodes to zeros.

**Wire layout** of one encoded tensor of ``numel`` elements (one ``uint8`` buffer):
``[scales: ceil(numel/block) × scale bytes][codes: ceil(numel·bits/8) bytes]``. Codes are packed little
end first: with 4 bits element ``2i`` is the low nibble of byte ``i`` and ``2i+1`` the high nibble; with
2 bits element ``4i+j`` sits in bits ``2j, 2j+1`` of byte ``i``. Padding codes (to a whole byte) are 0.
:meth:`BlockQuantizer.payload_bytes` is that size; :meth:`BlockQuantizer.decode` reads one buffer or a
``(workers, bytes)`` stack of them (an all-gather's output).

Nothing here keeps state: a sender that needs a generator or a residual holds them
(:mod:`quietsync.wire.compression`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...validate import check_choice, check_int

__all__ = ["LOWBIT_FORMATS", "SCALE_DTYPES", "ROUNDINGS", "LowBitFormat", "lowbit_format", "BlockQuantizer",
           "pack_codes", "unpack_codes"]


@dataclass(frozen=True)
class LowBitFormat:
    """A grid of levels and the code each level travels as."""

    name: str
    """The format's name (``fp4``, ``fp4_e3m0``, ``int4``, ``int2``)."""
    bits: int
    """Bits per code (4 or 2)."""
    levels: tuple[float, ...]
    """The levels, ascending, in units of the block scale."""
    codes: tuple[int, ...]
    """``codes[i]`` is the code of ``levels[i]``."""
    magnitude_index: tuple[int, ...]
    """Index of ``|levels[i]|`` among the format's magnitudes (decides ties under ``nearest``)."""

    @property
    def qmax(self) -> float:
        """The largest magnitude of a level: a block's absmax maps to it."""
        return max(abs(v) for v in self.levels)

    def decode_table(self) -> list[float]:
        """The level of every code ``0 .. 2**bits − 1`` (codes no level uses decode to 0)."""
        table = [0.0] * (1 << self.bits)
        for level, code in zip(self.levels, self.codes):
            table[code] = level
        return table

    def ties_up(self) -> list[bool]:
        """For the gap between ``levels[i]`` and ``levels[i+1]``: whether an exact midpoint rounds up."""
        out = []
        for i in range(len(self.levels) - 1):
            lo_even = self.magnitude_index[i] % 2 == 0
            hi_even = self.magnitude_index[i + 1] % 2 == 0
            out.append(hi_even and not lo_even or lo_even == hi_even)
        return out


def _sign_magnitude(name: str, magnitudes: tuple[float, ...]) -> LowBitFormat:
    """A 4-bit sign-magnitude float format: code = sign·8 + magnitude index (−0 is not produced)."""
    levels = [-m for m in reversed(magnitudes[1:])] + list(magnitudes)
    codes = [8 + i for i in reversed(range(1, len(magnitudes)))] + list(range(len(magnitudes)))
    mags = list(reversed(range(1, len(magnitudes)))) + list(range(len(magnitudes)))
    return LowBitFormat(name, 4, tuple(levels), tuple(codes), tuple(mags))


_FORMATS: dict[str, LowBitFormat] = {
    "fp4": _sign_magnitude("fp4", (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)),
    "fp4_e3m0": _sign_magnitude("fp4_e3m0", (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)),
    "int4": LowBitFormat("int4", 4, tuple(float(q) for q in range(-7, 8)), tuple(q & 0xF for q in range(-7, 8)),
                         tuple(abs(q) for q in range(-7, 8))),
    "int2": LowBitFormat("int2", 2, (-1.5, -0.5, 0.5, 1.5), (0, 1, 2, 3), (1, 0, 0, 1)),
}

LOWBIT_FORMATS: tuple[str, ...] = tuple(_FORMATS)
"""Names of the low-bit formats."""

SCALE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""What block scales may be stored as."""

ROUNDINGS = ("nearest", "stochastic")


def lowbit_format(name: str) -> LowBitFormat:
    """The :class:`LowBitFormat` called ``name``; a ValueError naming the allowed formats otherwise."""
    check_choice("format", name, LOWBIT_FORMATS)
    return _FORMATS[name]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``(..., n)`` codes (``uint8`` values below ``2**bits``) ``8/bits`` to a byte, low bits first.

    Returns ``(..., ceil(n·bits/8))`` ``uint8``; the codes past ``n`` in the last byte are 0.
    """
    per = 8 // bits
    n = codes.shape[-1]
    pad = -n % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    codes = codes.reshape(*codes.shape[:-1], -1, per)
    out = codes[..., 0].clone()  # the |= below must not write into the caller's codes
    for j in range(1, per):
        out |= codes[..., j] << (bits * j)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``(..., bytes)`` ``uint8`` → ``(..., n)`` codes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :n]


def _round_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` (fp32, ≥ 0) in ``dtype``, rounded up to the next representable value where the cast rounded
    down (so dividing by the stored scale never exceeds the format's range)."""
    stored = scale.to(dtype)
    if dtype == torch.float32:
        return stored
    low = stored.float() < scale
    if bool(low.any()):
        bumped = (stored.view(torch.int16) + 1).view(dtype)  # positive values: the next one up
        stored = torch.where(low, bumped, stored)
    return stored


class BlockQuantizer:
    """Block-scaled low-bit quantization, encoded to and decoded from a packed ``uint8`` buffer.

    Args:
        format: one of :data:`LOWBIT_FORMATS` (module docstring).
        block: elements per block (one scale each).
        scale_dtype: ``bf16`` (default), ``fp16`` or ``fp32``: what each block's scale travels as.
        rounding: ``nearest`` or ``stochastic`` (then :meth:`encode` needs a ``generator``).

    Values are quantized from their fp32 value and decode to fp32.
    """

    def __init__(self, format: str, block: int = 64, scale_dtype: str = "bf16", rounding: str = "nearest") -> None:
        self.format = lowbit_format(format)
        check_int("block", block, 1)
        check_choice("scale_dtype", scale_dtype, SCALE_DTYPES)
        check_choice("rounding", rounding, ROUNDINGS)
        self.block = block
        self.scale_dtype = SCALE_DTYPES[scale_dtype]
        self.scale_bytes = torch.empty((), dtype=self.scale_dtype).element_size()
        self.rounding = rounding
        self.bits = self.format.bits
        self._levels = torch.tensor(self.format.levels, dtype=torch.float32)
        self._codes = torch.tensor(self.format.codes, dtype=torch.uint8)
        self._ties_up = torch.tensor(self.format.ties_up())
        self._table = torch.tensor(self.format.decode_table(), dtype=torch.float32)
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __repr__(self) -> str:
        return (f"BlockQuantizer({self.format.name}, block={self.block}, scale_dtype={self.scale_dtype}, "
                f"rounding={self.rounding})")

    # ------------------------------------------------------------------ sizes
    def blocks(self, numel: int) -> int:
        """Number of blocks (scales) of a tensor of ``numel`` elements."""
        return -(-numel // self.block)

    def code_bytes(self, numel: int) -> int:
        """Bytes of the packed codes of ``numel`` elements."""
        return -(-numel * self.bits // 8)

    def payload_bytes(self, numel: int) -> int:
        """Bytes of one encoded tensor of ``numel`` elements: scales + packed codes."""
        check_int("numel", numel, 0)
        return self.blocks(numel) * self.scale_bytes + self.code_bytes(numel)

    # ------------------------------------------------------------------ tables
    def _tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in (self._levels, self._codes, self._ties_up, self._table))
        return self._on[device]

    # ------------------------------------------------------------------ encode / decode
    def scales(self, x: torch.Tensor) -> torch.Tensor:
        """The stored scale of every block of flat ``x`` (``scale_dtype``)."""
        blocks = self._blocks_of(x.reshape(-1).float())
        return _round_up(blocks.abs().amax(dim=1) / self.format.qmax, self.scale_dtype)

    def _blocks_of(self, flat: torch.Tensor) -> torch.Tensor:
        pad = -flat.numel() % self.block
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))  # zeros never raise a block's absmax
        return flat.view(-1, self.block)

    def quantize(self, x: torch.Tensor, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, scales)`` of flat ``x``: one ``uint8`` code per element, one scale per block (unpacked)."""
        flat = x.detach().reshape(-1).float()
        n = flat.numel()
        if self.rounding == "stochastic" and generator is None:
            raise ValueError("rounding 'stochastic' needs a generator (a seeded torch.Generator)")
        levels, codes_of, ties_up, _ = self._tables(flat.device)
        blocks = self._blocks_of(flat)
        stored = _round_up(blocks.abs().amax(dim=1) / self.format.qmax, self.scale_dtype)
        s = stored.float()
        # a block of zeros stores scale 0: divided by 1 there, not 0 (it decodes to zeros whatever its codes)
        v = blocks / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(1)
        # clamp: with fp32 scales, x / (max|x| / qmax) can land a rounding above qmax (int4: 7.0000005)
        v = v.reshape(-1)[:n].clamp(levels[0], levels[-1])
        # at the lowest level searchsorted gives 0: hi >= 1 keeps lo = hi - 1 a level
        hi = torch.searchsorted(levels, v).clamp_(1, levels.numel() - 1)
        lo = hi - 1
        lo_v, hi_v = levels[lo], levels[hi]
        if self.rounding == "nearest":
            d_lo, d_hi = v - lo_v, hi_v - v
            up = (d_hi < d_lo) | ((d_hi == d_lo) & ties_up[lo])
        else:
            u = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
            up = u < (v - lo_v) / (hi_v - lo_v)
        index = torch.where(up, hi, lo)
        return codes_of[index], stored

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The packed payload of flat ``x`` (``uint8``, :meth:`payload_bytes` long)."""
        codes, stored = self.quantize(x, generator)
        return torch.cat([stored.reshape(-1).view(torch.uint8), pack_codes(codes, self.bits)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """fp32 values of a payload (``(bytes,)``) or of a stack of payloads (``(workers, bytes)``):
        ``(numel,)`` or ``(workers, numel)``."""
        squeeze = payload.dim() == 1
        buf = payload.reshape(1, -1) if squeeze else payload
        if buf.dtype != torch.uint8 or buf.dim() != 2:
            raise ValueError(f"payload must be uint8 (bytes,) or (workers, bytes), got {payload.dtype} "
                             f"{tuple(payload.shape)}")
        if buf.shape[1] != self.payload_bytes(numel):
            raise ValueError(f"payload has {buf.shape[1]} bytes, {numel} elements in {self} need "
                             f"{self.payload_bytes(numel)}")
        nb = self.blocks(numel)
        sb = nb * self.scale_bytes
        raw = buf.new_empty(buf.shape[0], sb)
        raw.copy_(buf[:, :sb])  # a fresh (workers, sb) buffer: rows aligned for the view
        scales = raw.view(self.scale_dtype).float()  # (workers, nb)
        codes = unpack_codes(buf[:, sb:], self.bits, numel)
        table = self._tables(buf.device)[3]
        values = table[codes.long()]
        pad = nb * self.block - numel
        if pad:
            values = torch.nn.functional.pad(values, (0, pad))
        out = (values.view(buf.shape[0], nb, self.block) * scales.unsqueeze(2)).view(buf.shape[0], -1)[:, :numel]
        return out[0] if squeeze else out
