"""Weight-gradient groups: the schedule side of sharded gradients (ZeRO-2, issue 42).

With gradients sharded over the data-parallel ranks, a stage cannot keep a full gradient buffer for
the whole iteration (that is the memory ZeRO-2 saves), nor afford a reduce-scatter after every micro
batch (``m`` times the traffic). A split backward offers a third way: the ``W``'s are free to move,
so a stage can run the ``W``'s of ``k`` micro batches back to back, layer-major -- for each layer
(bucket), the ``k`` weight gradients into one bucket-sized buffer -- and reduce-scatter each bucket
into its shard once per group: ``ceil(m / k)`` collectives per bucket per iteration, and only a
couple of bucket buffers ever allocated. The price is that a group's earlier ``W`` inputs are held
until the group runs -- what the simulator's memory already counts once the ``W``'s are where they run.

:func:`group_wgrads` rewrites any split-backward schedule into that form (the data); the timing
kernel's reduce model with :attr:`~.costs.DPReduceModel.wgrad_group` times it (each bucket ready as
the group reaches its layer, reduce-scattered on the data-parallel channel); :func:`check_wgrad_groups`
is the rule both rely on, and :func:`group_runs` tells the runtime where each group runs (the store
runs a group layer-major: :meth:`~megatron_zb.runtime.wgrad_store.WeightGradStore.run_group`).
Vocabulary passes (``T``, ``IB``) are not grouped. Not yet: the planner's choice of ``k`` (issue 42).
"""

from __future__ import annotations

import dataclasses

from .ir import Action, Op, Schedule, ScheduleError

__all__ = ["check_wgrad_groups", "group_runs", "group_wgrads", "wgrad_group_of"]


def wgrad_group_of(schedule: Schedule) -> int | None:
    """The group size :func:`group_wgrads` recorded in ``schedule.meta`` (``None``: not grouped)."""
    return schedule.meta.get("wgrad_group")


def _numbered_ws(acts: list[Action]) -> dict[int, list[int]]:
    """Per stage, the positions in ``acts`` of its ``W``'s, in order."""
    ws: dict[int, list[int]] = {}
    for i, a in enumerate(acts):
        if a.op is Op.W:
            ws.setdefault(a.stage, []).append(i)
    return ws


def _groups(acts: list[Action], k: int) -> list[list[int]]:
    """The one grouping rule: each stage's ``W``'s in the order the rank runs them, in runs of ``k`` (the
    last run holds what is left); positions in ``acts``."""
    return [positions[g:g + k] for positions in _numbered_ws(acts).values() for g in range(0, len(positions), k)]


def group_wgrads(schedule: Schedule, k: int) -> Schedule:
    """``schedule`` with each stage's ``W``'s in groups of ``k`` micro batches, each group back to back.

    A stage's ``W``'s are grouped in the order the stage runs them (the last group holds ``m mod k``
    when ``k`` does not divide ``m``); each group runs where its last ``W`` ran, every earlier member
    moved later -- always valid: a ``W`` waits only for its own ``B``, which ran before it. Every other
    action keeps its place in its rank's order. ``k = 1`` leaves the order as it is. The result is
    compute-only (lower it again to run it) and records ``meta["wgrad_group"] = k``.

    Raises:
        ScheduleError: ``k < 1``, or the schedule fuses a backward (``BW``: its weight gradients are
            made inside the backward on the critical path; only ``k = 1`` suits it, as a reduce-scatter
            per micro batch -- use a split-backward family).
    """
    # 1. what cannot be grouped
    if k < 1:
        raise ScheduleError(f"a weight-gradient group holds at least one micro batch, not {k}")
    sched = schedule.compute_only()
    fused = next((a for _, _, a in sched.actions() if a.op is Op.BW), None)
    if fused is not None:
        raise ScheduleError(f"{sched.name or 'the schedule'} fuses its backward ({fused}): its weight gradients "
                            f"cannot wait for a group; use a split-backward family (e.g. zb, zbv, interleaved-zb)")
    # 2. per rank: each W goes to the place of its group's last W, the group in the stage's order
    ranks = []
    for acts in sched.ranks:
        at: dict[int, list[Action]] = {}  # position of a group's last W -> the group
        moved: set[int] = set()
        for members in _groups(acts, k):
            at[members[-1]] = [acts[i] for i in members]
            moved.update(members)
        ranks.append([b for i, a in enumerate(acts) for b in (at.get(i, ()) if i in moved else (a,))])
    return dataclasses.replace(sched, ranks=ranks, name=f"{sched.name}" if k == 1 else f"{sched.name} (W x{k})",
                               meta={**sched.meta, "wgrad_group": k})


def check_wgrad_groups(schedule: Schedule, k: int) -> None:
    """Raise :class:`ScheduleError` unless every stage's ``W``'s run in groups of ``k`` back to back on its
    rank (the last group possibly smaller) -- what a reduce per group assumes (:func:`group_wgrads`)."""
    for r, acts in enumerate(schedule.compute_only().ranks):
        for members in _groups(acts, k):
            if members[-1] - members[0] != len(members) - 1:
                w = acts[members[0]]
                raise ScheduleError(f"rank {r}: stage {w.stage}'s W's of micro batches "
                                    f"{[acts[i].mb for i in members]} are not back to back (positions {members}); "
                                    f"group them with group_wgrads(schedule, {k})")


def group_runs(acts: list[Action] | tuple[Action, ...], k: int | None) -> dict[tuple[int, int], tuple[int, ...]]:
    """Where one rank's ``W`` groups run: ``(stage, mb)`` of each group's *last* ``W`` -> the group's micro
    batches in run order, and ``(stage, mb)`` of every earlier member -> ``()`` (it runs with its group).
    ``acts`` may hold communication actions (a lowered rank); ``k`` ``None`` or 1: no groups (empty)."""
    if k is None or k == 1:
        return {}
    ws = [a for a in acts if a.op is Op.W]
    runs: dict[tuple[int, int], tuple[int, ...]] = {}
    for members in _groups(ws, k):
        group = [ws[i] for i in members]
        runs.update({(w.stage, w.mb): () for w in group[:-1]})
        runs[(group[-1].stage, group[-1].mb)] = tuple(w.mb for w in group)
    return runs
