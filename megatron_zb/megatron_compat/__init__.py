"""Every private megatron-core API megatron-zb touches, in one place, per supported release.

megatron-zb is a plugin: it imports megatron-core's public API freely, but some of what it needs
is private (underscore names, module internals, functions megatron-core does not export, objects it
patches). Each such use lives here, under the part of megatron-zb that needs it, so that one file
is reviewed at each megatron-core upgrade. Anything here may break on upgrade; nothing outside this
module and its parts reaches into megatron-core's private names, and only :func:`release` here asks
which megatron-core release is installed. The parts, one per job, read the release from here:
:mod:`megatron_zb.megatron_compat.optimizer` (what post-validation mirrors of megatron-core's
optimizer ``step()``), :mod:`megatron_zb.megatron_compat.platform` (what the CPU shim replaces) and
:mod:`megatron_zb.megatron_compat.te` (what the Transformer Engine route reads inside TE modules),
:mod:`megatron_zb.megatron_compat.mla` (what multi-latent attention needs on the local spec),
:mod:`megatron_zb.megatron_compat.training` (what the training loop, its data and its checkpoints rely on).
This module: the releases and the Megatron-LM loop's hooks, the table of private names, and the
runtime's and model's uses of them.

Supported releases: :data:`RELEASES` (megatron-core 0.16.1 on Python >= 3.10, 0.19.x on Python
>= 3.12). :data:`PRIVATE_API` is the table: each private name -> where it lives and how it is
called in each release (``None``: the release lacks it; what needs it is refused naming the
release). ``tests/megatron_lm/test_megatron_compat.py`` resolves every row on the installed release and
compares the recorded signatures, so an upgrade that moves or re-signs a name fails there first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

if TYPE_CHECKING:
    import torch

# ---------------------------------------------------------------------------------- releases

RELEASES: dict[str, str] = {"0.16": "0.16.1", "0.19": "0.19.0 to 0.19.2"}
"""Supported megatron-core release lines -> the versions tested (docs/compatibility.md). 0.17 and
0.18 are not tested and refused (setup.py excludes them)."""


MEGATRON_LM_TAGS: dict[str, str] = {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0"}
"""Per release line: the NVIDIA Megatron-LM release (git tag) whose training loop goes with it --
the ``pretrain_gpt.py`` the CPU harness runs (``tests/harness/megatron_lm_workarounds.py``)
and the flag list of ``megatron_zb/training/arguments/megatron_flags.py``. core_v0.19.0's
``package_info`` says 0.19.1; it runs with the megatron-core 0.19.2 wheel (docs/megatron_lm.md)."""


def megatron_lm_tag() -> str:
    """:data:`MEGATRON_LM_TAGS` of the installed megatron-core."""
    return MEGATRON_LM_TAGS[release()]


class MegatronLMLoop(NamedTuple):
    """Where megatron-zb's route into Megatron-LM's own loop (``megatron_zb/megatron_lm*.py``) hooks
    into one Megatron-LM release (a row of :data:`MEGATRON_LM_LOOP`)."""

    parse_args_holders: tuple[str, ...]
    """Modules whose global ``parse_args`` Megatron-LM calls; the route wraps it in each."""
    validate_args_holder: str | None
    """The module whose global ``validate_args`` Megatron-LM calls inside ``pretrain()``, once the
    script's model provider exists (the V route's check wraps it); ``None``: validation runs before
    ``pretrain()``."""
    v_model_builder: str | None
    """The class whose ``build_model`` / ``build_distributed_models`` Megatron-LM calls to build the
    model from the script's config; the V route wraps both (reading its private ``_model_config``).
    ``None``: ``get_model`` calls the script's provider, wrapped in ``v_model_provider``."""
    tp_batch_by_pipeline_end: str | None
    """The function ``pretrain_gpt.py``'s ``get_batch`` calls that keeps, on tensor-parallel rank 0
    too, only the fields of the rank's pipeline end; the V route calls it on the V's rank 0 (both
    ends) as for one pipeline rank. ``None``: it keeps the whole batch on tensor-parallel rank 0."""

