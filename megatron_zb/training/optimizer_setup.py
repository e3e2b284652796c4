"""The optimizer of a run: megatron-core's optimizer (optionally post-validated) and LR scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megatron_zb.training.model_setup import ModelBundle
from megatron_zb.training.run_config import RunConfig
from megatron_zb.training.wiring import megatron_optimizer, wrap_post_validation

__all__ = ["OptimizerBundle", "build_optimizer"]


@dataclass(frozen=True)
class OptimizerBundle:
    """The optimizer side of a run.

    Attributes:
        optimizer: what the loop steps: megatron-core's optimizer, or with
            ``--enable-optimizer-post-validation`` the
            :class:`~megatron_zb.optimizer.PostValidationOptimizer` wrapping it.
        inner: megatron-core's optimizer (``get_megatron_optimizer``'s result).
        scheduler: megatron-core's ``OptimizerParamScheduler``; steps counted in samples
            (the iteration's global batch size per successful iteration, which grows with
            ``--rampup-batch-size``), as Megatron counts them; lengths from
            :meth:`~megatron_zb.training.run_config.RunConfig.scheduler_steps`.
        post_validation: whether ``optimizer`` is the post-validation wrapper.
    """

    optimizer: Any
    inner: Any
    scheduler: Any
    post_validation: bool

    def learning_rate(self) -> float:
        """The current learning rate (first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        # The wrapped optimizer's: the post-validation wrapper's get_loss_scale would validate first.
        return float(self.inner.get_loss_scale().item())


def build_optimizer(config: RunConfig, *, model: ModelBundle,
                    on_validation_report: Callable[[Any], None]) -> OptimizerBundle:
    """megatron-core's optimizer over ``model.all_modules`` (:func:`~megatron_zb.training.wiring.megatron_optimizer`),
    the chunks' gradients sharded with ``--data-parallel-sharding-strategy optim_grads``
    (:func:`~megatron_zb.runtime.sharded_grads.shard_gradients`), the post-validation wrapper when asked for, the LR
    scheduler; sets every chunk's ``grad_scale_func``.

    With post-validation, every validation of an earlier step (``begin_iteration``, ``validate``,
    or a method that validates first) calls ``on_validation_report`` with its
    :class:`~megatron_zb.optimizer.ValidationReport`: it fixes the LR schedule and that
    iteration's logged values.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optim = config.optim
    inner = megatron_optimizer(optim, precision=config.precision, parallel=config.parallel,
                               modules=model.all_modules)
    if config.parallel.data_parallel_sharding_strategy == "optim_grads":  # ZeRO-2: after the optimizer's set-up
        from megatron_zb.runtime.sharded_grads import read_gradients_from_shards, shard_gradients

        shard_gradients(list(model.modules), timeout_s=config.schedule.pipeline_timeout_seconds)
        read_gradients_from_shards(inner, list(model.modules))
    optimizer = inner
    if optim.post_validation is not None:
        optimizer = wrap_post_validation(optim.post_validation, inner, check_nonfinite=config.precision.checks_nan)
        optimizer.register_validation_hook(on_validation_report)
    for chunk in model.chunks:
        chunk.module.config.grad_scale_func = optimizer.scale_loss
    steps = config.scheduler_steps()  # the scheduler counts samples, as Megatron-LM's
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=optim.lr_warmup_init, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=steps.lr_warmup_steps, lr_decay_steps=steps.lr_decay_steps,
        lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=steps.wd_incr_steps, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=optim.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=optim.override_opt_param_scheduler,
        wsd_decay_steps=steps.wsd_decay_steps, lr_wsd_decay_style=optim.lr_wsd_decay_style)
    return OptimizerBundle(optimizer=optimizer, inner=inner, scheduler=scheduler,
                           post_validation=optim.post_validation is not None)
