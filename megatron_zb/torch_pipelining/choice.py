"""``auto``: the fastest of a few candidate families for the stages' placement, within a memory limit.

PyTorch's split backward costs more than its fused one (an ``I`` and a ``W`` are two autograd
passes; docs/torch_pipelining.md measures ``T_I + T_W`` 25% over ``T_B`` on CPU), so whether a
zero-bubble schedule beats a fused-backward one depends on the measured costs. ``auto``
(:func:`choose_schedule`) builds every candidate of the placement (:func:`candidates`: the families
registered with ``torch_auto_candidate``, one fused-backward family first, the others split) from
the costs and the memory limit, predicts each one *as PyTorch runs it* -- each ``B`` directly followed by its own ``W`` fused into one ``BW``, as the
export writes it, every ``BW`` charged ``costs.t_bw`` (the simulator's timing kernel; ``t_b + t_w``
when ``t_bw`` is not given), one isolated iteration
(:func:`~megatron_zb.schedules.fusion.simulate_as_run`'s ``total_time``: PyTorch's ``step``) -- and
the split families with each ``W`` moved behind its ``B`` wherever the prediction does not grow
(:func:`~megatron_zb.schedules.fusion.fuse_where_free`: only the ``W``'s that fill a bubble pay the
split's extra cost; memory only falls), then written as they run with each fused backward split
again -- ``I`` and ``W`` as two adjacent actions -- where that is predicted faster
(:func:`~megatron_zb.schedules.fusion.split_where_faster`: the ``I`` sends its gradient before the
``W`` runs) -- and
returns the one with the least predicted iteration time among those whose simulated peak activation
memory is within the limit (ties: the lower peak, then :func:`candidates`' order).

PyTorch's own count-based orders for the placement (:data:`TORCH_CANDIDATES`, imported into our IR
by :func:`~megatron_zb.schedules.torch_import.import_torch_schedule`, named ``torch:<class>``) are
candidates too, fused where free like the split families and kept only when they fit the limit: with
many microbatches their order can come closer to the busiest rank's work than our greedy ``zbv``
(which plans with split costs), and ``auto`` then runs it rather than a schedule it predicts slower.
A class PyTorch refuses for the shape (``ScheduleDualPipeV`` below ``m = 2p``) is left out, as a
family whose build fails is.

The limit (per rank, unit of ``costs.mem_b``): the given one, else ``costs.memory_limit``, else
the simulated peak of the placement's fused-backward candidate (``1f1b``, ``1f1b-v``,
``interleaved-1f1b``): ``auto`` never holds more than that schedule would. The cost-aware
candidates are built for the limit; the others are kept only when they fit it.

Which placement: the stages'. :func:`placement_of` reads it from this rank's stage indices (the
user builds the stages before a schedule is chosen, so the choice is among the families of that
placement). :func:`~.profiling.profile_and_replan` measures ``T_I``, ``T_W`` *and* ``T_B`` (fused)
on every stage for an ``auto`` pipeline and chooses again from them.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..schedules.costs import CostModel
from ..schedules.fusion import REL_SLACK, fuse_where_free, simulate_as_run, split_where_faster
from ..schedules.ir import Placement, Schedule, ScheduleError
from ..schedules.registry import SCHEDULES, build_schedule, get_spec
from ..schedules.torch_import import import_torch_schedule
from .export import TorchExportError

__all__ = ["AUTO", "TORCH_CANDIDATES", "candidates", "choose_schedule", "placement_of"]

AUTO = "auto"
"""The schedule name that asks :func:`~.runtime.build_pipeline` for :func:`choose_schedule`."""

TORCH_CANDIDATES: dict[Placement, tuple[str, ...]] = {
    Placement.PLAIN: (),   # Schedule1F1B's order is our 1f1b's
    Placement.V: ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"),
    Placement.INTERLEAVED: ("ScheduleInterleavedZeroBubble",),
}
"""PyTorch's classes whose orders ``auto`` compares too, per placement (module doc)."""


