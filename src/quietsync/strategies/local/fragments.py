"""Streaming DiLoCo's fragments: the model's parameter tensors split into groups synced at staggered steps."""

from __future__ import annotations

from ...validate import check_int


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Indices of the tensors of each of ``fragments`` contiguous, non-empty fragments, balanced by element
    count (fragment k starts at the first tensor with at least k/F of all elements before it)."""
    check_int("fragments", fragments, 1, len(sizes))
    n, total = len(sizes), sum(sizes)
    before = [sum(sizes[:i]) for i in range(n)]
    bounds = [0]
    for k in range(1, fragments):
        b = next((i for i in range(n) if before[i] >= k * total / fragments), n)
        bounds.append(min(max(b, bounds[-1] + 1), n - (fragments - k)))
    bounds.append(n)
    return [list(range(bounds[k], bounds[k + 1])) for k in range(fragments)]
