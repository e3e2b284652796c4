"""``--profile``: megatron-zb's own view of the profile window -- where the bubble went.

Over the iterations the ``--profile`` backend records (:func:`window_iterations`: PyTorch's profiler
``--profile-step-start`` to ``--profile-step-end - 1``, CUDA's capture range one later, 1-based as the
iteration line counts), megatron-zb's runtime times every action it executes on each rank of global
rank 0's pipeline (:class:`~megatron_zb.runtime.action_timing.ActionTiming`: compute actions, and
each communication action -- a ``SEND_*``'s ``isend``, a ``RECV_*``'s posting and the host's wait for
the data). At the window's end global rank 0 gathers them and writes into ``--tensorboard-dir``:

* ``megatron_zb_timeline.json`` -- a Chrome trace (Perfetto, ``chrome://tracing``): one process
  per pipeline rank, thread 0 its compute actions (``F3``, ``B3``, ``W3``, ``BW3``: op and micro
  batch), thread 1 its communication actions (``RECV_F3`` ...: mostly the waits for a peer); one
  complete event (``ph: "X"``, ``ts``/``dur`` in microseconds) per executed action per iteration,
  with the iteration, micro batch and stage in ``args``. Times are each rank's host clock made
  absolute (``time.time``): exact between the processes of one node, as close as the nodes'
  clocks across nodes (not tested). On CUDA compute actions are GPU time (CUDA events, not run
  on a GPU here);
* ``megatron_zb_timeline.png`` -- the window's last iteration as measured, above the simulator's
  prediction for the same schedule with the medians of the window's measured F/B/W durations per
  stage (and the re-planned ``T_comm`` when profiling measured one, else 0): the idle time the
  schedule itself leaves against the idle time the run had (waits for slower peers, the host,
  cores shared between processes: when a CPU run's processes outnumber the cores, the headline and
  the log line say so).

Not written with ``--use-megatron-core-schedule`` (megatron-core's schedules time nothing per
action) or without ``--tensorboard-dir`` (a start-up line on rank 0 says why), nor when the run stops
before the window ends. A PNG that cannot be drawn is named with the error in the log line; the trace
is written and training goes on.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_zb.runtime.action_timing import ActionTiming, resolve_timings
from megatron_zb.runtime.forward_backward import ZeroBubbleForwardBackward
from megatron_zb.runtime.measure import Measure, Measured
from megatron_zb.schedules import CostModel, Schedule, SimResult, simulate
from megatron_zb.training.logging_utils import cpu_oversubscription, print_rank_0
from megatron_zb.training.checkpoint_check import first_line
from megatron_zb.training.run_config import ProfilingConfig

__all__ = ["JSON_NAME", "MeasuredTimeline", "PNG_NAME", "chrome_trace", "measured_result", "window_iterations"]

JSON_NAME = "megatron_zb_timeline.json"
PNG_NAME = "megatron_zb_timeline.png"

Event = tuple[int, str, str, int, int, float, float]
"""One executed action: (iteration, kind ``"compute"``/``"comm"``, op, micro batch, stage, start, end [s, wall clock])."""


def window_iterations(config: ProfilingConfig, *, device: torch.device) -> range:
    """The 1-based iterations ``--profile``'s backend records (:mod:`.profile_window`): PyTorch's profiler
    (``--use-pytorch-profiler`` or no CUDA) START..END-1, CUDA's capture range START+1..END."""
    start, end = config.profile_step_start, config.profile_step_end
    if config.use_pytorch_profiler or device.type != "cuda":
        return range(start, end)
    return range(start + 1, end + 1)


def _events(it: int, timing: ActionTiming, offset: float) -> list[Event]:
    """``timing``'s actions as events; ``offset`` turns ``perf_counter`` seconds into ``time.time`` seconds."""
    out: list[Event] = []
    for kind, records in (("compute", timing.records), ("comm", timing.comm)):
        out += [(it, kind, a.op.value, a.mb, a.stage, t0 + offset, t1 + offset) for a, t0, t1 in records]
    return out


