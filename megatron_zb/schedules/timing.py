"""The timing kernel: when every action of a schedule runs and how much memory a rank holds.

These rules exist once, here; the simulator, the greedy scheduler, the list scheduler and the
exact solver's model all use them (the zero-bubble paper's model):

* dependencies (:func:`inputs`): ``F(i, s)`` waits for ``F(i, s-1)``; ``B(i, s)`` and ``BW(i, s)``
  wait for ``F(i, s)`` and for the input-gradient backward (``B`` or ``BW``) of ``(i, s+1)`` (the
  last stage only for its own ``F``); ``W(i, s)`` waits for ``B(i, s)``. A dependency between two
  different ranks adds ``t_comm`` (a latency that occupies neither rank);
* durations and memory deltas: :meth:`~.costs.StageCosts.duration` and
  :meth:`~.costs.StageCosts.memory_delta` (``F`` allocates ``mem_b``, ``B`` changes the held memory
  by ``mem_w - mem_b`` -- frees, or allocates when ``mem_w > mem_b`` --, ``W`` frees ``mem_w``,
  ``BW`` frees ``mem_b``), tabulated per stage by :class:`Timeline`; the peak is taken after every
  action, so a peak right after an allocating ``B`` counts;
* a rank runs its actions in order, one at a time, each as soon as the rank is free and its inputs
  are done (:meth:`Timeline.run`, :meth:`Timeline.play`);
* the data-parallel gradient reduce, only when ``costs.dp_reduce`` is set (a
  :class:`~.dp_reduce.DPReduceModel`; off by default): a stage's buckets become ready during its
  last weight-gradient action (the ``m``-th ``W`` or ``BW`` of the stage, whichever runs last), in
  bucket order and in proportion to their bytes; each rank reduces its ready buckets one after the
  other on one channel (:func:`drain`, ``latency + bytes / bandwidth`` each), which neither delays
  nor is delayed by compute. With ``overlap`` a bucket starts once ready; without, the rank's
  buckets start after its last compute action. A rank's iteration then ends when its compute *and*
  its reduce are done (:meth:`Timeline.rank_end`), and :meth:`~Timeline.spans`,
  :meth:`~Timeline.makespan` and :meth:`~Timeline.total_time` count that end, so every generator
  that scores candidates through this class sees the exposed reduce.

* vocabulary passes, only when the schedule has them (``vocab_barriers`` 1 or 2; costs from
  ``costs.vocab``, per rank; docs/vocab_parallel_schedules.md): ``S(i, r)`` waits for the last
  stage's ``F(i)`` and its broadcast; the all-reduce ``C1(i)`` ends ``t_collective`` after the
  last ``S(i, *)`` of any rank (a barrier); ``T(i, r)`` waits for ``C1(i)``; the last stage's
  input-gradient backward of ``i`` waits for ``C1(i)`` (one barrier) or for ``C2(i)``, the
  all-reduce ending ``t_collective`` after the last ``T(i, *)`` (two barriers); ``F(i)`` of the
  first stage waits for the embedding's all-reduce, ``t_collective`` after the last ``IF(i, *)``;
  ``IB(i, r)`` waits for the first stage's input-gradient backward of ``i`` and its broadcast.
  Collectives occupy no rank (a side stream). ``S`` allocates ``mem_s``, ``T`` frees it.

Actions are integer-coded for speed: a :data:`Code` is ``(op, mb, stage)`` with ``op`` one of
:data:`F_CODE`, :data:`B_CODE`, :data:`W_CODE`, :data:`BW_CODE` (the kernel's names for
:class:`~.ir.Op`'s compute kinds: ``F``/``B``/``W``/``BW`` are :class:`~.ir.Action` builders in
:mod:`.ir`), or a vocabulary pass :data:`IF_CODE`, :data:`S_CODE`, :data:`T_CODE`, :data:`IB_CODE`
(whose ``stage`` is its rank); :func:`encode` / :func:`decode` convert from and to
:class:`~.ir.Action`. Units: times in the unit of the costs, memory in the unit of ``mem_b``.

Example (two stages on two ranks, unit costs)::

    tl = Timeline([0, 1], 1, CostModel().resolve(2))
    tl.play([[encode(a) for a in (F(0, 0), B(0, 0), W(0, 0))], [encode(a) for a in (F(0, 1), B(0, 1), W(0, 1))]])
    tl.clock  # [5.0, 4.0]: rank 0 ends at 5 (F 0-1, B 3-4, W 4-5), rank 1 at 4
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .costs import StageCosts
from .ir import VOCAB_OPS, Action, Op, ScheduleError
from .limits import slack_ceiling
from .lowering import pipeline_neighbours

__all__ = ["BW_CODE", "B_CODE", "Bucket", "Code", "DeadlockError", "F_CODE", "IB_CODE", "IF_CODE", "OPS", "S_CODE",
           "T_CODE", "Timeline", "W_CODE", "decode", "drain", "encode", "inputs"]

F_CODE, B_CODE, W_CODE, BW_CODE = 0, 1, 2, 3
"""Integer op codes of the compute actions (``OPS[F_CODE] is Op.F``, ...), for the kernel's hot loops."""

