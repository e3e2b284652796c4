"""Zero-bubble flags: which schedule runs (``--enable-zero-bubble``, ``--zero-bubble-v-schedule``,
``--schedule``), its activation-memory limit, profiling window and optimizer post-validation;
their checks, the placement-derived sizes, and the unit-cost schedule built to check them."""

from __future__ import annotations

import argparse

from megatron_zb.planning.layout import LayerSplit, layers_per_stage
from megatron_zb.schedules.ir import Placement, Schedule, ScheduleError, vocab_passes_unsupported
from megatron_zb.schedules.registry import ScheduleSpec, build_schedule, get_spec, schedule_names, vocab_schedule_names

from .common import ArgumentError, flag, notice

__all__ = [
    "EXACT_MATCH_WITHOUT_POST_VALIDATION",
    "POST_VALIDATION_FALLBACK_CLEAN_ITERS",
    "POST_VALIDATION_WARMUP_ITERS",
    "V_MEM_SETUP_TO_SCHEDULE",
    "add_zero_bubble_args",
    "check_layers",
    "check_post_validation",
    "check_profile_out",
    "check_profiling_window",
    "check_schedule_builds",
    "check_vocab_parallel",
    "check_wgrad_group",
    "check_zero_bubble_options",
    "initial_schedule",
    "resolve_schedule",
    "select_schedule",
    "virtual_chunks_flag",
]


def _v_mem_setups() -> dict[str, str]:
    setups: dict[str, str] = {}
    for name in schedule_names():
        setup = get_spec(name).v_mem_setup
        if setup is not None:
            setups[setup] = name
    return setups


V_MEM_SETUP_TO_SCHEDULE: dict[str, str] = _v_mem_setups()
"""``--zero-bubble-v-schedule-mem-setup`` value -> schedule library name, in registration order: derived
from the registry (:attr:`~megatron_zb.schedules.catalog.ScheduleSpec.v_mem_setup`) at import."""

POST_VALIDATION_WARMUP_ITERS = 10
"""Default of ``--post-validation-warmup-iters`` [iterations]."""

POST_VALIDATION_FALLBACK_CLEAN_ITERS = 10
"""Default of ``--post-validation-fallback-clean-iters`` [iterations] (the zero-bubble paper's heuristic)."""

_POST_VALIDATION_TUNING = (("post_validation_warmup_iters", POST_VALIDATION_WARMUP_ITERS),
                           ("post_validation_fallback_clean_iters", POST_VALIDATION_FALLBACK_CLEAN_ITERS))