def chrome_trace(per_rank: list[list[Event]], *, origin: float, metadata: dict[str, Any]) -> dict[str, Any]:
    """The Chrome-trace document of ``per_rank`` events (pipeline rank = process), times from ``origin`` [s]."""
    trace: list[dict[str, Any]] = []
    for r, events in enumerate(per_rank):
        trace.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"pipeline rank {r}"}})
        for tid, name in ((0, "compute (F/B/W)"), (1, "p2p (sends, receive posts and waits)")):
            trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}})
        for it, kind, op, mb, stage, t0, t1 in events:
            trace.append({"name": f"{op}{mb}", "cat": kind, "ph": "X", "pid": r, "tid": 0 if kind == "compute" else 1,
                          "ts": round((t0 - origin) * 1e6, 3), "dur": round(max(t1 - t0, 0.0) * 1e6, 3),
                          "args": {"iteration": it, "microbatch": mb, "stage": stage}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": metadata}


def measured_result(schedule: Schedule, per_rank: list[list[Event]], iteration: int, costs: CostModel) -> SimResult:
    """``iteration``'s measured compute actions as a :class:`SimResult` of ``schedule`` (ms from the
    earliest action of any rank), so that the schedule library draws it as it draws a prediction."""
    sched = schedule.compute_only()
    times = [{(op, mb, stage): (t0, t1) for it, kind, op, mb, stage, t0, t1 in ev if it == iteration and kind == "compute"}
             for ev in per_rank]
    origin = min(t0 for rank in times for t0, _ in rank.values())
    start = [[1e3 * (times[r][(a.op.value, a.mb, a.stage)][0] - origin) for a in acts] for r, acts in enumerate(sched.ranks)]
    end = [[1e3 * (times[r][(a.op.value, a.mb, a.stage)][1] - origin) for a in acts] for r, acts in enumerate(sched.ranks)]
    busy = [sum(e - s for s, e in zip(ss, ee)) for ss, ee in zip(start, end)]
    total = max((e[-1] for e in end if e), default=0.0)
    return SimResult(sched, costs.resolve(sched.num_stages), start, end, total, busy, [0.0] * sched.num_ranks)


def _median_costs(per_rank: list[list[Event]], num_stages: int, t_comm: float) -> CostModel:
    """F/B/W (or fused BW) medians per stage over the window [ms]; ``t_comm`` [ms]."""
    durations: dict[tuple[str, int], list[float]] = {}
    for ev in per_rank:
        for _, kind, op, _, stage, t0, t1 in ev:
            if kind == "compute":
                durations.setdefault((op, stage), []).append(1e3 * (t1 - t0))

    def med(op: str) -> list[float]:
        return [statistics.median(durations.get((op, s), [0.0])) for s in range(num_stages)]

    fused = not any(op == "W" for op, _ in durations)
    t_b, t_w = (med("BW"), [0.0] * num_stages) if fused else (med("B"), med("W"))
    return CostModel(t_f=[max(v, 1e-6) for v in med("F")], t_b=[max(v, 1e-6) for v in t_b], t_w=t_w, t_comm=t_comm)


class MeasuredTimeline:
    """The window's per-action timings on this rank, and their files at the window's end (module doc).

    Attributes:
        iterations: the window's iterations this run times (empty: nothing to do on this rank).
        kept: ``(iteration, schedule, timing)`` of each timed iteration so far.
        due: the window's last iteration was kept: :meth:`write` is due.
        written: the files global rank 0 wrote.
    """

    def __init__(self, config: ProfilingConfig, *, runtime: ZeroBubbleForwardBackward | None, device: torch.device,
                 pp_group: Any, train_iters: int) -> None:
        self.runtime, self.pp_group, self.kept, self.written, self.due = runtime, pp_group, [], [], False
        self.out_dir = config.trace_dir
        window = window_iterations(config, device=device)
        self.iterations = range(0)
        if not config.profile:
            return
        why = ("--use-megatron-core-schedule: megatron-core's schedules do not time each action" if runtime is None
               else "no --tensorboard-dir to write it into" if self.out_dir is None else None)
        if why is not None:
            print_rank_0(f"> --profile: megatron-zb's timeline of the window is not written ({why})")
        elif 0 in dist.get_process_group_ranks(pp_group):  # global rank 0's pipeline
            self.iterations = range(window.start, min(window.stop, train_iters + 1))

    def request(self, it: int) -> Measure:
        """What iteration ``it`` measures for the timeline: its actions' times inside the window."""
        return Measure(time_actions=it in self.iterations)

    def record(self, it: int, measured: Measured, *, schedule: Schedule) -> None:
        """Keep iteration ``it``'s timing (``schedule``: the one it ran); the window's last sets :attr:`due`."""
        if it not in self.iterations:
            return
        self.kept.append((it, schedule, measured.timing))
        self.due = it == self.iterations[-1]

    def write(self) -> None:
        """Gather the window over the pipeline; global rank 0 writes the JSON and the PNG. Collective
        over global rank 0's pipeline group."""
        self.due = False
        resolve_timings([t for _, _, t in self.kept])
        offset = time.time() - time.perf_counter()
        mine = [e for it, _, t in self.kept for e in _events(it, t, offset)]
        gathered: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        if dist.get_rank() == 0:
            self._write_files(gathered)

    def _write_files(self, per_rank: list[list[Event]]) -> None:
        """Global rank 0: the JSON, then the PNG (a failure to draw it is reported, the run goes on)."""
        first, (last, schedule, _) = self.kept[0][0], self.kept[-1]
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        json_path, png_path = out / JSON_NAME, out / PNG_NAME
        meta: dict[str, Any] = {"schedule": schedule.name, "iterations": [it for it, _, _ in self.kept]}
        shared = cpu_oversubscription()
        note = f" ({shared[0]} processes share {shared[1]} cores: much of the idle time is time-slicing)" if shared else ""
        try:
            measured_costs = self.runtime.costs
            t_comm = float(measured_costs.t_comm) if measured_costs is not None else 0.0
            costs = _median_costs(per_rank, schedule.num_stages, t_comm)
            predicted = simulate(schedule, costs, enforce_memory=False)
            measured = measured_result(schedule, per_rank, last, costs)
            meta.update(predicted_bubble_rate=predicted.bubble_rate, measured_idle_fraction=measured.idle_fraction,
                        predicted_idle_fraction=predicted.idle_fraction, t_comm_ms=t_comm)
            from megatron_zb.schedules.plot import plot_comparison

            plot_comparison([(f"measured: iteration {last}{note}", measured),
                             (f"predicted: the simulator, median measured F/B/W of iterations {first}-{last}, "
                              f"T_comm {t_comm:.3g} ms", predicted)],
                            png_path, title=f"{schedule.name}: p={schedule.num_ranks}, m={schedule.num_microbatches} "
                                            f"-- where the bubble went")
            idle = ", ".join(f"{100 * f:.1f}%" for f in measured.idle_fraction)
            png = (f" and {png_path} (iteration {last} measured, idle per rank [{idle}], beside the simulator's "
                   f"prediction, bubble rate {100 * predicted.bubble_rate:.1f}%){note}")
            self.written = [str(json_path), str(png_path)]
        except Exception as e:  # noqa: BLE001 -- a diagnostic: the trace is still written and training goes on
            png = f"; WARNING: {png_path} not drawn ({first_line(e)})"
            self.written = [str(json_path)]
        with open(json_path, "w") as f:
            json.dump(chrome_trace(per_rank, origin=min((e[5] for ev in per_rank for e in ev), default=0.0),
                                   metadata=meta), f)
        print(f"> --profile: megatron-zb's timeline of iterations {first}-{last} (each rank's measured actions "
              f"and waits) written to {json_path} (Chrome trace: Perfetto, chrome://tracing){png}", flush=True)
