"""Vocabulary parallelism (Yeung et al., MLSys 2025) for the searched families: ``zb-vocab-1/2``,
``zb-1p-vocab-1/2``, ``zb-2p-vocab-1/2`` (the greedy scheduler, plain placement) and
``v-half-vocab-1/2``, ``v-min-vocab-1/2`` (the memory-controllable V's) -- the family's own order with
the passes ``IF``/``S``/``T``/``IB`` of every rank placed in it (docs/vocab_parallel_schedules.md).

**One rule for every family.** The last stage's backward of microbatch ``i`` waits for the barriers
(``S(i)`` everywhere and ``C1``; with Vocab-1 also ``T(i)`` and ``C2``), so, as 1F1B gets
``barriers`` more warm-up forwards (:mod:`.vocab`) and ZB-V ``extra`` more ``(F1, F0)`` pairs
(:mod:`.vocab_v`), every rank keeps ``extra`` more microbatches in flight:

1. the base family's order, built by its own generator without the passes (its search, its default
   memory limit), for the transformer costs of ``costs``;
2. deepened by ``extra`` microbatches (:func:`~.vocab.deepen`: every rank's forwards run
   ``extra x chunks`` forwards earlier -- ``chunks`` = 1 plain, 2 on the V -- the other actions keep
   their order; on 1F1B's order this is exactly ``1f1b-vocab``'s warm-up);
3. the passes placed where ready (:func:`~.vocab.place_vocab_passes`);
4. ``extra = 0 .. barriers``, the smallest within :data:`~.vocab.EXTRA_GAIN` of the fastest
   (:func:`~.vocab.least_extra`, the rule ``zbv-vocab`` uses; ``meta['extra_warmup']``).

The base orders keep the first stage's backwards and the last stage's forwards in microbatch order
(the greedy scheduler and the V's list scheduler run each stage's ``F`` and ``B`` in microbatch
order), which the runtime's broadcasts need; :func:`vocab_family` refuses a base order that does not.

**Memory: the family's limit plus ``extra`` microbatches.** Let ``L`` be the family's limit (its
default, e.g. ``2p M_B`` for ``zb-2p``, ``(p/2 + 1)/p x R`` for ``v-half``) and ``M`` one
microbatch's share of a rank, ``chunks x max(mem_b)`` (plain: ``M_B``; V: two chunk ``M_B``). Without
an explicit limit the base is built at ``L`` and the result peaks at most at ``L + extra x M``
(:func:`~.vocab.deepen`'s bound; ``extra <= barriers``), plus ``mem_s`` for each ``S`` whose ``T`` has
not run -- the paper's ``p + 1`` / ``p + 2`` generalised (1F1B: ``L = p M_B``). An explicit
``memory_limit`` ``X`` (or ``costs.memory_limit``) caps the whole peak, as ``zbv-vocab``'s does: the base
for ``extra`` is built at ``X - extra x M - k x mem_s`` for ``k = 0 .. barriers + 1`` (room for ``k``
slices' ``S`` in flight, which the base order fills up to ``X`` otherwise; ``mem_s`` the largest rank's;
``k = 0`` only without ``mem_s``; a limit below the family's minimum is skipped, and ``X`` itself below it
refused) and only the results whose simulated peak fits ``X`` are kept, the fastest of them per ``extra``.
"""

from __future__ import annotations

from ..catalog import SCHEDULES, register
from ..costs import CostModel
from ..ir import VOCAB_OPS, Action, Op, Placement, Schedule, ScheduleError, make_schedule, plain_placement, v_placement
from .common import check_cost_model, check_count
from .vocab import VARIANT_BARRIERS, check_variant, deepen, least_extra
from .vshape import check_v_chunks

__all__ = ["BASES", "vocab_family"]

BASES = ("zb", "zb-1p", "zb-2p", "v-half", "v-min")
"""The families registered here with ``-vocab-1`` and ``-vocab-2`` (plain: the greedy ``zb``'s; V: the
memory-controllable ones; ``zbv-vocab`` keeps the hand-made order of :mod:`.vocab_v`)."""


