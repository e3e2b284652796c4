"""Checkpoints a cluster can trust (issue 23): damaged checkpoints named, ``--ckpt-step``, another
``--train-iters``, a job killed during a save, a preempted job (``--exit-signal-handler``).

One run (:func:`saved`: PP=2, greedy zero bubble, Megatron's default dropout 0.1, 8 iterations,
checkpoints at 4 and 8) is made once for this module and test_checkpoint_integrity.py
(tests/training/conftest.py); each test copies its checkpoint folder and damages the copy, or resumes it and compares the curve with that run's, bit for bit. The damaged
ones run ``pretrain_gpt_zb.py``'s ``main`` in 2 ranks of ``run_distributed`` (what torchrun would
start, without the process start-up); the kill and preemption tests run the script under torchrun
in a session of its own and signal that session, as a cluster does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.leftovers import job_environment, wait_until_none_left  # processes a killed job left
from harness.pretrain_harness import CHECKPOINT_ARGV, assert_resumes_at, main_in_ranks, SCRIPT, without, assert_curve, in_process, losses, train  # the end-to-end harness

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ARGV = CHECKPOINT_ARGV
"""SMALL of test_pretrain with dropout 0.1, 8 iterations, --save-interval 4; PP=2, greedy zero bubble."""
TRACKER = "latest_checkpointed_iteration.txt"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: (size, mtime in ns) -- to show that nothing was written."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _refused(argv: list[str], root: Path) -> str:
    """Run ``argv`` (loading from ``root``, saving there too); assert exit 1 on every rank, one error
    line from rank 0, no traceback, nothing written under ``root``; return the line."""
    before = _files(root)
    ranks = main_in_ranks(argv + ["--save", str(root)])
    assert [r["rc"] for r in ranks] == [1, 1], ranks
    errors = [ln for r in ranks for ln in r["err"].splitlines() if ln.strip()]
    everything = "".join(r["out"] + r["err"] for r in ranks)
    assert len(errors) == 1 and errors[0].startswith("pretrain_gpt_zb.py: error: "), errors
    assert "Traceback" not in everything, everything[-3000:]
    assert _files(root) == before, "a refused load wrote under the checkpoint folder"
    return errors[0]


# ---------------------------------------------------------------------------- damaged checkpoints
def test_truncated_shard_is_named_and_ckpt_step_loads_the_previous_checkpoint(tmp_path, saved):
    """A shard of iteration 8 cut in half: one line naming the file and ``--ckpt-step 4``; with
    ``--ckpt-step 4`` the run resumes at 4 and its iterations 5-8 are the uninterrupted run's."""
    full, ckpt = saved
    root = _copy(ckpt, tmp_path / "ckpt")
    shard = root / "iter_0000008" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    line = _refused(ARGV + ["--load", str(root)], root)
    assert f"{shard} is truncated" in line and "--ckpt-step 4" in line and str(root / "iter_0000004") in line, line
    assert_resumes_at(tmp_path, root, full, step=4, argv=ARGV)


def test_missing_shard_is_named(tmp_path, saved):
    """The second shard file of iteration 8 deleted (``__0_1.distcp`` with megatron-core 0.16.1, which
    writes two files per rank; ``__1_0.distcp`` with 0.19, one per rank): the line names it."""
    root = _copy(saved[1], tmp_path / "ckpt")
    shards = sorted((root / "iter_0000008").glob("__*.distcp"))
    assert len(shards) >= 2, shards
    shards[1].unlink()
    line = _refused(ARGV + ["--load", str(root)], root)
    assert f"{shards[1]} is missing" in line and "--ckpt-step 4" in line, line


def test_tracker_naming_a_missing_directory_is_named(tmp_path, saved):
    root = _copy(saved[1], tmp_path / "ckpt")
    shutil.rmtree(root / "iter_0000008")
    line = _refused(ARGV + ["--load", str(root)], root)
    assert f"{root / TRACKER} names iteration 8" in line and f"{root / 'iter_0000008'} does not exist" in line, line
    assert "--ckpt-step 4" in line, line


