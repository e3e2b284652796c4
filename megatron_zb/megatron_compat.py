"""Every private megatron-core API megatron-zb touches, in one place.

megatron-zb is a plugin: it imports megatron-core's public API freely, but some of what it needs
is private (underscore names, module internals, functions megatron-core does not export, objects it
patches). Each such use lives here, under the part of megatron-zb that needs it, so that one file
is reviewed at each megatron-core upgrade (pinned: megatron-core 0.16.1). Anything here may break
on upgrade; nothing outside this module reaches into megatron-core's private names.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------- runtime
# (the weight-gradient store's routes into megatron-core's layers, the executor's use of the
# schedules module's internals)
# Public and used directly elsewhere: megatron.core.parallel_state getters (incl.
# get_global_memory_buffer), megatron.core.utils.get_model_config / get_model_type,
# megatron.core.pipeline_parallel.get_forward_backward_func, megatron.core.tensor_parallel's
# exported layers.
import re  # noqa: E402
from typing import Any, Callable, NamedTuple  # noqa: E402

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
linear route's ``backward`` reads; ``tests/test_routes.py`` checks they are still set."""


def linear_custom_bwd() -> Callable[..., Any]:
    """The ``custom_bwd`` decorator megatron-core's linear backward carries (autocast state)."""
    from megatron.core.tensor_parallel import layers

    return layers.custom_bwd


def prepare_wgrad_inputs() -> Callable[..., Any]:
    """``megatron.core.utils.prepare_input_tensors_for_wgrad_compute``: the 3-D to 2-D reshape the
    linear backward applies to ``(grad_output, total_input)`` before the weight-gradient GEMM."""
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    return prepare_input_tensors_for_wgrad_compute


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


class PipelineStepFunctions(NamedTuple):
    """Per-microbatch helpers of ``megatron.core.pipeline_parallel.schedules`` (not exported by
    ``megatron.core.pipeline_parallel``; their signatures change between releases)."""

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
    from megatron.core.pipeline_parallel import schedules

    return PipelineStepFunctions(schedules.forward_step, schedules.backward_step,
                                 schedules.check_first_val_step, schedules.get_tensor_shapes,
                                 schedules.deallocate_output_tensor)


# ---------------------------------------------------------------------------- platform shim
# (what the CPU shim replaces inside megatron-core when CUDA is absent; see
# megatron_zb/platform/cpu_shim.py and docs/cpu_support.md for why each is patched)

CUDA_FACTORY_MODULES: tuple[str, ...] = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = torch.zeros(..., device="cuda")
    "megatron.core.optimizer.optimizer",  # FP32Optimizer._scale, mixed-precision found_inf
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors (fp16 only)
    "megatron.core.optimizer.clip_grads",  # grad-norm and dummy-overflow buffers
    "megatron.core.dist_checkpointing.exchange_utils",  # exchange buffers for fully-parallel load
    "megatron.core.transformer.utils",  # get_default_causal_mask (attention_mask=None, causal)
    "megatron.core.utils",  # local_multi_tensor_l2_norm: grad-norm for clip_grads without apex/TE
    "megatron.core.rerun_state_machine",  # RerunStateMachine._reduce_any: torch.tensor(..., device="cuda"), every step
    "megatron.core.tensor_parallel.data",  # _build_key_size_numel_dictionaries: sizes_cuda (broadcast_data, TP > 1)
)
"""megatron-core modules whose module-global ``torch`` the CPU shim replaces (they create
tensors with ``device="cuda"``)."""

TENSOR_CUDA_CALLERS: tuple[str, ...] = ("megatron.core.",)
"""Module prefixes whose ``Tensor.cuda()`` calls the CPU shim answers with the CPU tensor (more can be
added at run time with ``cpu_shim.allow_tensor_cuda_from``, e.g. by a harness running Megatron-LM)."""

TYPE_NAME_CALLERS: tuple[str, ...] = ("megatron.core.optimizer.",)
"""Module prefixes whose code classifies parameters by ``Tensor.type()`` names (``torch.cuda.*``)."""

RNG_MODULE: str = "megatron.core.tensor_parallel.random"
"""The module of megatron's RNG tracker; also the name of the logger whose fork warning the shim drops."""