def _base_order(base: str, p: int, m: int, costs: CostModel, limit: float | None) -> Schedule:
    """The base family's schedule, built by its registered generator; it must keep the first stage's
    backwards and the last stage's forwards in microbatch order (the runtime's broadcasts need it)."""
    spec = SCHEDULES[base]
    sched = spec.build(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=limit, num_chunks=2)
    last = sched.num_stages - 1
    for stage, ops in ((0, (Op.B, Op.BW)), (last, (Op.F,))):
        mbs = [a.mb for a in sched.ranks[sched.stage_to_rank[stage]] if a.op in ops and a.stage == stage]
        if mbs != sorted(mbs):   # pragma: no cover - both generators run a stage's F and B in order
            raise ScheduleError(f"{base}'s order runs stage {stage}'s {ops[0].value}'s out of microbatch order "
                                f"(p={p}, m={m}); {base}-vocab needs them in order")
    return sched


def vocab_family(base: str, *, num_ranks: int, num_microbatches: int, variant: int = 1,
                 costs: CostModel | None = None, memory_limit: float | None = None) -> Schedule:
    """``{base}-vocab-{variant}``: the family ``base`` (one of :data:`BASES`) with vocabulary parallelism
    (module docstring).

    Args:
        variant: the paper's ``1`` (Vocab-1: two all-reduce barriers) or ``2`` (Vocab-2: one).
        costs: per-stage costs (``2p`` stages on the V) and ``costs.vocab``; default ``CostModel()``.
        memory_limit: per-rank activation cap in the unit of ``costs.mem_b`` (``None``:
            ``costs.memory_limit``, else the family's default limit plus ``extra`` microbatches).

    Raises:
        ScheduleError: bad sizes, costs, variant or family; a limit below the family's minimum, or no
            ``extra`` fits it.
    """
    if base not in BASES:
        raise ScheduleError(f"no vocabulary-parallel form of {base!r}; choose one of: {', '.join(BASES)}")
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    vb = check_variant(variant)
    costs = check_cost_model(costs or CostModel())
    spec = SCHEDULES[base]
    chunks = spec.chunks_per_rank(2)
    n = chunks * p
    per_mb = chunks * max(costs.resolve(n).mem_b)          # M: one microbatch's share of a rank
    cap = memory_limit if memory_limit is not None else costs.memory_limit
    name = f"{base}-vocab-{variant}"
    mem_s = max(costs.vocab.resolve(p).mem_s) if costs.vocab is not None else 0.0
    built: dict[int, list[Schedule]] = {}   # extra -> the distinct base orders tried, limits descending

    def base_for(extra: int) -> list[list[list[Action]]]:
        if cap is None:
            if 0 not in built:
                built[0] = [_base_order(base, p, m, costs, None)]
            return [deepen(built[0][0].ranks, extra)]
        tried = built[extra] = []
        for k in range(vb + 2 if mem_s > 0 else 1):   # room for k slices' S in flight (module doc)
            try:
                sched = _base_order(base, p, m, costs, cap - extra * per_mb - k * mem_s)
            except ScheduleError:
                if extra == 0 and k == 0:
                    raise
                break   # the family's minimum is above this limit
            if not tried or sched.ranks != tried[-1].ranks:
                tried.append(sched)
        return [deepen(sched.ranks, extra) for sched in tried]

    s2r = v_placement(p) if spec.placement is Placement.V else plain_placement(p)
    extra, ranks, makespan = least_extra(base_for, s2r, m, costs, vb, name=name, memory_limit=cap,
                                         what=f"{base}'s order at its least limit")
    order = [[a for a in r if a.op not in VOCAB_OPS] for r in ranks]   # the chosen base, deepened
    chosen = next(b for b in built[extra if cap is not None else 0] if deepen(b.ranks, extra) == order)
    limit = chosen.meta.get("memory_limit")
    return make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name=name, vocab_barriers=vb,
                         variant=variant, extra_warmup=extra, makespan=makespan, base_memory_limit=limit)


# ---------------------------------------------------------------------------- registration
def _register(base: str, variant: int) -> None:
    spec = SCHEDULES[base]
    what = "two all-reduce barriers (C1, C2)" if variant == 1 else "one all-reduce barrier (C1)"

    @register(f"{base}-vocab-{variant}",
              f"{base} with vocabulary parallelism, Vocab-{variant}: {what}, peak at most {base}'s limit plus "
              f"{VARIANT_BARRIERS[variant]} microbatch(es)", placement=spec.placement, split_backward=True,
              cost_aware=True, vocab_parallel=True)
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
              num_chunks: int) -> Schedule:
        if spec.placement is Placement.V:
            check_v_chunks(num_chunks)
        return vocab_family(base, num_ranks=num_ranks, num_microbatches=num_microbatches, variant=variant,
                            costs=costs, memory_limit=memory_limit)


for _base in BASES:
    for _v in (1, 2):
        _register(_base, _v)
