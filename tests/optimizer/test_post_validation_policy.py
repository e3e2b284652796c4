"""The post-validation step policy alone: warm-up and clean-streak fallback (no process groups).

Each case feeds :class:`StepPolicy` the validated outcome of every step, as the wrapper does, and
compares the path it chose per step with one written by hand from the rule in
``docs/post_validation.md`` ("Fallback heuristic"): ``E`` eager (post-validated), ``S``
megatron-core's synchronous step.
"""

from __future__ import annotations

import pytest

from megatron_zb.optimizer import PostValidationConfig
from megatron_zb.optimizer.policy import StepPolicy


def _paths(policy: StepPolicy, outcomes: str) -> str:
    """Ask the policy before each step, then report that step's outcome: ``.`` clean, ``c``
    clipped, ``i`` inf/nan found (skipped). Returns one letter per step (``E`` / ``S``)."""
    chosen = []
    for iteration, outcome in enumerate(outcomes):
        chosen.append("E" if policy.eager_allowed(iteration) else "S")
        policy.observe(clipped=outcome == "c", found_inf=outcome == "i")
    return "".join(chosen)


@pytest.mark.parametrize(("warmup", "clean", "outcomes", "expected"), [
    # the first warmup_iters steps are synchronous, then every clean step is eager
    (3, 10, "........", "SSSEEEEE"),
    # warm-up 0: the first step is already post-validated
    (0, 10, "...", "EEE"),
    # clipping on every step: only the first step is eager with a fallback of 2 ...
    (0, 2, "cccccc", "ESSSSS"),
    # ... and every step is eager with a fallback of 0 (never falls back)
    (0, 0, "cccccc", "EEEEEE"),
    (0, 0, "i.i.", "EEEE"),
    # a clip stays synchronous until clean_iters_required consecutive clean steps
    (0, 3, "..c......", "EEESSSEEE"),
    # an inf/nan (a skipped step) falls back the same way
    (0, 2, "..i...", "EEESSE"),
    # a clip in the warm-up keeps the steps after it synchronous (warm-up steps feed the streak)
    (2, 3, ".c......", "SSSSSEEE"),
    # a clean warm-up needs no extra synchronous steps
    (2, 3, "......", "SSEEEE"),
    # a second clip during the fallback restarts the count of clean steps
    (0, 3, ".c.c......", "EESSSSSEEE"),
    # clean steps before a clip do not count towards the streak after it
    (0, 2, "....c..", "EEEEESS"),
])
def test_paths_follow_the_documented_rule(warmup, clean, outcomes, expected):
    assert _paths(StepPolicy(warmup_iters=warmup, clean_iters_required=clean), outcomes) == expected


def test_clean_streak_and_fallback_state():
    policy = StepPolicy(warmup_iters=0, clean_iters_required=2)
    assert (policy.clean_streak, policy.sync_until_clean) == (0, False)
    policy.observe(clipped=False, found_inf=False)
    assert (policy.clean_streak, policy.sync_until_clean) == (1, False)
    policy.observe(clipped=True, found_inf=False)
    assert (policy.clean_streak, policy.sync_until_clean) == (0, True)
    assert not policy.eager_allowed(5)
    policy.observe(clipped=False, found_inf=False)
    assert (policy.clean_streak, policy.sync_until_clean) == (1, True)
    policy.observe(clipped=False, found_inf=False)
    assert (policy.clean_streak, policy.sync_until_clean) == (2, False)
    assert policy.eager_allowed(5)


@pytest.mark.parametrize(("warmup", "clean"), [(-1, 10), (10, -1)])
def test_negative_counts_are_refused(warmup, clean):
    with pytest.raises(ValueError, match="must be >= 0"):
        StepPolicy(warmup_iters=warmup, clean_iters_required=clean)
    with pytest.raises(ValueError, match="must be >= 0"):
        PostValidationConfig(exact=True, warmup_iters=warmup, clean_iters_required=clean)