def test_checkpoint_of_another_model_names_the_tensor(tmp_path, saved):
    """Grouped-query attention (2 key/value groups) changes the QKV projection's shape, not any
    flag the checkpoint records: the line names the tensor and both shapes."""
    root = _copy(saved[1], tmp_path / "ckpt")
    line = _refused(ARGV + ["--load", str(root), "--group-query-attention", "--num-query-groups", "2"], root)
    assert re.search(r"tensor decoder\.layers\.self_attention\.linear_qkv\.weight has shape \(4, 96, 32\) in the "
                     r"checkpoint and \(4, 64, 32\) in this run's model", line), line


def test_ckpt_step_without_load_is_refused_up_front():
    from megatron_zb.training.arguments import ArgumentError
    from megatron_zb.training.pretrain import parse_command_line

    with pytest.raises(ArgumentError, match="--ckpt-step"):
        parse_command_line(ARGV + ["--ckpt-step", "4"], world_size=2)


# ---------------------------------------------------------------------------- another --train-iters
def _linear_lr(num_steps: int, *, max_lr: float, warmup: int, decay: int) -> float:
    """Megatron's linear schedule (min_lr 0, init_lr 0) after ``num_steps`` samples, written out here."""
    if num_steps <= warmup:
        return max_lr * num_steps / warmup
    if num_steps > decay:
        return 0.0
    return max_lr * (1.0 - (num_steps - warmup) / (decay - warmup))


def test_other_train_iters_names_megatrons_flags_and_honours_them(tmp_path, saved):
    """Resume iteration 4 with --train-iters 10 (saved with 8): refused in one line naming both flags;
    ``--use-checkpoint-opt_param-scheduler`` keeps decaying over 8 iterations,
    ``--override-opt_param-scheduler`` over 10 (as Megatron-LM's scheduler does)."""
    root = _copy(saved[1], tmp_path / "ckpt")
    argv = without(ARGV, "--train-iters") + ["--train-iters", "10", "--load", str(root), "--ckpt-step", "4"]
    line = _refused(argv, root)
    assert "--override-opt_param-scheduler" in line and "--use-checkpoint-opt_param-scheduler" in line, line
    assert "--lr-decay-iters / --lr-decay-samples, default the training length [samples]: checkpoint 64, this run 80" \
        in line, line
    gbs, warmup = 8, 2 * 8
    for flag, decay_iters in (("--use-checkpoint-opt_param-scheduler", 8), ("--override-opt_param-scheduler", 10)):
        run = in_process(tmp_path, flag.strip("-"), 2, argv + [flag, "--exit-interval", "6"])
        got = {r["iteration"]: r["learning rate"] for r in train(run)}
        assert sorted(got) == [5, 6], got
        for it, lr in got.items():
            want = _linear_lr(it * gbs, max_lr=2e-3, warmup=warmup, decay=decay_iters * gbs)
            assert lr == pytest.approx(want, rel=1e-6), (flag, it, lr, want)
        assert "> learning-rate schedule: " in run["log"], run["log"][-2000:]


# ---------------------------------------------------------------------------- killed jobs
PAUSE_LAUNCHER = Path(__file__).with_name("pause_before_tracker.py")
"""Runs ``pretrain_gpt_zb.py`` with a pause between a checkpoint's files and its tracker (its docstring)."""


