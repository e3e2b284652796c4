"""megatron-zb inside NVIDIA Megatron-LM's own training loop: the zero-bubble flags on Megatron-LM's
parser, checked before Megatron-LM initialises, and the schedule routed in.

Two lines at the top of the user's ``pretrain_gpt.py`` (before ``pretrain(...)`` runs)::

    import megatron_zb.megatron_lm
    megatron_zb.megatron_lm.install()

:func:`install` wraps Megatron-LM's ``parse_args`` (where Megatron-LM calls it:
``megatron_compat.MEGATRON_LM_LOOP``, per release -- core_v0.16.1: ``megatron.training.arguments`` and
the name ``megatron.training.initialize`` imported; core_v0.19.0: ``megatron.training.arguments``,
whose ``parse_and_validate_args`` ``pretrain_gpt.py`` calls before ``pretrain()``): the parser gets the zero-bubble flags beside whatever
``extra_args_provider`` the script passes, and right after parsing -- before any process group --
the zero-bubble flags are checked (one line per problem naming the flag, exit 2) and
:func:`megatron_zb.patch_megatron` routes megatron-core's ``get_forward_backward_func`` to the
chosen schedule. Flags: ``--enable-zero-bubble``, ``--zero-bubble-max-pending-backward``,
``--schedule``, ``--pipeline-timeout-seconds`` and the rest of the zero-bubble group of
``pretrain_gpt_zb.py`` (one definition: :func:`~megatron_zb.training.arguments.zero_bubble.add_zero_bubble_args`).

Cost-aware schedules (``zb``, ``zb-1p``, ``zb-2p``, ``interleaved-zb``) are profiled and re-planned
as in ``pretrain_gpt_zb.py``: :class:`ReplanningForwardBackward` (given to ``patch_megatron``) counts
Megatron-LM's training calls of ``forward_backward_func`` as iterations and hands them to the same
:class:`~megatron_zb.training.replanning.SchedulePlanner`: iterations
``[--zero-bubble-pipeline-timers-start-iter, --zero-bubble-pipeline-timers-end-iter)`` (default 2
and 4) are profiled, then the schedule is re-planned from the measured costs on global rank 0 and
installed on every rank; rank 0 prints the schedule report (at the first call with unit costs,
after the window with the measured ones) and, with ``--profile-out FILE``, writes the planning
profile. Megatron-LM's checkpoints do not carry the measured costs: a run resumed with ``--load``
counts its iterations from 1 again, so it profiles and re-plans again.

``--enable-optimizer-post-validation`` wraps the optimizer Megatron-LM builds and validates each
step when Megatron-LM's ``train_step`` returns (:mod:`megatron_zb.megatron_lm.optimizer`). V schedules
(``--zero-bubble-v-schedule``, ``--schedule zbv|v-half|v-min``): :mod:`megatron_zb.megatron_lm.v`
builds the V's two chunks per rank -- inside Megatron-LM core_v0.16.1's loop through the script's model
provider passed through :func:`v_model_provider`, inside core_v0.19.0's through the model builder
Megatron-LM calls (no further change of the script; ``megatron_compat.MEGATRON_LM_LOOP``).

Resuming: :func:`install` also runs Megatron-LM's ``load_checkpoint`` inside
:func:`~megatron_zb.training.checkpointing.repaired_distributed_adam_load` (megatron-core 0.16.1's
distributed optimizer with torch's Adam cannot resume without it), with or without a zero-bubble
schedule; checkpoints saved with zero bubble load without it and back (they hold the same state).

What this route cannot honour yet is refused up front (:data:`NOT_YET`): ``--allow-padding-num-layers``
and ``--enable-vocab-parallel`` (``pretrain_gpt_zb.py`` has them); so is what is not verified in this loop
with a zero-bubble schedule (:func:`refused_with_a_schedule`: ``--use-megatron-fsdp``,
``--moe-shared-expert-overlap``, ``--moe-router-force-load-balancing``;
with a V also :func:`~megatron_zb.megatron_lm.v.refused_with_a_v`, ``--mtp-num-layers`` among them), all in one
report, printed once (global rank 0).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import v as v_route
from .rebind import Rebinds
from .refusals import NOT_YET, exit_refused, refused_with_a_schedule
from .v import v_model_provider
from ..schedules.ir import vocab_passes_unsupported
from ..schedules.registry import get_spec
from ..training.arguments.common import ArgumentError, flag

if TYPE_CHECKING:
    from ..runtime.forward_backward import ZeroBubbleForwardBackward
    from ..training.cost_window import CostWindow
    from ..training.replanning import SchedulePlanner
    from ..training.run_config import RunConfig

__all__ = ["NOT_YET", "ReplanningForwardBackward", "add_flags", "configure", "install",
           "planner_config", "refused_with_a_schedule", "uninstall", "v_model_provider"]

_REBINDS = Rebinds()
"""What :func:`install` replaced in Megatron-LM (restored by :func:`uninstall`)."""


def install() -> None:
    """Add the zero-bubble flags to Megatron-LM's parser and route the schedule (module docstring), and
    start the rank's reaper (:mod:`megatron_zb.platform.reaper`: a killed torchrun worker leaves no
    process behind). Idempotent; :func:`uninstall` restores Megatron-LM's ``parse_args`` and ``validate_args``
    (the reaper stays: it only acts once the process is gone)."""
    from megatron.training import arguments

    from ..megatron_compat import megatron_lm_loop
    from ..platform.reaper import install as install_reaper

    install_reaper()
    if _REBINDS:
        return
    loop = megatron_lm_loop()
    original = arguments.parse_args

    def parse_args(extra_args_provider: Callable | None = None, ignore_unknown_args: bool = False) -> argparse.Namespace:
        def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            add_flags(parser)
            return parser

        args = original(provider, ignore_unknown_args)
        try:
            options = configure(args)
            v_flag = options.pop("v_flag", None) if options is not None else None
            if v_flag is not None:
                v_route.activate(options["schedule"], v_flag)
        except ArgumentError as e:
            exit_refused(e)
        if options is not None:  # else megatron-core's schedule runs untouched
            from .patching import patch_megatron

            name = options.pop("schedule")
            patch_megatron(name, wrapper=functools.partial(_wrap, schedule=name, v=v_flag is not None),
                           **options)
            if args.enable_optimizer_post_validation:
                from .optimizer import install as install_post_validation

                install_post_validation(args)
        return args

    for name in loop.parse_args_holders:
        _REBINDS.set(importlib.import_module(name), "parse_args", parse_args)
    if loop.validate_args_holder is not None:
        _install_provider_check(importlib.import_module(loop.validate_args_holder))
    _install_load_repairs()


def _install_provider_check(holder: Any) -> None:
    """``holder.validate_args`` (Megatron-LM's, called inside ``pretrain()``) after megatron-zb's check
    that the script wrapped its model provider for a V (:func:`~megatron_zb.megatron_lm.v.check_provider`)."""
    validate = holder.validate_args

    def validate_args(*args: Any, **kwargs: Any) -> Any:
        """Megatron-LM's, after megatron-zb's check that needs pretrain()'s arguments: a V schedule's
        model provider is wrapped (initialize_megatron validates only inside pretrain(), whose arguments
        exist by then, unlike at inprocess_restart's early parse)."""
        try:
            v_route.check_provider()
        except ArgumentError as e:
            exit_refused(e)
        return validate(*args, **kwargs)

    _REBINDS.set(holder, "validate_args", validate_args)


def uninstall() -> None:
    """Restore Megatron-LM's ``parse_args`` and megatron-core's ``get_forward_backward_func`` (and the
    names post-validation rebinds)."""
    from .optimizer import uninstall as uninstall_post_validation
    from .patching import unpatch_megatron

    uninstall_post_validation()
    _REBINDS.restore()
    unpatch_megatron()
    v_route.deactivate()


def _wrap(runtime: Any, *, schedule: str, v: bool) -> Callable:
    """megatron-zb's ``forward_backward_func`` as Megatron-LM gets it: re-planned for a cost-aware
    schedule, its losses handed to the last pipeline rank for a V."""
    fb = ReplanningForwardBackward(runtime, schedule=schedule) if get_spec(schedule).cost_aware else runtime
    return v_route.VForwardBackward(fb) if v else fb


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The zero-bubble group of ``pretrain_gpt_zb.py`` on Megatron-LM's parser, and the flags of the
    zero-bubble fork and VocabularyParallelism (the refused ones hidden, so that :func:`configure`
    answers them by name instead of Megatron-LM's parser stopping at them)."""
    from ..training.arguments.fork_flags import add_fork_args
    from ..training.arguments.zero_bubble import add_zero_bubble_args

    add_zero_bubble_args(parser)
    add_fork_args(parser, refused=True)


_SAID: set[str] = set()
"""The start-up lines already printed by this process (Megatron-LM parses more than once)."""


def _say_notices(args: argparse.Namespace) -> None:
    """Print the start-up lines the shared checks added (``validation_notices``) once, on rank 0."""
    from ..training.arguments.common import NOTICES

    for line in getattr(args, NOTICES, None) or ():
        if line not in _SAID and getattr(args, "rank", 0) == 0:
            print(f"megatron-zb: {line}", flush=True)
        _SAID.add(line)
    setattr(args, NOTICES, [])


def configure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Check the zero-bubble flags of Megatron-LM's parsed ``args``; return :func:`patch_megatron`'s
    arguments (``schedule`` and options; for a V also ``v_flag``, the flag that chose it), or ``None``
    when no zero-bubble schedule was asked for. A V schedule sets Megatron-LM's
    ``--num-virtual-stages-per-pipeline-rank`` (:func:`~megatron_zb.megatron_lm.v.check_v`).
    Raises :class:`ArgumentError` naming the flag."""
    try:
        return _configure(args)
    finally:
        _say_notices(args)


def _configure(args: argparse.Namespace) -> dict[str, Any] | None:
    """:func:`configure` but for printing the start-up lines: every flag refused by name
    (:data:`NOT_YET`, :func:`refused_with_a_schedule`, what a V cannot have) is reported in one
    :class:`ArgumentError`, with the first other problem after them."""
    refused: list[ArgumentError] = []
    try:
        options = _configure_checks(args, refused)
    except ArgumentError as e:
        refused.append(e)
    if refused:
        raise ArgumentError.combine(refused)
    return options


def _configure_checks(args: argparse.Namespace, refused: list[ArgumentError]) -> dict[str, Any] | None:
    """:func:`_configure`'s checks; the refused flags are added to ``refused``, the other problems raised."""
    from .optimizer import check_flags as check_post_validation
    from ..schedules.ir import Placement
    from ..training.arguments.fork_flags import check_fork_flags
    from ..training.arguments.zero_bubble import select_schedule

    check_fork_flags(args)
    refused.extend(ArgumentError(flag(dest), f"not supported inside Megatron-LM's loop: {why}")
                   for dest, why in NOT_YET.items() if getattr(args, dest, None))
    if args.schedule_requested is not None and args.enable_zero_bubble:
        raise ArgumentError("--schedule", "give --schedule or --enable-zero-bubble, not both")
    name, selected_by = select_schedule(args)
    pending = args.zero_bubble_max_pending_backward
    if name is None:
        if pending is not None:
            raise ArgumentError("--zero-bubble-max-pending-backward", "only applies with --enable-zero-bubble or "
                                                                      "--schedule; add one or drop this flag")
        _check_profiling(args, None)
        check_post_validation(args, None)
        return None
    spec = get_spec(name)
    refusal = vocab_passes_unsupported(name=name, vocab_parallel=spec.vocab_parallel)
    if refusal is not None:  # Megatron-LM's model provider builds the whole vocabulary layers
        raise ArgumentError(selected_by, refusal)
    refused.extend(refused_with_a_schedule(args, name))
    if spec.placement is Placement.V:
        refused.extend(v_route.refused_with_a_v(args, name))
    _check_profiling(args, name)
    check_post_validation(args, spec)
    if spec.placement is Placement.V:
        v_route.check_v(args, name, selected_by)
    chunks = _virtual_chunks(args)
    if spec.placement is not Placement.V and (spec.placement is Placement.INTERLEAVED) != (chunks > 1):
        raise ArgumentError("--schedule", f"{name!r} has the {spec.placement.value} placement but Megatron-LM "
                                          f"builds {chunks} model chunk(s) per rank; match --num-layers-per-virtual-"
                                          f"pipeline-stage to the schedule")
    if pending is None and selected_by == "--enable-zero-bubble":
        pending = args.pipeline_model_parallel_size  # ZB-1p: 1F1B's activation memory, as the fork does
    if pending is not None and pending < 1:
        raise ArgumentError("--zero-bubble-max-pending-backward", f"must be >= 1 micro batch, got {pending}")
    args.zero_bubble_max_pending_backward = pending  # resolved, as pretrain_gpt_zb.py's validation leaves it
    options: dict[str, Any] = {"schedule": name, "timeout": args.pipeline_timeout_seconds}
    if chunks > 1:
        options["num_chunks"] = chunks
    if pending is not None:
        options["memory_limit"] = float(pending * chunks)
    if spec.placement is Placement.V:
        options["v_flag"] = selected_by
    return options


def _check_profiling(args: argparse.Namespace, schedule: str | None) -> None:
    """The profiling window and ``--profile-out`` (``pretrain_gpt_zb.py``'s checks); only a cost-aware
    ``schedule`` is profiled here (:class:`ReplanningForwardBackward`), so ``--profile-out`` needs one."""
    from ..training.arguments.zero_bubble import check_profile_out, check_profiling_window

    check_profiling_window(args)
    if args.profile_out is None:
        return
    if schedule is None or not get_spec(schedule).cost_aware:
        what = "no zero-bubble schedule was chosen" if schedule is None else f"{schedule!r} is not cost-aware"
        raise ArgumentError("--profile-out", f"{what}, and only cost-aware schedules (zb, zb-1p, zb-2p) are "
                                             f"profiled inside Megatron-LM's loop; add --enable-zero-bubble or drop "
                                             f"the flag")
    check_profile_out(argparse.Namespace(**{**vars(args), "schedule": schedule}), get_spec(schedule))


def _virtual_chunks(args: argparse.Namespace) -> int:
    """Model chunks per pipeline rank Megatron-LM will build (its interleaving flags)."""
    if getattr(args, "num_virtual_stages_per_pipeline_rank", None):
        return int(args.num_virtual_stages_per_pipeline_rank)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_stage:
        return args.num_layers // args.pipeline_model_parallel_size // per_stage
    return 1


class ReplanningForwardBackward:
    """megatron-zb's ``forward_backward_func`` inside Megatron-LM's loop, profiled and re-planned.

    Megatron-LM calls ``forward_backward_func`` once per training iteration with
    ``forward_only=False`` (evaluation: ``forward_only=True``); this wrapper counts those training
    calls -- call ``n`` is iteration ``n``, Megatron-LM's numbering for a run that did not resume
    -- and hands each to ``pretrain_gpt_zb.py``'s :class:`~megatron_zb.training.replanning.SchedulePlanner`:
    iterations ``[--zero-bubble-pipeline-timers-start-iter, --zero-bubble-pipeline-timers-end-iter)``
    are profiled, then the schedule is re-planned from the measured costs on global rank 0 and
    installed on every rank, and rank 0 prints the schedule report. The planner is built (a
    collective) at the first call of any kind, when Megatron-LM's process groups exist.

    Attributes:
        runtime: megatron-zb's ``ZeroBubbleForwardBackward`` that runs every call.
        iteration: training calls so far.
        planner: the :class:`SchedulePlanner` (``None`` before the first call).
        window: its profiling window (:class:`~megatron_zb.training.cost_window.CostWindow`; ``None`` before).
    """

    def __init__(self, runtime: ZeroBubbleForwardBackward, *, schedule: str) -> None:
        """``schedule``: the schedule's name. The planner reads Megatron-LM's validated global
        arguments (``megatron.training.get_args()``) at the first call: Megatron-LM fills some in
        late (e.g. ``train_iters`` from ``--train-samples``), and the latest parse is not always the
        validated one (core_v0.19.0's ``pretrain()`` re-parses for fault tolerance without validating,
        after ``pretrain_gpt.py`` validated its own parse)."""
        self.runtime = runtime
        self.iteration = 0
        self.planner: SchedulePlanner | None = None
        self.window: CostWindow | None = None
        self._schedule = schedule

    def __call__(self, *, forward_step_func: Callable, data_iterator: Any, model: Any, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, decoder_seq_length: int | None = None,
                 forward_only: bool = False, collect_non_loss_data: bool = False, first_val_step: bool | None = None,
                 adjust_tensor_shapes_fn: Callable | None = None, p2p_communicator: Any = None,
                 pg_collection: Any = None, force_all_reduce: bool | None = False) -> list[Any]:
        """megatron-core's ``forward_backward_func`` (same keywords); a training call is one iteration."""
        from ..runtime.measure import Measure

        planner, window = self._planner(num_microbatches)
        planner.config = planner.config.replace(num_microbatches=num_microbatches)  # what --profile-out records
        planner.num_microbatches = num_microbatches
        call = functools.partial(
            self.runtime.run, forward_step_func=forward_step_func, data_iterator=data_iterator,
            model=model, num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length, forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
            adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
            pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        if forward_only:
            return call(Measure()).data
        self.iteration += 1
        measure = window.request(self.iteration)
        t0 = time.perf_counter()
        measured = call(measure)
        if window.record(self.iteration, measured, seconds=time.perf_counter() - t0):
            planner.replan(window)  # collective: every rank is in this call
        return measured.data

    def _planner(self, num_microbatches: int) -> tuple[SchedulePlanner, CostWindow]:
        """The planner and its profiling window, built at the first call with global rank 0's unit-cost
        schedule (collective: the install protocol)."""
        if self.planner is None:
            from megatron.core import parallel_state
            from megatron.training import get_args

            from ..training.distributed import context_from_parallel_state
            from ..training.replanning import SchedulePlanner

            args = get_args()
            pp = parallel_state.get_pipeline_model_parallel_world_size()
            stage_to_rank = self.runtime.options.stage_to_rank(pp)
            config = planner_config(args, schedule=self._schedule, stage_to_rank=stage_to_rank,
                                    num_microbatches=num_microbatches, memory_limit=self.runtime.options.memory_limit)
            self.planner = SchedulePlanner(config, stage_to_rank=stage_to_rank, runtime=self.runtime,
                                           dist_ctx=context_from_parallel_state(backend=args.distributed_backend))
            self.window = self.planner.cost_window()
            self.planner.report_initial()
        return self.planner, self.window


def planner_config(args: argparse.Namespace, *, schedule: str, stage_to_rank: Sequence[int], num_microbatches: int,
                   memory_limit: float | None) -> "RunConfig":
    """The :class:`~megatron_zb.training.run_config.RunConfig` that
    :class:`~megatron_zb.training.replanning.SchedulePlanner` reads, of Megatron-LM's validated ``args``:
    the model's sizes, the parallel layout, the precision, the training length and the schedule section
    with the values ``pretrain_gpt_zb.py``'s validation derives (``stage_to_rank``: the schedule's
    placement, which the layer split follows), and the data loader's workers and attention mask, the
    timing log level and the layer implementation, which the host-bound diagnosis names as causes
    (:mod:`~megatron_zb.training.host_bound`); the sections the planner does not read keep their
    defaults. ``num_microbatches``: per iteration per data-parallel rank; ``memory_limit``: in units of
    one stage's activation ``M_B`` (``None``: the schedule's default)."""
    from ..planning.layout import LayerSplit, layers_per_stage
    from ..training.run_config import (DataConfig, LoggingConfig, ModelConfig, OptimConfig, ParallelConfig,
                                      PrecisionConfig, RunConfig, ScheduleConfig)

    spec = get_spec(schedule)
    padded = getattr(args, "padded_vocab_size", None)
    gqa = args.group_query_attention
    model = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, padded_vocab_size=padded if padded is not None else args.vocab_size,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        max_position_embeddings=args.max_position_embeddings, num_query_groups=args.num_query_groups if gqa else None,
        # a real tokenizer: Megatron-LM pads its size, which pads to itself again
        vocab_size=args.vocab_size if args.vocab_size is not None else padded,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, normalization=args.normalization, swiglu=args.swiglu,
        add_bias_linear=args.add_bias_linear, position_embedding_type=args.position_embedding_type,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        transformer_impl=args.transformer_impl)
    split = LayerSplit(allow_padding=getattr(args, "allow_padding_num_layers", False),
                       first_stage_layers=args.decoder_first_pipeline_num_layers,
                       last_stage_layers=args.decoder_last_pipeline_num_layers,
                       account_for_embedding=args.account_for_embedding_in_pipeline_split,
                       account_for_loss=args.account_for_loss_in_pipeline_split)
    parallel = ParallelConfig(
        world_size=args.world_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, data_parallel_size=args.data_parallel_size,
        sequence_parallel=args.sequence_parallel, use_distributed_optimizer=args.use_distributed_optimizer,
        allow_padding_num_layers=split.allow_padding, decoder_first_pipeline_num_layers=split.first_stage_layers,
        decoder_last_pipeline_num_layers=split.last_stage_layers,
        account_for_embedding_in_pipeline_split=split.account_for_embedding,
        account_for_loss_in_pipeline_split=split.account_for_loss)
    sched = ScheduleConfig(
        name=schedule, placement=spec.placement, split_backward=spec.split_backward,
        cost_aware=spec.cost_aware, num_model_chunks=_virtual_chunks(args),
        layers_per_stage=tuple(layers_per_stage(args.num_layers, stage_to_rank, split)),
        max_pending_backward=args.zero_bubble_max_pending_backward, memory_limit=memory_limit,
        pipeline_timeout_seconds=args.pipeline_timeout_seconds,
        zero_bubble_pipeline_timers_start_iter=args.zero_bubble_pipeline_timers_start_iter,
        zero_bubble_pipeline_timers_end_iter=args.zero_bubble_pipeline_timers_end_iter, profile_out=args.profile_out)
    # what the host-bound diagnosis names as causes (training/host_bound.py) is read from these sections
    data = DataConfig(num_workers=args.num_workers,
                      create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader)
    return RunConfig(model=model, parallel=parallel, precision=PrecisionConfig(fp16=args.fp16, bf16=args.bf16),
                     optim=OptimConfig(lr=args.lr), schedule=sched, micro_batch_size=args.micro_batch_size,
                     global_batch_size=args.global_batch_size, num_microbatches=num_microbatches,
                     train_iters=args.train_iters, data=data,
                     logging=LoggingConfig(timing_log_level=args.timing_log_level))


def _install_load_repairs() -> None:
    """Megatron-LM's ``load_checkpoint(ddp_model, optimizer, ...)`` (``megatron.training.checkpointing``,
    and the name ``megatron.training.training`` imported) runs inside
    :func:`~megatron_zb.training.checkpointing.repaired_distributed_adam_load`: megatron-core 0.16.1's
    distributed optimizer with torch's Adam (no apex / Transformer Engine) cannot resume otherwise
    (``assert len(steps) == 1``, then a wrong Adam step), whichever schedule saved or resumes."""
    from megatron.training import checkpointing, training

    from ..training.checkpointing import repaired_distributed_adam_load

    original = checkpointing.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(ddp_model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        with repaired_distributed_adam_load(optimizer):
            return original(ddp_model, optimizer, *args, **kwargs)

    for module in (checkpointing, training):
        if getattr(module, "load_checkpoint", None) is original:
            _REBINDS.set(module, "load_checkpoint", load_checkpoint)
