"""A scripted CUDA clock for CPU tests of the CUDA-event action timing (``runtime/action_timing.py``).

CUDA cannot run on the CPU-only test machines: :class:`FakeCuda` / :class:`FakeEvent` stand in for
``torch.cuda.Event(enable_timing=True)``, ``torch.cuda.current_stream`` and ``torch.cuda.synchronize``
(installed with pytest's ``monkeypatch``), and :func:`run_actions` does what the executor does around
compute actions, with scripted host times. Tests work every expected number out by hand from the
scripted device (ms) and host (s) times.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_zb.runtime.action_timing import ActionTiming
from megatron_zb.schedules.ir import Action

__all__ = ["FakeCuda", "FakeEvent", "run_actions"]


class FakeEvent:
    """Test double for ``torch.cuda.Event(enable_timing=True)``.

    ``record(stream)`` takes the next scripted GPU time (ms) of its :class:`FakeCuda`;
    ``synchronize()`` counts one wait and completes every event recorded so far (one stream: events
    complete in recording order); ``elapsed_time(end)`` returns ``end``'s scripted time minus this
    one's (ms) and, as CUDA does (``cudaErrorNotReady``), refuses unless both have completed.
    """

    def __init__(self, cuda: "FakeCuda") -> None:
        self.cuda = cuda
        self.gpu_ms: float | None = None
        self.order = -1

    def record(self, stream: object = None) -> None:
        self.cuda.streams.append(stream)
        self.gpu_ms = self.cuda.script.pop(0)
        self.order = self.cuda.recorded
        self.cuda.recorded += 1

    def synchronize(self) -> None:
        self.cuda.syncs += 1
        self.cuda.completed = max(self.cuda.completed, self.order + 1)

    def elapsed_time(self, end: "FakeEvent") -> float:
        if max(self.order, end.order) >= self.cuda.completed:
            raise RuntimeError("CUDA error: device not ready (elapsed_time before the events completed)")
        return end.gpu_ms - self.gpu_ms  # type: ignore[operator]


class FakeCuda:
    """The scripted device: GPU times (ms) handed out to events in recording order; counts of
    synchronisations (event or device-wide) and of events recorded; the streams events were recorded on."""

    def __init__(self, script: list[float]) -> None:
        self.script = list(script)
        self.syncs = self.recorded = self.completed = 0
        self.streams: list[object] = []

    def install(self, monkeypatch: Any) -> "FakeCuda":
        """Replace ``torch.cuda.Event``, ``current_stream`` and ``synchronize`` with this device
        (``monkeypatch``: pytest's fixture, which restores them)."""
        def event(enable_timing: bool = False) -> FakeEvent:
            assert enable_timing, "a CUDA event without enable_timing cannot be timed"
            return FakeEvent(self)

        def synchronize(device: object = None) -> None:
            self.syncs += 1
            self.completed = self.recorded

        monkeypatch.setattr(torch.cuda, "Event", event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        return self


def run_actions(timing: ActionTiming, host: list[tuple[Action, float, float]], start: float) -> None:
    """What the executor does around compute actions: ``start`` [s], then mark / add_compute per action
    with the host ``perf_counter`` times of ``host`` [s] (CPU time: half of each action's host time)."""
    timing.start = start
    for a, t0, t1 in host:
        mark = timing.mark()
        timing.add_compute(a, t0, t1, 0.5 * (t1 - t0), mark)
