"""Data-parallel overlap (``--overlap-grad-reduce``, ``--overlap-param-gather``) under zero-bubble
schedules, PP=2 x DP=2 on gloo, against megatron-core's own 1F1B with the same DDP configuration.

Three iterations each (megatron-core launches nothing early in its first iteration, where it
records the per-parameter counts), new micro batches every iteration, Adam with clipping.
Plain placements (zb, zb-2p) are compared bit for bit; the V and interleaved placements put
layers on other ranks (another bucket layout, another summation order of the tied embedding),
so they are compared with a tolerance relative to each tensor's magnitude.
"""

from __future__ import annotations

from functools import partial

import pytest

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.testing import run_distributed
from megatron_zb.testing.dp_overlap import DPCase, assert_equal_runs, merge, run_dp_iterations
from megatron_zb.testing.tiny_gpt import TinyGPT

CFG = TinyGPT(pp=2, dp=2)
PLAIN = ("zb", "zb-2p")


def _run(case: DPCase, schedule: str | None) -> dict:
    return merge(run_distributed(partial(run_dp_iterations, CFG, case, schedule=schedule), world_size=4,
                                 timeout=300))


def _case(distributed_optimizer: bool, post_validation: bool = False) -> DPCase:
    return DPCase(overlap_grad_reduce=True, overlap_param_gather=distributed_optimizer,
                  use_distributed_optimizer=distributed_optimizer, post_validation=post_validation)


@pytest.fixture(scope="module")
def references() -> dict[bool, dict]:
    """megatron-core 1F1B with the same DDP configuration, per distributed-optimizer setting."""
    return {d: _run(_case(d), None) for d in (False, True)}


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
@pytest.mark.parametrize("schedule,post_validation", [
    ("zb", False), ("zb-2p", False), ("zbv", False), ("interleaved-zb", False), ("zb", True), ("zbv", True)])
def test_overlapped_reduce_matches_megatron_1f1b(references, schedule, post_validation, distributed_optimizer):
    got = _run(_case(distributed_optimizer, post_validation), schedule)
    plain = schedule in PLAIN
    # with the distributed optimizer only the rank's own shard of main_grad is reduced; the rest
    # holds local gradients laid out by the placement's buckets, comparable only for equal layouts
    assert_equal_runs(references[distributed_optimizer], got, bitwise=plain,
                      grads=plain or not distributed_optimizer,
                      what=f"{schedule} distopt={distributed_optimizer} post-validation={post_validation}")
    for dp, r in got.items():
        for pp, reports in r["reports"].items():
            assert reports[0].first_batch and not reports[0].launches  # megatron-core: first batch in finish
            for rep in reports[1:]:
                assert not rep.first_batch and len(rep.launches) == rep.num_buckets, (dp, pp)
    if schedule == "zb" and not post_validation:
        # evidence of overlap on the first stage (several buckets: --ddp-bucket-size 4000)
        for dp, r in got.items():
            rep = r["reports"][0][-1]
            assert rep.num_buckets > 3
            assert rep.launched_before_last_w() >= 1, f"DP rank {dp}: no bucket launched before the last W"
