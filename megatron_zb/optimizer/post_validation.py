"""Optimizer post-validation: step without the pipeline-wide all-reduce, validate one iteration later.

megatron-core's ``optimizer.step()`` needs two values reduced over *every* pipeline stage before
any stage may update: the fp16/bf16 inf/nan flag (``found_inf``, all-reduce MAX) and the gradient
norm for clipping (all-reduce SUM of squared norms), both over the optimizer's
grad-stats group (the model-parallel group; the whole distributed-optimizer instance with the
distributed optimizer). Every stage blocks there until the slowest stage has finished its
backward pass. :class:`PostValidationOptimizer` wraps a megatron-core optimizer and replaces that
blocking reduction by an asynchronous one (zero-bubble paper, arXiv 2401.10241, Sec. 4):

1. ``step()``: unscale the grads and check them for inf/nan locally, compute the local squared
   grad norm (and zero count), launch the *same* all-reduces megatron-core would run, over the
   same group, with ``async_op=True``; then step at once, assuming no clipping and no overflow.
2. ``begin_iteration()`` (call it before the next iteration's forward/backward; ``validate()``
   and ``finalize()`` do the same): wait for those reductions (with a timeout), update the loss
   scaler, and if clipping would have scaled the gradients or an inf/nan was found anywhere,
   roll the update back and redo it exactly as megatron-core's step would have done it.

See ``docs/post_validation.md`` for the data flow, what it saves and what it does not.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_zb.optimizer.rollback import (
    ExactSnapshot,
    InPlaceRecord,
    check_adam_invertible,
    group_hyperparams,
)

__all__ = [
    "PostValidationConfig",
    "PostValidationCounters",
    "PostValidationError",
    "PostValidationOptimizer",
    "PostValidationTimeout",
    "StepResult",
    "ValidationReport",
]


# ---------------------------------------------------------------------- public value types
@dataclass(frozen=True, kw_only=True)
class PostValidationConfig:
    """Settings of :class:`PostValidationOptimizer` (all keyword-only).

    Attributes:
        exact: rollback mode. True (``--enable-exactly-numeric-match``): before each eager step
            copy the params the inner optimizer updates (fp32 main params / their distributed
            shards) and their optimizer state; a rollback restores the copies, so every result
            is bitwise what megatron-core's synchronous step gives. False (in-place): store
            nothing; a rollback inverts the Adam/AdamW update algebraically from the post-step
            values and the gradients still in the grad buffers (torch ``Adam``/``AdamW`` only;
            agrees with the synchronous path to fp32 round-off).
        warmup_iters: the first ``warmup_iters`` steps use megatron-core's synchronous step
            (``pretrain_gpt_zb.py --post-validation-warmup-iters``).
        clean_iters_required: after a step that clipped or found an inf/nan, use the synchronous
            step until that many consecutive steps neither clipped nor overflowed (the
            published heuristic: 10); 0 never falls back
            (``pretrain_gpt_zb.py --post-validation-fallback-clean-iters``).
        timeout: seconds any wait of the wrapper may block (the asynchronous reductions and the
            stage-local agreement reduction). On expiry :class:`PostValidationTimeout` is raised;
            the process group is then unusable, as after any collective timeout.
        sync_on_local_clip: when this stage's own part of the squared grad norm already proves
            that clipping will fire (the global norm is at least the local one), wait for the
            global norm inside ``step()`` and step correctly instead of stepping eagerly and
            rolling back.
    """

    exact: bool
    warmup_iters: int = 10
    clean_iters_required: int = 10
    timeout: float = 600.0
    sync_on_local_clip: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.exact, bool):
            raise TypeError(f"exact must be a bool, got {self.exact!r}")
        if self.warmup_iters < 0 or self.clean_iters_required < 0:
            raise ValueError("warmup_iters and clean_iters_required must be >= 0")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")


class StepResult(NamedTuple):
    """megatron-core's ``step()`` return value: ``(update_successful, grad_norm, num_zeros_in_grad)``."""

    update_successful: bool
    grad_norm: float | None
    num_zeros_in_grad: float | int | None