MEGATRON_LM_LOOP: dict[str, MegatronLMLoop] = {
    "0.16": MegatronLMLoop(
        # arguments.parse_args, and initialize.py's name for it: initialize_megatron parses again
        parse_args_holders=("megatron.training.arguments", "megatron.training.initialize"),
        validate_args_holder="megatron.training.initialize",
        v_model_builder=None,
        tp_batch_by_pipeline_end=None),
    "0.19": MegatronLMLoop(
        # pretrain_gpt.py's __main__ calls arguments.parse_and_validate_args (parse_args, validate_args of
        # that module) before pretrain(); initialize.py no longer parses
        parse_args_holders=("megatron.training.arguments",),
        validate_args_holder=None,
        # setup_model_and_optimizer: GPTModelBuilder(model_cfg).build_distributed_models(...) ->
        # unimodal_build_distributed_models(self.build_model, ...), one build_model call per vp_stage
        v_model_builder="megatron.training.models.gpt.GPTModelBuilder",
        tp_batch_by_pipeline_end="megatron.core.utils.get_batch_on_this_tp_rank"),
}
"""Per release line: the Megatron-LM loop's hooks (the release of :data:`MEGATRON_LM_TAGS`)."""


def megatron_lm_loop() -> MegatronLMLoop:
    """:data:`MEGATRON_LM_LOOP` of the installed megatron-core."""
    return MEGATRON_LM_LOOP[release()]


class UnsupportedMegatronCore(RuntimeError):
    """The installed megatron-core is not a supported release, or lacks what was asked for."""


def megatron_core_version() -> str:
    """The installed megatron-core's version (``megatron.core.package_info``; from the checkout
    on ``sys.path`` when a Megatron-LM tree shadows the installed package)."""
    from megatron.core import package_info

    return str(package_info.__version__)


@functools.lru_cache(maxsize=None)
def release() -> str:
    """The supported release line (a key of :data:`RELEASES`) of the installed megatron-core;
    raises :class:`UnsupportedMegatronCore` for any other version."""
    version = megatron_core_version()
    m = re.match(r"(\d+)\.(\d+)", version)
    line = f"{m.group(1)}.{m.group(2)}" if m else version
    if line not in RELEASES:
        raise UnsupportedMegatronCore(
            f"megatron-core {version} is not supported by megatron-zb (tested: "
            + ", ".join(RELEASES.values()) + "); install megatron-core==0.16.1 (Python 3.11) "
            "or megatron-core>=0.19,<0.20 (Python >= 3.12)")
    return line


COMMON_STATE_IN_FILE: dict[str, bool] = {"0.16": True, "0.19": False}
"""Per release: whether megatron-core's dist-checkpointing writes the common (non-sharded) state to
``common.pt`` (0.16) or, as a ``ShardedObject`` ``"common_state"``, inside the torch_dist checkpoint
(0.19; it still reads a ``common.pt`` of an older checkpoint)."""


def common_state_in_file() -> bool:
    """Whether the installed megatron-core writes ``common.pt`` (:data:`COMMON_STATE_IN_FILE`)."""
    return COMMON_STATE_IN_FILE[release()]


ROUTER_SCORE_FUNCTIONS: dict[str, tuple[str, ...]] = {"0.16": ("softmax", "sigmoid"),
                                                      "0.19": ("softmax", "sigmoid", "sqrtsoftplus")}
"""Per release: the MoE router's score functions (``TransformerConfig.moe_router_score_function``, the
choices of Megatron-LM's ``--moe-router-score-function``); the first is the default. Expert bias
(``--moe-router-enable-expert-bias``) takes every one but softmax."""


def router_score_functions() -> tuple[str, ...]:
    """:data:`ROUTER_SCORE_FUNCTIONS` of the installed megatron-core."""
    return ROUTER_SCORE_FUNCTIONS[release()]


RERUN_ITERATION_OFFSET: dict[str, int] = {"0.16": 0, "0.19": 1}
"""Per release: what megatron-core's rerun state machine adds to its ``current_iteration`` when its
messages name the iteration (0.16 prints it as is; 0.19 keeps it 0-based and prints ``+ 1``)."""


def rerun_current_iteration(iteration: int) -> int:
    """The rerun state machine's ``current_iteration`` under which its messages name the 1-based
    training ``iteration`` (:data:`RERUN_ITERATION_OFFSET`)."""
    return iteration - RERUN_ITERATION_OFFSET[release()]


