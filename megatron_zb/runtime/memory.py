"""Activation accounting: bytes held by tensors autograd saved for backward, per rank.

:class:`ActivationMemoryTracker` installs ``torch.autograd.graph.saved_tensors_hooks`` while a
forward runs. Each saved tensor's *storage* is counted once (views share storage) from the moment
it is saved until the storage itself is freed -- a finalizer on the storage object, which torch
keeps alive while any tensor uses it. That covers the autograd graph (freed by B or BW) and the
weight-gradient store's closures (freed by W), which hold tensors that ``ctx.saved_tensors``
rebuilt from the saved ones (new Python objects on the same storage). Parameters are excluded. The
result is the measured counterpart of the simulator's ``peak_memory`` (``M_B`` held from F to B,
``M_W`` from B to W), in bytes. Works on CPU and GPU alike (no allocator statistics needed).

Tensors of the p2p layer -- receive buffers posted ahead of use, sent tensors until their send is
released (:mod:`megatron_zb.runtime.p2p`) -- are counted apart (:meth:`ActivationMemoryTracker.track_p2p`,
``p2p_bytes``): a receive buffer that a forward then saves becomes an activation at that moment,
so the activation count and its log are what they would be without p2p tracking, and
``peak_total_bytes`` is the high-water mark of both together.

Every change of the count is also logged with its ``time.perf_counter()`` time (``events``), so
the bytes one action left allocated are :meth:`ActivationMemoryTracker.bytes_between` its start
and end (the profiler's measured ``M_B`` / ``M_W``; one iteration's log, a few entries per saved
tensor).
"""

from __future__ import annotations

import bisect
import contextlib
import time
import weakref
from typing import Any, Iterable, Iterator

import torch


class ActivationMemoryTracker:
    """Counts live bytes of saved activations; ``peak_bytes`` is the high-water mark."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._sizes: dict[int, int] = {}      # storage pointer -> bytes, while the storage lives
        self._p2p: set[int] = set()           # storages counted as p2p bytes (not activations)
        self._aliases: dict[int, int] = {}    # storage pointer -> saved aliases alive (track_saved)
        self.current_bytes = 0
        self.peak_bytes = 0
        self.p2p_bytes = 0                    # bytes of p2p buffers held now
        self.peak_total_bytes = 0             # high-water mark of activations + p2p buffers
        self.events: list[tuple[float, int]] = []  # (time.perf_counter() [s], change of current_bytes [bytes])
        self._times: list[float] = []

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        self.peak_total_bytes = self.current_bytes + self.p2p_bytes

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as an activation until that storage is freed (parameters and meta
        tensors excluded); a storage counted as p2p bytes becomes an activation now."""
        storage, ptr = self._storage(t)
        if storage is None or (ptr in self._sizes and ptr not in self._p2p):
            return
        if ptr in self._p2p:  # a receive buffer the forward saved: an activation from now on
            self._p2p.discard(ptr)
            self.p2p_bytes -= self._sizes[ptr]
        else:
            self._sizes[ptr] = storage.nbytes()
            weakref.finalize(storage, self._release, ptr)
        self.current_bytes += self._sizes[ptr]
        self.events.append((time.perf_counter(), self._sizes[ptr]))
        self._peaks()

    def track_saved(self, alias: torch.Tensor) -> None:
        """Count ``alias``'s storage while ``alias`` -- the object autograd keeps for a backward, a
        detached view of a saved tensor -- or another alias of the same storage lives: the bytes *saved
        for backward*, freed when autograd releases the last of them even where something else (a
        runtime's preallocated receive buffer) keeps the storage alive. Not mixed with :meth:`track` on
        the same storage."""
        storage, ptr = self._storage(alias)
        if storage is None:
            return
        n = self._aliases.get(ptr, 0)
        self._aliases[ptr] = n + 1
        weakref.finalize(alias, self._drop_alias, ptr)
        if n == 0:
            self._sizes[ptr] = storage.nbytes()
            self.current_bytes += self._sizes[ptr]
            self.events.append((time.perf_counter(), self._sizes[ptr]))
            self._peaks()

    def _drop_alias(self, ptr: int) -> None:
        n = self._aliases.pop(ptr) - 1
        if n:
            self._aliases[ptr] = n
        else:
            self._release(ptr)

    def track_p2p(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as p2p bytes (a receive buffer or a sent tensor) until it is freed,
        unless it is counted already."""
        storage, ptr = self._storage(t)
        if storage is None or ptr in self._sizes:
            return
        self._sizes[ptr] = storage.nbytes()
        self._p2p.add(ptr)
        self.p2p_bytes += self._sizes[ptr]
        self._peaks()
        weakref.finalize(storage, self._release, ptr)

    def _storage(self, t: torch.Tensor) -> tuple[Any, int]:
        """``(storage, data pointer)`` of ``t``, or ``(None, 0)`` for what is never counted."""
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return None, 0
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None, 0
        ptr = storage.data_ptr()
        return (None, 0) if ptr == 0 or ptr in self._param_storages else (storage, ptr)

    def _peaks(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self.peak_total_bytes = max(self.peak_total_bytes, self.current_bytes + self.p2p_bytes)

    def _release(self, ptr: int) -> None:
        n = self._sizes.pop(ptr, 0)
        if ptr in self._p2p:
            self._p2p.discard(ptr)
            self.p2p_bytes -= n
            return
        self.current_bytes -= n
        self.events.append((time.perf_counter(), -n))

    def bytes_between(self, t0: float, t1: float) -> int:
        """Net change of the tracked bytes between ``time.perf_counter()`` times ``t0`` and ``t1`` [bytes]."""
        if len(self._times) != len(self.events):  # events are in time order; keys cached for bisect
            self._times = [t for t, _ in self.events]
        lo, hi = bisect.bisect_left(self._times, t0), bisect.bisect_right(self._times, t1)
        return sum(d for _, d in self.events[lo:hi])

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Track every tensor autograd saves inside this block (wrap forwards in it)."""
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.track(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
