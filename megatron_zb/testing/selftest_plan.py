"""The GPU self-test's plan: the jobs of :mod:`.selftest_jobs` packed into timed steps on 1 to 8 GPUs.

A **step** runs its jobs at the same time, each on its own GPUs (``CUDA_VISIBLE_DEVICES``) and
within its own timeout; the step lasts as long as its longest timeout, and the next step starts
when every job of it has ended. The **critical path** is the sum of the steps' timeouts (parallel
jobs counted once): the longest the run can take, apart from the few seconds each step's killed
jobs get to stop (:data:`~.selftest_jobs.KILL_GRACE_S`).

Packing (:func:`make_plan`), jobs taken most informative first: a job joins the step where it adds
the least to the critical path (free GPUs there, neither it nor the step *isolated* -- a timing
job runs alone on the node), else opens a new step at the end. Consecutive jobs of one ``together``
tag (the p2p stress under both connection settings) are placed as one, in the same step, where the
node has GPUs for all of them. A job the node cannot run is
*skipped* with its reason; a job that would take the plan past the budget is *deferred* (listed,
with the ``--steps`` that runs it). Jobs named with ``--steps`` are never deferred: a plan of them
above the budget is refused (:attr:`Plan.over_budget`). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .selftest_jobs import BUDGET_S, KILL_GRACE_S, Command, Context, Job, jobs

__all__ = ["Placed", "Plan", "Step", "describe_gpus", "make_plan", "render"]


@dataclass
class Placed:
    """A job with its GPUs and its commands."""

    job: Job
    gpus: tuple[int, ...]
    commands: list[Command]


@dataclass
class Step:
    """Jobs that run at the same time; its timeout is the longest of theirs (seconds)."""

    placed: list[Placed] = field(default_factory=list)

    @property
    def timeout_s(self) -> float:
        return max(p.job.timeout_s for p in self.placed)

    @property
    def isolated(self) -> bool:
        return any(p.job.isolated for p in self.placed)

    def free(self, gpus: int) -> list[int]:
        used = {g for p in self.placed for g in p.gpus}
        return [g for g in range(gpus) if g not in used]


@dataclass
class Plan:
    """Steps in order, and what is not in them (each with its reason)."""

    gpus: int
    budget_s: float
    steps: list[Step]
    skipped: list[tuple[Job, str]]
    deferred: list[tuple[Job, str]]
    opt_in: list[Job]

    @property
    def critical_s(self) -> float:
        """The sum of the steps' timeouts, seconds."""
        return sum(s.timeout_s for s in self.steps)

    @property
    def worst_s(self) -> float:
        """The critical path plus every step's kill grace, seconds."""
        return self.critical_s + KILL_GRACE_S * len(self.steps)

    @property
    def over_budget(self) -> bool:
        return self.critical_s > self.budget_s


def _cost(step: Step, unit: list[Job], gpus: int) -> float | None:
    """What the jobs of ``unit`` add to the critical path in ``step`` (None: they cannot join it)."""
    if step.isolated or any(j.isolated for j in unit) or len(step.free(gpus)) < sum(j.gpus for j in unit):
        return None
    return max(0.0, max(j.timeout_s for j in unit) - step.timeout_s)


def _place(steps: list[Step], unit: list[Job], gpus: int) -> tuple[int, float]:
    """(index of the step to join -- ``len(steps)`` for a new one, what it adds to the critical path)."""
    best = (len(steps), max(j.timeout_s for j in unit))
    for i, step in enumerate(steps):
        cost = _cost(step, unit, gpus)
        if cost is not None and cost < best[1]:
            best = (i, cost)
    return best


def _unrunnable(job: Job, ctx: Context) -> str | None:
    need = max(job.needs, job.gpus)
    if ctx.gpus < need:
        return f"needs {need} GPU{'s' if need > 1 else ''}{': ' + job.why if job.why else ''}"
    if job.needs_te and not ctx.have_te:
        return "Transformer Engine is not installed"
    return None


