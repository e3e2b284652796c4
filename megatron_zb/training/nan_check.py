"""``--check-for-nan-in-loss-and-grad``: Megatron-LM's NaN/Inf check of the loss and the gradients, every
rank agreeing to stop.

Megatron-LM checks two things (on by default; off for fp16 with dynamic loss scaling):

* every micro batch's loss, on the rank that computes it (``pretrain_gpt.py``'s ``loss_func``:
  ``validate_result(loss, torch.isnan / torch.isinf, "found NaN/Inf in local forward loss calculation")``);
* every gradient bucket's norm, before its data-parallel reduce (megatron-core DDP's ``check_grads`` in
  ``start_grad_sync``, with ``DistributedDataParallelConfig.check_for_nan_in_grad``).

Both go through megatron-core's rerun state machine, whose ``validate_result`` (rerun mode disabled) raises
``RuntimeError("Rank R, node N, device D, iteration I: Unexpected result X (message='...')")`` on the rank
that found it -- in the middle of the pipeline, where its peers then wait in a p2p transfer or a collective
until the launcher kills them.

megatron-zb runs the same checks with the same messages (:func:`check_loss`; megatron-core's own DDP check,
also for the buckets the zero-bubble runtime launches from a W), but :class:`LossAndGradCheck` records the
first finding of the iteration instead of raising, and the ranks agree afterwards:

* before a synchronous optimizer step (no post-validation, or its warm-up / fallback steps):
  :meth:`LossAndGradCheck.agree`, one MIN all-reduce over every rank after the forward-backward: the
  step is not taken and every rank stops;
* before an eager post-validated step the finding is handed to the optimizer
  (``PostValidationOptimizer.note_nonfinite``): it rides on post-validation's found-inf all-reduce, the
  step is skipped where seen and rolled back where taken, and every rank learns it at the validation
  (:meth:`LossAndGradCheck.mark_rolled_back`), then stops at the next common point
  (:meth:`LossAndGradCheck.stop_after_validation`).

Every rank then raises :class:`NonFiniteError` with one finding -- a loss's if any (the loss comes
first: Megatron-LM raises it in the forward), else a gradient's, of the lowest rank that made one
(``pretrain_gpt_zb.py`` prints it once, exit status 1). With ``--no-check-for-nan-in-loss-and-grad``
nothing is checked (a diverging run trains on, as before).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["LOSS_CHECKS", "LossAndGradCheck", "NonFiniteError", "NonFiniteFinding", "check_loss",
           "rerun_state_machine"]

LOSS_CHECKS: tuple[tuple[Callable[[torch.Tensor], Any], str], ...] = (
    (torch.isnan, "found NaN in local forward loss calculation"),
    (torch.isinf, "found Inf in local forward loss calculation"),
)
"""Megatron-LM's loss checks (``pretrain_gpt.py``'s ``loss_func``): rejection function and message."""

_REJECTED = "Unexpected result"
"""What megatron-core's ``validate_result`` (rerun mode disabled) says when it rejects a result."""


@dataclass(frozen=True)
class NonFiniteFinding:
    """A NaN/Inf found by the check.

    Attributes:
        iteration: the training iteration (1-based, as logged) whose loss or gradients failed.
        rank: the global rank that found it (``None``: post-validation's global grad norm, no single rank).
        message: Megatron-LM's message (``"Rank R, node N, device D, iteration I: Unexpected result ..."``).
    """

    iteration: int
    rank: int | None
    message: str


class NonFiniteError(RuntimeError):
    """Raised on every rank when the check stops the run; ``str()`` is the one error line's text."""

    def __init__(self, finding: NonFiniteFinding) -> None:
        self.finding = finding
        super().__init__(f"{finding.message}; every rank stops at iteration {finding.iteration}, whose update is "
                         f"not applied (--check-for-nan-in-loss-and-grad, on by default; "
                         f"--no-check-for-nan-in-loss-and-grad trains on)")


