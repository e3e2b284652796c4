"""Baseline schedules: 1F1B (fused backward) and Megatron's interleaved 1F1B."""

from __future__ import annotations

from ..catalog import register
from ..costs import CostModel
from ..ir import BW, B, F, W, Action, Placement, Schedule, ScheduleError, interleaved_placement, make_schedule, plain_placement
from ..simulator import deadlocks

__all__ = ["check_shape", "interleaved_1f1b", "interleaved_1f1b_order", "interleaved_order",
           "interleaved_warmup_extra", "one_f_one_b", "one_f_one_b_order"]


def check_shape(num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> None:
    """Reject impossible pipeline shapes with an error naming the bad value."""
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ScheduleError(f"pipeline size must be an integer >= 1, got {num_ranks!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ScheduleError(f"number of microbatches must be an integer >= 1, got {num_microbatches!r}")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ScheduleError(f"number of model chunks per rank must be an integer >= 1, got {num_chunks!r}")


def one_f_one_b_order(p: int, m: int, *, warmup: list[int], delay: list[int] | None = None) -> list[list[Action]]:
    """The 1F1B order on the plain placement, per rank: the one rule behind 1F1B, ZB-H1/H2 and
    the greedy scheduler's 1F1B candidate.

    Rank ``r`` runs ``min(warmup[r], m)`` forwards, then for each microbatch ``i`` in order its
    backward and, while forwards are left, the next forward; the pipeline drains by itself. With
    ``delay=None`` the backward is the fused ``BW``; otherwise it is ``B`` and its ``W`` runs once
    more than ``delay[r]`` W's are owed (``0``: right after its ``B``), the owed ones at the end.
    Megatron's 1F1B is ``warmup[r] = p - r`` (its ``p - 1 - r`` warm-up forwards plus the first
    steady-state one).
    """
    ranks: list[list[Action]] = []
    for r in range(p):
        n_warm = min(warmup[r], m)
        acts = [F(i, r) for i in range(n_warm)]     # 1. warm-up forwards
        pending: list[int] = []                     # microbatches whose W is still owed
        next_f = n_warm
        for i in range(m):                          # 2. steady state and cool-down
            if delay is None:
                acts.append(BW(i, r))
            else:
                acts.append(B(i, r))
                pending.append(i)
                while len(pending) > delay[r]:      #    run the W that is `delay` behind
                    acts.append(W(pending.pop(0), r))
            if next_f < m:                          #    one new forward per backward
                acts.append(F(next_f, r))
                next_f += 1
        acts += [W(i, r) for i in pending]          # 3. flush the delayed W
        ranks.append(acts)
    return ranks


def one_f_one_b(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """Megatron's non-interleaved 1F1B with a fused backward (``BW``).

    Rank ``r`` runs ``min(p-1-r, m)`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards (:func:`one_f_one_b_order`). Peak activation
    memory on rank ``r`` is ``min(p-r, m)`` microbatches.
    """
    check_shape(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    ranks = one_f_one_b_order(p, m, warmup=[p - r for r in range(p)])
    return make_schedule(num_microbatches=m, stage_to_rank=plain_placement(p), ranks=ranks, name="1f1b")


def interleaved_order(num_ranks: int, num_microbatches: int, num_chunks: int) -> list[tuple[int, int]]:
    """Megatron's order of (chunk, microbatch) forwards on every rank.

    Microbatches go in groups of ``p``: each group runs through chunk 0, then chunk 1, and so on.
    The backward order is the same with chunks reversed.
    """
    p, m, v = num_ranks, num_microbatches, num_chunks
    order = []
    for g in range(0, m, p):
        for c in range(v):
            order += [(c, i) for i in range(g, min(g + p, m))]
    return order


def interleaved_1f1b_order(num_ranks: int, num_microbatches: int, num_chunks: int, extra: int = 0
                           ) -> list[list[Action]]:
    """Megatron's interleaved 1F1B order, per rank, with ``extra`` more warm-up forwards on every rank
    (``0``: Megatron's count ``min(2*(p-1-r) + (v-1)*p, m*v)``; all of them when ``m == p``); fused
    ``BW``. The one rule behind :func:`interleaved_1f1b` and the interleaved vocabulary-parallel
    schedules (:mod:`.vocab_interleaved`), which keep more microbatches in flight."""
    p, m, v = num_ranks, num_microbatches, num_chunks
    fwd = interleaved_order(p, m, v)
    bwd = [(v - 1 - c, i) for c, i in fwd]
    total = m * v
    ranks: list[list[Action]] = []
    for r in range(p):
        warmup = total if m == p else min(2 * (p - 1 - r) + (v - 1) * p + extra, total)
        acts = [F(i, c * p + r) for c, i in fwd[:warmup]]  # 1. warm-up
        for k in range(total - warmup):                     # 2. steady state
            c, i = fwd[warmup + k]
            cb, ib = bwd[k]
            acts += [F(i, c * p + r), BW(ib, cb * p + r)]
        acts += [BW(i, c * p + r) for c, i in bwd[total - warmup:]]  # 3. cool-down
        ranks.append(acts)
    return ranks


def interleaved_1f1b(*, num_ranks: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """Megatron's interleaved (virtual pipeline) 1F1B with ``v`` chunks per rank.

    Stage ``s = c*p + r`` (chunk ``c`` of rank ``r``). Rank ``r`` runs
    ``min(2*(p-1-r) + (v-1)*p, m*v)`` warm-up forwards (Megatron's count; all of them when
    ``m == p``), then alternates one forward and one backward, then drains
    (:func:`interleaved_1f1b_order`). Any ``m >= 1`` works; the last microbatch group may have
    fewer than ``p`` microbatches.
    """
    check_shape(num_ranks, num_microbatches, num_chunks)
    p, m, v = num_ranks, num_microbatches, num_chunks
    return make_schedule(num_microbatches=m, stage_to_rank=interleaved_placement(p, v),
                         ranks=interleaved_1f1b_order(p, m, v, interleaved_warmup_extra(p, m, v)),
                         name="interleaved-1f1b", num_chunks=v)


def interleaved_warmup_extra(num_ranks: int, num_microbatches: int, num_chunks: int) -> int:
    """The fewest extra warm-up forwards (the same on every rank) with which
    :func:`interleaved_1f1b_order` completes: 0 when ``m % p == 0``. Megatron's warm-up count assumes
    full groups of ``p`` microbatches; when the last group is shorter the same count can deadlock."""
    p, m, v = num_ranks, num_microbatches, num_chunks
    if m % p == 0:
        return 0
    s2r = interleaved_placement(p, v)
    for extra in range(0, m * v + 1):
        if not deadlocks(Schedule(m, s2r, interleaved_1f1b_order(p, m, v, extra), "interleaved-1f1b")):
            return extra
    raise AssertionError("unreachable: with every forward in warm-up the order cannot deadlock")


# ---------------------------------------------------------------------------- registration
@register("1f1b", "Megatron's 1F1B, fused backward: peak p*M_B, bubble (p-1)(T_F+T_B+T_W)",
          placement=Placement.PLAIN, split_backward=False, cost_aware=False, torch_auto_candidate=True)
def _build_1f1b(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
                num_chunks: int) -> Schedule:
    return one_f_one_b(num_ranks=num_ranks, num_microbatches=num_microbatches)


@register("interleaved-1f1b", "Megatron's interleaved 1F1B with v chunks per rank (--chunks)",
          placement=Placement.INTERLEAVED, split_backward=False, cost_aware=False, torch_auto_candidate=True)
def _build_interleaved_1f1b(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
                            num_chunks: int) -> Schedule:
    return interleaved_1f1b(num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks)