RNG_STATE_HELPERS: tuple[str, str] = ("_get_cuda_rng_state", "_set_cuda_rng_state")
"""Private (get, set) CUDA RNG state helpers of :data:`RNG_MODULE` the shim replaces."""


MOE_TE_NAMES: tuple[str, tuple[str, ...]] = ("megatron.core.transformer.moe.moe_utils", ("te_general_gemm",))
"""(module, names): Transformer Engine functions ``moe_utils`` tests with ``is not None`` but only
defines when TE imports (the router's ``RouterGatingLinearFunction``); the shim sets them to ``None``."""

CUDA_STREAM_MODULES: tuple[str, ...] = (
    "megatron.core.transformer.moe.token_dispatcher",  # alltoall: torch.cuda.Stream() at construction
)
"""megatron-core modules whose module-global ``torch`` the CPU shim replaces by a stand-in whose
``torch.cuda`` has CPU streams (``Stream``, ``current_stream``, ``stream``: one synchronous stream)."""

MOE_HOST_COPY: tuple[str, str] = ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu")
"""(module, name) of the alltoall dispatcher's device-to-host copy of its split sizes. It converts
to NumPy only tensors that are on CUDA, so on CPU the split sizes stay tensors, which
``all_to_all_single`` rejects; the shim's version converts CPU tensors too when asked for NumPy."""


P2P_LAUNCHERS: tuple[str, tuple[str, ...]] = (
    "megatron.core.pipeline_parallel.p2p_communication", ("_p2p_ops", "_batched_p2p_ops"))
"""(module, names) of megatron-core's point-to-point launchers: keyword-only ``tensor_send_prev`` /
``tensor_send_next`` (and the receive buffers, group, ranks); ``P2PCommunicator._communicate`` looks
them up in the module at every call. The CPU shim wraps them so each send holds its own view of the
data (``deallocate_output_tensor`` may run before the send completes; docs/cpu_support.md)."""


def torch_norm_class() -> type:
    """``WrappedTorchNorm`` (the local spec's norm without apex); the shim wraps its ``__new__``."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def sharded_tensor_class() -> type:
    """``dist_checkpointing``'s ``ShardedTensor``; the shim wraps its ``init_data``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor


# --------------------------------------------------------------------------------- optimizer
# (what post-validation reads and calls inside megatron-core's optimizers)
# Callers: megatron_zb.optimizer.grad_stats and megatron_zb.optimizer.parts. Each function mirrors
# a named piece of megatron-core 0.16.1 (megatron/core/optimizer/{optimizer,clip_grads}.py);
# re-read that piece at an upgrade. Public megatron-core names (classes, config fields,
# get_grad_stats_parallel_group, clip_grad_by_total_norm_fp32, ...) are used directly there.
from typing import TYPE_CHECKING, Any  # noqa: E402  (this section's own imports)

if TYPE_CHECKING:
    import torch


def multi_tensor_l2_norm(grads: list["torch.Tensor"], overflow_buf: "torch.Tensor") -> "torch.Tensor":
    """The L2 norm of ``grads`` (not squared; a 1-element fp32 tensor) computed by the
    multi-tensor kernel that ``megatron.core.optimizer.clip_grads`` picked at import (Transformer
    Engine, apex or its local fallback), called exactly as ``get_grad_norm_fp32`` calls it.

    Private: ``clip_grads.multi_tensor_applier`` and ``clip_grads.l2_norm_impl`` are that module's
    internals. ``overflow_buf``: a 1-element int tensor, as megatron's ``dummy_overflow_buf``.
    """
    from megatron.core.optimizer import clip_grads

    grad_norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow_buf, [list(grads)], False)
    return grad_norm


def copy_model_grads_to_main_grads(optimizer: Any) -> None:
    """``MixedPrecisionOptimizer._copy_model_grads_to_main_grads()`` (Float16 / distributed
    optimizer): the first step of its ``prepare_grads``, no collective."""
    optimizer._copy_model_grads_to_main_grads()


