"""Host and device time per action, and the host-bound diagnosis (megatron_zb.training.host_bound), in the
schedule report and in ``--profile-out``'s JSON.

CUDA cannot run here: the device clock is scripted (:mod:`harness.fake_cuda`). The planner
test runs :class:`~megatron_zb.training.replanning.SchedulePlanner`'s own window and ``replan()`` on two
gloo processes (PP=2, ZB-H1, 2 micro batches), each with a runtime double whose iteration is scripted
on its own fake CUDA clock; the profile is agreed over both, rank 0 prints the report and writes the
file. Every expected number is worked out by hand from the scripted times.
"""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest
import torch

from megatron_zb.planning.profile import read_profile
from megatron_zb.testing.distributed import run_distributed
from megatron_zb.training import run_config as rc
from megatron_zb.training.host_bound import action_times, action_times_lines, likely_causes
from megatron_zb.training.profiling import AgreedProfile

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# One iteration of ZB-H1 on 2 ranks with 2 micro batches, each rank in its order. Per action (host t0, t1;
# device d0, d1) in ms after the rank's iteration start (host 1000 s, start event at GPU 0 ms: the device idle).
# Rank 0 (stage 0): each F launched for 10 ms, the device ends 1 ms later: D = 11, U = t1 - d0 = 10 (host-bound);
#   B0 launched for 1 ms on an idle device, which runs 8 ms: U = 1; B1, W0, W1 launched while the device is
#   still busy: U = 0. Medians: F 10/11/10, B 1/8/0.5 (U of B0 and B1: 1 and 0), W 1/2/0.
# Rank 1 (stage 1): every action launched for 1 ms; F runs 10 ms on the device, B 8, W 2; only F0 starts on an
#   idle device (U = 1), the others queue behind (U = 0). Medians: F 1/10/0.5, B 1/8/0, W 1/2/0.
TIMES = {  # (rank, op, mb): (t0, t1, d0, d1) [ms]
    (0, "F", 0): (0, 10, 0, 11), (0, "F", 1): (11, 21, 11, 22), (0, "B", 0): (22, 23, 22, 30),
    (0, "W", 0): (24, 25, 30, 32), (0, "B", 1): (26, 27, 32, 40), (0, "W", 1): (28, 29, 40, 42),
    (1, "F", 0): (0, 1, 0, 10), (1, "B", 0): (2, 3, 10, 18), (1, "F", 1): (4, 5, 18, 28),
    (1, "B", 1): (6, 7, 28, 36), (1, "W", 0): (8, 9, 36, 38), (1, "W", 1): (10, 11, 38, 40)}
START = 1000.0  # s
MASK = ("the attention mask in the data loader (megatron-core's create_attention_mask_in_dataloader: a [1, 1, 2048, "
        "2048] bool tensor, 4.0 MiB per micro batch to collate and copy to the GPU; "
        "--no-create-attention-mask-in-dataloader leaves it to megatron-core's attention)")
MAIN_THREAD = "data loading in the main thread (--num-workers 0)"
LOCAL = ("the local layers' unfused kernels, each launched from Python (--transformer-impl local; Transformer "
         "Engine fuses them)")
TIMERS = ("megatron-core's level-2 timers, which synchronise the device at every forward-compute / backward-compute "
          "start and stop (--timing-log-level 2)")


def config(*, stages: int = 2, profile_out: str | None = None, data: rc.DataConfig | None = None,
           timing_log_level: int = 0, transformer_impl: str = "local") -> rc.RunConfig:
    """A ZB-H1 run on ``stages`` pipeline ranks, one layer each."""
    model = rc.ModelConfig(num_layers=stages, hidden_size=8, num_attention_heads=1, seq_length=2048,
                           padded_vocab_size=8, vocab_size=8, ffn_hidden_size=32, kv_channels=8,
                           max_position_embeddings=2048, transformer_impl=transformer_impl)
    schedule = rc.ScheduleConfig(name="zb-h1", placement="plain", split_backward=True, cost_aware=False,
                                 num_model_chunks=1, layers_per_stage=(1,) * stages,
                                 zero_bubble_pipeline_timers_start_iter=2, zero_bubble_pipeline_timers_end_iter=3,
                                 profile_out=profile_out)
    return rc.RunConfig(model=model, parallel=rc.ParallelConfig(world_size=stages, pipeline_model_parallel_size=stages),
                        precision=rc.PrecisionConfig(), optim=rc.OptimConfig(lr=1e-3), schedule=schedule,
                        micro_batch_size=1, global_batch_size=2, num_microbatches=2, train_iters=10,
                        data=data or rc.DataConfig(num_workers=0),
                        logging=rc.LoggingConfig(timing_log_level=timing_log_level))