def rerun_state_machine() -> Any:
    """megatron-core's rerun state machine (initialised on first use, rerun mode disabled, without its
    start-up warnings: megatron-zb has no ``--rerun-mode``)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    logger = logging.getLogger("megatron.core.rerun_state_machine")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "Implicit initialization ..." / "initialized in mode ..."
    try:
        return get_rerun_state_machine()
    finally:
        logger.setLevel(level)


def check_loss(loss: torch.Tensor) -> None:
    """Megatron-LM's check of one micro batch's (local, pre-reduce) loss: NaN, then Inf (fatal results of
    the rerun state machine; raised, or recorded while a :class:`LossAndGradCheck` is installed)."""
    machine = rerun_state_machine()
    for rejects, message in LOSS_CHECKS:
        machine.validate_result(result=loss, rejection_func=rejects, message=message, tolerance=0.0, fatal=True)


class LossAndGradCheck:
    """This rank's ``--check-for-nan-in-loss-and-grad`` over a run (module docstring).

    Installed on megatron-core's rerun state machine while open (rerun mode disabled): its fatal
    rejections -- :func:`check_loss`, megatron-core DDP's bucket check -- are recorded, the first of each
    iteration kept (:attr:`local`). ``device``: where the agreement's tensors live (the run's device);
    ``vote``: post-validation's found-inf reduction does not span every rank (data-parallel replicas
    without the distributed optimizer), so :meth:`stop_after_validation` all-reduces over the world.
    """

    def __init__(self, enabled: bool, *, device: torch.device, vote: bool = False) -> None:
        self.enabled = enabled
        self.device = device
        self.vote = vote and enabled
        self.local: NonFiniteFinding | None = None
        self.rolled_back: int | None = None  # post-validation rolled back this iteration's step
        self._iteration = 0
        self._machine: Any = None
        if enabled:
            self._install()

    def _install(self) -> None:
        from megatron.core.rerun_state_machine import RerunMode

        machine = rerun_state_machine()
        if machine.mode != RerunMode.DISABLED:
            raise RuntimeError(f"megatron-core's rerun state machine runs in mode {machine.mode}; the NaN/Inf check "
                               f"of pretrain_gpt_zb.py needs it disabled (megatron-zb has no --rerun-mode)")
        original = machine.validate_result

        def validate_result(*args: Any, **kwargs: Any) -> None:
            fatal = args[5] if len(args) > 5 else kwargs.get("fatal", True)
            try:
                original(*args, **kwargs)
            except RuntimeError as e:
                if not fatal or _REJECTED not in str(e):
                    raise
                if self.local is None:
                    self.local = NonFiniteFinding(self._iteration, dist.get_rank(), str(e))

        machine.validate_result = validate_result
        self._machine = machine

    def close(self) -> None:
        """Give megatron-core's ``validate_result`` back."""
        if self._machine is not None:
            del self._machine.validate_result  # the instance attribute: the class's method again
            self._machine = None

    def begin(self, iteration: int) -> None:
        """Before ``iteration`` (1-based)'s forward-backward, or an evaluation after it: forget the last
        finding; name ``iteration`` in megatron-core's messages (its ``current_iteration``, as Megatron-LM)."""
        self.local = None
        self._iteration = iteration
        if self._machine is not None:
            from megatron_zb.megatron_compat import rerun_current_iteration

            self._machine.current_iteration = rerun_current_iteration(iteration)

    def agree(self) -> NonFiniteFinding | None:
        """Whether any rank found a NaN/Inf since :meth:`begin`: the lowest such rank's finding on every
        rank, else ``None``. Collective over every rank (no communication when the check is off)."""
        if not self.enabled:
            return None
        return self._lowest_finding()

    def mark_rolled_back(self, iteration: int) -> None:
        """Post-validation found the step of ``iteration`` non-finite and rolled it back (every rank of its
        found-inf reduction is told at the same validation)."""
        if self.enabled:
            self.rolled_back = iteration

    def stop_after_validation(self) -> NonFiniteFinding | None:
        """After a validation of post-validation, at a point every rank reaches: the finding to stop on
        when a step was rolled back for a NaN/Inf, else ``None``. Collective when one was, or with
        :attr:`vote` (then always: one MAX all-reduce)."""
        if not self.enabled:
            return None
        iteration = self.rolled_back or 0
        if self.vote:
            t = torch.tensor([iteration], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            iteration = int(t.item())
        if not iteration:
            return None
        found = self._lowest_finding()
        return found or NonFiniteFinding(iteration, None, f"iteration {iteration}: optimizer post-validation "
                                                          f"found a non-finite gradient norm")

    def _lowest_finding(self) -> NonFiniteFinding | None:
        """The finding to report (every rank), else ``None``: a loss's before a gradient's (the loss comes
        first, as Megatron-LM raises it in the forward), then the lowest rank's. Collective."""
        world = dist.get_world_size()
        key = 2 * world if self.local is None else dist.get_rank() + (0 if _is_loss(self.local) else world)
        t = torch.tensor([key], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        if int(t.item()) == 2 * world:
            return None
        finder = int(t.item()) % world
        box = [self.local]
        dist.broadcast_object_list(box, src=finder)
        return box[0]


def _is_loss(finding: NonFiniteFinding) -> bool:
    """Whether ``finding`` is a loss check's (:data:`LOSS_CHECKS`), not a gradient bucket's."""
    return any(f"'{message}'" in finding.message for _, message in LOSS_CHECKS)
