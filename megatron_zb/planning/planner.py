"""Build and simulate every schedule family for one model, layout and GPU; pick the recommendation.

Per family: the placement's stages get their layers (:mod:`.layout`), each stage its ``T_F``,
``T_B``, ``T_W`` (ms) and ``M_B``, ``M_W`` (bytes) -- estimated (:mod:`.flops`, :mod:`.memory`),
or measured (:mod:`.profile`) -- the schedule is built by the registry with its own default
memory limit, and simulated. One iteration is predicted as::

    iteration_time = makespan (simulator; the zero-bubble paper's cost, the period of a training
                     loop whose optimizer step does not synchronise the pipeline)
                   + optimizer step (46 bytes of HBM traffic per parameter: mixed-precision Adam,
                     grad-norm, unscale, 16-bit copy, zeroing; 36 in fp32: no unscale, no copy)
                   + data-parallel gradient all-reduce (fp32, ring, not overlapped; 0 with DP 1)

From a profile that measured them (:mod:`.profile`): every compute action lasts its measured cost
plus the profile's ``action_overhead_ms`` (the runtime's own time per action, fused ``BW`` counted
once), and the profile's ``step_ms`` (everything outside the schedule's actions, measured) replaces
the optimizer and all-reduce estimates when the plan keeps the profile's DP size and optimizer
(``step_source`` says which: ``"profile"`` or ``"estimate"``). When the profile also measured how
single action durations vary (its ``duration_spread``), the makespan is the median over seeded draws
of every action's duration from that spread (:func:`~megatron_zb.schedules.spread.simulate_spread`;
:data:`SPREAD_DRAWS` iterations), longer than the makespan of the median durations because an
iteration waits for the later of two varying actions at every cross-rank dependency; the
difference is ``duration_spread_ms``.

and throughput = ``m * micro_batch_size / iteration_time / (PP * TP)`` samples per second per
GPU. Peak memory per rank = the simulator's peak activation memory + the rank's parameters and
optimizer state; a family *fits* when the largest rank's total is at most the GPU's usable
memory, ``memory_fraction`` (default 0.9) of it: the rest is left for what the estimate does not
count (CUDA context, communication buffers, transient tensors, allocator fragmentation).
The recommendation is the fastest family that fits (ties: less memory, then a named family over
``zb`` with a limit).

``zb`` (the greedy scheduler under an explicit limit) is planned with the largest number ``N``
of microbatches' activations that fits the usable memory next to the parameters on every rank (its report names
``N``: ``pretrain_gpt_zb.py --schedule zb --zero-bubble-max-pending-backward N``); so are its
vocabulary-parallel forms ``zb-vocab-1|2`` (``N`` from their own parameters and stage ``M_B``, the
limit ``N x M_B`` capping their whole peak, the passes' included: ``vocab_family``). ``N x M_B`` rounds
the peak down to whole microbatches, so the family's default limit is simulated too and taken -- the
report then names no ``N`` -- when it fits and is faster.

Families left out by default, each listed in the plan with the reason: the exact CP-SAT
schedules (``zb-optimal``, ``zbv-optimal``: minutes beyond small ``p`` and ``m``), and the
search-based multi-chunk generators (cost-aware with interleaved or V placement) when
``stages * m`` exceeds :data:`SEARCH_LIMIT`. ``schedules=[...]`` runs exactly the named ones.
The vocabulary-parallel schedules (``ScheduleSpec.vocab_parallel``: every ``BASE-vocab-1|2`` in the
catalogue) are planned with ``enable_vocab_parallel=True`` (``plan --enable-vocab-parallel``) and
listed as skipped otherwise: their stages hold no word embedding and no output layer, every rank runs
its slice's passes with :mod:`.vocab`'s costs and holds its slice's parameters; each is reported
beside its base family (``FamilyResult.vocab_base``). With a profile they are skipped (it has no
measured costs for the passes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megatron_zb.schedules import CostModel, Placement, ScheduleError, SimResult, interleaved_placement, simulate
from megatron_zb.schedules.limits import count_that_fit
from megatron_zb.schedules.limits import fits as fits_limit
from megatron_zb.schedules.registry import ScheduleSpec, build_schedule, get_spec, schedule_names
from megatron_zb.schedules.spread import simulate_spread

from .flops import p2p_time_ms, stage_costs
from .hardware import Hardware
from .layout import StageShape, layers_per_stage, stage_shapes
from .memory import GIB, bytes_per_parameter, stage_activations, stage_parameters
from .model_flops import planned_flops_shape, tflops_per_gpu
from .model import PlanError, PlanLayout, PlanModel
from .profile import Profile
from .sharded import GroupRow, ShardedStage, choose_group, plan_groups, rank_model_state, sharded_stage
from .vocab import base_family, vocab_pass_costs, vocab_variant

SEARCH_LIMIT = 2048  # stages * microbatches above which multi-chunk search generators take minutes
OPTIMIZER_BYTES_PER_PARAM = {"bf16": 46.0, "fp16": 46.0, "fp32": 36.0}
"""HBM traffic of one optimizer step per parameter, by precision (module doc)."""
GRAD_ALLREDUCE_BYTES_PER_PARAM = 4.0
DEFAULT_MEMORY_FRACTION = 0.9
SPREAD_DRAWS = 128
"""Iterations drawn from a profile's duration spread per family (seed 0: the plan is reproducible)."""