class _SetAttr:
    """What :meth:`FakeCuda.install` needs of pytest's ``monkeypatch`` in a rank process (which ends after the test)."""

    @staticmethod
    def setattr(obj: object, name: str, value: object) -> None:
        setattr(obj, name, value)


def _planner_rank(out: str) -> str:
    """One rank: the planner's window of one iteration (iteration 2) on the scripted clock, then ``replan()``;
    returns what the rank printed."""
    import torch.distributed as dist

    from megatron_zb.runtime.action_timing import ActionTiming
    from megatron_zb.runtime.memory import ActivationMemoryTracker
    from megatron_zb.schedules import Op
    from megatron_zb.schedules.registry import build_schedule
    from harness.fake_cuda import FakeCuda, run_actions
    from megatron_zb.runtime.install import Installed
    from megatron_zb.runtime.measure import Measured
    from megatron_zb.training.replanning import SchedulePlanner

    rank = dist.get_rank()
    sched = build_schedule("zb-h1", num_ranks=2, num_microbatches=2)
    script, host = [0.0], []
    for a in sched.ranks[rank]:
        t0, t1, d0, d1 = TIMES[(rank, a.op.value, a.mb)]
        script += [float(d0), float(d1)]
        host.append((a, START + t0 / 1e3, START + t1 / 1e3))
    FakeCuda(script).install(_SetAttr())
    memory = ActivationMemoryTracker()  # 300 bytes kept by each F, 100 freed by each B (host times: mid-action)
    memory.events = sorted(((t0 + t1) / 2, 300 if a.op is Op.F else -100) for a, t0, t1 in host if a.op is not Op.W)
    # a runtime double whose one iteration is scripted above (a CUDA clock cannot run here)
    runtime = SimpleNamespace(install=lambda p, m, **kw: Installed(sched, 0.0), schedule_for=lambda p, m: sched,
                              costs=None)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        planner = SchedulePlanner(config(profile_out=out), schedule=sched, stage_to_rank=sched.stage_to_rank,
                                  runtime=runtime,
                                  dist_ctx=SimpleNamespace(device=torch.device("cpu"), pp_group=dist.group.WORLD))
        window = planner.cost_window()
        assert window.request(2).time_actions
        timing = ActionTiming(device="cuda")
        run_actions(timing, host, start=START)
        assert window.record(2, Measured(data=[], timing=timing, memory=memory), seconds=0.1)
        planner.replan(window)
    return printed.getvalue()


def test_a_host_bound_forward_is_flagged_in_the_report_and_the_profile(tmp_path):
    out = tmp_path / "profile.json"
    log, other = run_distributed(_planner_rank, world_size=2, args=(str(out),), timeout=120)
    assert other == ""  # rank 0 reports
    assert ("    measured host / device time per action / the device's wait for the host in it, at most (ms, median "
            "per stage; device: CUDA events): F=[10.000/11.000/10.000, 1.000/10.000/0.500]; "
            "B=[1.000/8.000/0.500, 1.000/8.000/0.000]; W=[1.000/2.000/0.000, 1.000/2.000/0.000]\n") in log
    assert ("    F is host-bound on stage 0: the GPU waited up to 10.0 of its 11.0 ms for the host\n"
            f"      likely causes: {MAIN_THREAD}; {MASK}; {LOCAL}\n") in log
    assert log.count("is host-bound") == 1, log  # F on stage 1 (U = 0.5 of 10 ms), B and W: not
    assert out.exists(), log
    times = json.loads(out.read_text())["action_times"]
    assert (times["clock"], times["host_bound_fraction"]) == ("cuda_events", 0.5)
    expected = [("F", 0, 10, 11, 10, True), ("F", 1, 1, 10, 0.5, False), ("B", 0, 1, 8, 0.5, False),
                ("B", 1, 1, 8, 0, False), ("W", 0, 1, 2, 0, False), ("W", 1, 1, 2, 0, False)]
    assert [(o["op"], o["stage"], o["host_bound"]) for o in times["ops"]] == [(e[0], e[1], e[5]) for e in expected]
    for o, (_, _, host_ms, device_ms, waited_ms, bound) in zip(times["ops"], expected):
        assert (o["host_ms"], o["device_ms"], o["waited_ms"]) == (
            pytest.approx(host_ms, rel=1e-9), pytest.approx(device_ms, rel=1e-9),
            pytest.approx(waited_ms, rel=1e-9, abs=1e-12))
        assert o["causes"] == ([MAIN_THREAD, MASK, LOCAL] if bound else [])
    assert read_profile(out).action_times.ops[0].causes == (MAIN_THREAD, MASK, LOCAL)  # read back


