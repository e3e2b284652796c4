"""The precision, optimizer, post-validation and learning-rate schedule sections of the run
configuration. The post-validation section is the optimizer's own
:class:`~megatron_zb.optimizer.values.PostValidationConfig` (one definition, re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_zb.optimizer.values import PostValidationConfig

from .fields import read_section

__all__ = ["OptimConfig", "PostValidationConfig", "PrecisionConfig", "SchedulerSteps"]


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision (``--fp16`` / ``--bf16`` and loss scaling)."""

    fp16: bool = False
    """``--fp16``."""
    bf16: bool = False
    """``--bf16``."""
    loss_scale: float | None = None
    """``--loss-scale``: a static loss scale (fp16); ``None``: dynamic."""
    initial_loss_scale: float = 2.0 ** 32
    """``--initial-loss-scale`` of the dynamic loss scaler."""
    min_loss_scale: float = 1.0
    """``--min-loss-scale`` of the dynamic loss scaler."""
    loss_scale_window: float = 1000
    """``--loss-scale-window``: clean steps before the dynamic loss scale grows [iterations]."""
    hysteresis: int = 2
    """``--hysteresis``: overflowing steps tolerated before the dynamic loss scale shrinks."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """``--accumulate-allreduce-grads-in-fp32`` (implied by ``--bf16``, see :attr:`grad_reduce_in_fp32`)."""
    grad_reduce_in_bf16: bool = False
    """``--grad-reduce-in-bf16``: with bf16, gradients accumulated and reduced in bf16."""
    check_for_nan_in_loss_and_grad: bool = True
    """``--check-for-nan-in-loss-and-grad`` / ``--no-check-for-nan-in-loss-and-grad`` (Megatron-LM's dest): check
    every micro batch's loss and every gradient bucket's norm for NaN/Inf and stop the run on one
    (:mod:`megatron_zb.training.nan_check`); validation turns it off for fp16 with dynamic loss scaling, and
    :attr:`checks_nan` applies that rule to sections built directly."""

    @property
    def checks_nan(self) -> bool:
        """Whether the NaN/Inf check runs: :attr:`check_for_nan_in_loss_and_grad`, except with fp16's dynamic
        loss scaling (no ``--loss-scale``), where an overflow is the loss scaler's signal (Megatron-LM's rule)."""
        return self.check_for_nan_in_loss_and_grad and not (self.fp16 and not self.loss_scale)

    @property
    def params_dtype(self) -> torch.dtype:
        """The parameters' dtype: ``torch.float16`` / ``torch.bfloat16`` / ``torch.float32``."""
        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32

    @property
    def grad_reduce_in_fp32(self) -> bool:
        """Gradients accumulated and reduced in fp32: ``--accumulate-allreduce-grads-in-fp32``, which
        Megatron-LM turns on for bf16 -- and off for bf16 with ``--grad-reduce-in-bf16``."""
        if self.bf16 and self.grad_reduce_in_bf16:
            return False
        return self.accumulate_allreduce_grads_in_fp32 or self.bf16

    @classmethod
    def from_args(cls, args: Any) -> "PrecisionConfig":
        """The precision section of validated ``args``."""
        return read_section(cls, args)


