"""Per-action timing (megatron_zb.runtime.action_timing): CUDA events resolved with one synchronisation,
host times kept for the activation tracker, perf_counter on CPU, and the profiling window's single wait.

CUDA cannot run on this machine: the CUDA path is driven through :class:`FakeCuda` / :class:`FakeEvent`,
test doubles of ``torch.cuda.Event``, ``torch.cuda.current_stream`` and ``torch.cuda.synchronize``.
Every expected number below is worked out by hand from the scripted GPU times.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from megatron_zb.runtime.action_timing import ActionTiming, resolve_timings
from megatron_zb.runtime.memory import ActivationMemoryTracker
from megatron_zb.schedules import Op
from megatron_zb.schedules.ir import Action
from megatron_zb.training.profiling import ActionProfile, ProfileWindow

F0, B0, W0 = Action(Op.F, 0, 0), Action(Op.B, 0, 0), Action(Op.W, 0, 0)


class FakeEvent:
    """Test double for ``torch.cuda.Event(enable_timing=True)``: CUDA cannot run here (CPU-only torch,
    no GPU), so this stands in for it.

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
        return end.gpu_ms - self.gpu_ms


class FakeCuda:
    """The scripted device: GPU times (ms) handed out to events in recording order; counts of
    synchronisations (event or device-wide) and of events recorded; the streams events were recorded on."""

    def __init__(self, script: list[float]) -> None:
        self.script = list(script)
        self.syncs = self.recorded = self.completed = 0
        self.streams: list[object] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeCuda":
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
    """What the executor does around compute actions: ``start``, then mark / add_compute per action."""
    timing.start = start
    for a, t0, t1 in host:
        mark = timing.mark()
        timing.add_compute(a, t0, t1, 0.5 * (t1 - t0), mark)


# one iteration: start event at GPU 100 ms; F 100.5-103, B 103-107.25, W 107.5-108.5 (ms)
SCRIPT = [100.0, 100.5, 103.0, 103.0, 107.25, 107.5, 108.5]
HOST = [(F0, 10.0, 10.001), (B0, 10.002, 10.003), (W0, 10.004, 10.0045)]  # perf_counter s: the launches


def test_cuda_timing_records_events_and_never_synchronises_per_action(monkeypatch):
    cuda = FakeCuda(SCRIPT).install(monkeypatch)
    timing = ActionTiming(device=torch.device("cuda"))
    run_actions(timing, HOST, start=50.0)
    assert cuda.recorded == 7            # the start event, then one before and one after each action
    assert cuda.syncs == 0
    assert cuda.streams == [("stream of", torch.device("cuda"))] * 7  # the given device's current stream
    assert not timing.resolved
    with pytest.raises(RuntimeError, match="resolve"):
        timing.records                    # unresolved GPU times are never read as if they were host times
    assert timing.host_records == HOST


def test_resolve_synchronises_once_and_gives_gpu_seconds_on_starts_clock(monkeypatch):
    cuda = FakeCuda(SCRIPT).install(monkeypatch)
    timing = ActionTiming(device="cuda")
    run_actions(timing, HOST, start=50.0)
    timing.resolve()
    assert cuda.syncs == 1
    # start + (GPU ms since the start event) / 1000
    assert [(a, pytest.approx(t0, abs=1e-12), pytest.approx(t1, abs=1e-12)) for a, t0, t1 in timing.records] == [
        (F0, 50.0005, 50.003), (B0, 50.003, 50.00725), (W0, 50.0075, 50.0085)]
    assert timing.durations(Op.F) == {0: [pytest.approx(0.0025)]}
    assert timing.durations(Op.B) == {0: [pytest.approx(0.00425)]}
    assert timing.durations(Op.W) == {0: [pytest.approx(0.001)]}
    assert timing.host_records == HOST    # the host times stay for the activation tracker
    assert timing.cpu_durations(Op.B) == {0: [pytest.approx(0.0005)]}
    timing.resolve()
    assert cuda.syncs == 1                # once only


def test_the_fake_refuses_elapsed_time_before_a_synchronisation(monkeypatch):
    """The double is strict: resolving without waiting fails, so the counts above mean something."""
    FakeCuda(SCRIPT).install(monkeypatch)
    timing = ActionTiming(device="cuda")
    run_actions(timing, HOST, start=50.0)
    with pytest.raises(RuntimeError, match="not ready"):
        timing.resolve(synchronize=False)