RAMPUP_CALCULATOR: dict[str, str | None] = {
    "0.16": "megatron.core.num_microbatches_calculator:RampupBatchsizeNumMicroBatchesCalculator", "0.19": None}
"""Per release: megatron-core's batch-size ramp-up calculator (``--rampup-batch-size``); 0.19 has
none (its step schedule, Megatron-LM's ``--step-batch-size-schedule``, replaced it)."""


def rampup_calculator() -> Any:
    """The installed megatron-core's ramp-up calculator class, or ``None`` where the release has none
    (:data:`RAMPUP_CALCULATOR`)."""
    where = RAMPUP_CALCULATOR[release()]
    if where is None:
        return None
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)


class Private(NamedTuple):
    """Where a private name lives in one release: ``"module:attribute"`` (``module:Class.attr``
    for a class attribute), and, for a callable megatron-zb calls, its parameter list as
    ``inspect.signature`` prints it (``None``: not compared)."""

    where: str
    signature: str | None = None


_SCHED = "megatron.core.pipeline_parallel.schedules"
_LAYERS = "megatron.core.tensor_parallel.layers"

PRIVATE_API: dict[str, dict[str, Private | None]] = {
    # -- runtime: megatron-core's per-microbatch pipeline helpers (the executor calls them)
    "forward_step": {
        r: Private(f"{_SCHED}:forward_step",
                   "(forward_step_func, data_iterator, model, num_microbatches, input_tensor, "
                   "forward_data_store, config, cp_group_size, collect_non_loss_data=False, "
                   "checkpoint_activations_microbatch=None, is_first_microbatch=False, "
                   "current_microbatch=None, vp_stage=None, is_last_stage=True)")
        for r in RELEASES},
    "backward_step": {
        "0.16": Private(f"{_SCHED}:backward_step",
                        "(input_tensor, output_tensor, output_tensor_grad, model_type, config)"),
        "0.19": Private(f"{_SCHED}:backward_step",
                        "(input_tensor, output_tensor, output_tensor_grad, config)")},
    # -- patching: megatron-core's schedule selector, which patch_megatron replaces (megatron_zb/megatron_lm/patching.py)
    "get_forward_backward_func": {
        "0.16": Private(f"{_SCHED}:get_forward_backward_func",
                        "(pp_size: Optional[int] = None, vp_size: Optional[int] = None)"),
        "0.19": Private(f"{_SCHED}:get_forward_backward_func",
                        "(pp_size: Optional[int] = None, vp_size: Optional[int] = None, schedule_pg_collection: "
                        "Optional[megatron.core.process_groups_config.MultiModuleProcessGroupCollection] = None)")},
    "forward_step_calc_loss": {
        r: Private(f"{_SCHED}:forward_step_calc_loss",
                   "(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data, num_microbatches, "
                   "forward_data_store, cp_group_size=None, is_last_stage=None)")
        for r in RELEASES},
    "check_first_val_step": {
        r: Private(f"{_SCHED}:check_first_val_step", "(first_val_step, forward_only, cond)")
        for r in RELEASES},
    "get_tensor_shapes": {
        "0.16": Private(f"{_SCHED}:get_tensor_shapes",
                        "(*, seq_length: int, micro_batch_size: int, decoder_seq_length: int, config, "
                        "tp_group: torch.distributed.distributed_c10d.ProcessGroup, "
                        "cp_group: torch.distributed.distributed_c10d.ProcessGroup)"),
        "0.19": Private(f"{_SCHED}:get_tensor_shapes",
                        "(*, seq_length: int, micro_batch_size: int, decoder_seq_length: int, config, "
                        "tp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, "
                        "cp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None)")},
    "deallocate_output_tensor": {
        r: Private(f"{_SCHED}:deallocate_output_tensor", "(out, deallocate_pipeline_outputs=False)")
        for r in RELEASES},
    # -- runtime: the linear route (megatron_zb/runtime/linear_route.py)
    "LinearWithGradAccumulationAndAsyncCommunication.forward": {
        "0.16": Private(f"{_LAYERS}:LinearWithGradAccumulationAndAsyncCommunication.forward",
                        "(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, "
                        "sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group)"),
        "0.19": Private(f"{_LAYERS}:LinearWithGradAccumulationAndAsyncCommunication.forward",
                        "(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, "
                        "sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group, "
                        "gtp_remat_size)")},
    "layers.custom_bwd": {r: Private(f"{_LAYERS}:custom_bwd") for r in RELEASES},
    "prepare_input_tensors_for_wgrad_compute": {
        r: Private("megatron.core.utils:prepare_input_tensors_for_wgrad_compute",
                   "(grad_output, all_gathered_input)") for r in RELEASES},
    # -- model: vocabulary parallelism (megatron_zb/model/vocab_parallel.py) reuses the group-free
    # arithmetic of megatron-core's vocab-parallel cross entropy (not exported by tensor_parallel)
    "VocabParallelCrossEntropy": {
        r: Private("megatron.core.tensor_parallel.cross_entropy:VocabParallelCrossEntropy") for r in RELEASES},
    # -- model: seeded CPU initialisation of a tensor-parallel weight slice (megatron_zb/model/gpt_chunks.py
    # re-draws the embedding / output weights, megatron_zb/training/moe_setup.py the experts')
    "_initialize_affine_weight_cpu": {
        r: Private(f"{_LAYERS}:_initialize_affine_weight_cpu",
                   "(weight, output_size, input_size, per_partition_size, partition_dim, init_method, stride=1, "
                   "return_master_weight=False, *, params_dtype=torch.float32, rank=None, world_size=None, "
                   "skip_set_tensor_parallel_attributes=False)")
        for r in RELEASES},
}
"""The table: private name -> release line -> :class:`Private` (``None``: absent in that release).
Rows are added as the sections below need them; :func:`private` resolves one."""