def unscale_main_grads_locally_(optimizer: Any, found_inf: "torch.Tensor") -> None:
    """``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan()`` without its all-reduce
    of the flag and without resetting it: unscale the main grads in place by the grad scaler's
    ``inv_scale``; set ``found_inf`` (1-element fp32, caller-zeroed) to 1 if any is inf/nan."""
    import torch

    main_grads = optimizer._collect_main_grad_data_for_unscaling()
    if main_grads:
        torch._amp_foreach_non_finite_check_and_unscale_(main_grads, found_inf, optimizer.grad_scaler.inv_scale)


def copy_main_params_to_model_params(optimizer: Any) -> None:
    """The copy half of ``MixedPrecisionOptimizer.step_with_ready_grads()``: refresh the model
    params (or, with ``reuse_grad_buf_for_mxfp8_param_ag``, the param buffer unless the param
    gather is overlapped) from the fp32 main params. No collective."""
    if optimizer.config.reuse_grad_buf_for_mxfp8_param_ag:
        if not optimizer.config.overlap_param_gather:
            optimizer._copy_main_params_to_param_buffer()
    else:
        optimizer._copy_main_params_to_model_params()


# ---------------------------------------------------------------------------------- training
# (megatron-core internals the training loop, data and checkpointing code rely on)


def fix_gpt_dataset_mask_cache() -> None:
    """Make megatron-core's ``GPTDataset`` loss mask depend on the sample only (idempotent).

    megatron-core 0.16.1 caches the masks of the first sample a ``GPTDataset`` object serves
    (when no EOD/reset option makes them sample-dependent), but the cached loss mask *is* the
    tensor returned for that sample, and ``__getitem__`` then zeroes its padded-label positions in
    place. Every later sample inherits the first sample's padding zeros, so the loss mask depends
    on which sample was read first -- a resumed run (or another rank) masks differently from an
    uninterrupted one. Mock data hits it whenever a token equals the tokenizer's PAD id. The
    cacheable mask is all ones, so after the first ``__getitem__`` the cache is reset to that.

    Private: ``GPTDataset.masks_and_position_ids_are_cacheable`` / ``..._are_cached`` /
    ``cached_loss_mask``; patches ``GPTDataset.__getitem__`` (``MockGPTDataset`` inherits it).
    """
    import torch
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if getattr(GPTDataset.__getitem__, "_megatron_zb_mask_fix", False):
        return
    original = GPTDataset.__getitem__

    def __getitem__(self, idx):  # type: ignore[no-untyped-def]
        first = self.masks_and_position_ids_are_cacheable and not self.masks_and_position_ids_are_cached
        out = original(self, idx)
        if first and self.cached_loss_mask is not None:
            self.cached_loss_mask = torch.ones_like(self.cached_loss_mask)
        return out

    __getitem__._megatron_zb_mask_fix = True  # type: ignore[attr-defined]
    __getitem__.__doc__ = original.__doc__
    GPTDataset.__getitem__ = __getitem__


def quiet_mock_dataset_cache_notice() -> None:
    """Drop megatron-core's "... because path_to_cache is None" log record of ``MockGPTDataset``.

    Mock datasets are never cached; megatron-core logs that once per split. Private: the logger
    name and the message text of ``megatron.core.datasets.gpt_dataset``.
    """
    import logging

    logging.getLogger("megatron.core.datasets.gpt_dataset").addFilter(
        lambda r: "because path_to_cache is None" not in r.getMessage())


def chunk_float16_module(config: "TransformerConfig", module: "torch.nn.Module", *, first: bool,
                         last: bool) -> "Float16Module":
    """megatron-core's ``Float16Module`` deciding first/last by the chunk's stage, not the pipeline rank.

    megatron-core's own asks ``parallel_state`` (pipeline rank, virtual stage), which is wrong for
    V / interleaved chunks built with ``vp_stage=None``: e.g. on a V's rank 0 the last stage's
    loss would stay in half precision, on the last rank a middle chunk's output would become fp32.

    Private: overrides ``Float16Module.forward`` and uses its ``float16_convertor`` and ``module``
    attributes.
    """
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

    class ChunkFloat16Module(Float16Module):
        def forward(self, *inputs, fp32_output=True, **kwargs):  # type: ignore[no-untyped-def]
            if first:
                inputs = fp32_to_float16(inputs, self.float16_convertor)
            outputs = self.module(*inputs, **kwargs)
            if last and fp32_output is True:
                outputs = float16_to_fp32(outputs)
            return outputs

    return ChunkFloat16Module(config, module)


