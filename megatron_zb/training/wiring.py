"""The one model / DDP / optimizer wiring, from the typed run configuration.

``pretrain_gpt_zb.py`` (:mod:`.model_setup`, :mod:`.optimizer_setup`), the test harnesses and the
benchmarks all wire megatron-core's pieces through these functions, so what the tests and the
benchmarks exercise is what a training run uses:

* :func:`gpt_config` / :func:`gpt_layer_spec` -- megatron-core's ``TransformerConfig`` and layer
  spec of a :class:`~.run_config.ModelConfig`;
* :func:`wrap_chunks` -- ``Float16Module`` (fp16/bf16), megatron-core ``DistributedDataParallel``
  (``disable_bucketing`` after the first chunk, as Megatron-LM) and the config hooks
  (``no_sync_func``, ``finalize_model_grads_func``, ``grad_sync_func`` with overlapped reduces);
* :func:`megatron_optimizer` -- ``get_megatron_optimizer`` over the wrapped chunks;
* :func:`wrap_post_validation` -- the post-validation wrapper (also used inside Megatron-LM's loop).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_zb.training.run_config import (ModelConfig, OptimConfig, ParallelConfig, PostValidationConfig,
                                             PrecisionConfig)

__all__ = ["ddp_config", "gpt_config", "gpt_layer_spec", "megatron_optimizer", "wrap_chunks", "wrap_post_validation"]


def gpt_config(model: ModelConfig, *, parallel: ParallelConfig, precision: PrecisionConfig) -> Any:
    """megatron-core's ``TransformerConfig`` (CPU initialisation, :func:`~megatron_zb.model.cpu_gpt_config`)."""
    from megatron_zb.model import cpu_gpt_config

    kwargs = model.transformer_config_kwargs()
    if model.moe is not None:
        kwargs.update(model.moe.transformer_config_kwargs(
            expert_model_parallel_size=parallel.expert_model_parallel_size))
    return cpu_gpt_config(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel, params_dtype=precision.params_dtype,
        pipeline_dtype=precision.params_dtype, fp16=precision.fp16, bf16=precision.bf16, **kwargs)


def gpt_layer_spec(model: ModelConfig) -> Any:
    """The transformer layer spec: Transformer Engine's with ``--transformer-impl transformer_engine``,
    else megatron-core's local spec for ``--qk-layernorm`` / ``--normalization`` /
    ``--multi-latent-attention`` (its core attention taking MLA's head sizes: :mod:`megatron_zb.model.mla`),
    with MoE MLPs on the layers ``--moe-layer-freq`` selects when the model has experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_zb.model.mla import mla_local_spec
    from megatron_zb.training.moe_setup import moe_layer_spec

    if model.transformer_impl == "transformer_engine":
        from megatron_zb.runtime.te_route import te_layer_spec

        return te_layer_spec(qk_layernorm=model.qk_layernorm)
    kwargs = dict(qk_layernorm=model.qk_layernorm, normalization=model.normalization,
                  multi_latent_attention=model.mla is not None)
    spec = moe_layer_spec(model.moe, local_spec_kwargs=kwargs) or get_gpt_layer_local_spec(**kwargs)
    return spec if model.mla is None else mla_local_spec(spec)


def ddp_config(parallel: ParallelConfig, precision: PrecisionConfig) -> Any:
    """megatron-core's ``DistributedDataParallelConfig`` of the run."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=precision.grad_reduce_in_fp32, overlap_grad_reduce=parallel.overlap_grad_reduce,
        overlap_param_gather=parallel.overlap_param_gather, use_distributed_optimizer=parallel.use_distributed_optimizer,
        bucket_size=parallel.ddp_bucket_size, average_in_collective=parallel.ddp_average_in_collective,
        check_for_nan_in_grad=precision.checks_nan)  # as Megatron-LM: --check-for-nan-in-loss-and-grad


