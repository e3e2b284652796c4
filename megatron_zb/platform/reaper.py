"""No process of a job left behind: a rank's reaper ends the rank's process group when the rank dies.

What a rank starts, and what would outlive it when the rank (or torchrun) is killed (``SIGKILL``, the
OOM killer, a node agent), with megatron-core 0.16.1 / 0.19 and Python's ``multiprocessing``:

* megatron-core's **checkpoint writer processes**: every save (``dist_checkpointing.save``, the
  ``torch_dist`` format: ``AsyncRequest.execute_sync`` -> ``FileSystemWriterAsync.write_preloaded_data_multiproc``,
  ``dist_checkpointing/strategies/filesystem_async.py``) forks one writer per file bucket
  (``multiprocessing.get_context("fork").Process``); an asynchronous save forks the caller too
  (``TemporalAsyncCaller``, ``strategies/async_utils.py``). Nothing in them watches the rank.
* a **multiprocessing manager** per rank: the first save calls ``_get_write_results_queue()``
  (``filesystem_async.py``), ``mp.get_context("spawn").Manager().Queue()`` -- a ``SyncManager`` server
  process (fork + exec of ``spawn_main``) that serves until the rank's ``atexit`` finaliser shuts it
  down, which a killed rank never runs: it lives for ever.
* a **resource tracker** per rank (``multiprocessing.resource_tracker``), started by the spawn above: it
  exits by itself, after unlinking leaked semaphores, once every holder of its pipe's write end (the
  rank, the manager, the rank's forked children) has closed it -- i.e. once they are dead.
* the **ranks themselves**: torchrun starts each worker in a session of its own
  (``start_new_session``) and ends it with ``killpg`` -- which a ``SIGKILL``ed torchrun never does.

A torchrun worker leads its own session (and process group), and every process above stays in its
group (none calls ``setsid`` / ``setpgid``), which holds nothing else: a process of another session
cannot join it. So :func:`install` starts, per rank, one small process (this file run as a
script: standard library only, ``python -I -S``) that polls every :data:`POLL_S` seconds whether the
rank is still its parent and, under torchrun (``TORCHELASTIC_RUN_ID`` set), whether torchrun is still
the rank's parent. When either is gone it ``SIGKILL``s every other member of the group -- the rank if
it still runs, the writers, the manager -- except the resource trackers, which then see their pipe
close, clean up and exit; then it exits. It ignores ``SIGTERM`` / ``SIGINT`` / ``SIGHUP`` so that a
graceful stop (torchrun's, SLURM's) does not end it before the rank. When the rank ends normally it
finds nothing left to kill.

Polling the parent relation rather than a pid cannot be fooled by pid reuse, and needs no thread in the
rank; ``prctl(PR_SET_PDEATHSIG)`` in forked children (``os.register_at_fork``) was not used: it does
not reach the manager (spawned through ``_posixsubprocess.fork_exec``, which runs no fork hooks), and
it fires when the forking *thread* ends, not the process.

Not covered (:func:`install` returns ``False`` and does nothing): other platforms than Linux (the
group members are read from ``/proc``), and a rank that does not lead its session -- a single
``python pretrain_gpt_zb.py`` run from a shell is in the shell's session, and leads at most the
shell job's process group, which it shares with e.g. ``| tee`` (not ours to kill); the shell's job
control signals the whole group, and a ``kill -9`` of that process alone leaves megatron-core's
manager behind (``kill -9 -- -PGID`` ends them all). A process of the job that leaves
the group (``setsid``) is not reaped either; none of megatron-core's or torch's does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["POLL_S", "group_members", "install", "is_running", "main", "reap"]

POLL_S = 0.5
"""Seconds between the reaper's looks at the rank and its launcher."""

SPARED = "multiprocessing.resource_tracker"
"""A group member whose command line contains this exits by itself once the others are dead (module docstring)."""

_reaper: subprocess.Popen | None = None


def install() -> bool:
    """Start this process's reaper (once per process); return whether one runs.

    Call it at start-up, before any child process starts; Linux only, and only in a process that leads
    its session (a torchrun worker, ``setsid``); otherwise it does nothing and returns ``False``.
    """
    global _reaper
    if _reaper is not None:
        return True
    if not sys.platform.startswith("linux") or os.getsid(0) != os.getpid():
        return False
    launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else 0
    _reaper = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
                                str(launcher)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
    return True


def is_running() -> bool:
    """Whether :func:`install` started this process's reaper."""
    return _reaper is not None


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, parent pid, process group)`` of ``pid`` from ``/proc/PID/stat``; ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[2])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from ``/proc``."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[2] == pgid and stat[0] != "Z":
                members.append(int(name))
    return members


def _alive(rank: int, launcher: int) -> bool:
    """Whether ``rank`` is still this process's parent and (if ``launcher``) ``launcher`` still the rank's."""
    if os.getppid() != rank:
        return False
    stat = _stat(rank)
    return stat is not None and (launcher == 0 or stat[1] == launcher)


def reap(pgid: int, *, rounds: int = 50) -> None:
    """``SIGKILL`` every member of ``pgid`` but this process and the resource trackers, until none is left
    (a member may fork while it is being killed; at most ``rounds`` looks, :data:`POLL_S` / 5 apart)."""
    for _ in range(rounds):
        targets = [p for p in group_members(pgid) if p != os.getpid() and SPARED not in _cmdline(p)]
        if not targets:
            return
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(POLL_S / 5)


def main(argv: list[str]) -> int:
    """The reaper: ``RANK_PID LAUNCHER_PID`` (``0``: no launcher to watch); returns once it has reaped."""
    rank, launcher = int(argv[0]), int(argv[1])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while _alive(rank, launcher):
        time.sleep(POLL_S)
    reap(rank)  # the rank led its session, and so its group: the group's id is its pid
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
