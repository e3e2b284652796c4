"""The profiling window of the re-plan: which iterations measure what, kept until the window ends.

Iterations ``[--zero-bubble-pipeline-timers-start-iter, --zero-bubble-pipeline-timers-end-iter)``
are profiled (:mod:`megatron_zb.training.profiling`). :meth:`CostWindow.request` says what an
iteration measures (a :class:`~megatron_zb.runtime.measure.Measure`, given to the runtime's ``run``),
:meth:`CostWindow.record` keeps what it measured (the call's
:class:`~megatron_zb.runtime.measure.Measured`) and says when the window is over; then the kept
iterations are resolved -- on CUDA an :class:`~megatron_zb.runtime.action_timing.ActionTiming` holds
events the device has not necessarily reached, and resolving each iteration would stall the host once
per iteration, so all are resolved with one synchronisation
(:func:`~megatron_zb.runtime.action_timing.resolve_timings`; on CPU the same code runs, free) -- and
added to :attr:`CostWindow.profile`, which :meth:`~megatron_zb.training.replanning.SchedulePlanner.replan`
reads.

The activation tracker's hooks slow the actions down (10-15% at hidden 64): with two or more window
iterations the first measures the bytes only, the others the times only (a window of one iteration
measures both). When two profiled iterations follow each other, the time from the first's last compute
action to the second's start is one sample of the time outside the schedule (less the window's own
bookkeeping).
"""

from __future__ import annotations

import time

from megatron_zb.runtime.action_timing import ActionTiming, resolve_timings
from megatron_zb.runtime.measure import Measure, Measured
from megatron_zb.training.profiling import ActionProfile
from megatron_zb.training.run_config import RunConfig

__all__ = ["CostWindow"]


class CostWindow:
    """The profiled iterations of one run (module docstring).

    Attributes:
        profile: the action times of the profiled iterations (filled when the window ends).
        profiled_iterations: the iterations profiled so far.
        active: whether this run profiles at all (megatron-zb's runtime; not megatron-core's schedule).
    """

    def __init__(self, config: RunConfig, *, active: bool) -> None:
        sched = config.schedule
        self.start, self.end = sched.zero_bubble_pipeline_timers_start_iter, sched.zero_bubble_pipeline_timers_end_iter
        self.last = min(self.end - 1, config.train_iters)   # the window's last iteration in this run
        self.active = active
        self.profile = ActionProfile()
        self.profiled_iterations: list[int] = []
        # kept until the window ends: (timing, seconds of the call, its tracker or None, times measured)
        self._kept: list[tuple[ActionTiming, float, object, bool]] = []
        self._next_starts: list[tuple[int, float]] = []   # (index in _kept, perf_counter [s] of the next start)
        self._timed_previous = False   # the last profiled iteration measured times (its end starts a sample)
        self._bookkeeping = 0.0        # seconds the window itself spent after that iteration
        self._bytes_only = self._times_tracked = False

    def profiles_after(self, iteration: int) -> bool:
        """Whether iterations after ``iteration`` will be profiled (for the start-of-training line)."""
        return self.active and iteration < self.end - 1

    def request(self, iteration: int) -> Measure:
        """What ``iteration`` measures (nothing outside the window; it names the iteration anyway, for
        the errors of a late data-parallel reduce). Call it first thing in an iteration: when the previous
        iteration was profiled too, the time since its last compute action is a time outside the schedule."""
        now = time.perf_counter()
        profiling = self.active and self.start <= iteration < self.end
        if profiling and self._timed_previous and self.profiled_iterations[-1:] == [iteration - 1]:
            self._next_starts.append((len(self._kept) - 1, now - self._bookkeeping))  # not the window's own time
        self._timed_previous = False
        self._bytes_only = profiling and not self.profiled_iterations and iteration < self.last
        self._times_tracked = profiling and not self._bytes_only and not self.profiled_iterations
        return Measure(time_actions=profiling, track_memory=self._bytes_only or self._times_tracked, iteration=iteration)

    def record(self, iteration: int, measured: Measured, *, seconds: float) -> bool:
        """Keep a profiled ``iteration``'s measurements (``seconds``: wall time of its call); returns
        whether the window is over now (then :attr:`profile` holds the window, resolved)."""
        timing = measured.timing
        if timing is not None and self.start <= iteration < self.end:
            t0 = time.perf_counter()
            memory = measured.memory if (self._bytes_only or self._times_tracked) else None
            self._kept.append((timing, seconds, memory, not self._bytes_only))
            self._bookkeeping = time.perf_counter() - t0
            self.profiled_iterations.append(iteration)
            self._timed_previous = not self._bytes_only and bool(timing.host_records)
        due = iteration == self.last and bool(self.profiled_iterations) and self.profiled_iterations[-1] == iteration
        if due:
            self._close()
        return due

    def _close(self) -> None:
        """Resolve every kept timing (one synchronisation on CUDA), add them to :attr:`profile`."""
        resolve_timings([timing for timing, _, _, _ in self._kept])
        for timing, elapsed, memory, times in self._kept:
            self.profile.add(timing, elapsed, memory, times=times)
        for i, began in self._next_starts:
            self.profile.add_outside(began - max(t1 for _, _, t1 in self._kept[i][0].records))
        self._kept, self._next_starts = [], []