@dataclass(frozen=True)
class StageTable:
    """Costs of every stage of one placement.

    Attributes:
        shapes: what each stage holds.
        t_f, t_b, t_w: ms per microbatch, per stage.
        mem_b, mem_w: activation bytes per microbatch, per stage.
        params: parameters per stage (one GPU).
        source: ``"estimate"``, ``"profile"`` (measured) or ``"scaled estimate"`` (estimate times
            the profile's measured/estimated ratio).
    """

    shapes: tuple[StageShape, ...]
    t_f: tuple[float, ...]
    t_b: tuple[float, ...]
    t_w: tuple[float, ...]
    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    params: tuple[float, ...]
    source: str

    def cost_model(self, t_comm_ms: float, vocab: Any = None) -> CostModel:
        """The simulator's costs of these stages (compute only: no action overhead), ``t_comm_ms`` per transfer."""
        return CostModel(t_f=list(self.t_f), t_b=list(self.t_b), t_w=list(self.t_w), t_comm=t_comm_ms,
                         mem_b=list(self.mem_b), mem_w=list(self.mem_w), vocab=vocab)

    def rank_params(self, pp: int, every_rank: float = 0.0) -> list[float]:
        """Parameters per pipeline rank (one GPU): its stages', plus ``every_rank`` (e.g. vocabulary slices)."""
        out = [every_rank] * pp
        for sh, n in zip(self.shapes, self.params):
            out[sh.rank] += n
        return out


def _same_step(measured: PlanLayout, planned: PlanLayout) -> bool:
    """Whether a profile's measured step time applies: same DP size, optimizer and sharding (the reduces and
    the optimizer's share of the parameters are the measured ones)."""
    def key(p: PlanLayout) -> tuple:
        return p.dp, p.use_distributed_optimizer, p.data_parallel_sharding_strategy == "optim_grads"
    return key(measured) == key(planned)