IF_CODE, S_CODE, T_CODE, IB_CODE = 4, 5, 6, 7
"""Integer op codes of the vocabulary passes (their ``stage`` is the rank)."""

OPS: tuple[Op, ...] = (Op.F, Op.B, Op.W, Op.BW)
"""Op code -> :class:`~.ir.Op` for the transformer stages' actions."""

ALL_OPS: tuple[Op, ...] = OPS + VOCAB_OPS
"""Op code -> :class:`~.ir.Op`, vocabulary passes included."""

_CODE_OF: dict[Op, int] = {op: k for k, op in enumerate(ALL_OPS)}

Code = tuple[int, int, int]
"""An integer-coded compute action ``(op code, microbatch, stage)``."""


Bucket = tuple[int, float, float, float]
"""One bucket's predicted reduce ``(stage, ready, start, end)`` (times in the unit of the costs)."""


def drain(ready: Sequence[tuple[int, float, float]], free: float) -> list[Bucket]:
    """Reduce ``ready`` buckets ``(stage, ready time, reduce time)`` one after the other on one
    channel that is free from ``free`` on; each starts at ``max(its ready time, channel free)``."""
    out = []
    for stage, at, took in ready:
        begin = at if at > free else free
        free = begin + took
        out.append((stage, at, begin, free))
    return out


def _buffered(buckets: list[tuple[float, float]], begin: float, span: float, slots: int, ends: list[float],
              pending: list[tuple[int, float, float]], stage: int, free: list[float], rank: int,
              blocks: bool) -> float:
    """One group's buckets written into ``slots`` work buffers in turn (``dp_reduce.work_buffers``): a bucket
    waits for the reduce of the rank's bucket ``slots`` launches before it (its buffer), then its share
    ``(fraction done, reduce time)`` of the group's ``span`` from ``begin``; each reduce on the rank's channel
    (``free[rank]``), its end appended to ``ends``, the bucket to ``pending``; ``blocks``
    (``dp_reduce.blocks_compute``): the next bucket is written after the reduce. Returns when the rank may
    compute again: the group's last bucket written (later than ``begin + span`` when a bucket waited), or
    with ``blocks`` its reduce done."""
    at, before, f = begin, 0.0, free[rank]
    for done, took in buckets:
        if len(ends) >= slots and ends[-slots] > at:
            at = ends[-slots]
        at += span * (done - before)
        before = done
        f = (at if at > f else f) + took
        ends.append(f)
        pending.append((stage, at, took))
        if blocks:
            at = f
    free[rank] = f
    return at


class DeadlockError(ScheduleError):
    """The schedule can never finish: every unfinished rank waits on something that never happens."""


def encode(a: Action) -> Code:
    """The :data:`Code` of a compute action."""
    return _CODE_OF[a.op], a.mb, a.stage


def decode(code: Code) -> Action:
    """The :class:`~.ir.Action` of a :data:`Code`."""
    op, mb, stage = code
    return Action(ALL_OPS[op], mb, stage)