def add_zero_bubble_args(parser: argparse.ArgumentParser) -> None:
    names = schedule_names()
    g = parser.add_argument_group("zero bubble")
    g.add_argument("--enable-zero-bubble", action="store_true",
                   help="Use the greedy zero-bubble schedule (schedule 'zb'): backward split into B and W, "
                        "W filling pipeline bubbles, under --zero-bubble-max-pending-backward.")
    g.add_argument("--zero-bubble-v-schedule", action="store_true",
                   help="Use a V-shaped zero-bubble schedule (two model chunks per rank; needs "
                        "--pipeline-model-parallel-size > 1); memory setup from --zero-bubble-v-schedule-mem-setup.")
    g.add_argument("--zero-bubble-v-schedule-mem-setup", choices=tuple(V_MEM_SETUP_TO_SCHEDULE), default=None,
                   help="V schedule memory setup: zb (ZB-V, 1F1B's activation memory, default), half "
                        "(V-Half, about 1/2 of it), min (V-Min, about 1/3 of it).")
    g.add_argument("--zero-bubble-max-pending-backward", type=int, default=None,
                   help="Activation-memory limit of zero-bubble schedules, in micro batches of activations held "
                        "per pipeline rank. PP gives ZB-1p (1F1B's peak), 2*PP gives ZB-2p. Default: PP for "
                        "--enable-zero-bubble, the schedule's own default otherwise.")
    g.add_argument("--zero-bubble-wgrad-group", type=int, default=None, metavar="K",
                   help="Run each stage's weight-gradient passes (W) in groups of K micro batches, each group "
                        "layer-major (every layer's weight gradients of the K micro batches back to back; the "
                        "gradients are bitwise those of the ungrouped schedule). K must divide the number of "
                        "micro batches; a group holds its W inputs longer, so an explicit "
                        "--zero-bubble-max-pending-backward must leave room for it. Zero-bubble schedules only. "
                        "The step towards sharded gradients (docs/schedules.md \"Weight-gradient groups\"). "
                        "Default: W's run as the schedule places them.")
    g.add_argument("--zero-bubble-pipeline-timers-start-iter", type=int, default=2,
                   help="First iteration (1-based) in which F/B/W/communication times are profiled (default 2).")
    g.add_argument("--zero-bubble-pipeline-timers-end-iter", type=int, default=4,
                   help="Profiling stops before this iteration; cost-aware schedules are then rebuilt from "
                        "the measured costs (default 4).")
    g.add_argument("--profile-out", type=str, default=None, metavar="FILE",
                   help="After the profiling window, global rank 0 writes the measured per-stage T_F/T_B/T_W, "
                        "T_comm (ms), activation bytes M_B/M_W, the runtime's time per action, the time outside "
                        "the schedule, the spread of single action durations and every op's host and device time "
                        "per stage with its host-bound flag (action_times), with the model and parallel "
                        "flags, to FILE (JSON), the profile `megatron-zb plan --profile FILE` reads. Needs a "
                        "schedule that splits the backward and a dense model (no MoE); fp32, bf16 and fp16 "
                        "are accepted.")
    g.add_argument("--enable-optimizer-post-validation", action="store_true",
                   help="Step the optimizer before the global gradient checks (NaN/inf, grad-norm clipping) "
                        "finish and roll back when they fail, removing the synchronisation bubble "
                        "(zero-bubble schedules only). Tuned by --post-validation-warmup-iters and "
                        "--post-validation-fallback-clean-iters.")
    g.add_argument("--enable-exactly-numeric-match", action="store_true",
                   help="With post-validation, reproduce the numerics of the synchronous optimizer step "
                        "exactly (slower).")
    g.add_argument("--post-validation-warmup-iters", type=int, default=None, metavar="N",
                   help="With --enable-optimizer-post-validation: the first N iterations (optimizer steps) of "
                        "the run use megatron-core's synchronous optimizer step; post-validation starts at "
                        "iteration N+1. Counted from the start of each run, also after --load. 0 "
                        "post-validates from the first step. Iterations, >= 0 "
                        f"(default {POST_VALIDATION_WARMUP_ITERS}).")
    g.add_argument("--post-validation-fallback-clean-iters", type=int, default=None, metavar="N",
                   help="With --enable-optimizer-post-validation: after a step whose gradients were clipped or "
                        "held an inf/nan, fall back to megatron-core's synchronous optimizer step until N "
                        "consecutive steps were neither clipped nor inf/nan, then post-validate again. 0 never "
                        "falls back: every step after the warm-up is post-validated (clipped ones are redone). "
                        "Iterations, >= 0 "
                        f"(default {POST_VALIDATION_FALLBACK_CLEAN_ITERS}).")
    g.add_argument("--allow-padding-num-layers", action="store_true",
                   help="Allow --num-layers not divisible by the number of pipeline stages: the first and "
                        "last stage take fewer layers.")
    g.add_argument("--schedule", dest="schedule_requested", choices=names, default=None, metavar="NAME",
                   help=f"Use any schedule of the library directly: {', '.join(names)}. Not together with "
                        "--zero-bubble-v-schedule.")
    g.add_argument("--enable-vocab-parallel", action="store_true",
                   help="Vocabulary parallelism (Yeung et al., MLSys 2025): the word embedding and the output "
                        "layer with its cross entropy split evenly over the pipeline x tensor ranks, their passes placed "
                        f"by the schedule: needs --schedule {_vocab_names()} (-1: two barriers, -2: one); "
                        "tied or untied embeddings; "
                        "pipeline, tensor (with or without --sequence-parallel) and data parallelism (no context "
                        "parallelism), fp32, --bf16 or --fp16, checkpoints, the distributed optimizer "
                        "(docs/vocab_parallel.md).")
    g.add_argument("--pipeline-timeout-seconds", type=float, default=300.0,
                   help="Timeout of pipeline point-to-point transfers, seconds (default 300).")