def _launch(argv: list[str], cwd: Path, pause_before_tracker: str | None = None,
            env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    """``pretrain_gpt_zb.py`` under torchrun, in a session of its own; its output lines collect in the list.
    ``pause_before_tracker`` (``ITERATION:SECONDS``): run it through :data:`PAUSE_LAUNCHER`; ``env``: added
    to the job's environment."""
    entry = [str(SCRIPT)] if pause_before_tracker is None else [str(PAUSE_LAUNCHER), pause_before_tracker]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *entry, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    return proc, lines


def _wait_for(proc: subprocess.Popen, lines: list[str], pattern: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not any(re.search(pattern, ln) for ln in list(lines)):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no line matching {pattern!r}; the log:\n{''.join(lines)[-4000:]}")
        time.sleep(0.05)


LEFTOVER_S = 30.0
"""Seconds after a kill by which no process of the job may be left."""


def _assert_none_left(job: str) -> None:
    """Within :data:`LEFTOVER_S`, no process of ``job`` is left; else kill the survivors and fail naming them."""
    left, waited = wait_until_none_left(job, LEFTOVER_S)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"{len(left)} process(es) of the killed job still ran {waited:.0f} s after the kill:\n" + \
        "\n".join(f"  {pid}: {cmd}" for pid, cmd in sorted(left.items()))


def test_job_killed_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, saved):
    """SIGKILL to torchrun's process group while iteration 8's checkpoint is being written (its files written,
    the tracker not yet: the fault-injection hook of :data:`PAUSE_LAUNCHER` pauses there): within 30 s no process
    of the job is left (the ranks, in sessions of their own, megatron-core's managers and writers, the resource
    trackers: ``megatron_zb/platform/reaper.py``); the tracker still names 4, and the resumed run's
    iterations 5-8 are the uninterrupted run's bit for bit; it then saves iteration 8 over the partial one."""
    full = saved[0]
    root = tmp_path / "ckpt"
    job, marker = job_environment()
    proc, lines = _launch(ARGV + ["--save", str(root)], tmp_path, pause_before_tracker="8:120", env=marker)
    _wait_for(proc, lines, r"TEST HOOK .*iteration 8's files are written")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    _assert_none_left(job)
    assert (root / TRACKER).read_text().strip() == "4"
    assert (root / "iter_0000008" / ".metadata").exists()  # the interrupted checkpoint's files are there
    resumed = in_process(tmp_path, "resumed", 2, ARGV + ["--load", str(root), "--save", str(root)])
    assert "at iteration 4" in resumed["log"]
    assert_curve(losses(resumed), losses(full), what="resumed after a kill during a save", exact=True)
    assert sorted(losses(resumed)) == list(range(5, 9))
    assert (root / TRACKER).read_text().strip() == "8"


def test_sigterm_saves_exits_0_and_resumes_exactly(tmp_path, saved):
    """--exit-signal-handler: SIGTERM to every process of the job (torchrun, its 2 ranks and their
    data-loader workers, as SLURM sends it; torchrun forwards it too) during training: the ranks
    finish the iteration, save it and exit 0; the resumed run continues bit for bit (dropout on)."""
    full = saved[0]
    root = tmp_path / "ckpt"
    argv = without(ARGV, "--num-workers") + ["--num-workers", "1", "--exit-signal-handler", "--save", str(root),
                                               "--loss-log-json", str(tmp_path / "first.json")]
    proc, lines = _launch(argv, tmp_path)
    _wait_for(proc, lines, r"\] iteration\s+2/")
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    log = "".join(lines)
    (tmp_path / "log.txt").write_text(log)
    m = re.search(r"> exiting program at iteration (\d+) after receiving SIGTERM \(--exit-signal-handler\)", log)
    assert m, log[-4000:]
    stopped = int(m.group(1))
    assert 2 <= stopped < 8 and (root / TRACKER).read_text().strip() == str(stopped), log[-4000:]
    assert not re.search(r"exitcode: -?[1-9]|Traceback \(most recent call last\):\n\s+File \"[^\"]*pretrain", log), \
        log[-4000:]  # no rank failed or died by the signal
    first = json.loads((tmp_path / "first.json").read_text())
    assert [r["lm loss"] for r in first["train"]] == [losses(full)[i] for i in range(1, stopped + 1)]
    resumed = in_process(tmp_path, "resumed", 2, ARGV + ["--load", str(root)])
    assert f"at iteration {stopped}" in resumed["log"]
    assert sorted(losses(resumed)) == list(range(stopped + 1, 9))
    assert_curve(losses(resumed), losses(full), what="resumed after SIGTERM", exact=True)
    for a, b in zip(train(resumed), train(full)[stopped:]):
        assert (a["learning rate"], a["grad norm"]) == (b["learning rate"], b["grad norm"])
