"""Data-parallel overlap (``--overlap-grad-reduce``, ``--overlap-param-gather``) under zero-bubble
schedules, PP=2 x DP=2 on gloo, against megatron-core's own 1F1B with the same DDP configuration.

Three iterations each (megatron-core launches nothing early in its first iteration, where it
records the per-parameter counts), new micro batches every iteration, Adam with clipping.
Plain placements (zb, zb-2p) are compared bit for bit; the V and interleaved placements put
layers on other ranks (another bucket layout, another summation order of the tied embedding),
so they are compared with a tolerance relative to each tensor's magnitude.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

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


# ---------------------------------------------------------------------------- pretrain_gpt_zb.py
REPO = Path(__file__).resolve().parents[1]
DP_FLAGS = ["--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather",
            "--ddp-bucket-size", "2000", "--ddp-average-in-collective"]
PRETRAIN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2",
            "--global-batch-size", "16", "--train-iters", "6", "--lr", "2e-3", "--clip-grad", "5.0", "--mock-data",
            "--num-workers", "0", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
            "--distributed-backend", "gloo", "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2",
            "--pipeline-model-parallel-size", "2"]


def _pretrain(tmp: Path, name: str, argv: list[str]) -> tuple[list[float], str]:
    out = tmp / name
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(REPO / "pretrain_gpt_zb.py"), *argv, "--loss-log-json", str(out / "values.json")]
    proc = subprocess.run(cmd, cwd=out, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    values = json.loads((out / "values.json").read_text())
    return [r["lm loss"] for r in values["train"]], log


def test_pretrain_loss_curve_with_dp_overlap_equals_megatron_core_schedule(tmp_path):
    """PP=2 x DP=2 through pretrain_gpt_zb.py: greedy ZB with every DP overlap flag on gives
    exactly the loss curve of megatron-core's own 1F1B with the same flags -- including
    --ddp-average-in-collective (megatron-core's ReduceOp.AVG reduce-scatter, which gloo runs)."""
    ref, ref_log = _pretrain(tmp_path, "mcore", PRETRAIN + DP_FLAGS + ["--use-megatron-core-schedule"])
    got, log = _pretrain(tmp_path, "zb", PRETRAIN + DP_FLAGS + ["--schedule", "zb"])
    assert len(ref) == 6 and got == ref
    line = ("> data parallel: size 2, distributed optimizer on, overlap-grad-reduce on, overlap-param-gather on, "
            "average-in-collective on, bucket size 2000")
    assert line in log and line in ref_log


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