def agreed(clock: str, rows: dict[tuple[str, int], tuple[float, float, float | None]]) -> AgreedProfile:
    """An agreed profile of ``rows``: (op, stage) -> (host ms, device ms, waited ms or None)."""
    return AgreedProfile(costs_ms={k: v[1] for k, v in rows.items()}, t_comm=0.0, idle_fraction=[0.0], iterations=1,
                         host_ms={k: v[0] for k, v in rows.items()},
                         waited_ms={k: v[2] for k, v in rows.items() if v[2] is not None}, clock=clock)


def test_the_threshold_is_more_than_half_of_the_device_time():
    """Waited 5.0 of 10.0 ms: not host-bound (not *more* than half); 5.5 of 10.0: host-bound. Nothing
    host-bound prints the per-action line only."""
    at_half = action_times(agreed("cuda_events", {("F", 0): (6.0, 10.0, 5.0), ("B", 0): (1.0, 9.0, 0.5)}), config())
    assert [o.host_bound for o in at_half.ops] == [False, False]
    assert action_times_lines(at_half) == (
        "    measured host / device time per action / the device's wait for the host in it, at most (ms, median per "
        "stage; device: CUDA events): F=[6.000/10.000/5.000]; B=[1.000/9.000/0.500]")
    above = action_times(agreed("cuda_events", {("F", 0): (6.0, 10.0, 5.5)}), config())
    assert above.ops[0].host_bound
    assert action_times_lines(above).splitlines()[1] == (
        "    F is host-bound on stage 0: the GPU waited up to 5.5 of its 10.0 ms for the host")


def test_cpu_profiles_say_host_equals_device_and_flag_nothing():
    times = action_times(agreed("host", {("F", 0): (3.0, 3.0, None), ("W", 1): (0.25, 0.25, None)}), config())
    assert [(o.waited_ms, o.host_bound, o.causes) for o in times.ops] == [(None, False, ())] * 2
    assert action_times_lines(times) == (
        "    measured host / device time per action (ms, median per stage; host = device on CPU, where no wait for "
        "the host can be observed): F=[3.000/3.000]; W=[0.250/0.250]")


def test_likely_causes_are_what_the_configuration_shows():
    """F reads data on the first and the last stage only; the timers synchronise in F, B and BW; the local
    layers' launches concern the layers' ops, not the vocabulary passes."""
    three = config(stages=3)
    assert likely_causes("F", 0, three) == (MAIN_THREAD, MASK, LOCAL)
    assert likely_causes("F", 2, three) == (MAIN_THREAD, MASK, LOCAL)
    assert likely_causes("F", 1, three) == (LOCAL,)
    assert likely_causes("W", 0, three) == (LOCAL,)
    quiet = config(stages=3, data=rc.DataConfig(num_workers=2, create_attention_mask_in_dataloader=False),
                   timing_log_level=2, transformer_impl="transformer_engine")
    assert likely_causes("F", 0, quiet) == (TIMERS,)
    assert likely_causes("B", 1, quiet) == likely_causes("BW", 1, quiet) == (TIMERS,)
    none = ("none visible in this run's configuration (the host's own launch time, or a synchronisation inside the "
            "action)",)
    assert likely_causes("W", 1, quiet) == likely_causes("IF", 0, quiet) == none
    assert likely_causes("IF", 0, three) == none  # data causes are F's; the local layers are not the vocabulary's
