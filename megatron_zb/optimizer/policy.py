"""When a step may be post-validated: the warm-up and the clean-streak fallback.

A pure state machine (no torch, no process groups), so the rule can be tested on its own
(``tests/optimizer/test_post_validation_policy.py``). :class:`~megatron_zb.optimizer.post_validation.PostValidationOptimizer`
asks :meth:`StepPolicy.eager_allowed` before every ``step()`` and reports every validated step to
:meth:`StepPolicy.observe`. Every rank feeds it the same global values (clip decision and
found-inf from the all-reduced statistics), so every rank takes the same path.

The rule (``docs/post_validation.md``, "Fallback heuristic"): step ``k`` (0-based) is eager if
``k >= warmup_iters`` and no clip or inf/nan happened in the last ``clean_iters_required``
validated steps; otherwise it is megatron-core's synchronous ``step()``. Steps of either path,
warm-up included, feed the streak. ``clean_iters_required == 0`` never falls back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepPolicy", "check_iteration_counts"]


def check_iteration_counts(*, warmup_iters: int, clean_iters_required: int) -> None:
    """Raise ``ValueError`` unless both counts (iterations) are ``>= 0``."""
    if warmup_iters < 0 or clean_iters_required < 0:
        raise ValueError("warmup_iters and clean_iters_required must be >= 0")


@dataclass(kw_only=True)
class StepPolicy:
    """Decides, step by step, between the eager (post-validated) and the synchronous path.

    Attributes:
        warmup_iters: the first ``warmup_iters`` steps (iterations) are synchronous.
        clean_iters_required: after a step that clipped or found an inf/nan, steps stay
            synchronous until this many consecutive validated steps did neither (iterations;
            the published heuristic: 10). 0: a clip or inf/nan never switches to synchronous.
        clean_streak: consecutive validated steps without clip or inf/nan, up to now.
        sync_until_clean: a clip or inf/nan has not yet been followed by enough clean steps.
    """

    warmup_iters: int
    clean_iters_required: int
    clean_streak: int = field(default=0, init=False)
    sync_until_clean: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        check_iteration_counts(warmup_iters=self.warmup_iters, clean_iters_required=self.clean_iters_required)

    def eager_allowed(self, iteration: int) -> bool:
        """May step ``iteration`` (0-based count of ``step()`` calls) skip the blocking reductions?

        Ask after every earlier step has been :meth:`observe`-d (the wrapper validates the
        previous step before the next ``step()``)."""
        if iteration < self.warmup_iters:
            return False
        return not self.sync_until_clean

    def observe(self, *, clipped: bool, found_inf: bool) -> None:
        """Record one validated step (either path): did clipping scale its grads, was an inf/nan
        found on some rank (the step was skipped)?"""
        if clipped or found_inf:
            self.clean_streak = 0
            self.sync_until_clean = self.clean_iters_required > 0
        else:
            self.clean_streak += 1
            if self.clean_streak >= self.clean_iters_required:
                self.sync_until_clean = False
