"""Lowering: derive the point-to-point communication of a schedule from its compute order.

Generators only write compute actions. :func:`lower` inserts, on each rank,

* ``SEND_F(i, s)`` right after ``F(i, s)`` when stage ``s+1`` lives on another rank, and the
  matching ``RECV_F(i, s)`` right before ``F(i, s+1)`` on that rank;
* ``SEND_B(i, s)`` right after ``B(i, s)``/``BW(i, s)`` when stage ``s-1`` lives on another rank,
  and the matching ``RECV_B(i, s)`` right before the backward of ``(i, s-1)``.

A ``RECV`` marks the latest point where the data must have arrived; a runtime may post the
receive earlier (the executor posts it as soon as the previous receive from that peer is
consumed). Transfers between two stages on the same rank (e.g. the tip of the V) need no action.
Vocabulary passes (``IF``, ``S``, ``T``, ``IB``) are kept as they are: their collectives run over
the whole pipeline group, not point to point, and are not lowered here.
Each transfer is identified by ``(direction, mb, stage)``; the runtime matches a send with its
receive by order (as NCCL does), posting each peer's receives in the order that peer sends them
(:class:`megatron_zb.runtime.rank_plan.RankPlan`).
"""

from __future__ import annotations

from collections import Counter

from .ir import VOCAB_OPS, Action, Op, Schedule, ScheduleError, validate


def pipeline_neighbours(op: Op, stage: int, num_stages: int) -> tuple[int | None, int | None]:
    """``(source, destination)``: the stages a compute action's data crosses to and from.

    ``F`` on ``stage`` reads the activation of ``stage - 1`` and feeds ``stage + 1``; ``B`` and
    ``BW`` read the output gradient of ``stage + 1`` (its input-gradient backward) and feed
    ``stage - 1``; ``W`` and the vocabulary passes (``IF``/``S``/``T``/``IB``, whose collectives
    the timing kernel models as barriers) neither. ``None`` past either end of the pipeline. When the other stage
    lives on another rank the data is a transfer (a send/receive pair, ``t_comm`` in the timing
    kernel), else it is handed over in memory. The one cross-stage dependency rule: :func:`lower`,
    the timing kernel's :func:`~.timing.inputs` and the runtime's executor all call it.
    """
    if op is Op.F:
        return (stage - 1 if stage > 0 else None), (stage + 1 if stage < num_stages - 1 else None)
    if op is Op.B or op is Op.BW:
        return (stage + 1 if stage < num_stages - 1 else None), (stage - 1 if stage > 0 else None)
    if op is Op.W or op in VOCAB_OPS:  # a vocabulary pass talks through its collectives, not p2p
        return None, None
    raise ScheduleError(f"{op} is not a compute action")


def lower(schedule: Schedule, *, check: bool = True) -> Schedule:
    """Return a copy of ``schedule`` with send/recv actions inserted (see module docstring).

    ``check=False`` skips validating the input and the result (only for tests of the runtime's
    own safety nets, which must see broken schedules).
    """
    if check:
        validate(schedule)
    s2r, n = schedule.stage_to_rank, schedule.num_stages
    ranks: list[list[Action]] = []
    for r, acts in enumerate(schedule.ranks):
        row: list[Action] = []
        for a in acts:
            src, dst = pipeline_neighbours(a.op, a.stage, n) if a.is_compute else (None, None)
            forward = a.op is Op.F
            if src is not None and s2r[src] != r:
                row.append(Action(Op.RECV_F if forward else Op.RECV_B, a.mb, src, peer=s2r[src]))
            row.append(a)
            if dst is not None and s2r[dst] != r:
                row.append(Action(Op.SEND_F if forward else Op.SEND_B, a.mb, a.stage, peer=s2r[dst]))
        ranks.append(row)
    out = Schedule(schedule.num_microbatches, list(s2r), ranks, schedule.name, dict(schedule.meta),
                   schedule.vocab_barriers)
    if check:
        check_lowered(out)
    return out


def check_lowered(schedule: Schedule) -> None:
    """Check that every send has exactly one matching receive on its peer, and vice versa.

    Raises :class:`ScheduleError` naming the first unmatched action (e.g. a send whose receive was
    removed, or a send addressed to the wrong peer).
    """
    sends: Counter[tuple[Op, int, int, int, int]] = Counter()
    recvs: Counter[tuple[Op, int, int, int, int]] = Counter()
    where: dict[tuple[Op, int, int, int, int], tuple[int, int, Action]] = {}  # first occurrence
    for r, i, a in schedule.actions():
        if a.is_compute:
            continue
        assert a.peer is not None
        direction = a.op.direction
        if a.op.is_send:
            key = (direction, a.mb, a.stage, r, a.peer)
            sends[key] += 1
        else:
            key = (direction, a.mb, a.stage, a.peer, r)
            recvs[key] += 1
        where.setdefault(key, (r, i, a))
    for key in list(sends) + list(recvs):
        if sends[key] != 1 or recvs[key] != 1:
            direction, mb, stage, src, dst = key
            r, i, a = where[key]
            raise ScheduleError(
                f"rank {r} action #{i}: {a} has {sends[key]} send(s) and {recvs[key]} receive(s) for the "
                f"{'activation' if direction is Op.F else 'gradient'} of mb={mb}, stage={stage} "
                f"from rank {src} to rank {dst}; expected exactly one of each")