def private(name: str, *, feature: str | None = None) -> Any:
    """The object :data:`PRIVATE_API` names ``name`` for the installed release; raises
    :class:`UnsupportedMegatronCore` naming the release (and ``feature``, what needs it) when the
    release lacks it."""
    entry = PRIVATE_API[name][release()]
    if entry is None:
        raise UnsupportedMegatronCore(
            f"{feature or name} is not available with megatron-core {megatron_core_version()} "
            f"(megatron-core's {name} is absent there); use megatron-core "
            + " or ".join(RELEASES[r] for r, e in PRIVATE_API[name].items() if e is not None))
    return resolve(entry.where)


def resolve(where: str) -> Any:
    """Import ``"module:attr[.attr...]"`` and return the attribute."""
    module, _, path = where.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------------- runtime
# (the weight-gradient store's routes into megatron-core's layers, the executor's use of the
# schedules module's internals)
# Public and used directly elsewhere: megatron.core.parallel_state getters (incl.
# get_global_memory_buffer), megatron.core.utils.get_model_config / get_model_type,
# megatron.core.pipeline_parallel.get_forward_backward_func, megatron.core.tensor_parallel's
# exported layers.
LINEAR_AUTOGRAD_FUNCTION: tuple[str, str] = (
    "megatron.core.tensor_parallel.layers", "LinearWithGradAccumulationAndAsyncCommunication")
"""(module, attribute) of the autograd function behind ``ColumnParallelLinear`` and
``RowParallelLinear`` (MoE ``SequentialMLP`` experts included). Not exported by megatron-core.
``linear_with_grad_accumulation_and_async_allreduce`` looks the name up in its module at every
call, so replacing the attribute routes every such layer: the linear route
(:mod:`megatron_zb.runtime.linear_route`) subclasses it."""

LINEAR_CTX_FIELDS: tuple[str, ...] = (
    "main_grad", "use_bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
    "grad_output_buffer", "tp_group")
"""What that function's ``forward`` sets on ``ctx`` (besides saving ``(input, weight)``) and the
linear route's ``backward`` reads; ``tests/runtime/test_routes.py`` checks they are still set."""


def linear_custom_bwd() -> Callable[..., Any]:
    """The ``custom_bwd`` decorator megatron-core's linear backward carries (autocast state)."""
    return private("layers.custom_bwd")


def prepare_wgrad_inputs() -> Callable[..., Any]:
    """``megatron.core.utils.prepare_input_tensors_for_wgrad_compute``: the 3-D to 2-D reshape the
    linear backward applies to ``(grad_output, total_input)`` before the weight-gradient GEMM."""
    return private("prepare_input_tensors_for_wgrad_compute")


