"""Fused and split backwards of one schedule: the same order, the backward as one ``BW`` or as ``B`` + ``W``.

A runtime may pay more for a split backward than for a fused one: PyTorch's pipeline runtime runs
an ``I`` (our ``B``) and a ``W`` as two autograd passes, which together cost more than its fused
``B`` (our ``BW``; docs/torch_pipelining.md measures +25%). The cost model says so with
:attr:`~.costs.CostModel.t_bw`, which the timing kernel charges to every ``BW``; these functions
rewrite a schedule so that its fused backwards are ``BW`` actions:

* :func:`fuse_adjacent` -- each ``B`` directly followed on its rank by its own ``W`` becomes one
  ``BW``: what the export to PyTorch writes as one ``B`` and PyTorch runs fused, so simulate this
  form to predict PyTorch's run;
* :func:`fuse_all` -- every ``B`` becomes a ``BW`` at its place and its ``W`` is dropped (valid:
  a ``BW`` waits for what its ``B`` waited for, and nothing waits for a ``W``; memory only falls);
* :func:`split_all` -- every ``BW`` becomes its ``B`` directly followed by its ``W``;
* :func:`fuse_where_free` -- each ``W`` moved directly behind its ``B`` (fused, as PyTorch runs it)
  wherever the predicted iteration does not grow: a split schedule that keeps apart only
  the ``W``'s that fill a bubble, and pays the split's extra cost for those alone;
* :func:`split_where_faster` -- the schedule *written as it runs* (:func:`as_run`, marked
  :data:`AS_WRITTEN`), each fused ``BW`` split into its ``B`` and, right after, its ``W`` -- two
  actions even though adjacent -- wherever that shortens the predicted iteration: a split ``B``
  sends its input gradient before the ``W`` runs, so a backward on the critical path can be worth
  the split's extra cost.

:func:`simulate_as_run` is the prediction they use: the schedule as it runs (:func:`as_run`)
simulated, its ``total_time`` one isolated iteration -- what PyTorch's ``step`` is (every rank
finishes it before the optimizer step; the next ``step`` does not overlap it), not the ``makespan``
of iterations allowed to overlap.

The profiler of :mod:`megatron_zb.torch_pipelining.profiling` runs both forms of one order to
measure ``T_B``, ``T_W`` and ``T_BW`` on every stage.
"""

from __future__ import annotations

from dataclasses import replace

from .costs import CostModel
from .ir import Action, Op, Schedule
from .simulator import SimResult, simulate

__all__ = ["AS_WRITTEN", "REL_SLACK", "as_run", "fuse_adjacent", "fuse_all", "fuse_where_free", "simulate_as_run",
           "split_all", "split_where_faster"]

REL_SLACK = 1e-9
"""Relative slack of a time or memory comparison (float rounding of sums of costs)."""

AS_WRITTEN = "backwards_as_written"
"""``Schedule.meta`` key: when true, the schedule's backwards run as written -- a ``BW`` fused, a ``B``
and its ``W`` as two actions even where adjacent (:func:`split_where_faster` writes such schedules)."""


def _with_ranks(schedule: Schedule, ranks: list[list[Action]]) -> Schedule:
    return replace(schedule, ranks=ranks, meta=dict(schedule.meta))


def fuse_adjacent(schedule: Schedule) -> Schedule:
    """``schedule`` with each ``B`` directly followed (same rank) by its own ``W`` written as one ``BW``."""
    ranks = []
    for acts in schedule.ranks:
        row: list[Action] = []
        for a in acts:
            prev = row[-1] if row else None
            if a.op is Op.W and prev is not None and prev == Action(Op.B, a.mb, a.stage):
                row[-1] = Action(Op.BW, a.mb, a.stage)   # B + its W -> BW
            else:
                row.append(a)
        ranks.append(row)
    return _with_ranks(schedule, ranks)


def fuse_all(schedule: Schedule) -> Schedule:
    """``schedule`` with every backward fused: each ``B`` replaced by ``BW``, each ``W`` dropped."""
    ranks = [[Action(Op.BW, a.mb, a.stage) if a.op is Op.B else a for a in acts if a.op is not Op.W]
             for acts in schedule.ranks]
    return _with_ranks(schedule, ranks)


def split_all(schedule: Schedule) -> Schedule:
    """``schedule`` with every backward split: each ``BW`` replaced by its ``B`` and, right after, its ``W``."""
    ranks = [[b for a in acts for b in ((Action(Op.B, a.mb, a.stage), Action(Op.W, a.mb, a.stage))
                                        if a.op is Op.BW else (a,))] for acts in schedule.ranks]
    return _with_ranks(schedule, ranks)


