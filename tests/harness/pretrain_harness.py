"""The end-to-end harness of ``pretrain_gpt_zb.py``'s tests (tests/training/): the script under
torchrun, its trainer in-process, the tiny command lines, and the loss-curve helpers.

Shared by ``tests/training/test_pretrain.py`` and the tests that run the trainer the same way
(checkpoint failures, dead peers, MoE, training length, profile output, model flags, data). Needs
pytest (the test extras): a failed run fails the calling test with the run's log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_zb.testing.distributed import cpu_run_env

__all__ = ["CHECKPOINT_ARGV", "DROPOUT", "RUN_TIMEOUT", "SCRIPT", "SMALL", "assert_curve", "assert_resumes_at", "in_process", "losses", "main_in_ranks",
           "main_rank", "torchrun", "torchrun_exit", "train", "without"]

SCRIPT = Path(__file__).resolve().parents[2] / "pretrain_gpt_zb.py"
"""The entry point under test."""
RUN_TIMEOUT = 240
"""Seconds per run (2 shared cores; a PP=4 torchrun takes ~30 s)."""

# Runs of the trainer (what pretrain_gpt_zb.py runs) inside run_distributed's ranks: a few
# seconds each instead of a torchrun start. 4 layers (V and PP=2 x 2 chunks split evenly).
SMALL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "2e-3", "--mock-data", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
         "--distributed-backend", "gloo", "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2"]


def main_rank(argv: list[str]) -> dict[str, Any]:
    """One rank of ``pretrain_gpt_zb.py``'s ``main`` (the process group is run_distributed's): its exit
    status, stdout and stderr."""
    import contextlib
    import io
    import warnings

    import torch.distributed as dist

    from megatron_zb.training.pretrain import main

    warnings.simplefilter("ignore")  # megatron-core's import-time notices (pretrain_gpt_zb.py silences them)
    os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}


def main_in_ranks(argv: list[str], world_size: int = 2) -> list[dict[str, Any]]:
    """``pretrain_gpt_zb.py``'s ``main`` on ``argv`` in ``world_size`` ranks of run_distributed (what torchrun
    would start, without the process start-up): each rank's :func:`main_rank`."""
    from megatron_zb.testing import run_distributed

    return run_distributed(main_rank, world_size=world_size, args=(argv,), timeout=RUN_TIMEOUT)


def in_process(tmp_path: Path, name: str, world: int, argv: list[str]) -> dict:
    """The trainer on ``argv`` in ``world`` ranks (:func:`harness.trainer_run.in_process`)."""
    from harness.trainer_run import in_process as run

    return run(tmp_path, name, world, argv, timeout=RUN_TIMEOUT)


def torchrun_exit(nproc: int, argv: list[str], *, cwd: Path, timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
    """``pretrain_gpt_zb.py`` under torchrun: its exit status and log (stdout and stderr); the log is also
    ``cwd/log.txt``. Fails the test when it runs past ``timeout`` seconds (the launcher and its ranks killed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(SCRIPT), *argv]
    env = cpu_run_env(PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {' '.join(argv)} did not finish in {timeout} s:\n{out[-6000:]}")
    (cwd / "log.txt").write_text(out)
    return proc.returncode, out


def torchrun(nproc: int, argv: list[str], *, cwd: Path) -> dict[str, Any]:
    """Run ``pretrain_gpt_zb.py`` under torchrun; fail the test with the log on a non-zero exit."""
    rc, out = torchrun_exit(nproc, argv, cwd=cwd)
    if rc != 0:
        errors = "\n".join(ln for ln in out.splitlines() if re.search(r"Error|error:|Traceback|Timeout", ln))
        pytest.fail(f"torchrun {' '.join(argv)} exited {rc}; log in {cwd / 'log.txt'}; error lines:\n"
                    f"{errors[-6000:]}\n--- end of the log ---\n{out[-3000:]}")
    return {"log": out}


def train(run: dict) -> list[dict]:
    return run["values"]["train"]


def losses(run: dict) -> dict[int, float]:
    return {r["iteration"]: r["lm loss"] for r in train(run)}


def assert_curve(got: dict[int, float], ref: dict[int, float], *, what: str, exact: bool) -> None:
    assert got, f"{what}: no losses"
    assert set(got) <= set(ref), f"{what}: iterations {sorted(set(got) - set(ref))} not in the reference"
    for it, value in sorted(got.items()):
        if exact:
            assert value == ref[it], f"{what}: iteration {it} lm loss {value!r} != reference {ref[it]!r}"
        else:
            assert value == pytest.approx(ref[it], rel=1e-5), f"{what}: iteration {it}: {value} vs {ref[it]}"


def without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` without ``flags`` and their values."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


DROPOUT = without(SMALL, "--hidden-dropout", "--attention-dropout") + [
    "--train-iters", "8", "--lr-warmup-iters", "2", "--save-interval", "4"]
"""SMALL with Megatron's default dropout (0.1 hidden and attention), 8 iterations, a checkpoint at 4 and 8."""
CHECKPOINT_ARGV = DROPOUT + ["--pipeline-model-parallel-size", "2", "--enable-zero-bubble"]
"""DROPOUT at PP=2 with greedy zero bubble: the run whose checkpoints the checkpoint tests damage and resume
(``tests/training/conftest.py``'s ``saved``)."""


def assert_resumes_at(tmp_path: Path, root: Path, full: dict, *, step: int, argv: list[str]) -> None:
    """``argv`` with ``--load root --ckpt-step step`` resumes at ``step`` and its later iterations are ``full``'s
    (the uninterrupted run's) bit for bit: loss, learning rate and grad norm."""
    resumed = in_process(tmp_path, "resumed", 2, argv + ["--load", str(root), "--ckpt-step", str(step)])
    assert f"at iteration {step}" in resumed["log"]
    assert sorted(losses(resumed)) == list(range(step + 1, max(losses(full)) + 1))
    assert_curve(losses(resumed), losses(full), what=f"--ckpt-step {step}", exact=True)
    for a, b in zip(train(resumed), train(full)[step:]):
        assert (a["learning rate"], a["grad norm"]) == (b["learning rate"], b["grad norm"])
