"""Whether a schedule runs each stage's weight gradients in the order of its input gradients.

Some layers keep their deferred weight-gradient work in a FIFO per module -- Transformer
Engine's ``delay_wgrad_compute`` (``WeightGradStore`` in ``transformer_engine/pytorch/module/_common.py``):
each ``B`` queues one entry, each ``backward_dw()`` runs the *oldest*. Such a layer computes the
right gradients only if, on every stage, the ``W`` actions come in the same microbatch order as
the ``B`` actions. A fused ``BW`` counts as both a ``B`` and a ``W`` at its position (its weight
gradient is computed right after its backward).

:func:`w_order_matches_b` lists every stage where this does not hold; an empty list means the
schedule is safe for FIFO layers. Every generator of the library produces such schedules
(``tests/runtime/test_te_contract.py`` checks them).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Op, Schedule

__all__ = ["OrderViolation", "w_order_matches_b"]


@dataclass(frozen=True)
class OrderViolation:
    """One stage whose weight gradients do not follow its input gradients' microbatch order.

    Attributes:
        stage: the pipeline stage.
        rank: the rank that runs it.
        b_order: microbatches in the order the stage runs ``B`` (or ``BW``).
        w_order: microbatches in the order the stage runs ``W`` (or ``BW``).
        position: index of the first ``W`` (in ``w_order``) that differs from ``b_order``.
    """

    stage: int
    rank: int
    b_order: tuple[int, ...]
    w_order: tuple[int, ...]
    position: int

    def __str__(self) -> str:
        got = self.w_order[self.position] if self.position < len(self.w_order) else "none"
        want = self.b_order[self.position] if self.position < len(self.b_order) else "none"
        return (f"stage {self.stage} (rank {self.rank}): W #{self.position} is for microbatch {got} but "
                f"B #{self.position} was for microbatch {want} (B order {list(self.b_order)}, "
                f"W order {list(self.w_order)})")


def w_order_matches_b(schedule: Schedule) -> list[OrderViolation]:
    """Stages of ``schedule`` whose W's do not run in their B's microbatch order (empty: none).

    Compute actions only are considered (a lowered schedule may be passed as is). A stage with
    no split backward (only ``BW``) always matches.
    """
    b_orders: dict[int, list[int]] = {}
    w_orders: dict[int, list[int]] = {}
    for _, _, a in schedule.actions():
        if a.op in (Op.B, Op.BW):
            b_orders.setdefault(a.stage, []).append(a.mb)
        if a.op in (Op.W, Op.BW):
            w_orders.setdefault(a.stage, []).append(a.mb)
    out = []
    for stage in sorted(set(b_orders) | set(w_orders)):
        b, w = tuple(b_orders.get(stage, ())), tuple(w_orders.get(stage, ()))
        if b != w:
            pos = next((i for i, (x, y) in enumerate(zip(b, w)) if x != y), min(len(b), len(w)))
            out.append(OrderViolation(stage=stage, rank=schedule.stage_to_rank[stage], b_order=b, w_order=w,
                                      position=pos))
    return out
