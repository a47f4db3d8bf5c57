"""Top-k per block, with indices in the smallest integer dtype that holds them.

DeMo sends, per DCT block, the ``k`` coefficients of largest magnitude and their position inside
the block. Positions are ``< block_numel`` (``<= chunk**2``), so they travel as ``uint8``
(blocks up to 256 elements), ``int16`` (up to 32768) or ``int32`` -- a quarter to a half of the
bytes of ``int64``. :func:`topk_positions` picks them: on CPU (fp32/fp64) with NumPy's introselect
(``np.argpartition``), about twice as fast as ``torch.topk`` on 64x64 blocks here (which copies every row
into a vector of (value, index) pairs first), elsewhere with ``torch.topk``. Both return a set of ``k``
largest magnitudes; only among entries of *equal* magnitude at the k-th place may the two pick different
positions (e.g. a block of zeros). :func:`topk_picks` gives the same positions with the values there (what
DeMo's extract sends), writing no ``|x|``. :func:`scatter_mean` is the receiving side: it averages each
coefficient over the workers that actually sent it (a coefficient only one worker picked is not diluted by the
others' implicit zeros), exactly as the DeMo reference's ``batch_decompress`` does.
"""

from __future__ import annotations

import numpy as np
import torch

from ...validate import check_int

__all__ = ["index_dtype", "topk_positions", "topk_picks", "topk_per_block", "scatter_mean", "densify"]

_ROWS_ELEMENTS = 2**20
"""Elements of ``x`` per NumPy call: its int64 index array (8 MiB) stays below the size glibc maps afresh
(and faults in page by page) on every allocation."""


def index_dtype(block_numel: int) -> torch.dtype:
    """Smallest integer dtype holding every position ``0 .. block_numel - 1``."""
    if block_numel <= 256:
        return torch.uint8
    if block_numel <= 2**15:
        return torch.int16
    if block_numel <= 2**31:
        return torch.int32
    return torch.int64