def test_cpu_timing_is_perf_counter_and_touches_no_cuda(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("CPU timing called torch.cuda")

    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    timing = ActionTiming()               # device defaults to the CPU
    assert timing.resolved and timing.mark() is None
    t0 = time.perf_counter()
    host = [(F0, t0, t0 + 0.25), (B0, t0 + 0.5, t0 + 1.0)]
    run_actions(timing, host, start=t0 - 1.0)
    timing.resolve()                      # nothing to do
    assert timing.records == host and timing.host_records == host
    assert timing.durations(Op.F) == {0: [pytest.approx(0.25)]}
    assert timing.durations(Op.B) == {0: [pytest.approx(0.5)]}


def test_profile_takes_durations_from_gpu_times_and_bytes_from_host_times(monkeypatch):
    FakeCuda(SCRIPT).install(monkeypatch)
    timing = ActionTiming(device="cuda")
    run_actions(timing, HOST, start=50.0)
    timing.resolve()
    memory = ActivationMemoryTracker()
    # host perf_counter times: 300 bytes saved during F, 120 freed during B, 80 more freed during W
    memory.events = [(10.0005, 300), (10.0025, -120), (10.0042, -80)]
    profile = ActionProfile()
    profile.add(timing, elapsed=0.02, memory=memory)
    assert profile.durations == {(Op.F, 0): [pytest.approx(0.0025)], (Op.B, 0): [pytest.approx(0.00425)],
                                 (Op.W, 0): [pytest.approx(0.001)]}
    assert profile.busy == pytest.approx(0.00775)
    assert profile.mean_bytes() == {(Op.F, 0): 300, (Op.B, 0): -120, (Op.W, 0): -80}


def three_iterations() -> tuple[list[float], list[list[tuple[Action, float, float]]]]:
    """Scripted GPU times (ms) and host times (s) of three iterations of F then B on stage 0.

    GPU per iteration i (base 10 i): start event at base, F base+1 .. base+3 (2 ms), B base+3 .. base+6 (3 ms)."""
    script, host = [], []
    for i in range(3):
        b = 10.0 * i
        script += [b, b + 1, b + 3, b + 3, b + 6]
        host.append([(F0, 1.0 * i, 1.0 * i + 0.001), (B0, 1.0 * i + 0.002, 1.0 * i + 0.003)])
    return script, host


def test_window_resolves_all_iterations_with_one_synchronisation(monkeypatch):
    script, host = three_iterations()
    cuda = FakeCuda(script).install(monkeypatch)
    window, profile = ProfileWindow(), ActionProfile()
    for i in range(3):
        timing = ActionTiming(device="cuda")
        run_actions(timing, host[i], start=1.0 * i)
        window.add(timing, elapsed=0.5, times=i > 0)  # the first: bytes only
        if i > 0:
            window.add_next_start(1.0 * i + 0.9)      # iteration i+1 began on the host at i + 0.9 s
    assert cuda.syncs == 0 and profile.iterations == 0
    window.close(profile)
    assert cuda.syncs == 1
    assert profile.iterations == 2
    assert profile.durations == {(Op.F, 0): [pytest.approx(0.002)] * 2, (Op.B, 0): [pytest.approx(0.003)] * 2}
    # the outside times: began minus the resolved end of the last B (start + 6 ms): 0.9 - 0.006 twice
    assert profile.outside == [pytest.approx(0.894), pytest.approx(0.894)]
    assert window.iterations == [] and window.next_starts == []


def test_resolve_timings_waits_once_for_all(monkeypatch):
    script, host = three_iterations()
    cuda = FakeCuda(script).install(monkeypatch)
    timings = []
    for i in range(3):
        timings.append(ActionTiming(device="cuda"))
        run_actions(timings[-1], host[i], start=0.0)
    resolve_timings(timings)
    assert cuda.syncs == 1
    assert [t.durations(Op.B) for t in timings] == [{0: [pytest.approx(0.003)]}] * 3


def test_planner_resolves_at_the_window_end_only(monkeypatch):
    """SchedulePlanner over a window of three iterations (2-4): no synchronisation before the
    window's last iteration ends, one then; the bytes-only first iteration gives no times."""
    import megatron.core.pipeline_parallel as mcore_pp

    from megatron_zb.training.replanning import SchedulePlanner

    monkeypatch.setattr(mcore_pp, "get_forward_backward_func", lambda: None)  # needs no process group then
    script, host = three_iterations()
    cuda = FakeCuda(script).install(monkeypatch)
    from megatron_zb.training import run_config as rc

    config = rc.RunConfig(
        model=rc.ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=8, padded_vocab_size=8,
                             ffn_hidden_size=32, kv_channels=8, max_position_embeddings=8),
        parallel=rc.ParallelConfig(), precision=rc.PrecisionConfig(), optim=rc.OptimConfig(lr=1e-3),
        schedule=rc.ScheduleConfig(name="1f1b", placement="plain", split_backward=False, cost_aware=False,
                                   num_model_chunks=1, layers_per_stage=(1,), use_megatron_core_schedule=True,
                                   zero_bubble_pipeline_timers_start_iter=2, zero_bubble_pipeline_timers_end_iter=5),
        micro_batch_size=1, global_batch_size=1, num_microbatches=1, train_iters=10)
    planner = SchedulePlanner(config, schedule=SimpleNamespace(stage_to_rank=[0], num_microbatches=1), dist_ctx=None)
    runtime = SimpleNamespace(options=SimpleNamespace(time_actions=False, track_memory=False),
                              last_timing=None, last_memory=None)
    planner.runtime = runtime             # a runtime whose iterations are scripted
    due = []
    for it in (2, 3, 4):
        assert planner.begin_iteration(it) and runtime.options.time_actions
        timing = ActionTiming(device="cuda")
        run_actions(timing, host[it - 2], start=time.perf_counter())
        runtime.last_timing = timing
        due.append(planner.end_iteration(it, profiling=True, seconds=0.5))
        assert cuda.syncs == (1 if it == 4 else 0)
    assert due == [False, False, True]
    assert planner.profiled_iterations == [2, 3, 4]
    assert planner.profile.iterations == 2 and len(planner.profile.outside) == 1
    assert planner.profile.durations[(Op.F, 0)] == [pytest.approx(0.002)] * 2
