"""Activation accounting: bytes held by tensors autograd saved for backward, per rank.

:class:`ActivationMemoryTracker` installs ``torch.autograd.graph.saved_tensors_hooks`` while a
forward runs. Each saved tensor's *storage* is counted once (views share storage) from the moment
it is saved until the storage itself is freed -- a finalizer on the storage object, which torch
keeps alive while any tensor uses it. That covers the autograd graph (freed by B or BW) and the
weight-gradient store's closures (freed by W), which hold tensors that ``ctx.saved_tensors``
rebuilt from the saved ones (new Python objects on the same storage). Parameters are excluded. The
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
        self._sizes: dict[int, int] = {}      # storage pointer -> bytes, while the storage lives
        self.current_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until that storage is freed (parameters and meta tensors excluded)."""
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._param_storages or ptr in self._sizes:
            return
        self._sizes[ptr] = storage.nbytes()
        self.current_bytes += self._sizes[ptr]
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._release, ptr)

    def _release(self, ptr: int) -> None:
        self.current_bytes -= self._sizes.pop(ptr, 0)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Track every tensor autograd saves inside this block (wrap forwards in it)."""
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.track(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
