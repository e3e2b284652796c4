"""``--zero-bubble-wgrad-group K`` through ``pretrain_gpt_zb.py``'s trainer (issue 42's runtime step).

Each stage's W's run in groups of K micro batches, each group layer-major (every layer's weight gradients
of the K micro batches back to back). A parameter still receives its micro batches' contributions in micro
batch order, so a grouped run is bitwise the ungrouped run of the same family -- and for ``zb``, bitwise
megatron-core's 1F1B. One exception: on the V, rank 0 holds the first and the last stage, whose word-embedding
lookup (in B) and output layer (in W) add into one tied parameter; grouping moves the W's, so that one
gradient sums the same terms in another order: within :data:`RTOL` (bitwise over these 2 iterations; a third
iteration's loss differed by 1e-8). Dropout is on (Megatron-LM's default): grouping moves only W's, which draw
no random numbers.

PP=2 x DP=2 (4 processes, 4 micro batches per data-parallel rank) with the distributed optimizer and its
overlapped gradient reduce and parameter gather; all runs share one launch (``in_process_many``). Both
iterations' lm loss and grad norm are compared; the second iteration's loss depends on every parameter
after the first step.
"""

from __future__ import annotations

import pytest

from harness.trainer_run import in_process_many
from megatron_zb.schedules.wgrad_groups import wgrad_group_of

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "2", "--lr", "2e-3",
        "--lr-warmup-iters", "1", "--mock-data", "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0",
        "--distributed-backend", "gloo", "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2",
        "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather"]
"""A tiny GPT at PP=2 x DP=2, 4 micro batches per data-parallel rank, dropout on."""

INTERLEAVED = ["--schedule", "interleaved-zb", "--num-virtual-stages-per-pipeline-rank", "2"]
RUNS = {"megatron-core": ["--use-megatron-core-schedule"],
        "zb x2": ["--enable-zero-bubble", "--zero-bubble-wgrad-group", "2"],
        "zb x4": ["--enable-zero-bubble", "--zero-bubble-wgrad-group", "4"],
        "zbv": ["--zero-bubble-v-schedule"],
        "zbv x4": ["--zero-bubble-v-schedule", "--zero-bubble-wgrad-group", "4"],
        "interleaved-zb": INTERLEAVED,
        "interleaved-zb x2": INTERLEAVED + ["--zero-bubble-wgrad-group", "2"]}
"""Each grouped run and the run it must equal bit for bit (:data:`SAME_AS`)."""
SAME_AS = {"zb x2": "megatron-core", "zb x4": "megatron-core", "zbv x4": "zbv", "interleaved-zb x2": "interleaved-zb"}
KEYS = ("lm loss", "grad norm")
RTOL = {"zbv x4": 1e-6}
"""Relative tolerance where the order of a sum changes (the module docstring says where); bitwise elsewhere."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    return in_process_many(tmp_path_factory.mktemp("wgrad_group"), {n: BASE + f for n, f in RUNS.items()}, 4,
                           timeout=600)


@pytest.mark.parametrize("name", list(SAME_AS))
def test_grouped_run_is_bitwise_the_ungrouped_one(runs, name):
    """Every iteration's lm loss and grad norm of the grouped run equal its reference's (bit for bit, or
    within :data:`RTOL`), and the
    schedule installed is grouped by K (its W's back to back in runs of K per stage)."""
    k = int(name.split("x")[-1])
    assert wgrad_group_of(runs[name]["installed"]) == k
    got, ref = runs[name]["values"]["train"], runs[SAME_AS[name]]["values"]["train"]
    assert [r["iteration"] for r in got] == [1, 2] == [r["iteration"] for r in ref]
    for a, b in zip(got, ref):
        for key in KEYS:
            where = f"{name} iteration {a['iteration']} {key}: {a[key]!r} vs {SAME_AS[name]}'s {b[key]!r}"
            assert a[key] is not None, where
            if name in RTOL:
                assert a[key] == pytest.approx(b[key], rel=RTOL[name], abs=0), where
            else:
                assert a[key] == b[key], where
    assert len({r["lm loss"] for r in ref}) == 2  # it trains: the loss moves