def select_schedule(args: argparse.Namespace) -> tuple[str | None, str]:
    """The schedule the zero-bubble flags ask for and the flag that chose it: ``--zero-bubble-v-schedule``
    (memory setup from ``--zero-bubble-v-schedule-mem-setup``; with ``--enable-zero-bubble`` too, as the
    zero-bubble fork reads the pair, logged), ``--schedule``, ``--enable-zero-bubble``; ``(None,
    "--schedule")`` when none does. Raises :class:`ArgumentError` for contradicting flags."""
    if args.zero_bubble_v_schedule_mem_setup is not None and not args.zero_bubble_v_schedule:
        raise ArgumentError("--zero-bubble-v-schedule-mem-setup",
                            "only applies to V schedules; add --zero-bubble-v-schedule or drop this flag")
    if args.zero_bubble_v_schedule:
        if args.schedule_requested is not None:
            raise ArgumentError("--zero-bubble-v-schedule",
                                "cannot be combined with --schedule; keep --zero-bubble-v-schedule (with "
                                "--zero-bubble-v-schedule-mem-setup) or --schedule, not both")
        name = V_MEM_SETUP_TO_SCHEDULE[args.zero_bubble_v_schedule_mem_setup or "zb"]
        if args.enable_zero_bubble:
            notice(args, f"--enable-zero-bubble --zero-bubble-v-schedule: the V schedule {name!r} (the zero-bubble "
                         f"fork's reading of the pair; --zero-bubble-v-schedule alone means the same)")
        return name, "--zero-bubble-v-schedule"
    if args.schedule_requested is not None:
        return args.schedule_requested, "--schedule"
    if args.enable_zero_bubble:
        return "zb", "--enable-zero-bubble"
    return None, "--schedule"


def _vocab_form(args: argparse.Namespace, name: str, selected_by: str | None) -> str:
    """``--enable-vocab-parallel`` without ``--schedule``: the vocabulary-parallel form of the family
    the other flags chose (``name``, chosen by the flag ``selected_by``; 1F1B and ``None`` without
    one), logged: Vocab-2 (one barrier, as
    VocabularyParallelism by default), Vocab-1 with ``--disable-backward-fusion``. ``name`` otherwise."""
    two_barriers = bool(getattr(args, "disable_backward_fusion", False))
    if two_barriers and not args.enable_vocab_parallel:
        raise ArgumentError("--disable-backward-fusion", "only applies with --enable-vocab-parallel; add it or drop "
                                                         "this flag")
    if not args.enable_vocab_parallel:
        return name
    form = "1" if two_barriers else "2"
    if selected_by == "--schedule":
        if two_barriers and not name.endswith("-vocab-1"):
            raise ArgumentError("--disable-backward-fusion", f"asks for a Vocab-1 schedule (two barriers), but "
                                                             f"--schedule is {name!r}; drop one of the two")
        return name
    vocab = f"{name}-vocab-{form}"
    if vocab not in schedule_names():
        raise ArgumentError("--enable-vocab-parallel", f"schedule {name!r} has no vocabulary-parallel form; "
                                                       f"choose --schedule {_vocab_names()}")
    by = selected_by or "no schedule flag (1F1B)"
    notice(args, f"--enable-vocab-parallel with {by}: schedule {vocab!r}, the family's Vocab-{form} form ("
                 + ("two all-reduce barriers, --disable-backward-fusion" if two_barriers else
                    "one all-reduce barrier, as VocabularyParallelism by default; --disable-backward-fusion: "
                    "Vocab-1") + ")")
    return vocab


def resolve_schedule(args: argparse.Namespace) -> ScheduleSpec:
    """Set ``args.schedule`` (and the placement-derived sizes); return the schedule's spec."""
    pp = args.pipeline_model_parallel_size
    chosen, selected_by = select_schedule(args)
    name = _vocab_form(args, chosen or "1f1b", selected_by if chosen else None)
    try:
        spec = get_spec(name)
    except ScheduleError as e:
        raise ArgumentError(selected_by, f"schedule {name!r} is not available in this installation ({e}); "
                                         f"choose another schedule") from None
    refusal = vocab_passes_unsupported(name=name, vocab_parallel=spec.vocab_parallel)
    if refusal is not None and not args.enable_vocab_parallel:
        raise ArgumentError(selected_by, refusal)
    if args.enable_zero_bubble and not spec.split_backward:
        raise ArgumentError("--schedule", f"{name!r} is not a zero-bubble schedule (it does not split the backward); "
                                          f"drop --enable-zero-bubble or choose a zero-bubble schedule")
    if spec.placement == Placement.V and pp == 1:
        raise ArgumentError(selected_by, f"the V schedule {name!r} needs --pipeline-model-parallel-size > 1 "
                                         f"(it places two model chunks per pipeline rank); raise PP or use "
                                         f"--enable-zero-bubble")
    chunks_flag, chunks_by = virtual_chunks_flag(args)
    if spec.placement == Placement.INTERLEAVED:
        chunks = chunks_flag if chunks_flag is not None else 2
        if chunks < 2:
            raise ArgumentError(chunks_by, f"interleaved schedule {name!r} needs >= 2 chunks per rank, got {chunks}")
    else:
        chunks = spec.chunks_per_rank(2)
        if chunks_flag is not None and chunks_flag != chunks:
            raise ArgumentError(chunks_by, f"schedule {name!r} uses {chunks} model chunk(s) per rank ({spec.placement} "
                                           f"placement); drop the flag or choose an interleaved schedule")
    args.schedule = name
    args.schedule_selected_by = selected_by
    args.schedule_placement = spec.placement
    args.split_backward = spec.split_backward
    args.schedule_cost_aware = spec.cost_aware
    args.num_model_chunks = chunks
    args.virtual_pipeline_model_parallel_size = chunks if chunks > 1 else None
    args.num_pipeline_stages = pp * chunks
    return spec


