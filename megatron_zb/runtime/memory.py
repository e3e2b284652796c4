"""Activation accounting: bytes held by tensors autograd saved for backward, per rank.

:class:`ActivationMemoryTracker` installs ``torch.autograd.graph.saved_tensors_hooks`` while a
forward runs. Each saved tensor's storage is counted once (views share storage) from the moment
it is saved until the last Python reference to it dies -- which covers the autograd graph (freed
by B or BW) and the weight-gradient store's closures (freed by W). Parameters are excluded. The
result is the measured counterpart of the simulator's ``peak_memory`` (``M_B`` held from F to B,
``M_W`` from B to W), in bytes. Works on CPU and GPU alike (no allocator statistics needed).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator

import torch


class ActivationMemoryTracker:
    """Counts live bytes of saved activations; ``peak_bytes`` is the high-water mark."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._refs: dict[int, int] = {}       # storage pointer -> live tracked tensor objects
        self._sizes: dict[int, int] = {}      # storage pointer -> bytes
        self._tracked: set[int] = set()       # id() of tensor objects already tracked
        self.current_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until ``t`` (this Python object) is garbage."""
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._param_storages or id(t) in self._tracked:
            return
        self._tracked.add(id(t))
        if self._refs.get(ptr, 0) == 0:
            self._sizes[ptr] = storage.nbytes()
            self.current_bytes += self._sizes[ptr]
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        weakref.finalize(t, self._release, ptr, id(t))

    def _release(self, ptr: int, tid: int) -> None:
        self._tracked.discard(tid)
        n = self._refs.get(ptr, 0) - 1
        if n <= 0:
            self._refs.pop(ptr, None)
            self.current_bytes -= self._sizes.pop(ptr, 0)
        else:
            self._refs[ptr] = n

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Track every tensor autograd saves inside this block (wrap forwards in it)."""
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.track(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