def linear_backward_grads(grad_input: Any, grad_weight: Any, grad_bias: Any) -> tuple[Any, ...]:
    """What the linear function's ``backward`` returns: the three gradients, then one ``None``
    for each further input of its ``forward`` (6 on megatron-core 0.16.1; 7 on 0.19, which adds
    ``gtp_remat_size``), read from the :data:`PRIVATE_API` row's signature."""
    signature = PRIVATE_API["LinearWithGradAccumulationAndAsyncCommunication.forward"][release()]
    assert signature is not None and signature.signature is not None
    num_inputs = len(signature.signature.split(",")) - 1  # minus ctx
    return (grad_input, grad_weight, grad_bias) + (None,) * (num_inputs - 3)


def check_linear_ctx(ctx: Any) -> None:
    """Refuse what the linear route cannot defer: megatron-core 0.19's GTP weight
    rematerialisation (``ctx.gtp_remat_size > 1``: the weight is sharded and re-gathered in
    backward, the weight gradient reduce-scattered). Absent on 0.16.1."""
    if getattr(ctx, "gtp_remat_size", 1) > 1:
        raise UnsupportedMegatronCore(
            f"megatron-core {megatron_core_version()}'s GTP weight rematerialisation (gtp_remat="
            f"{ctx.gtp_remat_size}) is not supported by megatron-zb's zero-bubble linear route; "
            "initialise model parallelism with gtp_remat=1")


def grad_accum_fusion_available() -> bool:
    """Whether megatron-core's linear layers found apex's fused weight-gradient kernels
    (``layers._grad_accum_fusion_available``)."""
    from megatron.core.tensor_parallel import layers

    return bool(getattr(layers, "_grad_accum_fusion_available", False))


def set_grad_accum_fusion_kernels(kernels: Any) -> None:
    """Give megatron-core's linear layers ``kernels`` as apex's ``fused_weight_gradient_mlp_cuda``
    and mark gradient-accumulation fusion available (``layers._grad_accum_fusion_available``)."""
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = kernels
    layers._grad_accum_fusion_available = True


def check_schedule_selection(selector_kwargs: dict[str, Any]) -> None:
    """Refuse what megatron-zb's schedules cannot run among the keyword arguments megatron-core's
    ``get_forward_backward_func`` got beyond ``pp_size`` / ``vp_size`` (see its
    :data:`PRIVATE_API` row): 0.19's ``schedule_pg_collection`` holding a
    ``MultiModuleProcessGroupCollection`` (multi-module models on separate process grids, run by
    megatron-core's cross-grid bridge schedule). Megatron-LM core_v0.19.0's ``train`` passes its
    ordinary ``ProcessGroupCollection`` there, which is accepted."""
    collection = selector_kwargs.get("schedule_pg_collection")
    if collection is None:
        return
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    if isinstance(collection, MultiModuleProcessGroupCollection):
        raise UnsupportedMegatronCore(
            f"megatron-core {megatron_core_version()}'s multi-module pipeline (get_forward_backward_func("
            "schedule_pg_collection=MultiModuleProcessGroupCollection)) is not supported by megatron-zb's "
            "schedules; run it without megatron-zb (unpatch_megatron) or on one process grid")


class PipelineStepFunctions(NamedTuple):
    """Per-microbatch helpers of ``megatron.core.pipeline_parallel.schedules`` (not exported by
    ``megatron.core.pipeline_parallel``; their signatures change between releases), each called
    the same way on every supported release:

    * ``forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
      forward_data_store, config, cp_group_size, **kwargs)`` -> ``(outputs, num_tokens)``;
    * ``backward_step(input_tensor, output_tensor, output_tensor_grad, config)`` -> input grad
      (0.16.1 also takes ``model_type``, unused there: passed as ``None``);
    * ``check_first_val_step(first_val_step, forward_only, cond)``;
    * ``get_tensor_shapes(*, seq_length, micro_batch_size, decoder_seq_length, config, tp_group,
      cp_group)``;
    * ``deallocate_output_tensor(out, deallocate_pipeline_outputs)``.
    """

    forward_step: Callable[..., Any]
    backward_step: Callable[..., Any]
    check_first_val_step: Callable[..., Any]
    get_tensor_shapes: Callable[..., Any]
    deallocate_output_tensor: Callable[..., Any]


