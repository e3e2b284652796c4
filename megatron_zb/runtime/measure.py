"""What one call of the runtime measures (:class:`Measure`, asked per call) and what it measured
(:class:`Measured`, returned by that call): the runtime's typed front door for the training side.

A caller never switches the runtime's measurements on by mutating it, and never reads them back from
attributes left behind by the last call: :meth:`~megatron_zb.runtime.forward_backward.ZeroBubbleForwardBackward.run`
takes a :class:`Measure` and returns a :class:`Measured`. Two requests for the same iteration (the
profiling window's and the ``--profile`` timeline's) combine with ``|``, so no request depends on the
order its askers were called in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .action_timing import ActionTiming
from .executor import LoopOverhead
from .grad_sync import GradSyncReport
from .memory import ActivationMemoryTracker

__all__ = ["Measure", "Measured"]


@dataclass(frozen=True)
class Measure:
    """What one call measures.

    Attributes:
        time_actions: record the seconds of every action (:class:`~.action_timing.ActionTiming`: host
            ``time.perf_counter`` on CPU, CUDA events on a CUDA model, resolved later with one
            synchronisation). Costs two clock reads per action on CPU, two events on CUDA.
        track_memory: measure the bytes autograd keeps saved, per action
            (:class:`~.memory.ActivationMemoryTracker`; its hooks slow the actions down, 10-15% at hidden 64).
        iteration: the caller's training iteration (1-based), named by the errors of a late
            data-parallel reduce; ``None``: they name the count of training calls ("training call 2").
    """

    time_actions: bool = False
    track_memory: bool = False
    iteration: int | None = None

    def __or__(self, other: "Measure") -> "Measure":
        """Both requests: a field asked by either is asked; the iteration of whichever names one."""
        return Measure(time_actions=self.time_actions or other.time_actions,
                       track_memory=self.track_memory or other.track_memory,
                       iteration=self.iteration if self.iteration is not None else other.iteration)


@dataclass(frozen=True)
class Measured:
    """What one call returned and measured.

    Attributes:
        data: what megatron-core's ``forward_backward_func`` returns (the last stage's reduced losses,
            in micro batch order; empty on other stages).
        timing: every action's times (``Measure.time_actions``; ``None`` otherwise). On a CUDA model
            unresolved: call its ``resolve()`` (one synchronisation), or ``resolve_timings`` over several.
        memory: the activation tracker of the call (``Measure.track_memory``; ``None`` otherwise).
        overhead: the call's executor time split into compute actions, p2p calls and the runtime's
            own overhead (always measured; :class:`~.executor.LoopOverhead`). Sum calls with ``merge``.
        grad_sync: with megatron-core DDP's ``overlap_grad_reduce``, the bucket launches of the call
            (``None`` otherwise, and in forward-only calls).
    """

    data: list[Any]
    timing: ActionTiming | None = None
    memory: ActivationMemoryTracker | None = None
    overhead: LoopOverhead | None = None
    grad_sync: GradSyncReport | None = None

    @property
    def peak_bytes(self) -> int | None:
        """Peak bytes of saved activations in the call (``None`` unless ``Measure.track_memory``)."""
        return self.memory.peak_bytes if self.memory is not None else None
