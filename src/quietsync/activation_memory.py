"""Activation memory, measured: the bytes autograd holds for backward, over time.

:class:`ActivationMeter` installs ``torch.autograd.graph.saved_tensors_hooks`` while it is active. Every
tensor autograd saves for a backward is *packed* into a small handle; the handle is released when autograd
drops it (after the backward that used it, or when the graph is freed), which a ``weakref.finalize`` on the
handle reports. Bytes are counted **per storage** (``untyped_storage().data_ptr()``), once however many
saved tensors view it, so a layer output saved by one op and the next op's input is one buffer — as in
device memory. Tensors for which ``exclude(t)`` is true (parameters: their storage is not an activation)
are not counted.

``current`` is the live byte count, ``peak`` its maximum since :meth:`reset_peak`; :meth:`sample` appends
``(label, current, peak since the previous sample)`` to :attr:`timeline`, e.g. once per time step of a
schedule. On CUDA, :meth:`sample` also records ``torch.cuda.memory_allocated`` and the allocator's peak
(``torch.cuda.max_memory_allocated``, reset at each sample) — the device's own view, which includes
everything the allocator holds, not only saved tensors.

Release is seen when autograd frees a saved tensor, i.e. after the backward that used it. A graph dropped
*without* backward can keep its saved outputs alive through a reference cycle (output → grad_fn → saved
handle → output); the meter then keeps counting them, as the memory is indeed still held until ``gc``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Sample:
    """One point of the timeline."""

    label: Any
    bytes: int
    """Saved-tensor bytes live at the sample."""
    peak: int
    """Highest saved-tensor bytes since the previous sample."""
    cuda_allocated: int | None = None
    cuda_peak: int | None = None


class _Handle:
    __slots__ = ("tensor", "__weakref__")  # __weakref__: weakref.finalize in _pack needs it on a slotted class

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Bytes held by autograd's saved tensors (see the module docstring).

    Args:
        exclude: ``exclude(t) -> bool`` for saved tensors that are not activations (default: none excluded).
        device: a CUDA device to also sample ``torch.cuda`` memory statistics on.
    """

    def __init__(self, exclude: Callable[[torch.Tensor], bool] | None = None,
                 device: torch.device | None = None) -> None:
        self.exclude = exclude
        self.device = device if device is not None and device.type == "cuda" else None
        self._lock = threading.Lock()
        self._refs: dict[int, list[int]] = {}  # storage ptr -> [handles alive, nbytes]
        self.current = 0
        self.peak = 0
        self._window_peak = 0
        self.timeline: list[Sample] = []

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor) -> Any:
        if self.exclude is not None and self.exclude(t):
            return t
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:  # nothing to count, and empty storages share data_ptr 0, which would merge their entries
            return t
        handle = _Handle(t)
        with self._lock:
            entry = self._refs.get(ptr)
            if entry is None:
                self._refs[ptr] = [1, nbytes]
                self._grow(nbytes)
            else:
                entry[0] += 1
        weakref.finalize(handle, self._release, ptr)
        return handle

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Handle) else packed

    def _grow(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self._window_peak = max(self._window_peak, self.current)

    def _release(self, ptr: int) -> None:
        with self._lock:
            entry = self._refs.get(ptr)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._refs[ptr]
                self.current -= entry[1]

    @contextmanager
    def track(self) -> Iterator[ActivationMeter]:
        """Count the tensors autograd saves inside this block (release is tracked after it, too)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    # ------------------------------------------------------------------ readings
    def sample(self, label: Any = None) -> Sample:
        """Append (and return) a timeline point: live bytes now and the peak since the previous sample."""
        with self._lock:
            s = Sample(label, self.current, self._window_peak)
            self._window_peak = self.current  # the next window's peak starts from what is live now, not 0
        if self.device is not None:
            torch.cuda.synchronize(self.device)
            s.cuda_allocated = torch.cuda.memory_allocated(self.device)
            s.cuda_peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.timeline.append(s)
        return s

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current
            self._window_peak = self.current
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)

    def reset(self) -> None:
        """Forget the timeline and the peak (live counts stay: they are still held)."""
        self.timeline.clear()
        self.reset_peak()


def exclude_storages(tensors: Callable[[], Any]) -> Callable[[torch.Tensor], bool]:
    """An ``exclude`` for :class:`ActivationMeter`: true for tensors sharing storage with ``tensors()``
    (called at each check, so it may return a changing set, e.g. every parameter version a strategy holds)."""

    def exclude(t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(ptr == x.untyped_storage().data_ptr() for x in tensors())

    return exclude
