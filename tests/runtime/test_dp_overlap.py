"""Data-parallel overlap (``--overlap-grad-reduce``, ``--overlap-param-gather``) under zero-bubble
schedules, PP=2 x DP=2 on gloo, against megatron-core's own 1F1B with the same DDP configuration.

Three iterations each (megatron-core launches nothing early in its first iteration, where it
records the per-parameter counts), new micro batches every iteration, Adam with clipping.
Plain placements (zb, zb-2p) are compared bit for bit; the V and interleaved placements put
layers on other ranks (another bucket layout, another summation order of the tied embedding),
so they are compared with a tolerance relative to each tensor's magnitude.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.schedules import CostModel, Op, Schedule
from megatron_zb.schedules.dp_reduce import DPReduceModel
from megatron_zb.schedules.registry import build_schedule
from megatron_zb.testing import run_distributed
from harness.dp_overlap import DPCase, assert_equal_runs, merge, run_dp_iterations
from megatron_zb.testing.tiny_gpt import TinyGPT

CFG = TinyGPT(pp=2, dp=2)
PLAIN = ("zb", "zb-2p")


def _run(case: DPCase, schedule: str | None, **options) -> dict:
    return merge(run_distributed(partial(run_dp_iterations, CFG, case, schedule=schedule, **options), world_size=4,
                                 timeout=300))


def _case(distributed_optimizer: bool, post_validation: bool = False) -> DPCase:
    return DPCase(overlap_grad_reduce=True, overlap_param_gather=distributed_optimizer,
                  use_distributed_optimizer=distributed_optimizer, post_validation=post_validation)


@pytest.fixture(scope="module")
def references() -> dict[bool, dict]:
    """megatron-core 1F1B with the same DDP configuration, per distributed-optimizer setting."""
    return {d: _run(_case(d), None) for d in (False, True)}


@pytest.fixture(scope="module")
def zbv_ddp() -> dict:
    """zbv with overlap, without the distributed optimizer (used by two tests)."""
    return _run(_case(False), "zbv")


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
@pytest.mark.parametrize("schedule,post_validation", [
    ("zb", False), ("zb-2p", False), ("zbv", False), ("interleaved-zb", False), ("zb", True), ("zbv", True)])
def test_overlapped_reduce_matches_megatron_1f1b(request, references, schedule, post_validation,
                                                 distributed_optimizer):
    if (schedule, post_validation, distributed_optimizer) == ("zbv", False, False):
        got = request.getfixturevalue("zbv_ddp")
    else:
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


def test_reduce_aware_v_tail_runs_bitwise_equal(zbv_ddp):
    """zbv built with a DPReduceModel (stage 1 reduces 4x the bytes of the others) regroups
    pipeline rank 1's trailing W's stage by stage (tests/schedules/test_dp_reduce_model.py works a case out
    by hand); every stage keeps its W's in microbatch order, so main_grad and the parameters
    after the step equal the plain zbv run's bit for bit, and every bucket is launched early."""
    unit = CostModel()
    with_dp = dataclasses.replace(unit, dp_reduce=DPReduceModel(stage_bytes=[1.0, 4.0, 1.0, 1.0], bucket_bytes=None,
                                                                bandwidth=1.0))
    p, m = CFG.pp, CFG.num_microbatches
    plain = build_schedule("zbv", num_ranks=p, num_microbatches=m, costs=unit)
    aware = build_schedule("zbv", num_ranks=p, num_microbatches=m, costs=with_dp)
    assert aware.ranks[0] == plain.ranks[0] and aware.ranks[1] != plain.ranks[1]

    def w_order(s: Schedule, stage: int) -> list[int]:
        return [a.mb for a in s.ranks[s.stage_to_rank[stage]] if a.op is Op.W and a.stage == stage]
    assert all(w_order(aware, st) == w_order(plain, st) for st in range(2 * p))
    got = _run(_case(False), "zbv", costs=with_dp)   # the runtime builds the reduce-aware V itself
    assert_equal_runs(zbv_ddp, got, bitwise=True, grads=True, what="zbv with the reduce-aware tail")
    for r in got.values():
        for reports in r["reports"].values():
            assert len(reports[-1].launches) == reports[-1].num_buckets


# ---------------------------------------------------------------------------- pretrain_gpt_zb.py
DP_FLAGS = ["--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather",
            "--ddp-bucket-size", "2000", "--ddp-average-in-collective"]
PRETRAIN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2",
            "--global-batch-size", "16", "--train-iters", "6", "--lr", "2e-3", "--clip-grad", "5.0", "--mock-data",
            "--num-workers", "0", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
            "--distributed-backend", "gloo", "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2",
            "--pipeline-model-parallel-size", "2"]


def test_pretrain_loss_curve_with_dp_overlap_equals_megatron_core_schedule(tmp_path):
    """PP=2 x DP=2 through pretrain_gpt_zb.py's trainer (in-process, one launch for both runs): greedy ZB with
    every DP overlap flag on gives exactly the loss curve of megatron-core's own 1F1B with the same flags --
    including --ddp-average-in-collective (megatron-core's ReduceOp.AVG reduce-scatter, which gloo runs)."""
    from harness.trainer_run import in_process_many

    runs = in_process_many(tmp_path, {"mcore": PRETRAIN + DP_FLAGS + ["--use-megatron-core-schedule"],
                                      "zb": PRETRAIN + DP_FLAGS + ["--schedule", "zb"]}, 4, timeout=400)
    ref, got = ([r["lm loss"] for r in runs[n]["values"]["train"]] for n in ("mcore", "zb"))
    assert len(ref) == 6 and got == ref
    line = ("> data parallel: size 2, distributed optimizer on, overlap-grad-reduce on, overlap-param-gather on, "
            "average-in-collective on, bucket size 2000")
    assert line in runs["zb"]["log"] and line in runs["mcore"]["log"]


@pytest.mark.parametrize("flags,message", [
    (["--overlap-param-gather", "--overlap-grad-reduce"], "--overlap-param-gather: is only supported with the "
                                                          "distributed optimizer"),
    (["--overlap-param-gather", "--use-distributed-optimizer"], "--overlap-param-gather: needs --overlap-grad-reduce"),
    (["--ddp-bucket-size", "0", "--overlap-grad-reduce"], "--ddp-bucket-size: must be a positive number"),
    (["--ddp-average-in-collective", "--calculate-per-token-loss"], "--ddp-average-in-collective: cannot be "
                                                                   "combined with --calculate-per-token-loss"),
], ids=["param-gather-without-distopt", "param-gather-without-grad-overlap", "bucket-size", "average-per-token"])
def test_refused_dp_flag_combinations_exit_2(flags, message, monkeypatch, capsys):
    import torch.distributed as dist

    from megatron_zb.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(PRETRAIN + flags) == 2
    assert not dist.is_initialized()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt_zb.py: error: {message}"), lines