def _units(runnable: list[Job], gpus: int) -> list[list[Job]]:
    """Consecutive jobs of one ``together`` tag as one unit where the node has GPUs for all of them."""
    units: list[list[Job]] = []
    for job in runnable:
        last = units[-1] if units else []
        if (job.together and last and last[0].together == job.together
                and sum(j.gpus for j in last) + job.gpus <= gpus):
            last.append(job)
        else:
            units.append([job])
    return units


def _select(ctx: Context, plan: Plan, full: bool, only: Sequence[str] | None) -> list[Job]:
    """The jobs to place; the others go to ``plan``'s opt-in and skipped lists."""
    every = jobs(ctx)
    if only is not None:
        unknown = set(only) - {j.key for j in every}
        if unknown:
            raise ValueError(f"unknown step(s) {', '.join(sorted(unknown))}; choose from "
                             f"{', '.join(j.key for j in every)}")
    runnable = []
    for job in every:
        if only is not None and job.key not in only:
            continue
        if job.full and not full and only is None:
            plan.opt_in.append(job)
        elif (why := _unrunnable(job, ctx)) is not None:
            plan.skipped.append((job, why))
        else:
            runnable.append(job)
    return runnable


def make_plan(ctx: Context, *, full: bool = False, budget_s: float = BUDGET_S,
              only: Sequence[str] | None = None) -> Plan:
    """Pack the jobs for ``ctx.gpus`` GPUs (module doc). ``only``: these job keys, never deferred."""
    plan = Plan(ctx.gpus, budget_s, [], [], [], [])
    for unit in _units(_select(ctx, plan, full, only), ctx.gpus):
        index, cost = _place(plan.steps, unit, ctx.gpus)
        if only is None and plan.critical_s + cost > budget_s:
            plan.deferred += [(job, f"no room in the {budget_s:g}-s plan (it would take {plan.critical_s + cost:g} "
                                    f"s); run it with --steps {job.key}") for job in unit]
            continue
        if index == len(plan.steps):
            plan.steps.append(Step())
        step = plan.steps[index]
        for job in unit:
            ids = tuple(step.free(ctx.gpus)[:job.gpus])
            step.placed.append(Placed(job, ids, job.build(ctx, ids)))
    return plan


def describe_gpus(ids: tuple[int, ...]) -> str:
    """``no GPU``, ``GPU 0`` or ``GPUs 0,1``."""
    return "no GPU" if not ids else f"GPU{'s' if len(ids) > 1 else ''} {','.join(map(str, ids))}"


def render(plan: Plan) -> list[str]:
    """The plan as lines: every step with its timeout, parallel groups, jobs and commands, then what
    is skipped, deferred or opt-in, then the critical path."""
    lines = []
    for i, step in enumerate(plan.steps, 1):
        groups = " | ".join(describe_gpus(p.gpus) for p in step.placed)
        lines.append(f"step {i} of {len(plan.steps)} (timeout {step.timeout_s:g} s"
                     f"{', alone on the node' if step.isolated else ''}): parallel groups: {groups}")
        for p in step.placed:
            lines.append(f"  [{p.job.key}] {p.job.title} ({describe_gpus(p.gpus)}; timeout {p.job.timeout_s:g} s)")
            lines += [f"  + {c.shell()}" for c in p.commands]
    lines += [f"skipped: [{j.key}] {j.title} ({why})" for j, why in plan.skipped]
    lines += [f"deferred: [{j.key}] {j.title} ({why})" for j, why in plan.deferred]
    lines += [f"opt-in (--full): [{j.key}] {j.title} (timeout {j.timeout_s:g} s)" for j in plan.opt_in]
    terms = " + ".join(f"{s.timeout_s:g}" for s in plan.steps) or "0"
    verdict = "within" if not plan.over_budget else "ABOVE"
    lines.append(f"planned critical path: {plan.critical_s:g} s = {terms} (the steps' timeouts; parallel jobs "
                 f"counted once), {verdict} the budget of {plan.budget_s:g} s; at most {plan.worst_s:g} s with "
                 f"{KILL_GRACE_S:g} s to stop each step's killed jobs")
    return lines
