"""What one iteration's actions cost on this rank: the executor's per-action timing records.

The executor (:func:`megatron_zb.runtime.executor.execute`) calls :meth:`ActionTiming.mark`
before each compute action and :meth:`ActionTiming.add_compute` after it, and
:meth:`ActionTiming.add_comm` after each communication action. On CPU the times are
``time.perf_counter`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..schedules import Action, Op


@dataclass
class ActionTiming:
    """Wall-clock seconds (``time.perf_counter``) of one iteration's actions on this rank.

    ``records``: every compute action ``(action, start, end)``. ``cpu``: the CPU seconds of the
    executing thread (``time.thread_time``) of each record, same order -- unlike wall time not
    inflated by other processes. ``comm``: every communication action -- for a ``SEND_*`` the
    ``isend`` call (the copy into the transport), for a ``RECV_*`` the posting of the receives it
    needs plus the wait for its data. ``start``: when :func:`execute` began.
    """

    start: float = 0.0
    records: list[tuple[Action, float, float]] = field(default_factory=list)
    comm: list[tuple[Action, float, float]] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def cpu_durations(self, op: Op | str) -> dict[int, list[float]]:
        """Per stage, the CPU seconds of the compute actions of kind ``op``."""
        op = Op(op)
        out: dict[int, list[float]] = {}
        for (a, _, _), c in zip(self.records, self.cpu):
            if a.op is op:
                out.setdefault(a.stage, []).append(c)
        return out

    def durations(self, op: Op | str) -> dict[int, list[float]]:
        """Per stage, the durations (seconds) of actions of kind ``op`` (compute or communication)."""
        op = Op(op)
        out: dict[int, list[float]] = {}
        for a, t0, t1 in (self.records if op.is_compute else self.comm):
            if a.op is op:
                out.setdefault(a.stage, []).append(t1 - t0)
        return out

    def mark(self) -> Any:
        """Called right before a compute action starts; what it returns goes to :meth:`add_compute`."""
        return None

    def add_compute(self, a: Action, t0: float, t1: float, cpu: float, mark: Any = None) -> None:
        """Record compute action ``a``: started at ``t0``, ended at ``t1`` (perf_counter seconds),
        ``cpu`` seconds of the executing thread; ``mark`` is what :meth:`mark` returned."""
        self.records.append((a, t0, t1))
        self.cpu.append(cpu)

    def add_comm(self, a: Action, t0: float, t1: float) -> None:
        """Record communication action ``a`` (perf_counter seconds)."""
        self.comm.append((a, t0, t1))

