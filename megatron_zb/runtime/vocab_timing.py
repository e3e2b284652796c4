"""What the vocabulary-parallel passes measure inside one iteration on this rank (host seconds).

The executor times every compute action from its start to its end
(:class:`~megatron_zb.runtime.action_timing.ActionTiming`). With vocabulary parallelism some of those
actions also *wait* for a collective of the other ranks -- the first stage's ``F`` for ``IF``'s
all-reduce, ``S`` for the broadcast of ``X``, ``T`` for the forward barrier, the last stage's ``B`` for
``C1`` (two barriers) or the barrier thread's input gradient (one barrier), ``IB`` for the broadcast of
the embedding's gradient -- and a ``W`` may run ``T``'s weight gradient queued for it. The schedule's
cost model has neither inside an action: the waits are its dependencies plus ``t_collective``, and
``T``'s deferred weight gradient is work of the ``W`` that runs it. :class:`VocabTiming` keeps, per
action ``(op, stage, microbatch)`` (a vocabulary pass's stage is the rank), the seconds spent inside it
on either, so the profile (:mod:`megatron_zb.training.profiling`) can take them out of the action's
time; and per microbatch the barrier thread's forward barrier (``C0``: the all-reduces, the last
rank's loss, the loss gradient's broadcast), whose shortest duration over the ranks is the profile's
``t_collective``.

Host ``time.perf_counter`` seconds (the barrier thread and the waits are host work on CPU; on CUDA a
wait is the host's, not the stream's: not run on a GPU). Always on: two clock reads per wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

__all__ = ["VocabTiming"]

T = TypeVar("T")
Key = tuple[str, int, int]  # (op, stage -- the rank for a vocabulary pass --, microbatch)


@dataclass
class VocabTiming:
    """Seconds measured inside one iteration's actions by the vocabulary passes (module doc).

    Attributes:
        waits: ``(op, stage, mb)`` -> seconds the compute action waited for a collective's result.
        t_weight: ``(stage, mb)`` of a ``W`` -> seconds of ``T``'s weight gradient it ran (queued by ``T``).
        barrier: microbatch -> seconds of the barrier thread's forward barrier (``C0``, the loss, the
            broadcast of its gradient), from the thread taking it up to its end.
    """

    waits: dict[Key, float] = field(default_factory=dict)
    t_weight: dict[tuple[int, int], float] = field(default_factory=dict)
    barrier: dict[int, float] = field(default_factory=dict)

    def wait(self, key: Key, fn: Callable[[], T]) -> T:
        """``fn()`` (a wait for a collective), its seconds added to ``waits[key]``."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.waits[key] = self.waits.get(key, 0.0) + time.perf_counter() - t0

    def timed_weight_grad(self, stage: int, mb: int, fn: Callable[[], Any]) -> Callable[[], None]:
        """``fn`` (``T``'s weight gradient queued for the ``W`` of ``(stage, mb)``), timing itself into ``t_weight``."""
        def run() -> None:
            t0 = time.perf_counter()
            fn()
            self.t_weight[(stage, mb)] = self.t_weight.get((stage, mb), 0.0) + time.perf_counter() - t0
        return run

    def timed_barrier(self, mb: int, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` (the barrier thread's work for microbatch ``mb``), timing itself into ``barrier``."""
        def run() -> T:
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.barrier[mb] = time.perf_counter() - t0
        return run

    def inside(self, op: str, stage: int, mb: int) -> float:
        """Seconds inside the action ``(op, stage, mb)`` that are not its own compute (waits, and for a
        ``W`` the ``T`` weight gradient it ran)."""
        extra = self.waits.get((op, stage, mb), 0.0)
        if op == "W":
            extra += self.t_weight.get((stage, mb), 0.0)
        return extra
