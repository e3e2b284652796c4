"""Interleaved placement with the backward split into ``B`` and ``W`` (``interleaved-zb``).

Placement: ``v`` chunks per rank, stage ``s = c*p + r`` on rank ``s % p`` (Megatron's virtual
pipeline, :func:`~megatron_zb.schedules.ir.interleaved_placement`), the layout PyTorch's
``ScheduleInterleavedZeroBubble`` uses. Costs are per stage (per chunk); memory in units of
``costs.mem_b`` (one chunk's ``M_B``).

Two kinds of candidates are built and the fastest one within the memory limit is kept (each scored
by the project's simulator):

* *pattern*: Megatron's interleaved 1F1B order (warm-up, one-forward-one-backward, cool-down;
  :func:`~.baselines.interleaved_1f1b`) with every fused backward split
  into ``B`` followed by its ``W``, where rank ``r`` may hold back its ``W`` by up to ``d_r``
  backwards (run later, or at the end). Tried delays: none (same timing and memory as
  interleaved 1F1B), ZB-H1-like ``d_r = r``, and ``d_r = 2r``, ``d_r = v*r`` -- kept only when
  they fit the limit;
* *list scheduler*: :func:`~.search.search` on the interleaved placement
  (the same event-driven scheduler as ZB-V), which reorders forwards and backwards as well.

With an overlapped data-parallel reduce in the costs (``costs.dp_reduce``) every candidate's
trailing W's are regrouped chunk by chunk when that ends the predicted iteration sooner
(:func:`~..dp_reduce.reduce_aware_tail`, as the V family does; a rank's chunks reduce separately,
so finishing one chunk's W's first lets its buckets reduce under the others'), before the
candidates are compared.

Default memory limit: the peak of interleaved 1F1B under the same costs (so the comparison with
``interleaved-1f1b`` is at equal memory); when a ``B`` allocates (``mem_w > mem_b``), which fused
``BW`` never does, the peak of that order with every backward split as ``B`` then its ``W`` at once
(the *pattern* with no delay), the least a split order of it holds. Pass ``memory_limit`` to trade
memory for bubble.
"""

from __future__ import annotations

from ..catalog import register
from ..costs import CostModel
from ..dp_reduce import overlapped_reduce_tail
from ..ir import Action, Op, Placement, Schedule, ScheduleError, interleaved_placement, make_schedule
from ..limits import check_minimum, fits, resolve_limit
from ..simulator import simulate
from .baselines import check_shape, interleaved_1f1b
from .common import check_cost_model
from .search import search

__all__ = ["interleaved_zb", "split_with_delay"]


def split_with_delay(base: Schedule, delays: list[int]) -> list[list[Action]]:
    """Split every ``BW`` of ``base`` into ``B`` then ``W``, rank ``r`` deferring up to ``delays[r]`` W's."""
    ranks = []
    for r, acts in enumerate(base.ranks):
        out: list[Action] = []
        pending: list[Action] = []
        for a in acts:
            if a.op is Op.BW:
                out.append(Action(Op.B, a.mb, a.stage))
                pending.append(Action(Op.W, a.mb, a.stage))
                while len(pending) > delays[r]:
                    out.append(pending.pop(0))
            else:
                out.append(a)
        ranks.append(out + pending)
    return ranks


def interleaved_zb(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
                   num_chunks: int = 2) -> Schedule:
    """Interleaved (virtual-pipeline) schedule with split backward, ``v = num_chunks`` chunks per rank.

    Args:
        num_ranks: ``p`` (>= 1); the model has ``p * v`` stages.
        num_microbatches: ``m`` (>= 1).
        costs: per-stage (per-chunk) costs for ``p * v`` stages; times in any unit.
        memory_limit: per-rank peak activation limit in units of ``costs.mem_b`` (one chunk's
            ``M_B``), resolved by :func:`~..limits.resolve_limit`: ``None``: ``costs.memory_limit``,
            else interleaved 1F1B's peak (with every ``B`` followed by its ``W`` when a ``B``
            allocates; no activation memory at all: no limit).
        num_chunks: ``v`` (>= 1).

    Raises:
        ScheduleError: bad sizes or costs, or a limit below one microbatch's activations on a rank
            (``sum of mem_b over the rank's chunks``, or more when a ``B`` allocates:
            :meth:`~..costs.StageCosts.microbatch_peak`, the minimum for any schedule).
    """
    check_shape(num_ranks, num_microbatches, num_chunks)
    check_cost_model(costs)
    p, m, v = num_ranks, num_microbatches, num_chunks
    s2r = interleaved_placement(p, v)
    n = p * v
    base_sc = costs.resolve(n)
    base = interleaved_1f1b(num_ranks=p, num_microbatches=m, num_chunks=v)
    base_peak = simulate(base, base_sc, enforce_memory=False).max_peak_memory
    need = [base_sc.microbatch_peak([s for s in range(n) if s2r[s] == r]) for r in range(p)]
    if any(base_sc.backward_alloc(s) > 0 for s in range(n)):   # B allocates: the split pattern's peak
        split = Schedule(m, s2r, split_with_delay(base, [0] * p), "split")
        base_peak = max(base_peak, simulate(split, base_sc, enforce_memory=False).max_peak_memory)
    limit = resolve_limit(memory_limit, costs, base_peak, minimum=max(need))
    worst = max(range(p), key=lambda r: need[r])
    check_minimum(limit, need[worst], f"rank {worst} must hold the activations of all its {v} chunks for one "
                                      f"microbatch at once")
    sc = costs.with_limit(limit).resolve(n)

    best: tuple | None = None

    def consider(name: str, ranks: list[list[Action]] | None) -> None:
        nonlocal best
        if ranks is None:
            return
        cand = Schedule(m, s2r, ranks, name)
        regrouped = overlapped_reduce_tail(cand, sc)  # the tail's W's do not raise the peak: same memory
        if regrouped is not cand:
            name, ranks = name + " + reduce-aware tail", regrouped.ranks
        res = simulate(regrouped, sc, enforce_memory=False)
        if not fits(res.max_peak_memory, limit):
            return
        score = (round(res.makespan, 9), round(res.max_peak_memory, 9))
        if best is None or score < best[0]:
            best = (score, name, ranks, res.makespan)

    for tag, delays in (("none", [0] * p), ("r", list(range(p))), ("2r", [2 * r for r in range(p)]),
                        ("vr", [v * r for r in range(p)])):
        consider(f"pattern/delay={tag}", split_with_delay(base, delays))
    found = search(s2r, m, sc, limit)
    if found is not None:
        consider("list/" + found[2], found[0])
    if best is None:
        raise ScheduleError(f"no interleaved schedule fits memory_limit {limit:g} for p={p}, m={m}, v={v}; "
                            f"interleaved 1F1B needs {base_peak:g}")
    _, name, ranks, makespan = best
    return make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name="interleaved-zb",
                         num_chunks=v, memory_limit=limit, variant=name, makespan=makespan)


@register("interleaved-zb", "interleaved placement (--chunks) with B/W split, W filling bubbles",
          placement=Placement.INTERLEAVED, split_backward=True, cost_aware=True, torch_auto_candidate=True)
def _build_interleaved_zb(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
                          num_chunks: int) -> Schedule:
    return interleaved_zb(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                          memory_limit=memory_limit, num_chunks=num_chunks)