def virtual_chunks_flag(args: argparse.Namespace) -> tuple[int | None, str]:
    """Model chunks per rank the interleaving flags ask for (``None``: neither given) and the flag that
    asked: ``--num-virtual-stages-per-pipeline-rank``, or Megatron-LM's ``--num-layers-per-virtual-pipeline-stage
    N`` as Megatron-LM reads it (``num_layers / PP / N``, each ``--account-for-*-in-pipeline-split`` adding
    one layer; not with the other flag nor the uneven first/last stage flags; every division exact)."""
    per_chunk, flag = args.num_layers_per_virtual_pipeline_stage, "--num-layers-per-virtual-pipeline-stage"
    if per_chunk is None:
        return args.num_virtual_stages_per_pipeline_rank, "--num-virtual-stages-per-pipeline-rank"
    if args.num_virtual_stages_per_pipeline_rank is not None:
        raise ArgumentError(flag, "give it or --num-virtual-stages-per-pipeline-rank, not both (as Megatron-LM)")
    if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
        raise ArgumentError(flag, "with --decoder-first/last-pipeline-num-layers use "
                                  "--num-virtual-stages-per-pipeline-rank instead (as Megatron-LM)")
    pp = args.pipeline_model_parallel_size
    layers = args.num_layers + int(args.account_for_embedding_in_pipeline_split) + int(
        args.account_for_loss_in_pipeline_split)
    if layers % pp or (layers // pp) % per_chunk:
        raise ArgumentError(flag, f"{layers} layers over --pipeline-model-parallel-size {pp} do not split into "
                                  f"chunks of {per_chunk} layers; choose a divisor of {layers // pp} "
                                  f"(layers per pipeline rank) or --num-virtual-stages-per-pipeline-rank")
    return layers // pp // per_chunk, flag


def check_layers(args: argparse.Namespace) -> None:
    """Split ``--num-layers`` over the pipeline stages; sets ``num_layers_per_stage`` (stage order).

    The split is the one rule, :func:`megatron_zb.planning.layout.layers_per_stage` (the planner's
    too), on the schedule's placement: needs ``schedule_placement`` and ``num_model_chunks`` (set
    by :func:`resolve_schedule`). Raises :class:`ArgumentError` naming the flag to change.
    """
    split = LayerSplit(allow_padding=args.allow_padding_num_layers,
                       first_stage_layers=args.decoder_first_pipeline_num_layers,
                       last_stage_layers=args.decoder_last_pipeline_num_layers,
                       account_for_embedding=args.account_for_embedding_in_pipeline_split,
                       account_for_loss=args.account_for_loss_in_pipeline_split)
    pp = args.pipeline_model_parallel_size
    if split.uneven and pp == 1:
        raise ArgumentError(split.flag, "the pipeline-split flags need --pipeline-model-parallel-size > 1; drop them")
    ranks = Placement(args.schedule_placement).stage_to_rank(pp, args.num_model_chunks)
    try:
        args.num_layers_per_stage = layers_per_stage(args.num_layers, ranks, split)
    except ValueError as e:
        raise _split_error(args, split, len(ranks), e) from None


def _split_error(args: argparse.Namespace, split: LayerSplit, stages: int, e: ValueError) -> ArgumentError:
    """The user's error when ``--num-layers`` does not split over ``stages`` (``e``: the rule's message)."""
    if split.uneven:  # --decoder-first/last-pipeline-num-layers, --account-for-*
        return ArgumentError(split.flag, f"{e}; change the split flags so they add up to --num-layers "
                                         f"{args.num_layers}")
    what = (f"{stages} pipeline stages (PP {args.pipeline_model_parallel_size} x "
            f"{args.num_model_chunks} chunk(s) per rank for schedule {args.schedule!r})")
    if args.num_layers % stages and not args.allow_padding_num_layers:
        return ArgumentError("--num-layers",
                             f"{args.num_layers} layers cannot be split evenly over {what}; use a multiple of "
                             f"{stages} or add --allow-padding-num-layers (first/last stage take fewer layers)")
    return ArgumentError("--num-layers", f"{args.num_layers} layers cannot be split over {what} even with "
                                         f"--allow-padding-num-layers ({e}); use more layers or fewer stages")


def check_schedule_builds(args: argparse.Namespace, spec: ScheduleSpec) -> Schedule:
    """Resolve the memory limit and build the schedule with unit costs: it must exist.

    Sets ``zero_bubble_max_pending_backward`` and ``schedule_memory_limit``; returns the schedule.
    """
    pp, m = args.pipeline_model_parallel_size, args.num_microbatches
    n = args.zero_bubble_max_pending_backward
    explicit = getattr(args, "zero_bubble_max_pending_backward_given", n is not None)  # kept when validated again
    if explicit and not spec.cost_aware:
        raise ArgumentError("--zero-bubble-max-pending-backward",
                            f"has no effect on schedule {args.schedule!r} (not memory-aware); drop it or use "
                            f"--enable-zero-bubble / --zero-bubble-v-schedule")
    if n is None and args.schedule == "zb":
        n = pp  # ZB-1p: 1F1B's peak activation memory
    args.zero_bubble_max_pending_backward = n
    args.zero_bubble_max_pending_backward_given = explicit
    args.schedule_memory_limit = float(n * args.num_model_chunks) if n is not None else None
    try:
        return initial_schedule(args)
    except ScheduleError as e:
        if explicit:
            try:
                _build(args, memory_limit=None)
            except ScheduleError:
                pass
            else:
                raise ArgumentError(
                    "--zero-bubble-max-pending-backward",
                    f"{n} micro batches is below what schedule {args.schedule!r} needs for PP={pp}, "
                    f"{m} micro batches ({e}); raise --zero-bubble-max-pending-backward") from None
        raise ArgumentError(args.schedule_selected_by,
                            f"schedule {args.schedule!r} cannot be built for PP={pp}, {m} micro batches per "
                            f"iteration ({e}); change the schedule or the batch sizes") from None


def initial_schedule(args: argparse.Namespace) -> Schedule:
    """The unit-cost schedule of validated ``args`` (the runtime may rebuild it from profiled costs).

    Builds it: validation already did and returns it
    (:attr:`~megatron_zb.training.arguments.ValidatedArgs.schedule`), so call this only when that
    one is not at hand. A generator that is not deterministic (a time-limited solver) may give
    another schedule each call.
    """
    return _build(args, memory_limit=args.schedule_memory_limit)


def _build(args: argparse.Namespace, *, memory_limit: float | None) -> Schedule:
    return build_schedule(args.schedule, num_ranks=args.pipeline_model_parallel_size,
                          num_microbatches=args.num_microbatches, memory_limit=memory_limit,
                          num_chunks=args.num_model_chunks)


def check_wgrad_group(args: argparse.Namespace, spec: ScheduleSpec, schedule: Schedule) -> Schedule | None:
    """``--zero-bubble-wgrad-group K``: a schedule that splits the backward, ``K`` >= 1 dividing the micro
    batches, and the grouped unit-cost ``schedule`` within an explicit ``--zero-bubble-max-pending-backward``.
    Returns the grouped schedule (``None`` without the flag)."""
    from megatron_zb.schedules.costs import CostModel
    from megatron_zb.schedules.simulator import simulate
    from megatron_zb.schedules.wgrad_groups import group_wgrads

    k, m = args.zero_bubble_wgrad_group, args.num_microbatches
    if k is None:
        return None
    if not spec.split_backward:
        raise ArgumentError("--zero-bubble-wgrad-group", f"groups the W passes of a zero-bubble schedule, but schedule "
                                                         f"{args.schedule!r} fuses its backward; add "
                                                         f"--enable-zero-bubble (or another zero-bubble schedule) or "
                                                         f"drop this flag")
    if k < 1 or m % k:
        raise ArgumentError("--zero-bubble-wgrad-group", f"{k} does not divide the {m} micro batches per iteration "
                                                         f"(--global-batch-size / (--micro-batch-size x data-parallel "
                                                         f"size)); use a divisor of {m}")
    grouped = group_wgrads(schedule, k)
    limit = args.schedule_memory_limit
    peak = max(simulate(grouped, CostModel(), enforce_memory=False).peak_memory)
    need = -(-peak // args.num_model_chunks)  # whole micro batches of activations per rank
    if limit is not None and peak > limit:
        if args.zero_bubble_max_pending_backward_given:
            raise ArgumentError("--zero-bubble-wgrad-group",
                                f"groups of {k} hold W inputs longer: the schedule then needs {need:g} micro batches "
                                f"of activations per rank, above --zero-bubble-max-pending-backward "
                                f"{args.zero_bubble_max_pending_backward}; raise that limit or use a smaller group")
        notice(args, f"--zero-bubble-wgrad-group {k}: W groups hold their inputs longer; schedule {args.schedule!r} "
                     f"then holds up to {need:g} micro batches of activations per rank (its default limit is "
                     f"{args.zero_bubble_max_pending_backward}; --zero-bubble-max-pending-backward sets a limit the "
                     f"group must keep)")
    return grouped


def check_zero_bubble_options(args: argparse.Namespace, spec: ScheduleSpec) -> None:
    check_post_validation(args, spec)
    check_profile_out(args, spec)
    check_profiling_window(args)


def check_post_validation(args: argparse.Namespace, spec: ScheduleSpec | None) -> None:
    """``--enable-optimizer-post-validation`` needs a schedule that splits the backward (``spec``:
    the schedule's; None: megatron-core's own schedule runs); ``--enable-exactly-numeric-match``
    without it is accepted with a WARNING (:data:`EXACT_MATCH_WITHOUT_POST_VALIDATION`), the tuning
    flags only with it (then defaulted). Also the rule of ``megatron_zb.megatron_lm``."""
    if args.enable_optimizer_post_validation and (spec is None or not spec.split_backward):
        what = "megatron-core's own" if spec is None else repr(spec.name)
        raise ArgumentError("--enable-optimizer-post-validation",
                            f"needs a zero-bubble schedule, but the schedule is {what}; add "
                            f"--enable-zero-bubble (or --zero-bubble-v-schedule) or drop the flag")
    if args.enable_exactly_numeric_match and not args.enable_optimizer_post_validation:
        notice(args, EXACT_MATCH_WITHOUT_POST_VALIDATION)
    if args.enable_optimizer_post_validation and not args.enable_exactly_numeric_match and not _torch_adam():
        raise ArgumentError("--enable-optimizer-post-validation",
                            "the in-place rollback inverts torch.optim Adam steps only, and megatron-core builds "
                            "Transformer Engine's or apex's FusedAdam here (installed); add "
                            "--enable-exactly-numeric-match (exact rollback)")
    _check_post_validation_tuning(args)


EXACT_MATCH_WITHOUT_POST_VALIDATION = (
    "WARNING: --enable-exactly-numeric-match without --enable-optimizer-post-validation has no effect: the "
    "zero-bubble fork's numeric-match mode makes its schedules reproduce its 1F1B baseline, while megatron-zb's "
    "schedules run megatron-core's own forward and backward steps and are bitwise equal to megatron-core's "
    "schedule wherever the arithmetic is the same (docs/compatibility.md); with dropout on, the masks follow "
    "the execution order, so compare with --attention-dropout 0 --hidden-dropout 0 (as the fork's scripts do)")
"""The start-up line of ``--enable-exactly-numeric-match`` alone (with post-validation it is the exact rollback)."""


def _torch_adam() -> bool:
    """megatron-core builds torch.optim's Adam (neither Transformer Engine nor apex is installed)."""
    from megatron.core import optimizer

    return bool(optimizer.USING_PYTORCH_OPTIMIZER)


def check_profiling_window(args: argparse.Namespace) -> None:
    """``--zero-bubble-pipeline-timers-start-iter`` >= 1 and ``-end-iter`` after it [iterations, 1-based]."""
    start, end = args.zero_bubble_pipeline_timers_start_iter, args.zero_bubble_pipeline_timers_end_iter
    if start < 1:
        raise ArgumentError("--zero-bubble-pipeline-timers-start-iter", f"must be >= 1, got {start}")
    if end <= start:
        raise ArgumentError("--zero-bubble-pipeline-timers-end-iter",
                            f"{end} must be greater than --zero-bubble-pipeline-timers-start-iter {start}")


def check_profile_out(args: argparse.Namespace, spec: ScheduleSpec) -> None:
    """``--profile-out``: only what the planning profile can describe (measured B and W, a dense model).
    ``spec``: the schedule's (``args.schedule`` names it)."""
    if args.profile_out is None:
        return
    mcore = getattr(args, "use_megatron_core_schedule", False)  # a developer flag (pretrain_gpt_zb.py has it)
    if mcore or not spec.split_backward:
        what = "megatron-core's schedule is not profiled" if mcore else (
            f"schedule {args.schedule!r} fuses B and W, so T_W is not measured")
        raise ArgumentError("--profile-out", f"{what}; profile a zero-bubble schedule (--enable-zero-bubble, "
                                             f"--zero-bubble-v-schedule or a --schedule that splits the backward)")
    if getattr(args, "num_experts", None):
        raise ArgumentError("--profile-out", "the planner does not model MoE layers; drop --num-experts or "
                                             "--profile-out")


def _check_post_validation_tuning(args: argparse.Namespace) -> None:
    """``--post-validation-warmup-iters`` / ``--post-validation-fallback-clean-iters``: >= 0, only
    with ``--enable-optimizer-post-validation``; then default to 10 each. Without post-validation
    they stay ``None`` (so that validating again still sees them as not given)."""
    for dest, _ in _POST_VALIDATION_TUNING:
        value = getattr(args, dest)
        if value is not None and value < 0:
            raise ArgumentError(flag(dest), f"must be >= 0 iterations, got {value}")
    given = [flag(dest) for dest, _ in _POST_VALIDATION_TUNING if getattr(args, dest) is not None]
    if given and not args.enable_optimizer_post_validation:
        raise ArgumentError(given[0], "only applies with --enable-optimizer-post-validation (it tunes when that "
                                      "optimizer steps synchronously); add --enable-optimizer-post-validation or "
                                      f"drop {' and '.join(given)}")
    if args.enable_optimizer_post_validation:
        for dest, default in _POST_VALIDATION_TUNING:
            if getattr(args, dest) is None:
                setattr(args, dest, default)



def _vocab_names() -> str:
    """The catalog's vocabulary-parallel schedules, ``"a, b or c"``."""
    names = vocab_schedule_names()
    return ", ".join(names[:-1]) + " or " + names[-1]


def check_vocab_parallel(args: argparse.Namespace) -> None:
    """``--enable-vocab-parallel``: a schedule that places the vocabulary passes, and none of what the
    runtime does not run with them yet (all such flags named in one problem)."""
    if not args.enable_vocab_parallel:
        return
    if not get_spec(args.schedule).vocab_parallel:
        forms = [f"{args.schedule}-vocab-{n}" for n in (2, 1) if f"{args.schedule}-vocab-{n}" in schedule_names()]
        which = " or ".join(forms) if forms else _vocab_names()
        raise ArgumentError("--enable-vocab-parallel", f"needs a schedule that places the vocabulary passes: "
                                                       f"--schedule {which} ({args.schedule!r} places none)")
    cp = args.context_parallel_size
    bad = [what for what, on in (
        ("--context-parallel-size > 1", cp > 1),
        ("--calculate-per-token-loss", args.calculate_per_token_loss),
        ("--num-experts", bool(args.num_experts)),
        ("--mtp-num-layers", bool(getattr(args, "mtp_num_layers", None))),
        ("--cross-entropy-loss-fusion", bool(getattr(args, "cross_entropy_loss_fusion", False))),
        ("--overlap-param-gather", bool(getattr(args, "overlap_param_gather", False))),
        ("--enable-optimizer-post-validation", args.enable_optimizer_post_validation),
        ("--use-megatron-core-schedule", args.use_megatron_core_schedule),
        ("--profile-out", args.profile_out is not None),
        ("--rampup-batch-size", bool(getattr(args, "rampup_batch_size", None))),
    ) if on]
    if bad:
        raise ArgumentError("--enable-vocab-parallel", "not supported yet together with " + ", ".join(bad)
                            + "; drop those flags or --enable-vocab-parallel")