@dataclass(frozen=True)
class ValidationReport:
    """What validation found for one post-validated step.

    Attributes:
        iteration: 0-based index of the ``step()`` call validated.
        result: what megatron-core's synchronous ``step()`` returns for that iteration.
        provisional: what ``step()`` returned (``(True, None, None)`` after an eager update,
            ``(False, None, None)`` when this stage already saw an inf/nan).
        clipped: clipping scaled the gradients (the step was redone with clipped grads).
        found_inf: an inf/nan was found on some rank (the step is skipped).
        rolled_back: this rank undid an update it had applied eagerly.
    """

    iteration: int
    result: StepResult
    provisional: StepResult
    clipped: bool
    found_inf: bool
    rolled_back: bool

    @property
    def changed(self) -> bool:
        """The validated ``update_successful`` differs from the provisional one: a training loop
        that acted on the provisional value (e.g. advanced an LR schedule) must undo that."""
        return self.result.update_successful != self.provisional.update_successful


@dataclass
class PostValidationCounters:
    """Event counts (see :meth:`PostValidationOptimizer.counters`).

    ``rollbacks`` and its split are this rank's (a stage that saw the inf/nan itself never
    applied the update and has nothing to roll back); the others are the same on every rank.
    """

    eager_steps: int = 0  #: steps that took the post-validated path (not megatron's synchronous step)
    sync_steps: int = 0  #: megatron-core's synchronous step (warm-up / after clipping)
    local_clip_syncs: int = 0  #: eager iterations that waited in step() because the local norm proved clipping
    rollbacks: int = 0  #: eager updates this rank undid (clip redo or inf/nan skip)
    clip_rollbacks: int = 0
    inf_rollbacks: int = 0
    clipped_iterations: int = 0  #: validated steps whose gradients were clipped
    skipped_iterations: int = 0  #: validated steps skipped for inf/nan (update_successful False)

    def add(self, other: "PostValidationCounters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class PostValidationError(RuntimeError):
    """Post-validation cannot guarantee the synchronous result (misuse or unsupported setup)."""


class PostValidationTimeout(PostValidationError, TimeoutError):
    """A wait of :class:`PostValidationOptimizer` passed its ``timeout``."""


# ---------------------------------------------------------------------- internals
@dataclass
class _Pending:
    """One eager step awaiting validation."""

    iteration: int
    provisional: StepResult
    stepped: bool  # this rank applied the update
    local_inf: bool  # this stage (agreement group) saw an inf/nan
    found: torch.Tensor | None  # per-part found_inf flags, all-reduced MAX over the grad-stats group
    found_work: Any
    norm_sq: torch.Tensor | None  # squared grad norm, all-reduced SUM (exactly megatron's tensor)
    norm_work: Any
    local_norm_sq: float | None  # this rank's own squared norm, to check the grads were kept
    zeros: torch.Tensor | None
    zeros_work: Any
    hyperparams: list[list[dict[str, Any]]]  # per part, per param group: the step's lr, wd, betas, ...
    undo: list[Any]  # per part: ExactSnapshot / InPlaceRecord / None


def _stats_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_sq_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's squared L2 norm of ``grads`` computed as megatron-core's ``get_grad_norm_fp32``
    does before its all-reduce (same multi-tensor kernel, same ``** 2.0``)."""
    from megatron.core.optimizer import clip_grads

    if grads:
        dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=_stats_device())
        grad_norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, dummy_overflow_buf, [list(grads)], False)
    else:
        grad_norm = torch.zeros(1, dtype=torch.float, device=_stats_device())
    return grad_norm ** 2.0


def _local_zeros(params: Sequence[torch.Tensor], tp_group: Any) -> torch.Tensor:
    """This rank's zero count as megatron-core's ``count_zeros_fp32`` accumulates it."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    total = torch.zeros(1, dtype=torch.float, device=_stats_device())
    for param in params:
        if (getattr(param, "grad", None) is not None and param_is_not_shared(param)
                and param_is_not_tensor_parallel_duplicate(param, tp_group=tp_group)):
            grad = param.grad.detach()
            total = (grad.numel() - torch.count_nonzero(grad)) + total
    return total


def _ranks(group: Any) -> list[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _same_group(a: Any, b: Any) -> bool:
    return a is b or _ranks(a) == _ranks(b)


def _stage_agreement_group(stats_group: Any, pp_group: Any, timeout: float) -> Any:
    """The ranks of ``stats_group`` at this rank's pipeline stage, as a process group (None if alone).

    Collective over the default group: every rank gathers every rank's (stats-group ranks, pp
    rank) and creates the same sub-groups in the same order.
    """
    me = dist.get_rank()
    pp_ranks = _ranks(pp_group)
    info: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(info, (tuple(_ranks(stats_group)), pp_ranks.index(me)))
    wanted = set()
    for members, stage in info:
        wanted.add(tuple(sorted(r for r in members if info[r][1] == stage)))
    mine = tuple(sorted(r for r in info[me][0] if info[r][1] == info[me][1]))
    result = None
    for members in sorted(wanted):
        if len(members) > 1:
            pg = dist.new_group(list(members), timeout=datetime.timedelta(seconds=timeout))
            if members == mine:
                result = pg
    return result


# ---------------------------------------------------------------------- the wrapper
_VALIDATE_FIRST = (
    # Everything that reads or replaces the params, grads, optimizer state or loss scale.
    "load_state_dict", "reload_model_params", "save_parameter_state", "load_parameter_state",
    "get_loss_scale", "scale_loss", "prepare_grads", "step_with_ready_grads", "get_grad_norm",
    "clip_grad_norm", "count_zeros", "offload_to_cpu", "restore_from_cpu",
)


class PostValidationOptimizer:
    """Wrap a megatron-core optimizer; step without the pipeline-wide all-reduce; validate later.

    ``optimizer`` is what ``get_megatron_optimizer(OptimizerConfig(...), model_chunks)`` returns
    (a ``ChainedOptimizer``), or one ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` /
    ``DistributedOptimizer``: fp32, bf16 or fp16 (dynamic or constant loss scale), with or
    without the distributed optimizer, over megatron-core DDP grad buffers. Exact mode works for
    any inner ``torch.optim`` optimizer; in-place mode needs torch ``Adam``/``AdamW``.

    Construction is collective over the default process group (it creates the stage-local
    agreement groups). Keyword arguments are the fields of :class:`PostValidationConfig`; use
    :meth:`from_config` to pass one. ``pp_group`` is this rank's pipeline-parallel group
    (default: megatron's ``parallel_state``); it only decides which ranks share a stage.

    Training-loop protocol (one iteration)::

        opt.register_validation_hook(fix)  # once: fix(report) repairs what the loop did on a
                                           # provisional result, e.g. steps an LR schedule back
        ...
        opt.begin_iteration()              # validate the previous step (calls the hooks)
        for chunk in model: chunk.zero_grad_buffer()
        opt.zero_grad()
        losses = forward_backward_func(...)
        update_successful, grad_norm, num_zeros = opt.step()   # provisional while pending

    Everything else of the wrapped optimizer is reachable through this object; methods that read
    or replace params, grads, optimizer state or the loss scale (``state_dict``,
    ``sharded_state_dict``, ``load_state_dict``, ``zero_grad``, ``get_loss_scale``, ...) validate first.
    """

    def __init__(self, optimizer: Any, *, exact: bool, warmup_iters: int = 10, clean_iters_required: int = 10,
                 timeout: float = 600.0, sync_on_local_clip: bool = True, pp_group: Any = None) -> None:
        self.__dict__["_optimizer"] = optimizer  # first: __getattr__ forwards to it
        self.pv_config = PostValidationConfig(exact=exact, warmup_iters=warmup_iters,
                                              clean_iters_required=clean_iters_required, timeout=timeout,
                                              sync_on_local_clip=sync_on_local_clip)
        self._inspect(optimizer)
        if pp_group is None:
            from megatron.core import parallel_state
            pp_group = parallel_state.get_pipeline_model_parallel_group()
        self._pp_group = pp_group
        self._agree_group = _stage_agreement_group(self._stats_group, pp_group, timeout)
        self._iteration = 0
        self._pending: _Pending | None = None
        self._sync_until_clean = False
        self._clean_streak = 0
        self._total = PostValidationCounters()
        self._interval = PostValidationCounters()
        self._hooks: list[Callable[[ValidationReport], None]] = []
        self.last_report: ValidationReport | None = None

    @classmethod
    def from_config(cls, optimizer: Any, config: PostValidationConfig, *, pp_group: Any = None) -> "PostValidationOptimizer":
        """Build from a :class:`PostValidationConfig`."""
        return cls(optimizer, pp_group=pp_group, **{f.name: getattr(config, f.name) for f in fields(config)})

    # ------------------------------------------------------------------ setup
    def _inspect(self, optimizer: Any) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import (
            ChainedOptimizer,
            Float16OptimizerWithFloat16Params,
            FP32Optimizer,
            MixedPrecisionOptimizer,
        )

        if isinstance(optimizer, PostValidationOptimizer):
            raise TypeError("optimizer is already a PostValidationOptimizer")
        if isinstance(optimizer, ChainedOptimizer):
            self._kind = "chained"
            parts = list(optimizer.chained_optimizers)
        elif isinstance(optimizer, (FP32Optimizer, MixedPrecisionOptimizer)):
            self._kind = "fp32" if isinstance(optimizer, FP32Optimizer) else "mixed"
            parts = [optimizer]
        else:
            raise TypeError(f"unsupported optimizer {type(optimizer).__qualname__}: expected megatron-core's "
                            "ChainedOptimizer, FP32Optimizer, Float16OptimizerWithFloat16Params or DistributedOptimizer")
        if not parts:
            raise PostValidationError("the ChainedOptimizer holds no optimizer")
        for part in parts:
            if type(part) not in (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer):
                raise TypeError(f"unsupported optimizer part {type(part).__qualname__} (its step() is not the one "
                                "post-validation mirrors)")
            cfg = part.config
            if cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                raise NotImplementedError("precision-aware optimizer (decoupled_grad, TE FusedAdam) is not supported")
            if cfg.overlap_param_gather_with_optimizer_step:
                raise NotImplementedError("overlap_param_gather_with_optimizer_step is not supported")
            if getattr(getattr(part, "ddp_config", None), "use_megatron_fsdp", False):
                raise NotImplementedError("megatron FSDP is not supported")
            if not self.pv_config.exact and not getattr(part, "is_stub_optimizer", False):
                check_adam_invertible(part.optimizer)
        self._parts = parts
        self._stats_group = parts[0].get_grad_stats_parallel_group()
        if not all(_same_group(p.get_grad_stats_parallel_group(), self._stats_group) for p in parts[1:]):
            raise NotImplementedError("optimizer parts with different grad-stats groups (expert-parallel MoE "
                                      "optimizers) are not supported")
        self._config = parts[0].config
        self._scaled = [isinstance(p, MixedPrecisionOptimizer) and p.grad_scaler is not None for p in parts]
        clip = self._config.clip_grad > 0.0
        # Which reductions megatron-core's step() runs (and so which values it returns).
        self._needs_norm = self._kind == "chained" or clip
        self._needs_zeros = bool(self._config.log_num_zeros_in_grad)

    # ------------------------------------------------------------------ forwarding
    def __getattr__(self, name: str) -> Any:
        optimizer = self.__dict__.get("_optimizer")
        if optimizer is None:
            raise AttributeError(name)
        value = getattr(optimizer, name)
        if name in _VALIDATE_FIRST and callable(value):
            def validated(*args: Any, **kwargs: Any) -> Any:
                self.validate()
                return value(*args, **kwargs)
            validated.__name__ = name
            validated.__doc__ = f"Validate any pending step, then ``{type(optimizer).__name__}.{name}``."
            return validated
        return value

    @property
    def optimizer(self) -> Any:
        """The wrapped megatron-core optimizer's inner ``torch.optim`` optimizer (as megatron exposes it)."""
        return self._optimizer.optimizer

    @property
    def wrapped(self) -> Any:
        """The wrapped megatron-core optimizer."""
        return self._optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:
        return self._optimizer.state

    @property
    def pending(self) -> bool:
        """A step awaits validation."""
        return self._pending is not None

    @property
    def iteration(self) -> int:
        """Number of ``step()`` calls so far."""
        return self._iteration

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Validate any pending step (it may need the grads), then the wrapped ``zero_grad``."""
        self.validate()
        self._optimizer.zero_grad(set_to_none)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Validate any pending step (finishing a rollback), then the wrapped ``state_dict``."""
        self.validate()
        return self._optimizer.state_dict(*args, **kwargs)

    def sharded_state_dict(self, model_sharded_state_dict: Any, is_loading: bool = False, **kwargs: Any) -> Any:
        """Validate any pending step (finishing a rollback), then the wrapped ``sharded_state_dict``."""
        self.validate()
        return self._optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)

    def register_validation_hook(self, hook: Callable[[ValidationReport], None]) -> Callable[[], None]:
        """Call ``hook(report)`` whenever a step is validated, whichever call triggered it
        (``begin_iteration``, ``state_dict``, ``zero_grad``, ...), before that call goes on.

        This is where a training loop repairs what it did on a provisional result: e.g. an LR
        schedule advanced on ``update_successful=True`` is stepped back when ``report.changed``.
        Because ``state_dict()`` validates first, a checkpoint then holds the repaired values.
        Returns a function that removes the hook.
        """
        self._hooks.append(hook)
        return lambda: self._hooks.remove(hook)

    def rollback_nbytes(self) -> int:
        """Bytes this rank keeps per eager step to be able to roll it back: in exact mode a copy of
        every param the inner optimizers update (fp32 main params / shards) and of its state
        tensors, as they are now; 0 in in-place mode (scalars aside)."""
        if not self.pv_config.exact:
            return 0
        from megatron_zb.optimizer.rollback import snapshot_nbytes

        total = 0
        for part in self._parts:
            if part.optimizer is not None:
                total += snapshot_nbytes(part.optimizer, all_params=True)
        return total

    # ------------------------------------------------------------------ counters
    def counters(self, *, interval: bool = False) -> PostValidationCounters:
        """A copy of the totals, or (``interval=True``) of the counts since :meth:`reset_interval_counters`."""
        src = self._interval if interval else self._total
        out = PostValidationCounters()
        out.add(src)
        return out

    def reset_interval_counters(self) -> PostValidationCounters:
        """Return the counts of the logging interval that ends now and start a new one."""
        out = self.counters(interval=True)
        self._interval = PostValidationCounters()
        return out

    def log_string(self, *, reset: bool = True) -> str:
        """``" post-validation rollbacks: I (T) | skipped iterations: I (T) |"`` for megatron's log
        line (I: this logging interval, T: total); ``reset`` starts a new interval."""
        i = self.reset_interval_counters() if reset else self.counters(interval=True)
        t = self._total
        return (f" post-validation rollbacks: {i.rollbacks} ({t.rollbacks}) |"
                f" skipped iterations: {i.skipped_iterations} ({t.skipped_iterations}) |")

    def _count(self, **kw: int) -> None:
        for name, n in kw.items():
            setattr(self._total, name, getattr(self._total, name) + n)
            setattr(self._interval, name, getattr(self._interval, name) + n)

    # ------------------------------------------------------------------ mode
    def _eager_allowed(self) -> bool:
        if self._iteration < self.pv_config.warmup_iters:
            return False
        return not self._sync_until_clean

    def _observe(self, *, clipped: bool, found_inf: bool) -> None:
        """Track the clean streak that switches between the synchronous and the eager path."""
        if clipped or found_inf:
            self._clean_streak = 0
            self._sync_until_clean = self.pv_config.clean_iters_required > 0
            if clipped:
                self._count(clipped_iterations=1)
            if found_inf:
                self._count(skipped_iterations=1)
        else:
            self._clean_streak += 1
            if self._clean_streak >= self.pv_config.clean_iters_required:
                self._sync_until_clean = False

    def _clip_fires(self, grad_norm: float | None) -> bool:
        clip = self._config.clip_grad
        if clip <= 0.0 or grad_norm is None or not any(p.get_parameters() for p in self._parts):
            return False
        return clip / (grad_norm + 1.0e-6) < 1.0  # megatron-core's clip_grad_by_total_norm_fp32

    def _format(self, *, found_inf: bool, grad_norm: float | None, num_zeros: float | None,
                success: bool) -> StepResult:
        """The tuple megatron-core's step() of the wrapped type returns."""
        if found_inf:
            return StepResult(False, None, None)
        clip = self._config.clip_grad > 0.0
        if self._kind == "chained":
            return StepResult(success, grad_norm, num_zeros if self._needs_zeros else None)
        if self._kind == "mixed":
            return StepResult(success, grad_norm if clip else 0.0, num_zeros if self._needs_zeros else 0)
        return StepResult(success, grad_norm if clip else None, num_zeros if self._needs_zeros else None)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> StepResult:
        """Step: megatron-core's synchronous step during warm-up / after clipping, else eagerly.

        Returns megatron-core's ``(update_successful, grad_norm, num_zeros_in_grad)``; after an
        eager update it is provisional, ``(True, None, None)`` -- the validated values come from
        :meth:`begin_iteration` / :meth:`validate` (and :attr:`last_report`).
        """
        if self._pending is not None:
            raise PostValidationError(
                f"step() of iteration {self._iteration} while the step of iteration {self._pending.iteration} is "
                "still unvalidated: call begin_iteration() before the forward/backward of every iteration "
                "(the forward must not use parameters that may still be rolled back)")
        iteration = self._iteration
        eager = self._eager_allowed()
        self._iteration += 1
        if not eager:
            result = StepResult(*self._optimizer.step())
            found_inf = not result.update_successful
            clipped = (not found_inf) and self._clip_fires(result.grad_norm)
            self._count(sync_steps=1)
            self._observe(clipped=clipped, found_inf=found_inf)
            return result
        return self._eager_step(iteration)

    def _eager_step(self, iteration: int) -> StepResult:
        device = _stats_device()
        parts = self._parts
        # 1. megatron's prepare_grads, minus its blocking found_inf all-reduce and the scaler update.
        found = torch.zeros(len(parts), dtype=torch.float, device=device) if any(self._scaled) else None
        with self._no_timers():
            for i, part in enumerate(parts):
                self._prepare_grads_locally(part, None if found is None or not self._scaled[i] else found[i:i + 1])
        # 2. local grad statistics, exactly as megatron computes them before its all-reduces.
        grads_for_norm = [g for p in parts for g in p.get_main_grads_for_grad_norm()] if self._needs_norm else []
        norm_sq = _local_sq_norm(grads_for_norm) if self._needs_norm else None
        local_norm_sq = float(norm_sq.item()) if norm_sq is not None else None
        zeros = None
        if self._needs_zeros:
            if self._kind == "chained":
                zeros = _local_zeros([q for p in parts for q in p.get_parameters()], None)
            else:
                zeros = _local_zeros(parts[0].get_parameters(), getattr(parts[0], "tp_group", None))
        local_found = found.clone() if found is not None else None
        # 3. the pipeline-wide reductions, asynchronous: the same collectives on the same group.
        group = self._stats_group
        found_work = dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group, async_op=True) if found is not None else None
        norm_work = dist.all_reduce(norm_sq, op=dist.ReduceOp.SUM, group=group, async_op=True) if norm_sq is not None else None
        zeros_work = dist.all_reduce(zeros, op=dist.ReduceOp.SUM, group=group, async_op=True) if zeros is not None else None
        # 4. agree with the ranks of this stage (they share collectives in the update, e.g. the
        #    distributed optimizer's param all-gather) on the local decision.
        local_inf = bool(local_found is not None and local_found.sum().item() > 0)
        stage_norm_sq = local_norm_sq
        if self._agree_group is not None:
            vec = torch.tensor([1.0 if local_inf else 0.0, local_norm_sq or 0.0], dtype=torch.float64, device=device)
            self._wait(dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self._agree_group, async_op=True),
                       iteration, "stage agreement all-reduce")
            local_inf, stage_norm_sq = vec[0].item() > 0, vec[1].item()
        clip_certain = (not local_inf and self.pv_config.sync_on_local_clip and stage_norm_sq is not None
                        and self._clip_fires(math.sqrt(stage_norm_sq)))
        hyperparams = [group_hyperparams(p.optimizer) if p.optimizer is not None else [] for p in parts]
        pending = _Pending(iteration=iteration, provisional=StepResult(True, None, None), stepped=False,
                           local_inf=local_inf, found=found, found_work=found_work, norm_sq=norm_sq,
                           norm_work=norm_work, local_norm_sq=local_norm_sq, zeros=zeros, zeros_work=zeros_work,
                           hyperparams=hyperparams, undo=[None] * len(parts))
        self._count(eager_steps=1)
        if local_inf:
            # An inf/nan here is an inf/nan everywhere: skip now, nothing to roll back later.
            pending.provisional = StepResult(False, None, None)
            self._pending = pending
            return pending.provisional
        if clip_certain:
            # The global norm is at least this stage's: clipping will fire. Wait and step correctly.
            self._count(local_clip_syncs=1)
            self._pending = pending
            return self._finish(pending, immediate=True).result
        for i, part in enumerate(parts):
            if part.optimizer is not None and not part.is_stub_optimizer:
                pending.undo[i] = (ExactSnapshot if self.pv_config.exact else InPlaceRecord).capture(part.optimizer)
        pending.stepped = True
        with self._no_timers():
            success = self._optimizer.step_with_ready_grads()
        pending.provisional = StepResult(bool(success), None, None)
        self._pending = pending
        return pending.provisional

    @staticmethod
    def _prepare_grads_locally(part: Any, found: torch.Tensor | None) -> None:
        """megatron-core's ``prepare_grads`` without the all-reduce of found_inf and the scaler update."""
        from megatron.core.optimizer.optimizer import FP32Optimizer

        if isinstance(part, FP32Optimizer):
            part.prepare_grads()  # main_grad -> grad; no collective, no inf/nan check in fp32
            return
        if part.is_stub_optimizer:
            return
        part._copy_model_grads_to_main_grads()
        if found is not None:
            main_grads = part._collect_main_grad_data_for_unscaling()
            if main_grads:
                torch._amp_foreach_non_finite_check_and_unscale_(main_grads, found, part.grad_scaler.inv_scale)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> ValidationReport | None:
        """Finish the pending step: wait for the global state, update the loss scale, roll back
        and redo if needed. Returns its :class:`ValidationReport`, or None if nothing was pending."""
        if self._pending is None:
            return None
        return self._finish(self._pending)

    def begin_iteration(self) -> ValidationReport | None:
        """Call before each iteration's forward/backward: :meth:`validate` the previous step."""
        return self.validate()

    def finalize(self) -> ValidationReport | None:
        """Call at the end of training (or before anything reads the params): :meth:`validate`."""
        return self.validate()

    def _wait(self, work: Any, iteration: int, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.pv_config.timeout))
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise PostValidationTimeout(
                    f"post-validation of iteration {iteration}: the {what} did not complete within "
                    f"{self.pv_config.timeout:g} s (a rank of the optimizer's grad-stats group never reached "
                    f"its step?)") from e
            raise

    def _finish(self, pend: _Pending, *, immediate: bool = False) -> ValidationReport:
        """Validate ``pend``; ``immediate``: inside its own step() (the caller gets the final result)."""
        self._pending = None  # whatever happens next, this step is no longer pending
        it = pend.iteration
        for work, what in ((pend.found_work, "found-inf all-reduce"), (pend.norm_work, "grad-norm all-reduce"),
                           (pend.zeros_work, "zero-count all-reduce")):
            if work is not None:
                self._wait(work, it, what)
        # Loss scaler: each part with a scaler updates with its own flag, as in prepare_grads.
        found_inf = False
        if pend.found is not None:
            for i, part in enumerate(self._parts):
                if self._scaled[i]:
                    flag = pend.found[i].item() > 0
                    part.grad_scaler.update(flag)
                    found_inf |= flag
        if pend.local_inf and not found_inf:
            raise PostValidationError(f"iteration {it}: a local inf/nan was not found globally; the found-inf "
                                      "reduction and the local check disagree")
        grad_norm = None
        if not found_inf and pend.norm_sq is not None:
            grad_norm = pend.norm_sq.item() ** (1.0 / 2.0)  # as get_grad_norm_fp32
        clipped = (not found_inf) and self._clip_fires(grad_norm)
        num_zeros = pend.zeros.item() if pend.zeros is not None and not found_inf else None
        rolled_back = False
        success = True
        if found_inf:
            if pend.stepped:
                self._undo(pend, grads_needed=not self.pv_config.exact)
                with self._no_timers():
                    self._resync_model_params()
                rolled_back = True
                self._count(rollbacks=1, inf_rollbacks=1)
        elif clipped or not pend.stepped:
            if pend.stepped:
                self._undo(pend, grads_needed=True)
                rolled_back = True
                self._count(rollbacks=1, clip_rollbacks=1)
            if clipped:
                self._clip(grad_norm)
            with self._hyperparams_of(pend), self._no_timers():
                success = bool(self._optimizer.step_with_ready_grads())
        result = self._format(found_inf=found_inf, grad_norm=grad_norm, num_zeros=num_zeros, success=success)
        report = ValidationReport(iteration=it, result=result, provisional=result if immediate else pend.provisional,
                                  clipped=clipped, found_inf=found_inf, rolled_back=rolled_back)
        self._observe(clipped=clipped, found_inf=found_inf)
        self.last_report = report
        for hook in list(self._hooks):
            hook(report)
        return report

    def _check_grads_kept(self, pend: _Pending) -> None:
        """The redo needs the grads the eager step used: refuse if they were zeroed or changed."""
        if pend.local_norm_sq is None:
            return
        grads = [g for p in self._parts for g in p.get_main_grads_for_grad_norm()]
        now, then = float(_local_sq_norm(grads).item()), pend.local_norm_sq
        if not (now == then or (math.isnan(now) and math.isnan(then))):
            raise PostValidationError(
                f"iteration {pend.iteration} needs a rollback, but the gradients changed since its step "
                f"(squared norm {then!r} -> {now!r}): call begin_iteration() before "
                "zero_grad_buffer() / zero_grad() and the next forward/backward")

    def _undo(self, pend: _Pending, *, grads_needed: bool) -> None:
        """Restore (exact) or invert (in-place) the eager update of every part."""
        if grads_needed:
            self._check_grads_kept(pend)
        for undo, hps in zip(pend.undo, pend.hyperparams):
            if isinstance(undo, ExactSnapshot):
                undo.restore()
            elif isinstance(undo, InPlaceRecord):
                undo.invert(hps)

    def _resync_model_params(self) -> None:
        """After restoring main params without a redo: refresh the model params from them, as
        megatron-core's ``step_with_ready_grads`` does after the inner step."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import FP32Optimizer

        for part in self._parts:
            if part.is_stub_optimizer or isinstance(part, FP32Optimizer):
                continue
            if part.config.reuse_grad_buf_for_mxfp8_param_ag:
                if not part.config.overlap_param_gather:
                    part._copy_main_params_to_param_buffer()
            else:
                part._copy_main_params_to_model_params()
            if isinstance(part, DistributedOptimizer) and not part.ddp_config.overlap_param_gather:
                for chunk in part.model_chunks:
                    chunk.start_param_sync()

    def _clip(self, grad_norm: float) -> None:
        """megatron-core's clipping with the global norm (ChainedOptimizer.step / clip_grad_norm)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for part in self._parts:
            if part.is_stub_optimizer or part.config.clip_grad <= 0.0:
                continue
            params = part.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                                             use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    @contextlib.contextmanager
    def _no_timers(self) -> Iterator[None]:
        """Run megatron-core's optimizer internals without its timers: with
        ``barrier_with_L1_time`` they barrier on the default group, which cannot line up when
        stages take different paths (one rolls back in begin_iteration, another skipped)."""
        configs = {id(p.config): p.config for p in self._parts}
        saved = {k: c.timers for k, c in configs.items()}
        for c in configs.values():
            c.timers = None
        try:
            yield
        finally:
            for k, c in configs.items():
                c.timers = saved[k]

    @contextlib.contextmanager
    def _hyperparams_of(self, pend: _Pending) -> Iterator[None]:
        """Temporarily give the param groups the values they had at the step (an LR scheduler may
        have moved them on since); restore the current values afterwards."""
        groups = [list(p.optimizer.param_groups) if p.optimizer is not None else [] for p in self._parts]
        current = [[{k: g[k] for k in vals if k in g} for g, vals in zip(gs, vs)]
                   for gs, vs in zip(groups, pend.hyperparams)]
        for gs, vs in zip(groups, pend.hyperparams):
            for g, vals in zip(gs, vs):
                g.update(vals)
        try:
            yield
        finally:
            for gs, vs in zip(groups, current):
                for g, vals in zip(gs, vs):
                    g.update(vals)

    def __repr__(self) -> str:
        return (f"PostValidationOptimizer({type(self._optimizer).__name__}, {self.pv_config}, "
                f"iteration={self._iteration}, pending={self.pending})")