def candidates(placement: Placement) -> tuple[str, ...]:
    """The families ``auto`` compares for ``placement``: the schedules registered with
    ``torch_auto_candidate`` (:class:`~megatron_zb.schedules.catalog.ScheduleSpec`), the
    fused-backward ones first (the first one's peak is the default limit), then in registration order.

    Raises:
        TorchExportError: no fused-backward candidate is registered for ``placement``.
    """
    specs = [s for s in SCHEDULES.values() if s.torch_auto_candidate and s.placement is placement]
    names = tuple(s.name for s in sorted(specs, key=lambda s: s.split_backward))   # stable: registration order
    if not names or get_spec(names[0]).split_backward:
        raise TorchExportError(f"auto: no fused-backward schedule of the {placement.value} placement is registered "
                               f"with torch_auto_candidate=True")
    return names


def placement_of(stage_indices: Sequence[int], num_stages: int, num_ranks: int, rank: int) -> Placement:
    """The placement whose ``stage_to_rank`` puts exactly ``stage_indices`` on ``rank``.

    Raises:
        TorchExportError: no placement does (the stages were built for none of them).
    """
    mine = sorted(stage_indices)
    for pl in (Placement.PLAIN, Placement.V, Placement.INTERLEAVED):
        chunks = num_stages // num_ranks
        if num_stages % num_ranks or pl.chunks_per_rank(chunks) != chunks:
            continue
        if [s for s, r in enumerate(pl.stage_to_rank(num_ranks, chunks)) if r == rank] == mine:
            return pl
    raise TorchExportError(f"rank {rank} holds stages {mine} of {num_stages} on {num_ranks} ranks, which no placement "
                        f"gives (plain: stage r; V: stages r and 2p-1-r; interleaved: r, r+p, ...): build the stages "
                        f"with stages_for_rank for one family of the placement wanted")


def choose_schedule(placement: Placement, *, num_ranks: int, num_microbatches: int, costs: CostModel,
                    memory_limit: float | None = None, num_chunks: int = 2) -> tuple[Schedule, list[tuple]]:
    """The fastest candidate of ``placement`` within the limit (module doc), and every candidate's
    ``(name, predicted iteration time, simulated peak)`` (time ``inf`` for one over the limit), best first.

    ``costs`` as PyTorch's runtime spends them (:func:`~.runtime.runtime_costs`, or measured).
    """
    names = candidates(placement)
    built = {n: build_schedule(n, num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                               memory_limit=memory_limit if get_spec(n).cost_aware else None, num_chunks=num_chunks)
             for n in names[:1]}
    limit = memory_limit if memory_limit is not None else costs.memory_limit
    if limit is None:   # the fused-backward candidate's own peak
        limit = simulate_as_run(built[names[0]], costs).max_peak_memory or math.inf
    for n in names[1:]:
        try:
            built[n] = build_schedule(n, num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                                      memory_limit=limit if get_spec(n).cost_aware else None, num_chunks=num_chunks)
        except ScheduleError:   # e.g. the limit is below what the family needs
            continue
    for cls in TORCH_CANDIDATES[placement]:
        try:
            order = import_torch_schedule(cls, num_ranks=num_ranks, num_microbatches=num_microbatches,
                                          num_chunks=num_chunks)
        except ScheduleError:   # PyTorch refuses the shape
            continue
        built[order.name] = order
    for n in list(built)[1:]:   # split orders: each W fused behind its B wherever that costs no time,
        built[n] = split_where_faster(fuse_where_free(built[n], costs), costs)   # then split where faster
    rows = []
    for k, (n, s) in enumerate(built.items()):
        res = simulate_as_run(s, costs)
        fits = res.max_peak_memory <= limit * (1 + REL_SLACK)
        rows.append((n, res.total_time if fits else math.inf, res.max_peak_memory, k))
    rows.sort(key=lambda t: (t[1], t[2], t[3]))
    if not math.isfinite(rows[0][1]):
        raise TorchExportError(f"no {placement.value} candidate ({', '.join(built)}) fits the memory limit {limit:g}: "
                            f"raise the limit")
    return built[rows[0][0]], [r[:3] for r in rows]
