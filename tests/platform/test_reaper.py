"""The reaper of ``megatron_zb/platform/reaper.py``, without training: a session leader (as a torchrun worker) that
starts what megatron-core's checkpoint save starts -- a forked writer and a spawned
``multiprocessing`` manager (with its resource tracker) -- is killed alone (``SIGKILL``, as the OOM
killer would); within a few seconds nothing it started is left. The whole-job kill under torchrun is
``tests/training/test_checkpoint_failures.py::test_job_killed_during_a_save_resumes_from_the_previous_checkpoint``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.leftovers import job_environment, marked_processes, wait_until_none_left

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper is Linux-only")

ROOT = Path(__file__).resolve().parents[2]

_RANK = r"""
import multiprocessing as mp, os, sys, time
from megatron_zb.platform.reaper import install

def write():  # megatron-core's forked checkpoint writer, stuck
    time.sleep(600)

if __name__ == "__main__":
    print("reaper", install(), flush=True)
    queue = mp.get_context("spawn").Manager().Queue()  # megatron-core's _get_write_results_queue()
    mp.get_context("fork").Process(target=write).start()
    print("ready", flush=True)
    time.sleep(600)
"""


def test_a_killed_session_leader_leaves_nothing_behind(tmp_path):
    job, marker = job_environment()
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **marker)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # a session leader, as torchrun starts its workers
    try:
        assert proc.stdout.readline().strip() == "reaper True"
        assert proc.stdout.readline().strip() == "ready"
        started = marked_processes(job)
        kinds = ("reaper.py", "resource_tracker", "spawn_main", str(script))
        assert all(any(k in cmd for cmd in started.values()) for k in kinds), started
        assert len(started) >= 5, started  # the rank, its reaper, the manager, its tracker, the writer
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        left, waited = wait_until_none_left(job, 10.0)
        assert not left, f"left {waited:.0f} s after the kill: {left}"
    finally:
        for pid in marked_processes(job):
            os.kill(pid, signal.SIGKILL)


def test_not_installed_outside_a_group_leader():
    """A process in its parent's session (``python pretrain_gpt_zb.py`` from a shell, maybe ``| tee``): no
    reaper, even where it leads a process group (a shell's job)."""
    code = "from megatron_zb.platform.reaper import install, is_running; print(install(), is_running())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)), text=True,
                         capture_output=True, timeout=60, process_group=0)
    assert out.stdout.split() == ["False", "False"], out