def as_run(schedule: Schedule) -> Schedule:
    """``schedule`` as the export to PyTorch writes it: unchanged when its backwards are written as they
    run (:data:`AS_WRITTEN`), else :func:`fuse_adjacent` (each ``B`` directly followed by its ``W``
    one ``BW``)."""
    return schedule if schedule.meta.get(AS_WRITTEN) else fuse_adjacent(schedule)


def simulate_as_run(schedule: Schedule, costs: CostModel) -> SimResult:
    """``schedule`` simulated as it runs (:func:`as_run`; every ``BW`` charged ``costs.t_bw``), memory
    not enforced: ``total_time`` is its predicted iteration [unit of the costs], ``max_peak_memory``
    its peak [unit of ``mem_b``]."""
    return simulate(as_run(schedule), costs, enforce_memory=False, check=False)


def split_where_faster(schedule: Schedule, costs: CostModel) -> Schedule:
    """``schedule`` written as it runs (:func:`as_run`, marked :data:`AS_WRITTEN`), with each ``BW``
    split into its ``B`` directly followed by its ``W`` where the predicted iteration
    (:func:`simulate_as_run`'s ``total_time``) falls and the peak memory does not rise.

    Greedy, rank by rank, in each rank's order, once. Valid by construction (the ``B`` and ``W``
    stand where the ``BW`` stood).
    """
    written = as_run(schedule)
    written = replace(written, meta={**written.meta, AS_WRITTEN: True})
    ranks = [list(acts) for acts in written.ranks]
    res = simulate_as_run(written, costs)
    best, peak = res.total_time, res.max_peak_memory
    for r in range(len(ranks)):
        for bw in [a for a in ranks[r] if a.op is Op.BW]:
            i = ranks[r].index(bw)
            trial = ranks[r][:i] + [Action(Op.B, bw.mb, bw.stage), Action(Op.W, bw.mb, bw.stage)] + ranks[r][i + 1:]
            res = simulate_as_run(_with_ranks(written, ranks[:r] + [trial] + ranks[r + 1:]), costs)
            if res.total_time < best * (1 - REL_SLACK) and res.max_peak_memory <= peak * (1 + REL_SLACK):
                ranks[r], best = trial, res.total_time
    return _with_ranks(written, ranks)


def fuse_where_free(schedule: Schedule, costs: CostModel, *, max_rounds: int = 4) -> Schedule:
    """``schedule`` with every ``W`` that can be fused for free moved directly behind its ``B``.

    Greedy: rank by rank, each ``W`` not yet behind its ``B`` is moved there when the predicted
    iteration (:func:`simulate_as_run`'s ``total_time``) stays at most the current one; rounds repeat
    until none moves (at most ``max_rounds``). Valid by construction (a ``W`` waits only for its ``B``,
    and nothing waits for a ``W``), and memory only falls: a ``W`` frees what its ``B`` kept, now
    earlier. With ``t_bw`` at ``t_b + t_w`` (not measured) fusing saves nothing, so
    only ``W``'s that leave no gap behind move.

    Raises:
        ValueError: ``schedule`` is already written as it runs (:data:`AS_WRITTEN`): a ``W`` moved
            behind its ``B`` there would stay a separate action, not fuse.
    """
    if schedule.meta.get(AS_WRITTEN):
        raise ValueError(f"{schedule.name or 'the schedule'} is written as it runs: fuse where free before "
                         f"split_where_faster, not after")
    ranks = [list(acts) for acts in schedule.ranks]
    best = simulate_as_run(schedule, costs).total_time
    for _ in range(max_rounds):
        moved = False
        for r, acts in enumerate(ranks):
            for w in [a for a in acts if a.op is Op.W]:
                i, j = acts.index(w), acts.index(Action(Op.B, w.mb, w.stage))
                if i == j + 1:
                    continue
                trial = acts[:i] + acts[i + 1:]
                trial.insert(j + 1, w)
                cand = _with_ranks(schedule, ranks[:r] + [trial] + ranks[r + 1:])
                span = simulate_as_run(cand, costs).total_time
                if span <= best * (1 + REL_SLACK):
                    ranks[r], acts, best, moved = trial, trial, span, True
        if not moved:
            break
    return _with_ranks(schedule, ranks)
