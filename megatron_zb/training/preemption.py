"""``--exit-signal-handler``: stop at the end of the iteration when the job is told to stop (Megatron's flag).

A cluster stops a job by signalling it first: torchrun forwards the SIGTERM it receives to every
worker and kills them 30 s later; SLURM sends SIGTERM to every process of the job step and kills
them after its ``KillWait``. With ``--exit-signal-handler`` each rank records ``--exit-signal``
(default SIGTERM) instead of dying; after every iteration the ranks agree (one max-all-reduce of
one integer) whether any of them received it, and if so the trainer saves a checkpoint and exits
with status 0, as Megatron-LM's ``checkpoint_and_decide_exit``. Data-loader workers ignore the
signal (:class:`IgnoreSignalInWorker`), so that a signal sent to every process does not end
them before the save.

``--exit-duration-in-mins`` (:class:`ExitDuration`) is the same decision on a clock: after every
iteration the ranks agree whether any has run longer than the limit (Megatron-LM's
``checkpoint_and_decide_exit``), and the trainer then saves and exits with status 0.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ExitDuration", "ExitSignalHandler", "IgnoreSignalInWorker"]


class ExitSignalHandler:
    """Records ``sig`` in this process from :meth:`install` to :meth:`release` (both idempotent)."""

    def __init__(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.sig = sig
        self.received = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> "ExitSignalHandler":
        """Handle ``sig`` from now on (main thread only, as Python's ``signal.signal``)."""
        if not self._installed:
            self._previous = signal.signal(self.sig, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def any_rank_received(self, device: torch.device) -> bool:
        """Collective over the default group: whether any rank has received the signal."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def release(self) -> None:
        """Put the previous handler back."""
        if self._installed:
            signal.signal(self.sig, self._previous)
            self._installed = False


class ExitDuration:
    """``--exit-duration-in-mins``: whether the run has lasted ``minutes`` since ``started``
    (``time.perf_counter()`` [s], when the run started)."""

    def __init__(self, minutes: float, *, started: float) -> None:
        self.minutes, self.started = minutes, started

    def elapsed_minutes(self) -> float:
        """Minutes since the run started on this rank."""
        return (time.perf_counter() - self.started) / 60.0

    def any_rank_over(self, device: torch.device) -> bool:
        """Collective over the default group: whether any rank has run longer than the limit."""
        flag = torch.tensor([1 if self.elapsed_minutes() > self.minutes else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class IgnoreSignalInWorker:
    """``worker_init_fn`` of a ``DataLoader``: the worker process ignores ``sig`` (picklable)."""

    def __init__(self, sig: signal.Signals) -> None:
        self.sig = sig

    def __call__(self, worker_id: int) -> None:
        signal.signal(self.sig, signal.SIG_IGN)
