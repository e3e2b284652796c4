"""Per-action timing (megatron_zb.runtime.action_timing): CUDA events resolved with one synchronisation,
host times kept for the activation tracker, perf_counter on CPU, and the profiling window's single wait.

CUDA cannot run on this machine: the CUDA path is driven through
:class:`~harness.fake_cuda.FakeCuda` / ``FakeEvent``, test doubles of ``torch.cuda.Event``,
``torch.cuda.current_stream`` and ``torch.cuda.synchronize``.
Every expected number below is worked out by hand from the scripted GPU times.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from megatron_zb.runtime.action_timing import ActionTiming, device_waits, resolve_timings
from megatron_zb.runtime.memory import ActivationMemoryTracker
from megatron_zb.schedules import Op
from megatron_zb.schedules.ir import Action
from harness.fake_cuda import FakeCuda, run_actions
from megatron_zb.training.profiling import ActionProfile

F0, B0, W0 = Action(Op.F, 0, 0), Action(Op.B, 0, 0), Action(Op.W, 0, 0)


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
    """CostWindow over iterations 1-3 on a scripted CUDA clock and a scripted host clock: the first
    measures the bytes only; nothing is resolved before the window ends, all at once then; the time
    from iteration 2's last compute action to iteration 3's start is the one outside sample."""
    from megatron_zb.runtime.measure import Measured
    from megatron_zb.training import cost_window

    script, host = three_iterations()
    cuda = FakeCuda(script).install(monkeypatch)
    now = [0.0]
    monkeypatch.setattr(cost_window, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    window = cost_window.CostWindow(_config(start=1, end=4), active=True)
    for i in range(3):
        now[0] = 1.0 * i + 0.9 if i else 0.0          # iteration i+1 begins on the host at i + 0.9 s
        window.request(i + 1)
        timing = ActionTiming(device="cuda")
        run_actions(timing, host[i], start=1.0 * i)
        due = window.record(i + 1, Measured(data=[], timing=timing), seconds=0.5)
        assert cuda.syncs == (1 if i == 2 else 0) and due == (i == 2)
    profile = window.profile
    assert profile.iterations == 2   # the first: bytes only
    assert profile.durations == {(Op.F, 0): [pytest.approx(0.002)] * 2, (Op.B, 0): [pytest.approx(0.003)] * 2}
    # the outside time: iteration 3 began at 2.9 s, iteration 2's last B ended at its start + 6 ms (1.006 s)
    assert profile.outside == [pytest.approx(2.9 - 1.006)]


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


def _config(*, start: int, end: int):
    """A one-stage run whose re-plan window is iterations ``start`` to ``end - 1``."""
    from megatron_zb.training import run_config as rc

    return rc.RunConfig(
        model=rc.ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=8, padded_vocab_size=8,
                             ffn_hidden_size=32, kv_channels=8, max_position_embeddings=8),
        parallel=rc.ParallelConfig(), precision=rc.PrecisionConfig(), optim=rc.OptimConfig(lr=1e-3),
        schedule=rc.ScheduleConfig(name="1f1b", placement="plain", split_backward=False, cost_aware=False,
                                   num_model_chunks=1, layers_per_stage=(1,),
                                   zero_bubble_pipeline_timers_start_iter=start, zero_bubble_pipeline_timers_end_iter=end),
        micro_batch_size=1, global_batch_size=1, num_microbatches=1, train_iters=10)


def test_cost_window_resolves_at_the_window_end_only(monkeypatch):
    """The re-plan's CostWindow over a window of three iterations (2-4): every iteration asks the runtime
    for its actions' times, the first also for the bytes (only); no synchronisation before the window's
    last iteration ends, one then; the bytes-only first iteration gives no times."""
    from megatron_zb.runtime.measure import Measured
    from megatron_zb.training.cost_window import CostWindow

    script, host = three_iterations()
    cuda = FakeCuda(script).install(monkeypatch)
    window = CostWindow(_config(start=2, end=5), active=True)
    assert not window.request(1).time_actions   # before the window
    due, requests = [], []
    for it in (2, 3, 4):
        measure = window.request(it)
        requests.append((measure.time_actions, measure.track_memory, measure.iteration))
        timing = ActionTiming(device="cuda")
        run_actions(timing, host[it - 2], start=time.perf_counter())
        due.append(window.record(it, Measured(data=[], timing=timing), seconds=0.5))
        assert cuda.syncs == (1 if it == 4 else 0)
    assert requests == [(True, True, 2), (True, False, 3), (True, False, 4)]
    assert due == [False, False, True]
    assert window.profiled_iterations == [2, 3, 4]
    assert window.profile.iterations == 2 and len(window.profile.outside) == 1
    assert window.profile.durations[(Op.F, 0)] == [pytest.approx(0.002)] * 2
    assert not window.request(5).time_actions   # after it


# ---------------------------------------------------------------------------- the device's wait for the host
# One iteration, start event at GPU 100 ms and host start 50 s, so GPU g ms is host 50 + (g - 100) / 1000 s.
# F: the host launches for 30 ms (50.000-50.030 s); the device ends F 0.5 ms after the host (GPU 100.0-130.5):
#    D = 30.5 ms, the after-event's lag l1 = 0.5 ms, so U = D - l1 = 30.0 ms: host-bound.
# B: the host launches for 2 ms (50.031-50.033 s); the device runs B from 131.0 to 151.0 ms: D = 20 ms, l1 = 18 ms,
#    U = 2.0 ms: device-bound.
# W: launched 50.0335-50.034 s while the device still runs B; it runs at 151.0-155.0 ms: D = 4 ms, t1 - d0 = -17 ms,
#    U = 0.
WAIT_SCRIPT = [100.0, 100.0, 130.5, 131.0, 151.0, 151.0, 155.0]
WAIT_HOST = [(F0, 50.0, 50.030), (B0, 50.031, 50.033), (W0, 50.0335, 50.034)]


def test_host_waits_bound_the_device_wait_for_the_host_per_action(monkeypatch):
    FakeCuda(WAIT_SCRIPT).install(monkeypatch)
    timing = ActionTiming(device="cuda")
    run_actions(timing, WAIT_HOST, start=50.0)
    timing.resolve()
    assert timing.host_waits() == [pytest.approx(0.030, rel=1e-9), pytest.approx(0.002, rel=1e-9), 0.0]
    assert timing.durations(Op.F) == {0: [pytest.approx(0.0305, rel=1e-9)]}  # the device's interval
    assert [t1 - t0 for _, t0, t1 in timing.host_records] == [pytest.approx(v, rel=1e-9) for v in
                                                              (0.030, 0.002, 0.0005)]  # the host's


def test_device_waits_correct_for_a_device_behind_at_the_iteration_start():
    """The device reached the start event 5 ms after the host read ``start``: every resolved device time
    is 5 ms early. True times: F device 50.005-50.0305 s (host 50.000-50.030), B device 50.031-50.046 s
    (host 50.031-50.041); resolved 5 ms earlier. F's resolved after-event is 4.5 ms before its host time,
    which proves the device was at least 4.5 ms behind: every device time is moved 4.5 ms later.
    F: D = 25.5 ms, t1 - d0 - 4.5 = 25.5 -> U = 25.5 ms (the true bound, min(D, 30 - 5), is 25.0).
    B: D = 15 ms, t1 - d0 - 4.5 = 50.041 - 50.026 - 0.0045 = 10.5 ms (true bound 10.0; uncorrected 15.0)."""
    host = [(F0, 50.000, 50.030), (B0, 50.031, 50.041)]
    device = [(F0, 50.000, 50.0255), (B0, 50.026, 50.041)]
    assert device_waits(host, device) == [pytest.approx(0.0255, rel=1e-9), pytest.approx(0.0105, rel=1e-9)]
    with pytest.raises(ValueError, match="same actions"):
        device_waits(host, device[::-1])


def test_cpu_timing_observes_no_wait():
    """On CPU the device is the host: there is no wait to observe."""
    timing = ActionTiming()
    run_actions(timing, [(F0, 1.0, 1.5)], start=0.5)
    assert timing.host_waits() is None


def test_profile_keeps_host_and_device_time_and_the_wait_per_action(monkeypatch):
    FakeCuda(WAIT_SCRIPT).install(monkeypatch)
    timing = ActionTiming(device="cuda")
    run_actions(timing, WAIT_HOST, start=50.0)
    profile = ActionProfile()
    resolve_timings([timing])
    profile.add(timing, elapsed=0.06)
    assert profile.clock == "cuda_events"
    assert profile.medians_ms() == {(Op.F, 0): pytest.approx(30.5, rel=1e-9), (Op.B, 0): pytest.approx(20.0, rel=1e-9),
                                    (Op.W, 0): pytest.approx(4.0, rel=1e-9)}
    assert profile.host_medians_ms() == {(Op.F, 0): pytest.approx(30.0, rel=1e-9),
                                         (Op.B, 0): pytest.approx(2.0, rel=1e-9), (Op.W, 0): pytest.approx(0.5, rel=1e-9)}
    assert profile.wait_medians_ms() == {(Op.F, 0): pytest.approx(30.0, rel=1e-9),
                                         (Op.B, 0): pytest.approx(2.0, rel=1e-9), (Op.W, 0): 0.0}
    cpu = ActionProfile()
    cpu_timing = ActionTiming()
    run_actions(cpu_timing, [(F0, 1.0, 1.5)], start=0.5)
    cpu.add(cpu_timing, elapsed=1.0)
    assert (cpu.clock, cpu.wait_medians_ms(), cpu.host_medians_ms()) == ("host", {}, cpu.medians_ms())
