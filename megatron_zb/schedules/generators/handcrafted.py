"""Handcrafted zero-bubble schedules ZB-H1 and ZB-H2 (zero-bubble paper, Sec. 3.1), and the
hand-made ZB-V order (Sec. 6) that the V family keeps as a candidate (:func:`zbv_handcrafted_order`).

Both are "1F1B with the backward split": after a warm-up of forwards, each rank repeats
``B, W, F`` -- except that the ``W`` it runs belongs to an older microbatch. Delaying ``W`` on
later ranks lets their ``B`` chain reach rank 0 sooner, and the delayed ``W`` fill the tail.

=========  ========================  =====================  ===================================
schedule   warm-up forwards, rank r  delayed W on rank r    result (m >= p, resp. m >= 2p)
=========  ========================  =====================  ===================================
ZB-H1      ``p - r``                 ``r``                  bubble ``(p-1)(T_F+T_B-T_W)``,
                                                            peak ``p*M_B`` (as 1F1B)
ZB-H2      ``2(p - r) - 1``          ``2r``                 bubble ``(p-1)(T_F+T_B-2T_W)``,
                                                            peak ``(2p-1)*M_B``
=========  ========================  =====================  ===================================

The peaks hold because ``M_W <= M_B``: rank ``r`` holds at most ``(warm-up)*M_B + delay*M_W``.
Bubbles are measured the paper's way (largest per-rank span, see :class:`SimResult`).
"""

from __future__ import annotations

from ..catalog import register
from ..costs import CostModel
from ..ir import Action, Op, Placement, Schedule, make_schedule, plain_placement, v_stages
from .baselines import check_shape, one_f_one_b_order

__all__ = ["VOrder", "zb_h1", "zb_h2", "zbv_handcrafted_order"]


def _split_backward_1f1b(p: int, m: int, warmup: list[int], delay: list[int], name: str) -> Schedule:
    ranks = one_f_one_b_order(p, m, warmup=warmup, delay=delay)
    return make_schedule(num_microbatches=m, stage_to_rank=plain_placement(p), ranks=ranks, name=name)


def zb_h1(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's peak memory, bubble ``(p-1)(T_F+T_B-T_W)`` (about a third of 1F1B's)."""
    check_shape(num_ranks, num_microbatches)
    p = num_ranks
    return _split_backward_1f1b(p, num_microbatches, [p - r for r in range(p)], list(range(p)), "zb-h1")


def zb_h2(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2: peak ``(2p-1)*M_B``, bubble ``(p-1)(T_F+T_B-2T_W)`` (zero when ``T_F+T_B <= 2T_W``)."""
    check_shape(num_ranks, num_microbatches)
    p = num_ranks
    return _split_backward_1f1b(p, num_microbatches, [2 * (p - r) - 1 for r in range(p)],
                                [2 * r for r in range(p)], "zb-h2")



class VOrder:
    """One rank's order on the V placement, written step by step: ``run((op, chunk), ...)`` appends
    each op for its chunk's next microbatch (``done[op, chunk]`` counts them; chunk ``c`` is stage
    ``v_stages(p, r)[c]``). With ``limit=n`` a forward past ``n`` microbatches, or a backward without
    its forward, is skipped instead of written."""

    def __init__(self, num_ranks: int, rank: int, limit: int | None = None) -> None:
        self.stage = v_stages(num_ranks, rank)
        self.limit = limit
        self.done = {(op, c): 0 for op in (Op.F, Op.B, Op.W) for c in (0, 1)}
        self.acts: list[Action] = []

    def run(self, *steps: tuple[Op, int]) -> None:
        """Append ``steps`` in order (each: ``(op, chunk)``)."""
        done = self.done
        for op, c in steps:
            if self.limit is not None and ((op is Op.F and done[op, c] >= self.limit)
                                           or (op is Op.B and done[op, c] >= done[Op.F, c])):
                continue
            self.acts.append(Action(op, done[op, c], self.stage[c]))
            done[op, c] += 1

def zbv_handcrafted_order(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    """The zero-bubble paper's hand-made ZB-V order (Sec. 6), per rank, on the V placement.

    Rank ``r`` holds chunk 0 (stage ``r``) and chunk 1 (stage ``2p-1-r``). With ``n = max(m, 2p-1)``
    microbatches (the pattern needs ``2p - 1`` to fill the V; actions of microbatches ``>= m`` are
    then left out), its order is, each op taking its chunk's next microbatch:

    1. warm-up: ``2(p-r)-1`` x ``F0``; ``r`` x ``(F1, F0)``; ``p-r`` x ``(F1, B1, W1)``;
    2. steady state, while chunk 0 has forwards left or chunk 1 is behind it:
       ``(F0 if any left), B0, W0, F1, B1, W1``;
    3. cool-down: ``r`` x ``(B0, B1)``; ``p-r`` x ``(B0, W0)``; every remaining ``W1``, then every
       remaining ``W0``.

    Zero bubble when ``T_F = T_B = T_W`` and ``m >= 2p - 1``; peak ``2p`` chunk ``M_B`` on rank 0 (1F1B's
    ``p`` full stages). :func:`~.vshape.v_schedule` keeps it as one more candidate (PyTorch's
    ``ScheduleZBVZeroBubble`` builds the same order; ``tests/schedules/test_vshape.py`` compares them).
    """
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p - 1)
    ranks = []
    for r in range(p):
        order = VOrder(p, r)
        run, done, acts = order.run, order.done, order.acts
        f0, f1, b0, b1, w0, w1 = (Op.F, 0), (Op.F, 1), (Op.B, 0), (Op.B, 1), (Op.W, 0), (Op.W, 1)
        run(*[f0] * (2 * (p - r) - 1), *[f1, f0] * r, *[f1, b1, w1] * (p - r))          # 1. warm-up
        while done[f1] < done[f0] or done[f0] < n:                                      # 2. steady state
            run(*([f0] if done[f0] < n else []), b0, w0, f1, b1, w1)
        run(*[b0, b1] * r, *[b0, w0] * (p - r))                                         # 3. cool-down
        run(*[w1] * (done[b1] - done[w1]), *[w0] * (done[b0] - done[w0]))
        ranks.append([a for a in acts if a.mb < m])
    return ranks


# ---------------------------------------------------------------------------- registration
@register("zb-h1", "handcrafted ZB-H1: 1F1B's peak memory, bubble (p-1)(T_F+T_B-T_W)",
          placement=Placement.PLAIN, split_backward=True, cost_aware=False, torch_auto_candidate=True)
def _build_zb_h1(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
                 num_chunks: int) -> Schedule:
    return zb_h1(num_ranks=num_ranks, num_microbatches=num_microbatches)


@register("zb-h2", "handcrafted ZB-H2: peak (2p-1)*M_B, bubble (p-1)(T_F+T_B-2T_W)",
          placement=Placement.PLAIN, split_backward=True, cost_aware=False)
def _build_zb_h2(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
                 num_chunks: int) -> Schedule:
    return zb_h2(num_ranks=num_ranks, num_microbatches=num_microbatches)