def pipeline_step_functions() -> PipelineStepFunctions:
    """megatron-core's ``forward_step``, ``backward_step``, ``check_first_val_step``,
    ``get_tensor_shapes`` and ``deallocate_output_tensor``, which the executor calls so that loss
    scaling, per-token loss normalisation, the forward data store and the pseudo-freeing of stage
    outputs (``deallocate_pipeline_outputs``) stay megatron-core's."""
    backward_step = private("backward_step")
    if release() == "0.16":
        def backward_step_016(input_tensor, output_tensor, output_tensor_grad, config):  # type: ignore[no-untyped-def]
            return backward_step(input_tensor, output_tensor, output_tensor_grad, None, config)

        uniform_backward_step: Callable[..., Any] = backward_step_016
    else:
        uniform_backward_step = backward_step
    return PipelineStepFunctions(private("forward_step"), uniform_backward_step,
                                 private("check_first_val_step"), private("get_tensor_shapes"),
                                 private("deallocate_output_tensor"))


def forward_step_calc_loss() -> Callable[..., Any]:
    """megatron-core's ``forward_step_calc_loss``: the last stage's part of ``forward_step`` (the
    ``loss_func``, per-token normalisation, the forward data store), which the vocabulary-parallel
    runtime calls once the loss is reduced over the pipeline ranks (runtime/vocab_runtime.py)."""
    return private("forward_step_calc_loss")


# ------------------------------------------------------------------------------------- model
def vocab_parallel_cross_entropy_math() -> Any:
    """megatron-core's ``VocabParallelCrossEntropy``: the static methods of its vocab-parallel cross
    entropy (``calculate_logits_max``, ``calculate_predicted_logits``, ``calculate_cross_entropy_loss``,
    ``prepare_gradient_calculation_operands``, ``calculate_gradients``), which take no process group;
    :mod:`megatron_zb.model.vocab_parallel` runs them with its own collectives over the pipeline group.
    The same class and methods in 0.16.1 and 0.19."""
    return private("VocabParallelCrossEntropy")


def initialize_affine_weight_cpu(weight: "torch.Tensor", output_size: int, input_size: int,
                                 per_partition_size: int, partition_dim: int, init_method: Callable[..., Any], *,
                                 params_dtype: "torch.dtype", rank: int, world_size: int) -> None:
    """Fill ``weight`` (this tensor-parallel rank's slice, ``per_partition_size`` rows or columns along
    ``partition_dim`` of the full ``output_size x input_size`` weight) as megatron-core's CPU
    initialisation does: draw the full weight with ``init_method`` from the current torch RNG, keep
    ``rank``'s slice of ``world_size``. Sets no tensor-parallel attributes (the layer already has them).

    Private: ``tensor_parallel.layers._initialize_affine_weight_cpu`` (same signature in 0.16.1 and 0.19).
    """
    private("_initialize_affine_weight_cpu")(
        weight, output_size, input_size, per_partition_size, partition_dim, init_method,
        params_dtype=params_dtype, rank=rank, world_size=world_size, skip_set_tensor_parallel_attributes=True)


MODEL_NOTICES: dict[str, tuple[tuple[str, str], ...]] = {
    "0.16": (),
    "0.19": (("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),),
}
"""Per release: (logger, message start) of what constructing a ``GPTModel`` logs, addressed to whoever
chose the class. megatron-core 0.19 logs "GPTModel IS DEPRECATED ... use ``HybridModel``" (rank 0,
WARNING) in every ``GPTModel.__init__``; megatron-zb builds ``GPTModel`` chunks as Megatron-LM
core_v0.19.0's own ``pretrain_gpt.py`` does (``gpt_builders.py``), so the user has nothing to act on.
:func:`quiet_model_notices` drops it while megatron-zb builds its chunks, and only then (a
``GPTModel`` built elsewhere, e.g. by Megatron-LM's model provider, still logs it)."""


@contextlib.contextmanager
def quiet_model_notices() -> Iterator[None]:
    """Drop the installed release's :data:`MODEL_NOTICES` log records inside the ``with`` block."""
    import logging

    filters = []
    for name, start in MODEL_NOTICES[release()]:
        logger = logging.getLogger(name)
        f = (lambda r, start=start: not r.getMessage().startswith(start))
        logger.addFilter(f)
        filters.append((logger, f))
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
