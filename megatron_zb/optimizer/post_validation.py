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

See ``docs/post_validation.md`` for the data flow, what it saves and what it does not. This
module sequences the work of the package's other modules (listed in ``megatron_zb/optimizer/__init__.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from megatron_zb.optimizer.grad_stats import GradStatsInFlight, local_sq_norm, stage_agreement_group, stats_device
from megatron_zb.optimizer.parts import Hyperparams, OptimizerParts
from megatron_zb.optimizer.policy import StepPolicy
from megatron_zb.optimizer.rollback import ExactSnapshot, InPlaceRecord, snapshot_nbytes
from megatron_zb.optimizer.values import (
    PostValidationConfig,
    PostValidationCounters,
    PostValidationError,
    PostValidationTimeout,
    StepResult,
    ValidationReport,
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


@dataclass
class _Pending:
    """One eager step awaiting validation."""

    iteration: int
    provisional: StepResult
    stepped: bool  # this rank applied the update
    local_inf: bool  # this stage (agreement group) saw an inf/nan
    stats: GradStatsInFlight  # the step's grad statistics, being all-reduced over the grad-stats group
    hyperparams: Hyperparams  # the step's lr, wd, betas, ... (a redo / inversion needs them)
    undo: list[Any]  # per part: ExactSnapshot / InPlaceRecord / None

    @property
    def norm_work(self) -> Any:
        """The grad-norm all-reduce's handle (None if megatron-core's step computes no norm)."""
        return self.stats.norm_work


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

    ``check_nonfinite`` (``pretrain_gpt_zb.py``'s ``--check-for-nan-in-loss-and-grad``): an eager step is
    also an inf/nan step -- skipped where it is seen, rolled back elsewhere, ``found_inf`` in its report --
    when its gradient norm is not finite (any precision; without it fp32 and bf16 apply such a step, as
    megatron-core's own step does) or when a rank called :meth:`note_nonfinite` before it (its loss or its
    gradients failed the caller's check); the flag rides on the found-inf all-reduce. Synchronous steps
    are megatron-core's own: the caller checks before them (:attr:`next_step_eager`).
    """

    def __init__(self, optimizer: Any, *, exact: bool, warmup_iters: int = PostValidationConfig.warmup_iters,
                 clean_iters_required: int = PostValidationConfig.clean_iters_required,
                 timeout: float = PostValidationConfig.timeout,
                 sync_on_local_clip: bool = PostValidationConfig.sync_on_local_clip, pp_group: Any = None,
                 check_nonfinite: bool = False) -> None:
        self.__dict__["_optimizer"] = optimizer  # first: __getattr__ forwards to it
        self.pv_config = PostValidationConfig(exact=exact, warmup_iters=warmup_iters,
                                              clean_iters_required=clean_iters_required, timeout=timeout,
                                              sync_on_local_clip=sync_on_local_clip)
        if isinstance(optimizer, PostValidationOptimizer):
            raise TypeError("optimizer is already a PostValidationOptimizer")
        self._parts = OptimizerParts.inspect(optimizer, exact=exact)
        if pp_group is None:
            from megatron.core import parallel_state
            pp_group = parallel_state.get_pipeline_model_parallel_group()
        self._pp_group = pp_group
        self._agree_group = stage_agreement_group(self._parts.stats_group, pp_group, timeout)
        self._iteration = 0
        self._pending: _Pending | None = None
        self._policy = StepPolicy(warmup_iters=warmup_iters, clean_iters_required=clean_iters_required)
        self._total = PostValidationCounters()
        self._interval = PostValidationCounters()
        self._hooks: list[Callable[[ValidationReport], None]] = []
        self.last_report: ValidationReport | None = None
        self._check_nonfinite = check_nonfinite  # see the class docstring
        self._noted_nonfinite = False  # note_nonfinite() before the next eager step

    @classmethod
    def from_config(cls, optimizer: Any, config: PostValidationConfig, *, pp_group: Any = None,
                    check_nonfinite: bool = False) -> "PostValidationOptimizer":
        """Build from a :class:`PostValidationConfig` (``check_nonfinite``: see the class docstring)."""
        return cls(optimizer, pp_group=pp_group, check_nonfinite=check_nonfinite,
                   **{f.name: getattr(config, f.name) for f in fields(config)})

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

    @property
    def next_step_eager(self) -> bool:
        """Whether the next ``step()`` will be eager (post-validated); ask after validating the previous one."""
        return self._pending is None and self._policy.eager_allowed(self._iteration)

    def note_nonfinite(self, found: bool = True) -> None:
        """With ``check_nonfinite``: this rank found a NaN/Inf in the coming eager step's loss or gradients,
        so that step is skipped here and rolled back on every rank that took it (``found``: whether it did)."""
        if found and not self._check_nonfinite:
            raise PostValidationError("note_nonfinite() needs check_nonfinite=True")
        self._noted_nonfinite = found

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
        total = 0
        for part in self._parts.parts:
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

    def _observe(self, *, clipped: bool, found_inf: bool) -> None:
        """Feed a validated step (either path) to the policy and the counters."""
        self._policy.observe(clipped=clipped, found_inf=found_inf)
        if clipped:
            self._count(clipped_iterations=1)
        if found_inf:
            self._count(skipped_iterations=1)

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
        eager = self._policy.eager_allowed(iteration)
        noted, self._noted_nonfinite = self._noted_nonfinite, False
        if noted and not eager:
            raise PostValidationError(f"a NaN/Inf was noted for step {iteration}, which is synchronous: check "
                                      "next_step_eager and stop (or skip) before a synchronous step instead")
        self._iteration += 1
        if not eager:
            result = StepResult(*self._optimizer.step())
            found_inf = not result.update_successful
            clipped = (not found_inf) and self._parts.clip_fires(result.grad_norm)
            self._count(sync_steps=1)
            self._observe(clipped=clipped, found_inf=found_inf)
            return result
        return self._eager_step(iteration, noted=noted)

    def _eager_step(self, iteration: int, *, noted: bool = False) -> StepResult:
        parts = self._parts
        # 1. megatron's prepare_grads, minus its blocking found_inf all-reduce and the scaler update.
        found = parts.prepare_grads_locally()
        if self._check_nonfinite:  # one more flag on the same all-reduce: a NaN/Inf noted by the caller
            flag = torch.full((1,), 1.0 if noted else 0.0, dtype=torch.float, device=stats_device())
            found = flag if found is None else torch.cat([found, flag])
        # 2. local grad statistics, exactly as megatron computes them before its all-reduces;
        # 3. the pipeline-wide reductions, asynchronous: the same collectives on the same group.
        stats = GradStatsInFlight.launch(found=found,
                                         norm_sq=local_sq_norm(parts.grads_for_norm()) if parts.needs_norm else None,
                                         zeros=parts.local_zero_count() if parts.needs_zeros else None,
                                         group=parts.stats_group)
        if self._check_nonfinite and not _finite(stats.local_norm_sq):
            stats.local_found_inf = True  # this rank's gradients: a NaN/Inf is one everywhere
        # 4. agree with the ranks of this stage (they share collectives in the update, e.g. the
        #    distributed optimizer's param all-gather) on the local decision.
        local_inf, stage_norm_sq = stats.agree_in_stage(self._agree_group, timeout=self.pv_config.timeout,
                                                        iteration=iteration)
        clip_certain = (not local_inf and self.pv_config.sync_on_local_clip and stage_norm_sq is not None
                        and parts.clip_fires(math.sqrt(stage_norm_sq)))
        pending = _Pending(iteration=iteration, provisional=StepResult(True, None, None), stepped=False,
                           local_inf=local_inf, stats=stats, hyperparams=parts.hyperparams(),
                           undo=[None] * len(parts.parts))
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
        pending.undo = parts.capture_undo(exact=self.pv_config.exact)
        pending.stepped = True
        with parts.no_timers():
            success = self._optimizer.step_with_ready_grads()
        pending.provisional = StepResult(bool(success), None, None)
        self._pending = pending
        return pending.provisional

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

    def _finish(self, pend: _Pending, *, immediate: bool = False) -> ValidationReport:
        """Validate ``pend``; ``immediate``: inside its own step() (the caller gets the final result)."""
        self._pending = None  # whatever happens next, this step is no longer pending
        it, stats = pend.iteration, pend.stats
        stats.wait(timeout=self.pv_config.timeout, iteration=it)
        # Loss scaler: each part with a scaler updates with its own flag, as in prepare_grads.
        found_inf = self._parts.update_loss_scalers(stats.found)
        if self._check_nonfinite:  # the caller's flag (last) and the global norm, in any precision
            noted = bool(stats.found[-1].item() > 0)  # type: ignore[index]
            found_inf |= noted or not _finite(stats.global_grad_norm())
        if pend.local_inf and not found_inf:
            raise PostValidationError(f"iteration {it}: a local inf/nan was not found globally; the found-inf "
                                      "reduction and the local check disagree")
        grad_norm = None if found_inf else stats.global_grad_norm()
        clipped = (not found_inf) and self._parts.clip_fires(grad_norm)
        num_zeros = None if found_inf else stats.global_zero_count()
        rolled_back, success = self._repair(pend, found_inf=found_inf, clipped=clipped, grad_norm=grad_norm)
        result = self._parts.result(found_inf=found_inf, grad_norm=grad_norm, num_zeros=num_zeros, success=success)
        report = ValidationReport(iteration=it, result=result, provisional=result if immediate else pend.provisional,
                                  clipped=clipped, found_inf=found_inf, rolled_back=rolled_back)
        self._observe(clipped=clipped, found_inf=found_inf)
        self.last_report = report
        for hook in list(self._hooks):
            hook(report)
        return report

    def _repair(self, pend: _Pending, *, found_inf: bool, clipped: bool, grad_norm: float | None) -> tuple[bool, bool]:
        """Bring the params to what megatron-core's synchronous step gives: undo an eager update
        that must be skipped (inf/nan) or clipped, and take the (clipped) step if it is due.
        Returns (this rank rolled back, the redo's ``update_successful``; True if no redo)."""
        parts = self._parts
        if found_inf:
            if not pend.stepped:
                return False, True
            self._undo(pend, grads_needed=not self.pv_config.exact)
            parts.resync_model_params()
            self._count(rollbacks=1, inf_rollbacks=1)
            return True, True
        if pend.stepped and not clipped:
            return False, True  # the eager update stands
        rolled_back = pend.stepped
        if rolled_back:
            self._undo(pend, grads_needed=True)
            self._count(rollbacks=1, clip_rollbacks=1)
        if clipped:
            parts.clip_(grad_norm)
        with parts.hyperparams_set_to(pend.hyperparams), parts.no_timers():
            success = bool(self._optimizer.step_with_ready_grads())
        return rolled_back, success

    def _check_grads_kept(self, pend: _Pending) -> None:
        """The redo needs the grads the eager step used: refuse if they were zeroed or changed."""
        then = pend.stats.local_norm_sq
        if then is None:
            return
        now = float(local_sq_norm(self._parts.grads_for_norm()).item())
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

    def __repr__(self) -> str:
        return (f"PostValidationOptimizer({type(self._optimizer).__name__}, {self.pv_config}, "
                f"iteration={self._iteration}, pending={self.pending})")


def _finite(value: float | None) -> bool:
    """``value`` is finite, or absent (``None``: not computed)."""
    return value is None or math.isfinite(value)