def inputs(op: int, stage: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """The events ``(op code, stage)`` of the same microbatch that ``op`` on ``stage`` waits for.

    ``B_CODE`` in a result stands for the input-gradient backward, ``B`` or ``BW`` (whichever the
    schedule runs). This is the dependency rule of every schedule (see the module docstring); which
    stages the data crosses is :func:`~.lowering.pipeline_neighbours`.
    """
    if op == W_CODE:
        return ((B_CODE, stage),)
    src, _ = pipeline_neighbours(OPS[op], stage, num_stages)   # the rule of every schedule
    across = () if src is None else ((F_CODE if op == F_CODE else B_CODE, src),)
    return across if op == F_CODE else ((F_CODE, stage),) + across


def _barrier_fn(rows: Sequence[list[float]], latency: float,
                after: Callable[[int], float] | None = None) -> Callable[[int], float]:
    """``mb ->`` ``latency`` after the latest of ``rows[*][mb]`` (a collective over the ranks whose
    end times are ``rows``), and not before ``after(mb)`` when given."""
    def ready(mb: int) -> float:
        t = max(row[mb] for row in rows) + latency
        if after is not None:
            a = after(mb)
            return a if a > t else t
        return t
    return ready


def _ready_fn(ins: tuple[tuple[list[float], float], ...]) -> Callable[[int], float]:
    """``mb ->`` the latest ``end + latency`` over the inputs ``(end times by mb, latency)`` (0 if none)."""
    if not ins:
        return lambda mb: 0.0
    if len(ins) == 1:
        ((row, lat),) = ins
        return lambda mb: row[mb] + lat
    ((row1, lat1), (row2, lat2)) = ins   # inputs() gives at most two

    def ready(mb: int) -> float:
        a, b = row1[mb] + lat1, row2[mb] + lat2
        return a if a > b else b
    return ready


class Timeline:
    """One timing pass over a placement: event end times, per-rank clocks and held memory.

    Drive it with :meth:`play` (whole per-rank orders, every action as soon as possible) or action by
    action with :meth:`ready` and :meth:`run` (what a list scheduler does while it builds an order).

    Attributes:
        stage_to_rank: the placement.
        num_microbatches: ``m``.
        duration: ``duration[op][stage]``, time of one action (unit of the costs).
        per_action: ``per_action[op][stage][mb]``, the time of each single action, overriding
            ``duration`` (a Monte Carlo draw, :mod:`.spread`), or ``None``. The lists are used as
            given, so a caller may refill them and :meth:`reset` between plays.
        delta: ``delta[op][stage]``, change of the rank's held activation memory (unit of ``mem_b``).
        f_end / b_end: ``[stage][mb]``, end of ``F`` / of the input-gradient backward (``B`` or
            ``BW``); ``inf`` until it has run.
        ready_of: ``ready_of[op][stage](mb)``, the :meth:`ready` time (a function per op and stage,
            built from :func:`inputs`).
        run: ``run(rank, op, mb, stage, ready) -> start``: run ``op`` on ``(mb, stage)`` as
            ``rank``'s next action, starting at ``max(ready, clock[rank])``, and update the ends,
            clock, memory and peak. ``ready`` is normally :meth:`ready`'s value (a list scheduler may
            pass a later one to hold an action back).
        clock: per rank, end of its last action so far (0 before the first).
        first: per rank, start of its first action (``inf`` before it).
        mem / peak: per rank, activation memory held now / at most so far.
        count: per rank, actions run so far.
        over: per rank, the position (in the rank's order) of the first action that brought its
            memory above ``costs.memory_limit`` (what :func:`~.limits.fits` refuses), or -1.
        dp_reduce: ``costs.dp_reduce`` (``None``: no reduce modelled).
        reduce_ready: per rank, ``(stage, ready time, reduce time)`` of each bucket that is ready
            so far, in ready order (empty without ``dp_reduce``).
        reduce_free: per rank, end of the overlapped channel's last bucket so far (0 before).
    """

    def __init__(self, stage_to_rank: Sequence[int], num_microbatches: int, costs: StageCosts, *,
                 num_ranks: int | None = None, per_action: list[list[list[float]]] | None = None,
                 vocab_barriers: int = 0) -> None:
        s2r = list(stage_to_rank)
        n, m = len(s2r), num_microbatches
        if len(costs.t_f) != n:
            raise ScheduleError(f"costs are resolved for {len(costs.t_f)} stages, the placement has {n}")
        p = num_ranks if num_ranks is not None else max(s2r, default=-1) + 1
        self.stage_to_rank = s2r
        self.num_microbatches = m
        self.duration = tuple(tuple(costs.duration(op, s) for s in range(n)) for op in OPS)
        self.per_action = per_action
        self.delta = tuple(tuple(costs.memory_delta(op, s) for s in range(n)) for op in OPS)
        self.f_end = [[math.inf] * m for _ in range(n)]
        self.b_end = [[math.inf] * m for _ in range(n)]
        ends = (self.f_end, self.b_end)
        self.ready_of = tuple(
            tuple(_ready_fn(tuple((ends[q_op][q], costs.t_comm if s2r[q] != s2r[s] else 0.0)
                                  for q_op, q in inputs(op, s, n))) for s in range(n))
            for op in range(len(OPS)))
        self.vocab_barriers = vocab_barriers
        self.v_end: list[list[list[float]]] = []   # [op code - IF][rank][mb]
        if vocab_barriers:
            self._add_vocab(costs, p)
        self.clock = [0.0] * p
        self.first = [math.inf] * p
        self.mem = [0.0] * p
        self.peak = [0.0] * p
        self.count = [0] * p
        self.over = [-1] * p
        self._limit = slack_ceiling(costs.memory_limit)
        self.dp_reduce = dp = costs.dp_reduce
        self.reduce_ready: list[list[tuple[int, float, float]]] = [[] for _ in range(p)]
        self.reduce_free = [0.0] * p
        self.reduce_ends: list[list[float]] = [[] for _ in range(p)]
        self._w_left = [m] * n
        self.run = self._runner() if dp is None else self._reduce_runner(
            self._runner(), [[(done, dp.reduce_time(size)) for done, size in dp.ready_fractions(s)]
                             for s in range(n)])

    def _add_vocab(self, costs: StageCosts, p: int) -> None:
        """Extend the tables with the vocabulary passes (rows indexed by rank) and their barriers."""
        if self.per_action is not None:
            raise ScheduleError("per-action durations (a duration spread) are not modelled for vocabulary passes yet; "
                                "simulate the schedule without a spread")
        if self.vocab_barriers not in (1, 2):
            raise ScheduleError(f"vocab_barriers is {self.vocab_barriers}; it must be 0, 1 or 2")
        vc, m, n = costs.vocab_for(p), self.num_microbatches, len(self.stage_to_rank)
        c = vc.t_collective
        self.v_end = [[[math.inf] * m for _ in range(p)] for _ in VOCAB_OPS]
        if_end, s_end, t_end, _ = self.v_end
        times = {IF_CODE: vc.t_if, S_CODE: vc.t_s, T_CODE: vc.t_t, IB_CODE: vc.t_ib}
        self.duration += tuple(times[k] for k in (IF_CODE, S_CODE, T_CODE, IB_CODE))
        self.delta += ((0.0,) * p, vc.mem_s, tuple(-x for x in vc.mem_s), (0.0,) * p)
        ready = [list(row) for row in self.ready_of]
        last_f, first_b = self.f_end[n - 1], self.b_end[0]
        ready[F_CODE][0] = _barrier_fn(if_end, c, ready[F_CODE][0])                      # embedding all-reduce
        last_b = _barrier_fn(s_end if self.vocab_barriers == 1 else t_end, c, ready[B_CODE][n - 1])  # C1 or C2
        ready[B_CODE][n - 1] = ready[BW_CODE][n - 1] = last_b
        c1 = _barrier_fn(s_end, c)
        ready.append([lambda mb: 0.0] * p)                                     # IF: no input
        ready.append([lambda mb: last_f[mb] + c] * p)                          # S: broadcast of X
        ready.append([c1] * p)                                                 # T: after C1
        ready.append([lambda mb: first_b[mb] + c] * p)                         # IB: broadcast of dX
        self.ready_of = tuple(tuple(row) for row in ready)

    def action_time(self, op: int, mb: int, stage: int) -> float:
        """Duration of ``op`` on ``(mb, stage)``: ``per_action``'s when given, else the stage's."""
        return self.duration[op][stage] if self.per_action is None else self.per_action[op][stage][mb]

    def ready(self, op: int, mb: int, stage: int) -> float:
        """Earliest start of ``op`` on ``(mb, stage)`` as far as its inputs go (``inf``: not all done).

        The same as ``ready_of[op][stage](mb)``, which hot loops call directly.
        """
        return self.ready_of[op][stage](mb)

    def reset(self) -> None:
        """Forget every action run so far (the tables stay), ready for another pass."""
        unset = [math.inf] * self.num_microbatches
        for row in self.f_end + self.b_end + [r for rows in self.v_end for r in rows]:
            row[:] = unset
        p = len(self.clock)
        self.clock[:], self.first[:] = [0.0] * p, [math.inf] * p
        self.mem[:], self.peak[:] = [0.0] * p, [0.0] * p
        self.count[:], self.over[:] = [0] * p, [-1] * p
        self.reduce_free[:] = [0.0] * p
        self._w_left[:] = [self.num_microbatches] * len(self._w_left)
        for row in self.reduce_ready + self.reduce_ends:
            row.clear()

    def _runner(self) -> Callable[[int, int, int, int, float], float]:
        """Build :attr:`run` (a closure over the state lists: hot loops call it for every action)."""
        clock, first, mem, peak, count, over = self.clock, self.first, self.mem, self.peak, self.count, self.over
        duration, delta, f_end, b_end, limit = self.duration, self.delta, self.f_end, self.b_end, self._limit
        v_end = self.v_end
        per_action = self.per_action  # the same lists: a caller may refill them between plays

        def run(rank: int, op: int, mb: int, stage: int, ready: float) -> float:
            """Run ``op`` on ``(mb, stage)`` as ``rank``'s next action, not before ``ready``; return its start."""
            clk = clock[rank]
            start = ready if ready > clk else clk
            end = start + (duration[op][stage] if per_action is None else per_action[op][stage][mb])
            if op == F_CODE:
                f_end[stage][mb] = end
            elif op == B_CODE or op == BW_CODE:
                b_end[stage][mb] = end
            elif op != W_CODE:                # a vocabulary pass: stage is the rank
                v_end[op - IF_CODE][stage][mb] = end
            clock[rank] = end
            if start < first[rank]:
                first[rank] = start
            held = mem[rank] + delta[op][stage]
            mem[rank] = held
            if held > peak[rank]:   # memory first exceeds the limit at a new peak
                peak[rank] = held
                if held > limit and over[rank] < 0:
                    over[rank] = count[rank]
            count[rank] += 1
            return start
        return run

    def _reduce_runner(self, run: Callable[[int, int, int, int, float], float],
                       buckets: list[list[tuple[float, float]]]) -> Callable[[int, int, int, int, float], float]:
        """:attr:`run` that also readies a stage's buckets during its last weight-gradient action --
        with ``dp_reduce.wgrad_group = k``, during the last of each group of ``k`` (the group's actions
        back to back, layer-major: a bucket is ready once the group has computed its layers, at its
        fraction of the group's time from the group's start); ``buckets[stage]`` = ``(fraction of the
        stage's bytes done, reduce time)`` per bucket."""
        left, pending, free, action_time = self._w_left, self.reduce_ready, self.reduce_free, self.action_time
        m, group, slots = self.num_microbatches, self.dp_reduce.wgrad_group, self.dp_reduce.work_buffers
        k = group or m  # None: one group of the whole iteration, but not layer-major: ready in its last W
        clock, ends, blocks = self.clock, self.reduce_ends, self.dp_reduce.blocks_compute

        def run_dp(rank: int, op: int, mb: int, stage: int, ready: float) -> float:
            start = run(rank, op, mb, stage, ready)
            if op == W_CODE or op == BW_CODE:
                left[stage] -= 1
                done_w = m - left[stage]
                if left[stage] == 0 or done_w % k == 0:
                    d = action_time(op, mb, stage)
                    span = d if group is None else d * (done_w - (done_w - 1) // k * k)  # the group's W's, back to back
                    begin = start + d - span
                    if slots is None:
                        new = [(stage, begin + span * done, took) for done, took in buckets[stage]]
                        pending[rank] += new
                        if new:
                            free[rank] = drain(new, free[rank])[-1][3]
                        at = free[rank] if blocks else 0.0  # blocking: the rank waits for the reduces
                    else:
                        at = _buffered(buckets[stage], begin, span, slots, ends[rank], pending[rank], stage, free,
                                       rank, blocks)
                    if at > clock[rank]:  # the group waited for work buffers or reduces: the rank goes on later
                        clock[rank] = at
            return start
        return run_dp

    def play(self, orders: Sequence[Sequence[Code]], *,
             record: bool = False) -> tuple[list[list[float]], list[list[float]]] | None:
        """Run every rank's order (rank ``r`` = ``orders[r]``), each action as soon as possible.

        Returns ``(start, end)`` per rank and action when ``record``, else ``None`` (the results are
        in the attributes). Raises :class:`DeadlockError` naming each rank's blocked action and what
        it waits for when the orders can never all finish.
        """
        ready_of, run, inf = self.ready_of, self.run, math.inf
        ptr = [0] * len(orders)
        starts = [[0.0] * len(o) for o in orders] if record else None
        remaining = sum(len(o) for o in orders)
        while remaining:
            progressed = False
            for r, seq in enumerate(orders):
                k = ptr[r]
                while k < len(seq):
                    op, mb, stage = seq[k]
                    t = ready_of[op][stage](mb)
                    if t == inf:
                        break
                    t = run(r, op, mb, stage, t)
                    if starts is not None:
                        starts[r][k] = t
                    k += 1
                if k != ptr[r]:
                    remaining -= k - ptr[r]
                    ptr[r] = k
                    progressed = True
            if not progressed:
                raise DeadlockError(self._deadlock_message(orders, ptr))
        if starts is None:
            return None
        dur = self.action_time
        ends = [[t + dur(op, mb, s) for t, (op, mb, s) in zip(row, seq)] for row, seq in zip(starts, orders)]
        return starts, ends

    def _deadlock_message(self, orders: Sequence[Sequence[Code]], ptr: list[int]) -> str:
        n = len(self.stage_to_rank)
        ends = (self.f_end, self.b_end)
        lines = []
        for r, seq in enumerate(orders):
            if ptr[r] == len(seq):
                lines.append(f"rank {r} finished")
                continue
            op, mb, stage = seq[ptr[r]]
            waits = ", ".join(f"{OPS[q_op]}(mb={mb}, stage={q})" for q_op, q in inputs(op, stage, n)
                              if op < IF_CODE and ends[q_op][q][mb] == math.inf)
            if self.vocab_barriers and (op >= IF_CODE or (op == F_CODE and stage == 0)
                                        or (op != W_CODE and stage == n - 1)):
                waits = ", ".join(w for w in (waits, f"the vocabulary passes of mb={mb} (a collective)") if w)
            lines.append(f"rank {r} blocked at action #{ptr[r]} {decode(seq[ptr[r]])} waiting for {waits}")
        return "schedule deadlocks:\n  " + "\n  ".join(lines)

    # ------------------------------------------------------------------ results
    def reduce_buckets(self, rank: int) -> list[Bucket]:
        """``rank``'s buckets so far as ``dp_reduce`` runs them: overlapped (each once ready) or
        after the rank's last compute action so far (empty without ``dp_reduce``)."""
        dp = self.dp_reduce
        if dp is None:
            return []
        return drain(self.reduce_ready[rank], 0.0 if dp.overlap else self.clock[rank])

    def rank_end(self, rank: int) -> float:
        """End of ``rank``'s last action, or of its last bucket reduce when that is later."""
        clk = self.clock[rank]
        if self.dp_reduce is None or not self.reduce_ready[rank]:
            return clk
        end = self.reduce_free[rank] if self.dp_reduce.overlap else self.reduce_buckets(rank)[-1][3]
        return end if end > clk else clk

    def spans(self) -> list[float]:
        """Per rank, :meth:`rank_end` minus the start of its first action (0 for a rank without
        actions); without ``dp_reduce`` the end of its last action."""
        if self.dp_reduce is None:
            return [c - f if f != math.inf else 0.0 for c, f in zip(self.clock, self.first)]
        return [self.rank_end(r) - f if f != math.inf else 0.0 for r, f in enumerate(self.first)]

    def makespan(self) -> float:
        """The longest per-rank span (the zero-bubble paper's cost)."""
        return max(self.spans(), default=0.0)

    def total_time(self) -> float:
        """The latest :meth:`rank_end` (one isolated iteration; without ``dp_reduce`` the end of
        the last action on any rank)."""
        if self.dp_reduce is None:
            return max(self.clock, default=0.0)
        return max((self.rank_end(r) for r in range(len(self.clock))), default=0.0)