def wrap_chunks(gpt_models: Sequence[torch.nn.Module], *, first_last: Sequence[tuple[bool, bool]],
                parallel: ParallelConfig, precision: PrecisionConfig, device: torch.device) -> list[Any]:
    """Wrap this rank's ``GPTModel`` chunks (stage order) as Megatron-LM does; set the config hooks.

    ``first_last``: per chunk, whether it holds the first / the last pipeline stage (Float16Module
    casts there). Returns the DDP-wrapped modules (the ``model`` list of ``forward_backward_func``).
    """
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    from megatron_zb.megatron_compat.training import chunk_float16_module

    cfg = ddp_config(parallel, precision)
    if cfg.check_for_nan_in_grad:  # its check reports through megatron-core's rerun state machine
        from megatron_zb.training.nan_check import rerun_state_machine

        rerun_state_machine()
    modules = []
    for i, (gpt, (first, last)) in enumerate(zip(gpt_models, first_last, strict=True)):
        module: Any = gpt
        if device.type == "cuda":
            module.cuda(device)
        if precision.fp16 or precision.bf16:
            module = chunk_float16_module(gpt.config, module, first=first, last=last)
        if parallel.data_parallel_sharding_strategy == "optim_grads":  # buckets on every stage and chunk
            from megatron_zb.runtime.sharded_grads import bucketed_ddp

            size = parallel.ddp_bucket_size or max(40_000_000, 1_000_000 * parallel.data_parallel_size)  # mcore's
            modules.append(bucketed_ddp(size, config=gpt.config, ddp_config=cfg, module=module))
        else:
            modules.append(DistributedDataParallel(config=gpt.config, ddp_config=cfg, module=module,
                                                   disable_bucketing=i > 0))
    no_sync = [m.no_sync for m in modules] if len(modules) > 1 else modules[0].no_sync
    grad_sync = [m.start_grad_sync for m in modules] if len(modules) > 1 else modules[0].start_grad_sync
    for gpt in gpt_models:
        gpt.config.no_sync_func = no_sync
        gpt.config.finalize_model_grads_func = finalize_model_grads
        if parallel.overlap_grad_reduce:  # Megatron's --align-grad-reduce (its default) for its own schedules
            gpt.config.grad_sync_func = grad_sync
    return modules


def megatron_optimizer(optim: OptimConfig, *, precision: PrecisionConfig, parallel: ParallelConfig,
                       modules: Sequence[Any]) -> Any:
    """``get_megatron_optimizer(OptimizerConfig(...))`` over the wrapped ``modules`` (no post-validation)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, decoupled_lr=optim.decoupled_lr, decoupled_min_lr=optim.decoupled_min_lr,
        fp16=precision.fp16, bf16=precision.bf16, params_dtype=precision.params_dtype,
        loss_scale=precision.loss_scale, initial_loss_scale=precision.initial_loss_scale,
        min_loss_scale=precision.min_loss_scale, loss_scale_window=precision.loss_scale_window,
        hysteresis=precision.hysteresis, use_distributed_optimizer=parallel.use_distributed_optimizer,
        log_num_zeros_in_grad=optim.log_num_zeros_in_grad, decoupled_weight_decay=optim.decoupled_weight_decay)
    return get_megatron_optimizer(cfg, list(modules), use_gloo_process_groups=parallel.distributed_backend != "gloo")


def wrap_post_validation(settings: PostValidationConfig, inner: Any, *, announce: bool = True,
                         check_nonfinite: bool = False) -> Any:
    """``inner`` wrapped in :class:`~megatron_zb.optimizer.PostValidationOptimizer`; with ``announce``
    rank 0 prints the settings; ``check_nonfinite``: the wrapper's ``check_nonfinite``
    (``--check-for-nan-in-loss-and-grad``: :attr:`PrecisionConfig.checks_nan`). Collective."""
    from megatron_zb.optimizer import PostValidationOptimizer
    from megatron_zb.training.logging_utils import print_rank_0

    optimizer = PostValidationOptimizer.from_config(inner, settings, check_nonfinite=check_nonfinite)
    if announce:
        clean = settings.clean_iters_required
        mode = "exact" if settings.exact else "in-place"
        print_rank_0(f"> optimizer post-validation ({mode} rollback): synchronous steps in the first "
                     f"{settings.warmup_iters} iteration(s) (--post-validation-warmup-iters) and "
                     + (f"after a clipped or inf/nan step until {clean} consecutive clean one(s)" if clean else
                        "never after a clipped or inf/nan step")
                     + " (--post-validation-fallback-clean-iters)")
    return optimizer
