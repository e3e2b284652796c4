"""What one iteration's actions cost on this rank: the executor's per-action timing records.

The executor (:func:`megatron_zb.runtime.executor.execute`) calls :meth:`ActionTiming.mark`
before each compute action and :meth:`ActionTiming.add_compute` after it, and
:meth:`ActionTiming.add_comm` after each communication action; it sets ``start`` (host
``time.perf_counter`` seconds) when it begins.

Which clock times a compute action depends on the device the actions run on, chosen explicitly
(``ActionTiming(device=...)``; :class:`~megatron_zb.runtime.forward_backward.ZeroBubbleForwardBackward`
passes its model's device):

* **CPU**: ``time.perf_counter`` seconds, ``records`` are ready at once (:meth:`resolve` does
  nothing).
* **CUDA**: the host only *launches* kernels, so host times would measure the launches and put
  the compute into whichever later call waits for it. Instead a CUDA event
  (``torch.cuda.Event(enable_timing=True)``) is recorded on the device's current stream when the
  timing is created (the iteration's start), before each compute action (:meth:`mark`) and after
  it (:meth:`add_compute`) -- no synchronisation per action. :meth:`resolve` waits once, for the
  last event, and turns the events into seconds: ``records`` then hold ``start + (GPU time since
  the start event)``, so durations are GPU time and every time is on ``start``'s clock (exact
  when the device reached the start event as the host recorded it, i.e. had no work queued at
  the iteration's start). :func:`resolve_timings` resolves several iterations' timings with a
  single wait. This path is verified on CPU with a mocked event only (``tests/runtime/test_action_timing.py``),
  not run on a GPU.

Host times are kept on both devices (``host_records``): the activation tracker logs its events in
``time.perf_counter`` time (:meth:`~megatron_zb.runtime.memory.ActivationMemoryTracker.bytes_between`
pairs host times), and the runtime's own loop time is a host quantity. On CPU the two are one clock
(host = device). On CUDA the pair also bounds how long the device waited for the host inside each
action (:func:`device_waits`, :meth:`ActionTiming.host_waits`; verified with a mocked CUDA clock on
CPU only, never on a GPU).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Hashable, Iterator, Sequence

import torch

from ..schedules import Action, Op

__all__ = ["ActionTiming", "device_waits", "resolve_timings"]

Record = tuple[Action, float, float]  # (action, start [s], end [s])


class ActionTiming:
    """Seconds of one iteration's actions on this rank (module doc: host or CUDA-event times).

    Attributes:
        device: where the actions run (``cuda``: CUDA events; anything else: ``perf_counter``).
        start: host ``time.perf_counter`` seconds when :func:`execute` began.
        records: every compute action ``(action, start, end)`` in seconds on ``start``'s clock:
            ``perf_counter`` on CPU, resolved GPU times on CUDA (reading it before :meth:`resolve`
            raises there).
        host_records: the same actions' host ``perf_counter`` seconds (on CPU, ``records`` itself):
            for the activation tracker's ``bytes_between`` and the runtime's own loop time.
        cpu: CPU seconds of the executing thread (``time.thread_time``) of each record, same order
            -- unlike wall time not inflated by other processes (host time on both devices).
        collectives: every vocabulary collective's program step (``COLL`` / ``WAIT``: issuing it, waiting
            for it, and for the forward barrier its all-reduces and the last rank's loss), host seconds.
        comm: every communication action in host ``perf_counter`` seconds -- for a ``SEND_*`` the
            ``isend`` call (the copy into the transport), for a ``RECV_*`` the posting of the
            receives it needs plus the host's wait for its data (on CUDA the stream's wait for a
            NCCL receive is not timed).
        intervals: seconds measured with :meth:`interval` on the same clock as ``records`` (the
            vocabulary passes: ``("TW", stage, mb)`` for ``T``'s weight gradients run by a ``W``,
            ``("C0", mb)`` for the forward barrier); ``host_intervals`` the same in host seconds.
    """

    def __init__(self, *, device: torch.device | str = "cpu", start: float = 0.0) -> None:
        self.device = torch.device(device)
        self.start = start
        self.comm: list[Record] = []
        self.collectives: list[tuple[Any, float, float]] = []
        self.cpu: list[float] = []
        self._records: list[Record] = []
        self._cuda = self.device.type == "cuda"
        self._host: list[Record] = [] if self._cuda else self._records
        self._events: list[tuple[Any, Any]] = []  # CUDA: (before, after) event of each compute action
        self.host_intervals: dict[Hashable, float] = {}      # key -> host seconds of interval()
        self._intervals: dict[Hashable, float] = self.host_intervals if not self._cuda else {}  # resolved
        self._interval_events: list[tuple[Hashable, Any, Any]] = []  # CUDA: (key, start, end) to resolve
        self._last: Any = None
        self._start_event = self._record_event() if self._cuda else None
        self.resolved = not self._cuda

    # ------------------------------------------------------------------ what the executor calls
    def mark(self) -> Any:
        """Called right before a compute action starts; what it returns goes to :meth:`add_compute`
        (on CUDA the event recorded now, on CPU ``None``)."""
        return self._record_event() if self._cuda else None

    def add_compute(self, a: Action, t0: float, t1: float, cpu: float, mark: Any = None) -> None:
        """Record compute action ``a``: host ``perf_counter`` seconds ``t0`` (start) and ``t1`` (end),
        ``cpu`` seconds of the executing thread; ``mark`` is what :meth:`mark` returned."""
        self._host.append((a, t0, t1))
        self.cpu.append(cpu)
        if self._cuda:
            if mark is None:
                raise ValueError(f"CUDA action timing: {a} has no start event (call mark() before the action)")
            self._events.append((mark, self._record_event()))

    def add_comm(self, a: Action, t0: float, t1: float) -> None:
        """Record communication action ``a`` (host ``perf_counter`` seconds)."""
        self.comm.append((a, t0, t1))

    def add_collective(self, step: Any, t0: float, t1: float) -> None:
        """Record a vocabulary collective's program step (an ``Issue``; host ``perf_counter`` seconds)."""
        self.collectives.append((step, t0, t1))

    @contextlib.contextmanager
    def interval(self, key: Hashable) -> Iterator[None]:
        """Time the work done inside the ``with`` block on the actions' clock (``perf_counter`` on
        CPU, CUDA events on the current stream on CUDA), added to :attr:`intervals` ``[key]``: what
        the vocabulary passes measure inside and between actions (``T``'s weight gradient run by a
        ``W``, the forward barrier), so that it is subtracted from, and compared with, times of the
        same clock."""
        e0 = self._record_event() if self._cuda else None
        t0 = time.perf_counter()
        yield
        self.host_intervals[key] = self.host_intervals.get(key, 0.0) + time.perf_counter() - t0
        if self._cuda:
            self._interval_events.append((key, e0, self._record_event()))

    @property
    def intervals(self) -> dict[Hashable, float]:
        """Seconds per key of :meth:`interval` (resolved on CUDA: read after :meth:`resolve`)."""
        if not self.resolved:
            raise RuntimeError("CUDA action timing read before resolve()")
        return self._intervals

    # ------------------------------------------------------------------ reading the times
    @property
    def records(self) -> list[Record]:
        """Every compute action ``(action, start, end)``, seconds on ``start``'s clock (class doc)."""
        if not self.resolved:
            raise RuntimeError("CUDA action timing read before resolve(): call resolve() (one synchronisation) "
                               "or megatron_zb.runtime.action_timing.resolve_timings for several iterations")
        return self._records

    @records.setter
    def records(self, value: list[Record]) -> None:
        self._records = value
        if not self._cuda:
            self._host = value

    @property
    def host_records(self) -> list[Record]:
        """Every compute action ``(action, start, end)`` in host ``time.perf_counter`` seconds."""
        return self._host

    def resolve(self, *, synchronize: bool = True) -> None:
        """On CUDA: wait for the last recorded event (one synchronisation; ``synchronize=False`` when
        the caller already waited for a later event on the same stream), then fill ``records`` with
        ``start + start_event.elapsed_time(event) / 1000`` seconds. Once only; nothing to do on CPU."""
        if self.resolved:
            return
        if synchronize:
            self.last_event.synchronize()
        s0 = self._start_event
        self._records = [(a, self.start + s0.elapsed_time(e0) / 1e3, self.start + s0.elapsed_time(e1) / 1e3)
                         for (a, _, _), (e0, e1) in zip(self._host, self._events)]
        for key, e0, e1 in self._interval_events:
            self._intervals[key] = self._intervals.get(key, 0.0) + e0.elapsed_time(e1) / 1e3
        self._events, self._interval_events = [], []
        self.resolved = True

    @property
    def last_event(self) -> Any:
        """CUDA: the event recorded last (an action's or an interval's end, else the start event)."""
        return self._last

    def host_waits(self) -> list[float] | None:
        """Per compute action (the order of ``records``), an upper bound on the seconds the device waited
        for the host inside it (:func:`device_waits`); ``None`` on CPU, where the device is the host and
        no wait can be observed. Reads ``records``: resolve first on CUDA."""
        return device_waits(self._host, self.records) if self._cuda else None

    def durations(self, op: Op | str) -> dict[int, list[float]]:
        """Per stage, the durations (seconds) of actions of kind ``op`` (compute: from ``records``, GPU
        time on CUDA; communication: host time)."""
        op = Op(op)
        out: dict[int, list[float]] = {}
        for a, t0, t1 in (self.records if op.is_compute else self.comm):
            if a.op is op:
                out.setdefault(a.stage, []).append(t1 - t0)
        return out

    def cpu_durations(self, op: Op | str) -> dict[int, list[float]]:
        """Per stage, the CPU seconds of the compute actions of kind ``op``."""
        op = Op(op)
        out: dict[int, list[float]] = {}
        for (a, _, _), c in zip(self._host, self.cpu):
            if a.op is op:
                out.setdefault(a.stage, []).append(c)
        return out

    def _record_event(self) -> Any:
        """A timing CUDA event recorded now on the current stream of ``device`` (the stream the
        actions' kernels are launched on)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._last = event
        return event


def device_waits(host: Sequence[Record], device: Sequence[Record]) -> list[float]:
    """Per compute action, an upper bound ``U`` [s] on the time the device spent waiting for the host
    inside it, from CUDA events alone (no per-kernel profiler).

    ``host[i] = (a, t0, t1)``: host ``perf_counter`` seconds; the executor reads ``t1`` when the
    action's code returned, *then* records the after-event. ``device[i] = (a, d0, d1)``: the
    seconds at which the device completed the before- and the after-event, on the host clock through
    the iteration's start event (``ActionTiming.records``). One stream: between ``d0`` and ``d1`` the
    device runs the action's work in order; its device time is ``D = d1 - d0``.

    Derivation:

    1. Nothing completes before the host enqueues it, and the after-event is enqueued after ``t1``:
       ``d1 >= t1``; the after-event's lag ``l1 = d1 - t1 >= 0``.
    2. By ``t1`` every kernel of the action is enqueued; from then on the device runs queued work and
       needs nothing more from the host to reach the after-event. So it can wait for the host inside
       the action only before ``t1``, i.e. within ``[d0, min(d1, t1)]``:
       ``waited <= U = min(D, max(0, t1 - d0)) = min(D, max(0, D - l1))``.
    3. ``U`` is tight, and nothing better than ``waited >= 0`` follows from two events: one kernel of
       length ``D`` launched at the action's start (waited 0) and one kernel of length ``l1`` launched
       at ``t1`` (the device idle from ``d0`` to ``t1``: waited ``U``) give the same ``d0, d1, t1``. So
       the action's own device work ``C`` (its kernels and any wait on another stream) lies in
       ``[D - U, D]``; ``D - U = l1`` when ``t1 >= d0`` -- the tail after the host finished, during
       which the device is certainly busy. (Hence "waited >= D - (host time - lag at the start)" is
       wrong: that difference is this busy tail ``l1``.)
    4. The clock: ``records`` put device times on the host clock as if the device reached the start
       event when ``start`` was read. Had it reached it ``delta`` later (work still queued when the
       iteration began), every device time is ``delta`` early; since every ``d1 >= t1`` (1.),
       ``delta >= max_i(t1_i - d1_i)``, and that bound, when positive, is added to every ``d`` before
       ``U`` is taken: the tightest correction the events allow, and ``U`` stays an upper bound (a
       larger ``delta`` only lowers it). Exact up to the microseconds between recording the start event
       and the executor reading ``start`` (the runtime creates the timing right before it).

    A synchronisation inside the action (``.item()``, a copy from pageable memory, megatron-core's
    level-2 timers) makes the host wait for the device, and afterwards the device waits for every
    launch that follows: ``U`` counts both, as host time inside the action. Host and device records
    must be of the same actions, in the same order (``ValueError`` otherwise).
    """
    if [a for a, _, _ in host] != [a for a, _, _ in device]:
        raise ValueError("device_waits: host and device records are not the same actions in the same order")
    behind = max([0.0] + [t1 - d1 for (_, _, t1), (_, _, d1) in zip(host, device)])
    return [min(d1 - d0, max(0.0, t1 - d0 - behind)) for (_, _, t1), (_, d0, d1) in zip(host, device)]


def resolve_timings(timings: Sequence[ActionTiming]) -> None:
    """Resolve ``timings`` (iterations run in this order on one device) with one synchronisation:
    wait for the last unresolved timing's last event -- events complete in the order they were
    recorded on the stream, so every earlier event has completed too -- then convert them all."""
    pending = [t for t in timings if not t.resolved]
    if not pending:
        return
    pending[-1].resolve()
    for t in pending[:-1]:
        t.resolve(synchronize=False)
