"""The schedule reports rank 0 prints: before training (unit costs, or a checkpoint's costs) and after
the profiling window (the measured costs, per stage; the runtime's own time; activation bytes).

Pure functions of the run's configuration, the installed schedule and the measured profile: the
re-plan (:mod:`megatron_zb.training.replanning`) calls them and prints what they return.
"""

from __future__ import annotations

from typing import Any

from megatron_zb.schedules import CostModel, simulate
from megatron_zb.schedules.ir import Schedule
from megatron_zb.training.logging_utils import format_schedule_report
from megatron_zb.training.profiling import AgreedProfile, mem_w_ratio, vocab_line
from megatron_zb.training.run_config import RunConfig

__all__ = ["initial_report", "measured_lines", "window_report"]


def initial_report(config: RunConfig, schedule: Schedule, *, restored: CostModel | None) -> str:
    """The report before training: ``schedule`` under unit costs, or under the ``restored`` costs a
    resumed run rebuilt it from."""
    c = config
    ratio = mem_w_ratio(hidden_size=c.model.hidden_size, num_attention_heads=c.model.num_attention_heads,
                        seq_length=c.model.seq_length)
    sim = simulate(schedule, CostModel(mem_w=ratio), enforce_memory=False)
    name = c.schedule.name + (" (megatron-core's own forward_backward_func)"
                              if c.schedule.use_megatron_core_schedule else "")
    title = "schedule report (unit costs T_F = T_B = T_W = 1, before profiling)"
    measured = None
    peak, limit, unit = sim.peak_memory, c.schedule.memory_limit, "M_B"
    if restored is not None:
        title = "schedule report (rebuilt from the profiled costs stored in the checkpoint)"
        sim = simulate(schedule, restored, enforce_memory=False)
        sc = restored.resolve(c.schedule.num_pipeline_stages)
        measured = {"T_F": sum(sc.t_f) / len(sc.t_f), "T_B": sum(sc.t_b) / len(sc.t_b),
                    "T_W": sum(sc.t_w) / len(sc.t_w), "T_comm": sc.t_comm}
        peak, limit, unit = _memory_in_report(restored, sim.peak_memory)
    return format_schedule_report(
        schedule=name, num_ranks=c.parallel.pipeline_model_parallel_size, num_microbatches=schedule.num_microbatches,
        predicted_bubble_rate=sim.bubble_rate, peak_activation_memory=peak,
        memory_limit=limit, memory_unit=unit, measured_costs=measured, title=title)


def window_report(config: RunConfig, schedule: Schedule, agreed: AgreedProfile, costs: CostModel, *,
                  iterations: list[int]) -> str:
    """The report after the window (``iterations``: the profiled ones): ``schedule`` (the one now
    installed) under the measured ``costs``, with the measured idle fraction and costs."""
    sim = simulate(schedule, costs, enforce_memory=False)
    peak, limit, unit = _memory_in_report(costs, sim.peak_memory)
    return format_schedule_report(
        schedule=config.schedule.name, num_ranks=config.parallel.pipeline_model_parallel_size,
        num_microbatches=schedule.num_microbatches, predicted_bubble_rate=sim.bubble_rate,
        peak_activation_memory=peak, memory_limit=limit, memory_unit=unit,
        measured_idle_fraction=agreed.idle_fraction,
        measured_costs=agreed.report_costs(config.schedule.num_pipeline_stages),
        title=f"schedule report after profiling iterations {iterations[0]}-{iterations[-1]} "
              f"(costs: mean over stages, ms; idle: 1 - busy/elapsed per pipeline rank)")


def _ms(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.3f}"


def _memory_in_report(costs: CostModel, peak: Any) -> tuple[list[float], float | None, str]:
    """Peak per rank and limit of ``costs`` for the report: in MiB when measured in bytes, else in
    units of M_B (a cost model of unit memory: every ``mem_b`` exactly 1)."""
    mem_b = [costs.mem_b] if isinstance(costs.mem_b, (int, float)) else list(costs.mem_b)
    if all(v == 1.0 for v in mem_b):
        return list(peak), costs.memory_limit, "M_B"
    mib = float(2 ** 20)
    return ([v / mib for v in peak], None if costs.memory_limit is None else costs.memory_limit / mib,
            "MiB (measured bytes)")


def measured_lines(agreed: AgreedProfile, stages: int, *, num_ranks: int | None = None) -> str:
    """The report's lines of what the window measured: per-stage times, with ``num_ranks`` (vocabulary
    parallelism) the passes' per-rank times and ``t_collective``, the runtime's time per action and outside
    the schedule, activation bytes (and a warning when B leaves more for W than F left for B)."""
    lines = "    measured per stage (ms): " + "; ".join(
        f"{name}=[{', '.join(f'{v:.3f}' for v in vals)}]"
        for name, op in (("T_F", "F"), ("T_B", "B"), ("T_W", "W"), ("T_BW", "BW"))
        if (vals := agreed.per_stage(op, stages)) is not None)
    if num_ranks is not None:
        lines += "\n" + vocab_line(agreed, stages, num_ranks)
    lines += "\n    measured runtime time per compute action (ms, mean over ranks of medians): " + _ms(
        agreed.action_overhead_ms) + "; outside the schedule's actions per iteration (ms, min over ranks of " \
        "medians): " + _ms(agreed.step_ms)
    if (acts := agreed.activation_bytes(stages)) is not None:
        lines += "\n    measured activations per stage and micro batch (KiB): " + "; ".join(
            f"{name}=[{', '.join(f'{v / 1024:.1f}' for v in vals)}]" for name, vals in zip(("M_B", "M_W"), acts))
        held = agreed.bytes_held_for_w(stages) or []
        over = [(s, w, b) for s, (w, b) in enumerate(zip(held, acts[0])) if w > b]
        if over:
            lines += ("\n    WARNING: B leaves more for W than F left for B on stage(s) " + ", ".join(
                f"{s} ({w / 1024:.1f} > {b / 1024:.1f} KiB)" for s, w, b in over)
                + " (full recomputation: B rebuilds what W needs); the re-plan caps M_W at M_B (its limit "
                  "--zero-bubble-max-pending-backward x M_B may be below what B leaves) and under-counts "
                  "memory between B and W")
    return lines