# ------------------------------------------------------------------------ transformer engine
# (what the Transformer Engine route reads inside TE modules and megatron-core's TE config;
# see megatron_zb/runtime/te_route.py and docs/transformer_engine.md). TE's public API used
# directly there: ``module.wgrad_store.delay_wgrad_compute()``, ``module.backward_dw()``,
# ``module.register_wgrad_accumulation_and_reduce_hooks(hook)`` (TE >= 2.7).


def te_queued_wgrad(module: Any) -> int:
    """Entries queued in a TE module's deferred weight-gradient FIFO.

    Private to TE: ``WeightGradStore.context`` is the ``queue.Queue`` that ``put`` fills and
    ``pop`` drains (``transformer_engine/pytorch/module/_common.py``, unchanged from TE 2.3 to
    2.18). One ``backward_dw()`` pops one entry (``LayerNormMLP``: two, fc2 then fc1);
    ``need_backward_dw()`` (TE >= 2.10) only says whether delaying is switched on.
    """
    context = module.wgrad_store.context
    return 0 if context is None else context.qsize()


def te_drop_queued_wgrad(module: Any) -> None:
    """Empty a TE module's deferred weight-gradient FIFO without running it (after a failed
    iteration; see :func:`te_queued_wgrad` for the private ``WeightGradStore.context``)."""
    context = module.wgrad_store.context
    while context is not None and not context.empty():
        context.get_nowait()


_TE_WEIGHT_NAME = re.compile(r"(fc[12]_)?weight\d*")


def te_delayed_weight_params(module: Any) -> tuple[Any, ...]:
    """The weights of a TE module whose gradients its ``backward_dw()`` computes: the module's
    ``weight_names`` (``Linear``, ``LayerNormLinear``), else its own parameters named ``weight``,
    ``weight<i>`` (``GroupedLinear``) or ``fc1_weight`` / ``fc2_weight`` (``LayerNormMLP``) --
    not a norm's ``layer_norm_weight``, whose gradient TE computes in the backward.

    With delaying on, the gradient TE's backward hands autograd for these is never the weight
    gradient: ``None``, a dummy with ``fuse_wgrad_accumulation`` under megatron-core DDP
    (``get_dummy_wgrad``), or -- ``GroupedLinear``, TE >= 2.8, without fusion -- the packed
    buffer the delayed GEMM will fill, uninitialised in B (``module/grouped_linear.py``).
    """
    names = getattr(module, "weight_names", None)
    if names is None:
        names = [n for n, _ in module.named_parameters(recurse=False) if _TE_WEIGHT_NAME.fullmatch(n)]
    return tuple(getattr(module, n) for n in names)


TE_OP_FUSER_CLASSES: tuple[str, ...] = ("TEFusedMLP",)
"""megatron-core's modules that run Transformer Engine's op fuser (``te.pytorch.ops``, whose
``BasicLinear`` has no delayed weight gradients): ``TEFusedMLP`` in
``megatron/core/extensions/transformer_engine.py``, chosen by
``get_gpt_layer_with_transformer_engine_spec(use_te_op_fuser=True)``. Matched by class name
(the class exists only where TE imports)."""


def set_delay_wgrad_compute(config: Any) -> None:
    """Set ``config.delay_wgrad_compute = True`` on an already validated ``TransformerConfig``.

    megatron-core 0.16.1 accepts ``delay_wgrad_compute`` only together with
    ``overlap_moe_expert_parallel_comm`` (an assertion in ``TransformerConfig.__post_init__``,
    ``megatron/core/transformer/transformer_config.py``); its TE wrappers
    (``megatron/core/extensions/transformer_engine.py``) read the field when they build a TE
    module (``delay_wgrad_compute=`` for TE >= 2.3) and in their ``backward_dw()``. Setting the
    field after validation -- before the model is built -- passes it to TE without the MoE-only
    check; no megatron-core file changes.
    """
    config.delay_wgrad_compute = True