def topk_positions(x: torch.Tensor, k: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Positions (``int64``, ``(blocks, k)``, in no particular order) of the ``k`` largest-magnitude
    entries of each row of ``x`` (``(blocks, block_numel)``); NaN counts as largest.

    ``scratch`` (``x``'s shape, dtype and device) receives ``|x|`` when given, so a caller that steps
    repeatedly reuses one buffer.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be (blocks, block_numel), got shape {tuple(x.shape)}")
    n = x.shape[1]
    check_int("k", k, 1, n)  # at most the block size
    if k == n:
        return torch.arange(n, device=x.device).expand(x.shape[0], n)
    mag = torch.abs(x, out=scratch) if scratch is not None else x.abs()
    if mag.device.type == "cpu" and mag.dtype in (torch.float32, torch.float64) and x.shape[0] > 0:
        arr = mag.detach().numpy()
        pos = _topk_by_groups(arr, k)
        return pos if pos is not None else _argpartition_rows(arr, k, np.arange(x.shape[0]))
    return mag.topk(k, dim=1, sorted=False).indices


def _argpartition_rows(arr: np.ndarray, k: int, rows: np.ndarray, pos: torch.Tensor | None = None,
                       into: np.ndarray | None = None) -> torch.Tensor:
    """Positions of the ``k`` largest entries of rows ``rows`` of ``arr`` by NumPy's introselect, written into
    rows ``into`` (default: the same rows) of ``pos`` (a new ``(len(arr), k)`` tensor when None)."""
    n = arr.shape[1]
    if pos is None:
        pos = torch.empty(arr.shape[0], k, dtype=torch.long)
    if into is None:
        into = rows
    out = pos.numpy()
    step = max(1, _ROWS_ELEMENTS // n)  # argpartition returns a full index array: keep it small and reused
    for start in range(0, len(rows), step):
        mine = rows[start : start + step]
        picked = arr[mine] if len(mine) != arr.shape[0] else arr
        out[into[start : start + step]] = np.argpartition(picked, n - k, axis=1)[:, n - k:]
    return pos


def _k_largest(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Column indices ``(rows, k)`` of each row's ``k`` largest entries, by one (non-indirect) partition for the
    ``k``-th largest and a comparison, and whether that choice was the only one (False: ties at the ``k``-th
    value, or NaN; such a row's indices are ``0 .. k - 1``, to be replaced)."""
    rows, n = values.shape
    part = np.partition(values, n - k, axis=1)
    kth = part[:, n - k : n - k + 1]
    mask = values >= kth
    # without NaN (which sorts largest, so it would sit among the k kept) every row holds at least k entries >= its
    # k-th: then k per row in all is exactly k in each (one count, no per-row reduction)
    if np.count_nonzero(mask) == rows * k and not np.isnan(part[:, n - k :]).any():
        sure = np.ones(rows, dtype=bool)
    else:
        sure = np.count_nonzero(mask, axis=1) == k
        mask[~sure] = False
        mask[~sure, :k] = True
    return (np.flatnonzero(mask).reshape(rows, k) - np.arange(0, rows * n, n)[:, None]), sure  # row starts off


def _group_size(n: int, k: int) -> int | None:
    """Entries per group of :func:`_topk_by_groups` for rows of ``n``: ``k * s`` candidates, about a quarter of
    ``n``; None where grouping does not pay (short rows)."""
    s = 1 << max(0, (n // (4 * k)).bit_length() - 1)
    return None if s < 4 or n % s else s  # s must divide n for the (rows, s, n // s) view


def _topk_by_groups(arr: np.ndarray, k: int) -> torch.Tensor | None:
    """The top-k positions of every row of ``arr`` (magnitudes), looked for among few candidates.

    A row is cut into ``G`` strided groups of ``s`` entries (``j, j + G, j + 2G, ...``). The ``k`` groups with the
    largest maxima hold every one of the row's ``k`` largest entries (an entry outside them is below ``k`` group
    maxima, so below ``k`` entries), so a selection over those ``k * s`` candidates finds them -- about a
    quarter of the row -- and each selection is a partition of values and a comparison, not NumPy's indirect
    ``argpartition`` (about 3x slower on a whole row). Where the choice is not unique (ties with the ``k``-th
    group maximum or the ``k``-th entry, NaN) the row is left to :func:`_argpartition_rows`, so every row gets
    the positions the plain introselect over the whole row gives: the same set, in another order. None where
    grouping does not pay (short rows).
    """
    rows, n = arr.shape
    s = _group_size(n, k)
    if s is None:
        return None
    groups = n // s
    grid = torch.from_numpy(arr).view(rows, s, groups)
    top, sure = _k_largest(grid.amax(1).numpy(), k)  # (rows, k) groups: maxima over contiguous reads
    cand = torch.gather(grid, 2, torch.from_numpy(top)[:, None, :].expand(rows, s, k)).view(rows, s * k)
    sel, sure_too = _k_largest(cand.numpy(), k)  # (rows, k) into the (s, k) candidate grid
    member, group = np.divmod(sel, k)
    # candidate (member, g) is the row's entry top[g] + member * groups (groups are strided)
    pos = torch.from_numpy(np.take_along_axis(top, group, 1) + member * groups)
    unsure = ~(sure & sure_too)
    if unsure.any():
        _argpartition_rows(arr, k, np.flatnonzero(unsure), pos)
    return pos


def topk_picks(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, values)``, both ``(blocks, k)``: :func:`topk_positions`' positions (the same, in the same order)
    and ``x``'s entries there -- what DeMo's extract sends.

    On CPU (fp32/fp64, contiguous rows) the selection writes no ``|x|``: a group's largest
    magnitude is ``max(amax, -amin)`` of its signed entries, and the values come from the candidates already
    gathered, not from a second gather out of the rows (about 12% of the selection's time on the 10m model).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be (blocks, block_numel), got shape {tuple(x.shape)}")
    rows, n = x.shape
    check_int("k", k, 1, n)  # at most the block size
    s = _group_size(n, k)
    # the path below views x and reads it through .numpy(): a contiguous CPU float tensor outside autograd
    if (s is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or rows == 0
            or not x.is_contiguous() or x.requires_grad):
        pos = topk_positions(x, k)
        return pos, torch.gather(x, 1, pos)
    groups = n // s
    grid = x.view(rows, s, groups)
    peaks = torch.maximum(grid.amax(1), grid.amin(1).neg_())  # each group's largest |x|; NaN stays NaN
    top, sure = _k_largest(peaks.numpy(), k)
    cand = torch.gather(grid, 2, torch.from_numpy(top)[:, None, :].expand(rows, s, k)).view(rows, s * k).numpy()
    sel, sure_too = _k_largest(np.abs(cand), k)
    member, group = np.divmod(sel, k)
    pos = torch.from_numpy(np.take_along_axis(top, group, 1) + member * groups)
    values = torch.from_numpy(np.take_along_axis(cand, sel, 1))
    unsure = np.flatnonzero(~(sure & sure_too))
    if len(unsure):  # ties or NaN: the plain introselect's positions, as topk_positions gives them
        _argpartition_rows(np.abs(x.numpy()[unsure]), k, np.arange(len(unsure)), pos, unsure)
        values[unsure] = torch.gather(x[unsure], 1, pos[unsure])
    return pos, values


def topk_per_block(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` largest-magnitude entries of each row of ``x`` (shape ``(blocks, block_numel)``).

    Returns ``(values, positions)``, both ``(blocks, k)``; positions in :func:`index_dtype`
    (chosen by :func:`topk_positions`).
    """
    pos = topk_positions(x, k)
    return torch.gather(x, 1, pos), pos.to(index_dtype(x.shape[1]))


def _flat_positions(positions: torch.Tensor, block_numel: int) -> torch.Tensor:
    blocks = positions.shape[-2]
    base = torch.arange(blocks, device=positions.device).unsqueeze(1) * block_numel
    return positions.long() + base


def densify(values: torch.Tensor, positions: torch.Tensor, block_numel: int) -> torch.Tensor:
    """One worker's sparse blocks as dense ``(blocks, block_numel)`` (zeros elsewhere)."""
    blocks = values.shape[0]
    out = torch.zeros(blocks * block_numel, dtype=values.dtype, device=values.device)
    out[_flat_positions(positions, block_numel).reshape(-1)] = values.reshape(-1)
    return out.reshape(blocks, block_numel)


def scatter_mean(
    values: torch.Tensor, positions: torch.Tensor, block_numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Average sparse blocks from several workers, per coefficient over the workers that sent it.

    ``values`` / ``positions`` have shape ``(workers, blocks, k)``; returns dense
    ``(blocks, block_numel)`` in ``dtype``.
    """
    workers, blocks, _ = values.shape
    flat = _flat_positions(positions, block_numel).reshape(-1)
    total = torch.zeros(blocks * block_numel, dtype=dtype, device=values.device)
    count = torch.zeros(blocks * block_numel, dtype=dtype, device=values.device)
    total.index_add_(0, flat, values.reshape(-1).to(dtype))
    count.index_add_(0, flat, torch.ones(flat.numel(), dtype=dtype, device=values.device))
    return (total / count.clamp_min(1)).reshape(blocks, block_numel)  # a coefficient nobody sent: 0 / 1, not 0 / 0
