"""Processes a test's job left behind: every process started from the job carries a marker in its
environment (``JOB_MARKER``, set by the test when it launches the job), which each process inherits --
torchrun's workers (in sessions of their own), their forked and spawned children, the resource trackers
-- and which ``/proc/PID/environ`` shows (the environment a process was started with). Linux only.
"""

from __future__ import annotations

import os
import time
import uuid

__all__ = ["JOB_MARKER", "job_environment", "marked_processes", "wait_until_none_left"]

JOB_MARKER = "MEGATRON_ZB_TEST_JOB"
"""The environment variable naming a test's job (read only by this harness, from ``/proc``)."""


def job_environment() -> tuple[str, dict[str, str]]:
    """A fresh job id and ``{JOB_MARKER: id}`` to add to the job's environment."""
    job = uuid.uuid4().hex
    return job, {JOB_MARKER: job}


def marked_processes(job: str) -> dict[int, str]:
    """Every live (not zombie) process whose environment carries ``job``: pid -> command line."""
    needle = f"{JOB_MARKER}={job}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def wait_until_none_left(job: str, timeout_s: float) -> tuple[dict[int, str], float]:
    """Poll until no process of ``job`` is left or ``timeout_s`` seconds pass; return the survivors (empty
    when none) and the seconds waited."""
    t0 = time.monotonic()
    while True:
        left = marked_processes(job)
        waited = time.monotonic() - t0
        if not left or waited > timeout_s:
            return left, waited
        time.sleep(0.2)
