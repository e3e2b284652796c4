"""The optimizer of a run: megatron-core's optimizer (optionally post-validated) and LR scheduler."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from megatron_zb.training.logging_utils import print_rank_0
from megatron_zb.training.model_setup import ModelBundle

__all__ = ["OptimizerBundle", "build_optimizer", "wrap_post_validation"]


@dataclass(frozen=True)
class OptimizerBundle:
    """The optimizer side of a run.

    Attributes:
        optimizer: what the loop steps: megatron-core's optimizer, or with
            ``--enable-optimizer-post-validation`` the
            :class:`~megatron_zb.optimizer.PostValidationOptimizer` wrapping it.
        inner: megatron-core's optimizer (``get_megatron_optimizer``'s result).
        scheduler: megatron-core's ``OptimizerParamScheduler``; steps counted in samples
            (``global batch size`` per successful iteration), as Megatron counts them.
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


def build_optimizer(args: argparse.Namespace, *, model: ModelBundle,
                    on_validation_report: Callable[[Any], None]) -> OptimizerBundle:
    """``get_megatron_optimizer(OptimizerConfig(...))`` over ``model.modules``, the post-validation
    wrapper when asked for, the LR scheduler; sets every chunk's ``grad_scale_func``.

    With post-validation, every validation of an earlier step (``begin_iteration``, ``validate``,
    or a method that validates first) calls ``on_validation_report`` with its
    :class:`~megatron_zb.optimizer.ValidationReport`: it fixes the LR schedule and that
    iteration's logged values.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, fp16=args.fp16, bf16=args.bf16, params_dtype=args.params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        use_distributed_optimizer=args.use_distributed_optimizer)
    inner = get_megatron_optimizer(cfg, model.modules, use_gloo_process_groups=args.distributed_backend != "gloo")
    optimizer = inner
    if args.enable_optimizer_post_validation:
        optimizer = wrap_post_validation(args, inner)
        optimizer.register_validation_hook(on_validation_report)
    for chunk in model.chunks:
        chunk.module.config.grad_scale_func = optimizer.scale_loss
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
    return OptimizerBundle(optimizer=optimizer, inner=inner, scheduler=scheduler,
                           post_validation=args.enable_optimizer_post_validation)


def wrap_post_validation(args: argparse.Namespace, inner: Any) -> Any:
    """``inner`` wrapped in :class:`~megatron_zb.optimizer.PostValidationOptimizer`; rank 0 prints the settings.

    Reads ``enable_exactly_numeric_match``, ``post_validation_warmup_iters``,
    ``post_validation_fallback_clean_iters`` (iterations) and ``distributed_timeout_minutes`` from
    ``args`` (also Megatron-LM's parsed arguments: ``megatron_zb.megatron_lm_optimizer``). Collective."""
    from megatron_zb.optimizer import PostValidationOptimizer

    optimizer = PostValidationOptimizer(
        inner, exact=args.enable_exactly_numeric_match, warmup_iters=args.post_validation_warmup_iters,
        clean_iters_required=args.post_validation_fallback_clean_iters,
        timeout=60.0 * args.distributed_timeout_minutes)
    clean = args.post_validation_fallback_clean_iters
    mode = "exact" if args.enable_exactly_numeric_match else "in-place"
    print_rank_0(f"> optimizer post-validation ({mode} rollback): synchronous steps in the first "
                 f"{args.post_validation_warmup_iters} iteration(s) (--post-validation-warmup-iters) and "
                 + (f"after a clipped or inf/nan step until {clean} consecutive clean one(s)" if clean else
                    "never after a clipped or inf/nan step")
                 + " (--post-validation-fallback-clean-iters)")
    return optimizer