class CostSource:
    """Stage tables for any placement: estimates, or a profile (measured for its own placement,
    estimates scaled by measured/estimated totals for the others)."""

    def __init__(self, model: PlanModel, par: PlanLayout, hw: Hardware, profile: Profile | None = None,
                 memory_fraction: float = DEFAULT_MEMORY_FRACTION):
        self.model, self.par, self.hw, self.profile = model, par, hw, profile
        self.usable_bytes = memory_fraction * hw.memory_gib * GIB
        self.t_comm_ms = p2p_time_ms(model, par, hw) if profile is None else profile.t_comm_ms
        self.action_overhead_ms = 0.0 if profile is None else profile.action_overhead_ms or 0.0
        self.spread = None if profile is None else profile.duration_spread
        self.step_ms = None  # the measured time outside the schedule, when it applies to this plan
        if profile is not None and profile.step_ms is not None and _same_step(profile.parallel, par):
            self.step_ms = profile.step_ms
        self.scale = {k: 1.0 for k in ("t_f", "t_b", "t_w", "mem_b", "mem_w")}
        if profile is not None:
            est = self.estimate(Placement(profile.placement), len(profile.stages) // par.pp)
            for key, attr in (("t_f", "t_f_ms"), ("t_b", "t_b_ms"), ("t_w", "t_w_ms"), ("mem_b", "mem_b_bytes"),
                              ("mem_w", "mem_w_bytes")):
                total = sum(getattr(est, key))
                self.scale[key] = sum(getattr(s, attr) for s in profile.stages) / total if total else 1.0

    def estimate(self, placement: Placement, chunks: int, *, vocab_parallel: bool = False) -> StageTable:
        """Estimated costs; ``vocab_parallel``: the stages without the word embedding and the output layer."""
        shapes = stage_shapes(num_layers=self.model.num_layers, pp=self.par.pp, placement=placement, chunks=chunks,
                              split=self.par.split)
        vp = vocab_parallel
        costs = stage_costs(self.model, self.par, self.hw, shapes, vocab_parallel=vp)
        acts = [stage_activations(self.model, self.par, s, vocab_parallel=vp) for s in shapes]
        return StageTable(tuple(shapes), tuple(c.f.time_ms for c in costs), tuple(c.b.time_ms for c in costs),
                          tuple(c.w.time_ms for c in costs), tuple(a.mem_b for a in acts),
                          tuple(a.mem_w for a in acts),
                          tuple(stage_parameters(self.model, self.par, s, vocab_parallel=vp) for s in shapes),
                          "estimate")

    def table(self, placement: Placement, chunks: int) -> StageTable:
        """Costs for ``placement`` (``chunks`` per rank); ``ValueError`` if the layers do not split."""
        est = self.estimate(placement, chunks)
        prof = self.profile
        if prof is None:
            return est
        if prof.placement == placement and len(prof.stages) == len(est.shapes):
            st = prof.stages
            return StageTable(est.shapes, tuple(s.t_f_ms for s in st), tuple(s.t_b_ms for s in st),
                              tuple(s.t_w_ms for s in st), tuple(s.mem_b_bytes for s in st),
                              tuple(s.mem_w_bytes for s in st), est.params, "profile")
        k = self.scale
        return StageTable(est.shapes, *(tuple(x * k[key] for x in getattr(est, key))
                                        for key in ("t_f", "t_b", "t_w", "mem_b", "mem_w")),
                          est.params, "scaled estimate")


@dataclass
class FamilyResult:
    """One schedule family's prediction (``status`` ``"ok"``) or why there is none.

    Attributes:
        name: registry name (as ``megatron-zb list`` prints it).
        status: ``"ok"``, ``"skipped"`` (not applicable / left out, see ``reason``) or ``"failed"``
            (the generator refused; ``reason`` has its message).
        reason: why not ``"ok"``, or a note (e.g. the chunks chosen).
        chunks: model chunks per rank.
        iteration_time_ms, makespan_ms, optimizer_ms, dp_sync_ms: ms (see the module doc); with a
            measured ``step_ms``, ``optimizer_ms`` is it and ``dp_sync_ms`` is 0 (included).
        step_source: ``"profile"`` (the measured ``step_ms``) or ``"estimate"``.
        duration_spread_ms: with a profile's ``duration_spread``, the median makespan over the draws
            minus ``makespan_ms`` (the makespan of the median durations), ms, included in
            ``iteration_time_ms``; ``None`` without a spread.
        bubble_rate: the simulator's ``(makespan - busiest rank's work) / makespan``.
        throughput: samples per second per GPU.
        model_tflops_per_gpu: the model TFLOP/s per GPU ``--log-throughput`` would print at this
            iteration time (:mod:`.model_flops`, Megatron-LM's formula).
        peak_activation_gib, param_optimizer_gib, peak_memory_gib: of the rank with the largest
            total (GiB); the first two are each the maximum over ranks.
        peak_memory_per_rank_gib, peak_activation_per_rank_gib, param_optimizer_per_rank_gib: the
            same per pipeline rank (GiB; total = activation + parameters and optimizer state), what a
            measured per-rank peak compares with (``scripts/gpu_selftest.sh``'s memory step).
        fits: ``peak_memory_gib <= memory_fraction * GPU memory``.
        memory_limit_n: for ``zb`` and ``zb-vocab-1|2``, the ``--zero-bubble-max-pending-backward``
            value planned.
        vocab_base: for a vocabulary-parallel family, the family it is compared with (``zb-h1`` for
            ``zb-h1-vocab-1``); ``None`` otherwise.
        wgrad_group: with sharded gradients (``optim_grads``), the W group size ``k`` the family's numbers are
            for (given, or recommended: :mod:`.sharded`); ``None`` otherwise.
        wgrad_groups: with sharded gradients, the distributed optimizer's row and one per candidate ``k``
            (:class:`~.sharded.GroupRow`); not serialised as such (the report's ``wgrad_groups``).
        cost_source: where the stage costs came from (:class:`StageTable`).
        seconds: wall time spent building and simulating.
        result: the simulation (for plots), not serialised.
    """

    name: str
    status: str
    reason: str | None = None
    chunks: int = 1
    iteration_time_ms: float | None = None
    makespan_ms: float | None = None
    optimizer_ms: float | None = None
    dp_sync_ms: float | None = None
    step_source: str | None = None
    duration_spread_ms: float | None = None
    bubble_rate: float | None = None
    throughput: float | None = None
    model_tflops_per_gpu: float | None = None
    peak_activation_gib: float | None = None
    param_optimizer_gib: float | None = None
    peak_memory_gib: float | None = None
    peak_memory_per_rank_gib: list[float] | None = None
    peak_activation_per_rank_gib: list[float] | None = None
    param_optimizer_per_rank_gib: list[float] | None = None
    fits: bool | None = None
    memory_limit_n: int | None = None
    vocab_base: str | None = None
    wgrad_group: int | None = None
    wgrad_groups: list[GroupRow] | None = field(default=None, repr=False)
    cost_source: str | None = None
    seconds: float = 0.0
    result: SimResult | None = field(default=None, repr=False)


@dataclass
class Plan:
    """Everything ``plan`` predicts.

    Attributes:
        model, parallel, hardware: the inputs.
        t_comm_ms: one stage-to-stage transfer, ms.
        stages: the plain placement's stage costs (the table printed above the schedules).
        families: one entry per registered schedule, registry order.
        recommended: the fastest family that fits, or ``None`` if none fits.
        profile: the profile used, or ``None``.
        memory_fraction: part of the GPU memory a plan may use.
        action_overhead_ms: added to every compute action's duration, ms (a profile's measured
            runtime overhead; 0 otherwise).
        vocab_parallel: whether the vocabulary-parallel families were planned.
    """

    model: PlanModel
    parallel: PlanLayout
    hardware: Hardware
    t_comm_ms: float
    stages: StageTable
    families: list[FamilyResult]
    recommended: str | None
    profile: Profile | None = None
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    action_overhead_ms: float = 0.0
    vocab_parallel: bool = False


def family_names(requested: Sequence[str] | None) -> list[str]:
    """Registered names to plan: all (``None``) or the requested ones, checked."""
    names = schedule_names()
    if requested is None:
        return names
    unknown = [n for n in requested if n not in names]
    if unknown:
        raise PlanError("--schedules", f"unknown schedule(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    return [n for n in names if n in requested]


def _interleaved_chunks(model: PlanModel, par: PlanLayout) -> int:
    """``--num-virtual-stages-per-pipeline-rank``, else the smallest v >= 2 the layers split into."""
    if par.num_virtual_stages is not None:
        return par.num_virtual_stages
    for v in range(2, model.num_layers // par.pp + 1):
        try:
            layers_per_stage(model.num_layers, interleaved_placement(par.pp, v), par.split)
            return v
        except ValueError:
            continue
    return 2  # none splits: the family is reported as not applicable with v = 2's reason


def plan(*, model: PlanModel, parallel: PlanLayout, hardware: Hardware, schedules: Sequence[str] | None = None,
         profile: Profile | None = None, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
         progress: Callable[[str, int, int], None] | None = None, enable_vocab_parallel: bool = False) -> Plan:
    """Predict every schedule family (see the module doc); ``enable_vocab_parallel`` plans the
    vocabulary-parallel ones too.

    ``progress(name, i, n)`` is called before the ``i``-th of ``n`` families is planned.
    """
    if not 0 < memory_fraction <= 1:
        raise PlanError("--memory-fraction", f"must be in (0, 1], got {memory_fraction:g}")
    names = family_names(schedules)
    source = CostSource(model, parallel, hardware, profile, memory_fraction)
    families = []
    for i, name in enumerate(names):
        if progress is not None:
            progress(name, i + 1, len(names))
        t0 = time.perf_counter()
        fam = _plan_family(name, source, explicit=schedules is not None, vocab=enable_vocab_parallel)
        fam.seconds = time.perf_counter() - t0
        families.append(fam)
    ok = [f for f in families if f.status == "ok" and f.fits]
    best = min(ok, key=lambda f: (round(f.iteration_time_ms, 6), round(f.peak_memory_gib, 6),
                                  f.memory_limit_n is not None), default=None)  # ties: a named family over zb
    return Plan(model, parallel, hardware, source.t_comm_ms, source.table(Placement.PLAIN, 1), families,
                best.name if best else None, profile, memory_fraction, source.action_overhead_ms,
                enable_vocab_parallel)


def _plan_family(name: str, source: CostSource, *, explicit: bool, vocab: bool) -> FamilyResult:
    model, par = source.model, source.par
    spec = get_spec(name)
    placement = Placement(spec.placement)
    chunks = (_interleaved_chunks(model, par) if placement is Placement.INTERLEAVED
              else placement.chunks_per_rank(1))
    if not explicit and spec.excluded_from_plan is not None:
        return FamilyResult(name, "skipped", f"{spec.excluded_from_plan}; request it with --schedules", chunks)
    if spec.vocab_parallel and not vocab:
        return FamilyResult(name, "skipped", "vocabulary-parallel schedule: plan it with --enable-vocab-parallel",
                            chunks)
    if spec.vocab_parallel and source.profile is not None:
        return FamilyResult(name, "skipped", "vocabulary-parallel schedule: a profile has no measured costs for "
                                             "the vocabulary passes; plan without --profile", chunks)
    why_not = _not_sharded(spec, placement, model, par)
    if why_not is not None:
        return FamilyResult(name, "skipped", why_not, chunks)
    try:
        table = (source.estimate(placement, chunks, vocab_parallel=True) if spec.vocab_parallel
                 else source.table(placement, chunks))
    except ValueError as e:
        return FamilyResult(name, "skipped", f"{placement.value} placement with {chunks} chunk(s) per rank: {e}",
                            chunks)
    size = len(table.shapes) * par.num_microbatches
    if not explicit and spec.cost_aware and placement != Placement.PLAIN and size > SEARCH_LIMIT:
        return FamilyResult(name, "skipped", f"search-based generator takes minutes at stages x m = {size} > "
                                             f"{SEARCH_LIMIT}; request it with --schedules {name}", chunks)
    passes = vocab_pass_costs(model, par, source.hw, variant=vocab_variant(name)) if spec.vocab_parallel else None
    compute = table.cost_model(source.t_comm_ms, None if passes is None else passes.costs())
    costs = compute.with_action_overhead(source.action_overhead_ms, split_backward=spec.split_backward)
    ranks = [r.rank for r in table.shapes]
    params = table.rank_params(par.pp, 0.0 if passes is None else passes.params)  # vocabulary slices: every rank
    sharded = ([sharded_stage(model, par, sh, tied_on_rank=placement is Placement.V) for sh in table.shapes]
               if par.data_parallel_sharding_strategy == "optim_grads" else None)
    param_bytes = [n * bytes_per_parameter(source.model, par) for n in params]
    if sharded is not None:  # every k keeps the same model state (sharded.plan_groups)
        param_bytes = rank_model_state(sharded, ranks, params, model, par, sharded=True)
    limit, n_limit = None, None
    if _limited_by_free_memory(name):
        free = source.usable_bytes - max(param_bytes)
        n_limit = count_that_fit(free, max(table.mem_b)) if free > 0 else 0
        if n_limit < 1:
            return FamilyResult(name, "skipped", "not even one microbatch's activations fit next to the "
                                                 "parameters and optimizer state", chunks)
        limit = n_limit * max(table.mem_b)
    try:
        sched = build_schedule(name, num_ranks=par.pp, num_microbatches=par.num_microbatches, costs=costs,
                               memory_limit=limit, num_chunks=chunks)
        res = simulate(sched, costs)
        if limit is not None:  # N x M_B rounds the peak down: the default limit when it fits and is faster
            default = build_schedule(name, num_ranks=par.pp, num_microbatches=par.num_microbatches, costs=costs,
                                     num_chunks=chunks)
            d_res = simulate(default, costs)
            if d_res.makespan < res.makespan and fits_limit(max(_rank_totals(d_res, param_bytes)), source.usable_bytes):
                sched, res, n_limit = default, d_res, None
    except ImportError as e:
        return FamilyResult(name, "skipped", f"its generator cannot be imported here ({e})", chunks)
    except (ScheduleError, ValueError) as e:
        return FamilyResult(name, "failed", " ".join(str(e).split()), chunks)
    assert ranks == sched.stage_to_rank, "placement of the stage table and of the schedule differ"
    spread_ms = None
    if source.spread is not None:  # the compute alone: simulate_spread adds the overhead after the draw
        drawn = simulate_spread(res.schedule, compute, source.spread, action_overhead=source.action_overhead_ms,
                                draws=SPREAD_DRAWS)
        spread_ms = drawn.median - res.makespan
    if sharded is not None:
        return _sharded_family(name, chunks, res, costs, sharded, ranks, params, table, source, n_limit)
    fam = _metrics(name, chunks, res, params, param_bytes, table, source, n_limit, spread_ms)
    fam.vocab_base = base_family(name) if spec.vocab_parallel else None
    return fam


def _not_sharded(spec: ScheduleSpec, placement: Placement, model: PlanModel, par: PlanLayout) -> str | None:
    """Why a family is not planned with sharded gradients (what ``pretrain_gpt_zb.py`` refuses), or ``None``."""
    if par.data_parallel_sharding_strategy != "optim_grads":
        return None
    if not spec.split_backward:
        return "fuses its backward: sharded gradients reduce each bucket after W groups (a split backward)"
    if spec.vocab_parallel:
        return "vocabulary parallelism is not served with sharded gradients yet"
    if not model.untie_embeddings_and_output_weights and placement is not Placement.V:
        return ("its word embedding is tied to the output layer on another rank: sharded gradients need "
                "--untie-embeddings-and-output-weights (or a V)")
    return None


def _sharded_family(name: str, chunks: int, res: SimResult, costs: CostModel, stages: list[ShardedStage], ranks: list[int],
                    params: list[float], table: StageTable, source: CostSource, n_limit: int | None) -> FamilyResult:
    """The family at its ``k`` (given or recommended), with every candidate's row (:mod:`.sharded`)."""
    optimizer_ms = _optimizer_ms(params, source)
    rows = plan_groups(res.schedule, costs, stages=stages, ranks=ranks, params=params, model=source.model,
                       par=source.par, hw=source.hw, optimizer_ms=optimizer_ms, usable_bytes=source.usable_bytes)
    pick = choose_group(rows) if source.par.wgrad_group is None else rows[-1]
    if pick is None:
        return FamilyResult(name, "skipped", "no W group size fits the memory with sharded gradients", chunks,
                            wgrad_groups=rows)
    fam = _metrics(name, chunks, pick.result, params, pick.model_state_bytes, table, source, n_limit, None,
                   dp_ms=pick.iteration_time_ms - pick.result.makespan - optimizer_ms)
    fam.wgrad_group, fam.wgrad_groups = pick.k, rows
    return fam


def _limited_by_free_memory(name: str) -> bool:
    """Whether ``name`` is planned under the free memory's limit (module doc): ``zb``, the greedy
    scheduler under an explicit limit, and its vocabulary-parallel forms ``zb-vocab-1|2`` (the same
    greedy order, the limit capping their whole peak)."""
    return "zb" in (name, base_family(name))


def _rank_totals(res: SimResult, param_bytes: list[float]) -> list[float]:
    """Per rank, the simulated peak activation bytes plus the parameter and optimizer bytes [bytes]."""
    return [a + p for a, p in zip(res.peak_memory, param_bytes)]


def _optimizer_ms(params: list[float], source: CostSource) -> float:
    """The optimizer step of the largest rank, ms: the profile's measured step, else the HBM estimate."""
    if source.step_ms is not None:
        return source.step_ms
    return max(params) * OPTIMIZER_BYTES_PER_PARAM[source.model.precision] / source.hw.hbm_bytes_per_ms


def _metrics(name: str, chunks: int, res: SimResult, params: list[float], param_bytes: list[float],
             table: StageTable, source: CostSource, n_limit: int | None, spread_ms: float | None, *,
             dp_ms: float | None = None) -> FamilyResult:
    """The family's result from its simulation; ``dp_ms`` replaces the estimated DP all-reduce (sharded
    gradients: the residual reduce, the groups' reduces being in ``res``)."""
    model, par, hw = source.model, source.par, source.hw
    optimizer_ms = _optimizer_ms(params, source)
    step_source = "profile" if source.step_ms is not None else "estimate"
    if dp_ms is None:
        dp_ms = (0.0 if par.dp == 1 or source.step_ms is not None else
                 max(params) * GRAD_ALLREDUCE_BYTES_PER_PARAM * 2 * (par.dp - 1) / par.dp / hw.dp_bytes_per_ms)
    iteration = res.makespan + (spread_ms or 0.0) + optimizer_ms + dp_ms
    totals = _rank_totals(res, param_bytes)
    peak = max(totals) / GIB
    return FamilyResult(
        name, "ok", None, chunks, iteration_time_ms=iteration, makespan_ms=res.makespan, optimizer_ms=optimizer_ms,
        dp_sync_ms=dp_ms, step_source=step_source, duration_spread_ms=spread_ms, bubble_rate=res.bubble_rate,
        throughput=par.num_microbatches * model.micro_batch_size / (iteration / 1000.0) / (par.pp * par.tp),
        model_tflops_per_gpu=tflops_per_gpu(
            planned_flops_shape(model, par.tp), batch_size=par.num_microbatches * model.micro_batch_size * par.dp,
            seconds_per_iteration=iteration / 1000.0, num_gpus=par.pp * par.tp * par.dp),
        peak_activation_gib=max(res.peak_memory) / GIB, param_optimizer_gib=max(param_bytes) / GIB,
        peak_memory_gib=peak, peak_memory_per_rank_gib=[t / GIB for t in totals],
        peak_activation_per_rank_gib=[a / GIB for a in res.peak_memory],
        param_optimizer_per_rank_gib=[p / GIB for p in param_bytes],
        fits=fits_limit(max(totals), source.usable_bytes), memory_limit_n=n_limit, cost_source=table.source, result=res)