@dataclass(frozen=True)
class SchedulerSteps:
    """Lengths of megatron-core's ``OptimizerParamScheduler``, which counts samples [samples]."""

    lr_warmup_steps: float
    """Linear warm-up (a float with ``--lr-warmup-fraction``, as Megatron-LM passes it)."""
    lr_decay_steps: int
    """Decay to ``--min-lr``."""
    wd_incr_steps: int
    """Weight decay's increment length: the whole run."""
    wsd_decay_steps: int | None = None
    """WSD's annealing phase, at the end of the decay (``None``: not given)."""


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule (Megatron-LM's "training" / "learning rate" flags)."""

    lr: float
    """``--lr``: peak learning rate."""
    optimizer: str = "adam"
    """``--optimizer``: ``"adam"`` or ``"sgd"``."""
    min_lr: float = 0.0
    """``--min-lr``."""
    weight_decay: float = 0.01
    """``--weight-decay``."""
    adam_beta1: float = 0.9
    """``--adam-beta1``."""
    adam_beta2: float = 0.999
    """``--adam-beta2``."""
    adam_eps: float = 1e-8
    """``--adam-eps``."""
    clip_grad: float = 1.0
    """``--clip-grad``: gradient-norm clipping (0: off)."""
    lr_warmup_iters: int = 0
    """``--lr-warmup-iters`` [iterations] (with ``--train-iters``)."""
    lr_decay_iters: int | None = None
    """``--lr-decay-iters`` [iterations] (validation: ``--train-iters``; ``None`` with ``--train-samples``)."""
    lr_warmup_samples: int = 0
    """``--lr-warmup-samples`` [samples] (with ``--train-samples``)."""
    lr_decay_samples: int | None = None
    """``--lr-decay-samples`` [samples] (validation: ``--train-samples``; ``None`` with ``--train-iters``)."""
    lr_warmup_init: float = 0.0
    """``--lr-warmup-init``: the learning rate the warm-up starts from (megatron-core's ``init_lr``)."""
    lr_warmup_fraction: float | None = None
    """``--lr-warmup-fraction``: the warm-up as a fraction of the decay length, instead of
    ``lr_warmup_iters`` / ``lr_warmup_samples`` (``None``: not given)."""
    lr_wsd_decay_style: str = "exponential"
    """``--lr-wsd-decay-style``: the annealing phase of ``--lr-decay-style WSD``."""
    lr_wsd_decay_iters: int | None = None
    """``--lr-wsd-decay-iters`` [iterations]: WSD's annealing phase (with ``--train-iters``)."""
    lr_wsd_decay_samples: int | None = None
    """``--lr-wsd-decay-samples`` [samples]: WSD's annealing phase (with ``--train-samples``)."""
    lr_decay_style: str = "linear"
    """``--lr-decay-style``."""
    decoupled_lr: float | None = None
    """``--decoupled-lr``: peak learning rate of the input embedding and the output layer (``None``: ``lr``)."""
    decoupled_min_lr: float | None = None
    """``--decoupled-min-lr``: their minimum learning rate (``None``: ``min_lr``)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """``--use-checkpoint-opt_param-scheduler``."""
    override_opt_param_scheduler: bool = False
    """``--override-opt_param-scheduler``."""
    post_validation: PostValidationConfig | None = None
    """With ``--enable-optimizer-post-validation``: its settings; ``None``: off."""
    log_num_zeros_in_grad: bool = False
    """``--log-num-zeros-in-grad``: megatron-core's ``OptimizerConfig.log_num_zeros_in_grad`` (the
    optimizer counts the zero gradient elements of each step) [elements]."""
    decoupled_weight_decay: bool = True
    """megatron-core's ``OptimizerConfig.decoupled_weight_decay``: AdamW (``True``) or Adam with L2
    weight decay (``False``). No Megatron-LM flag sets it (core_v0.16.1 and core_v0.19.0 train with
    AdamW): a run's is always ``True``; test harnesses build the section with ``False``."""

    def scheduler_steps(self, *, train_iters: int, train_samples: int | None,
                        global_batch_size: int) -> "SchedulerSteps":
        """The LR scheduler's lengths in samples, Megatron-LM's rule (``get_optimizer_param_scheduler``):
        iteration-based (``train_samples`` ``None``): iterations x ``global_batch_size`` (the final one);
        sample-based: the sample counts as given; ``--lr-warmup-fraction`` x the decay length either way;
        WSD's annealing phase likewise (``--lr-wsd-decay-iters`` / ``--lr-wsd-decay-samples``)."""
        if train_samples is None:
            decay = (self.lr_decay_iters if self.lr_decay_iters is not None else train_iters) * global_batch_size
            warmup: float = self.lr_warmup_iters * global_batch_size
            wd_incr = train_iters * global_batch_size
            wsd = self.lr_wsd_decay_iters * global_batch_size if self.lr_wsd_decay_iters is not None else None
        else:
            decay = self.lr_decay_samples if self.lr_decay_samples is not None else train_samples
            warmup, wd_incr, wsd = self.lr_warmup_samples, train_samples, self.lr_wsd_decay_samples
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return SchedulerSteps(lr_warmup_steps=warmup, lr_decay_steps=decay, wd_incr_steps=wd_incr,
                              wsd_decay_steps=wsd)

    @classmethod
    def from_args(cls, args: Any) -> "OptimConfig":
        """The optimizer section of validated ``args``."""
        pv = PostValidationConfig.from_args(args) if args.enable_optimizer_post_validation else None
        return read_section(cls, args, post_validation=pv, decoupled_weight_decay=True)  # no flag: AdamW
