"""The planner's prediction for ``python -m megatron_zb.bench zero2`` (:mod:`.zero2`): per W group size ``k``,
the iteration time the planner's sharded-gradient model (:mod:`megatron_zb.planning.sharded`) predicts from what
this machine measured, and the ``k`` it recommends.

Inputs, all measured here:

* the baseline's profile (``--profile-out`` of an untimed distributed-optimizer run): per stage ``T_F``, ``T_B``,
  ``T_W``, the p2p time, the runtime's overhead per action and ``step_ms`` (the time outside the schedule);
* the reduce-scatter of the data-parallel group (:func:`measure_reduce_scatter`: gloo, two groups of 2 ranks at
  once, as in the runs): the median time of a 1-element and of a bucket-sized fp32 reduce-scatter give the
  latency and the bandwidth (``Hardware.p2p_latency_ms`` and ``dp_gbps``); gloo's collectives copy through
  TCP on the cores the compute uses, so they do not overlap it (``Hardware.host_collectives``);
* the schedule the runs execute (the runtime's own, from rank 0).

``step_ms`` holds the baseline's exposed reduce, so the time outside the schedule is ``step_ms`` minus the
baseline row's predicted exposed reduce, added to every row.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

__all__ = ["cpu_hardware", "measure_reduce_scatter", "predict"]

REPEATS = 15


def measure_reduce_scatter(bucket_elements: int) -> tuple[float, float]:
    """One rank of the measurement (world of 4, data-parallel groups ``{0, 2}`` and ``{1, 3}``): the median ms of
    a 1-element-per-rank and of a ``bucket_elements`` fp32 reduce-scatter over the rank's group."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    out = []
    for n in (2, bucket_elements - bucket_elements % 2):
        src, dst = torch.ones(n), torch.empty(n // 2)
        times = []
        for i in range(REPEATS + 3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.reduce_scatter_tensor(dst, src, group=group)
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
        out.append(statistics.median(times))
    return out[0], out[1]


def cpu_hardware(small_ms: float, bucket_ms: float, bucket_bytes: float) -> Any:
    """A custom :class:`~megatron_zb.planning.hardware.Hardware` whose ring reduce-scatter over 2 ranks takes the
    measured times (``ring_reduce_scatter``: ``latency = p2p_latency_ms``, ``bandwidth = 2 x dp_bytes_per_ms``), its collectives
    on the compute's cores (``host_collectives``)."""
    from megatron_zb.planning.hardware import resolve_hardware

    per_ms = bucket_bytes / max(bucket_ms - small_ms, 1e-6) / 2   # bytes each GPU sends per ms
    hw = resolve_hardware(tflops=1.0, memory_gib=1e6, hbm_gbs=1.0, p2p_latency_ms=small_ms, dp_gbps=per_ms * 8 / 1e6)
    return dataclasses.replace(hw, name="CPU (gloo)", host_collectives=True)


def predict(profile_path: str, schedule: Any, *, bucket_elements: int, groups: tuple[int, ...],
            reduce_ms: tuple[float, float]) -> list[Any]:
    """Per row (the baseline, then each ``k`` of ``groups``): :class:`~megatron_zb.planning.sharded.GroupRow`
    with the measured time outside the schedule included (module doc)."""
    from megatron_zb.planning.planner import CostSource
    from megatron_zb.planning.profile import read_profile
    from megatron_zb.planning.sharded import plan_groups, sharded_stage
    from megatron_zb.schedules import Placement

    prof = read_profile(profile_path)
    hw = cpu_hardware(*reduce_ms, 4.0 * bucket_elements)
    par = dataclasses.replace(prof.parallel, data_parallel_sharding_strategy="optim_grads",
                              ddp_bucket_size=bucket_elements)
    source = CostSource(prof.model, par, hw, prof)
    table = source.table(Placement.PLAIN, 1)
    costs = table.cost_model(source.t_comm_ms).with_action_overhead(source.action_overhead_ms, split_backward=True)
    rows = plan_groups(schedule, costs, stages=[sharded_stage(prof.model, par, sh, tied_on_rank=False)
                                                for sh in table.shapes],
                       ranks=[sh.rank for sh in table.shapes], params=table.rank_params(par.pp), model=prof.model,
                       par=par, hw=hw, optimizer_ms=0.0, usable_bytes=float("inf"), candidates=groups)
    outside = max(0.0, (prof.step_ms or 0.0) - rows[0].exposed_reduce_ms)
    for r in rows:
        r.iteration_time_ms += outside
    return rows
