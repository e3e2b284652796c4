"""Run the GPU self-test's plan (``scripts/gpu_selftest.sh``): steps in order, results as each job ends.

``python -m megatron_zb.testing.selftest [--gpus N] [--dry-run] [--out DIR] [--steps a,b] [--full]``

Makes the plan (:func:`megatron_zb.testing.selftest_plan.make_plan`), prints it (every command, each
step's timeout and parallel groups, the planned critical path) and refuses, exit 2, a plan above its
budget (9 minutes; ``--full``: an hour). Without ``--dry-run`` it runs the steps: each job's
commands in a new session with their output in ``WORK/<job>.log``, stopped at the job's timeout
(SIGTERM to its process group, SIGKILL :data:`~.selftest_jobs.KILL_GRACE_S` s later: a FAIL naming
the step and the job). Every step prints a line when it starts and ends, and every 10 s the last
output line of each job still running. ``OUT/summary.txt`` gets one line per job as soon as it ends
(PASS / FAIL with the job's last output line), after a header with the plan's SKIPPED, DEFERRED and
OPT-IN jobs; ``OUT/logs.tar.gz`` (every log and run file of WORK below 4 MiB) is rewritten after
every step, so a run killed at any moment leaves everything finished so far in OUT, in two files.
Exit status 0 when no job failed, 1 otherwise, 2 for a bad command line or a plan above its budget.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .selftest_jobs import BUDGET_S, FULL_BUDGET_S, KILL_GRACE_S, Context
from .selftest_plan import Placed, Plan, describe_gpus, make_plan, render

__all__ = ["JobResult", "Stopped", "main", "run_plan"]

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 10.0
"""Seconds between progress lines while a step runs."""
TAR_FILE_LIMIT = 4 * 2**20
"""Files of WORK above this many bytes stay out of ``logs.tar.gz``."""
_RUNNING: set[subprocess.Popen] = set()
"""The jobs' processes now running (stopped with the run when it is stopped by a signal)."""
_RUNNING_LOCK = threading.Lock()


class Stopped(Exception):
    """The self-test received SIGTERM or SIGINT."""


@dataclass
class JobResult:
    """How one job ended: ``PASS`` or ``FAIL``, its seconds and the reason (its last output line)."""

    status: str
    seconds: float
    reason: str


def last_line(path: Path) -> str:
    """The last non-empty line of a file (its last 8 KiB), at most 300 characters."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process's group; SIGKILL after the grace."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_job(placed: Placed, log: Path, started: float) -> JobResult:
    """Run the job's commands one after the other within its timeout (from ``started``, monotonic s)."""
    deadline = started + placed.job.timeout_s
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    with open(log, "w") as f:
        for cmd in placed.commands:
            f.write(f"+ {cmd.shell()}\n")
            f.flush()
            try:
                proc = subprocess.Popen(cmd.argv, env=cmd.environ(env), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            except OSError as e:
                return JobResult("FAIL", time.monotonic() - started, f"cannot start {cmd.argv[0]}: {e}")
            with _RUNNING_LOCK:
                _RUNNING.add(proc)
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _stop(proc)
                return JobResult("FAIL", time.monotonic() - started, f"timed out after {placed.job.timeout_s:g} s "
                                 f"(killed); last output: {last_line(log)}")
            finally:
                with _RUNNING_LOCK:
                    _RUNNING.discard(proc)
            if code != 0:
                return JobResult("FAIL", time.monotonic() - started, f"exit {code}: {last_line(log)}")
    return JobResult("PASS", time.monotonic() - started, last_line(log))


class Summary:
    """``summary.txt``: written at once, then one line appended per job as it ends (thread-safe)."""

    def __init__(self, path: Path, head: Sequence[str]) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.failed = 0
        self.passed = 0
        path.write_text("".join(f"{ln}\n" for ln in head))

    def add(self, line: str, status: str) -> None:
        with self.lock:
            self.failed += status == "FAIL"
            self.passed += status == "PASS"
            with open(self.path, "a") as f:
                f.write(line + "\n")
            print(line, flush=True)


def pack_logs(work: Path, tar: Path) -> None:
    """Rewrite ``tar`` with every file of ``work`` below :data:`TAR_FILE_LIMIT` bytes."""
    tmp = tar.with_name(tar.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as t:
        for path in sorted(work.rglob("*")):
            if path.is_file() and path.stat().st_size <= TAR_FILE_LIMIT:
                t.add(path, arcname=str(path.relative_to(work.parent)))
    os.replace(tmp, tar)


def _heartbeat(i: int, threads: dict[str, threading.Thread], logs: dict[str, Path], t0: float) -> None:
    running = [k for k, t in threads.items() if t.is_alive()]
    if running:
        parts = "; ".join(f"[{k}] {last_line(logs[k])[:120]}" for k in running)
        print(f"   ... step {i}, {time.monotonic() - t0:.0f} s: {parts}", flush=True)


def run_step(i: int, step_jobs: list[Placed], work: Path, report: Callable[[Placed, JobResult], None]) -> None:
    """Run one step's jobs side by side; ``report`` is called as each ends."""
    t0 = time.monotonic()
    logs = {p.job.key: work / f"{p.job.key}.log" for p in step_jobs}

    def one(p: Placed) -> None:
        report(p, run_job(p, logs[p.job.key], t0))

    threads = {p.job.key: threading.Thread(target=one, args=(p,), daemon=True) for p in step_jobs}
    for t in threads.values():
        t.start()
    next_beat = t0 + HEARTBEAT_S
    while any(t.is_alive() for t in threads.values()):
        for t in threads.values():
            t.join(timeout=0.5)
        if time.monotonic() >= next_beat:
            _heartbeat(i, threads, logs, t0)
            next_beat += HEARTBEAT_S


def _plan_lines(plan: Plan) -> list[str]:
    return ([f"{'SKIPPED':<8} [{j.key}] {j.title} ({why})" for j, why in plan.skipped]
            + [f"{'DEFERRED':<8} [{j.key}] {j.title} ({why})" for j, why in plan.deferred]
            + [f"{'OPT-IN':<8} [{j.key}] {j.title} (--full)" for j in plan.opt_in])


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def _kill_running() -> None:
    with _RUNNING_LOCK:
        procs = list(_RUNNING)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_plan(plan: Plan, out: Path, work: Path, head: Sequence[str] = ()) -> int:
    """Run every step (module doc); 0 when no job failed, else 1. On SIGTERM / SIGINT the running
    jobs are killed, ``STOPPED`` is written and the logs packed."""
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary = Summary(out / "summary.txt", [*head, *_plan_lines(plan)])
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _run_steps(plan, out, work, summary)
    except Stopped as e:
        _kill_running()
        summary.add(f"{'STOPPED':<8} the self-test received {e}; the running jobs were killed", "FAIL")
        pack_logs(work, out / "logs.tar.gz")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    tail = (f"result: {summary.passed} passed, {summary.failed} failed, {len(plan.skipped)} skipped, "
            f"{len(plan.deferred)} deferred; exit {1 if summary.failed else 0}")
    summary.add(tail, "")
    return 1 if summary.failed else 0


def _run_steps(plan: Plan, out: Path, work: Path, summary: Summary) -> None:
    n = len(plan.steps)
    for i, step in enumerate(plan.steps, 1):
        t0 = time.monotonic()
        names = ", ".join(p.job.key for p in step.placed)
        print(f">> step {i}/{n} start (timeout {step.timeout_s:g} s): {names}", flush=True)

        def report(p: Placed, r: JobResult, i: int = i) -> None:
            summary.add(f"{r.status:<8} step {i} [{p.job.key}] {p.job.title} ({describe_gpus(p.gpus)}; "
                        f"{r.seconds:.0f} s): {r.reason}", r.status)

        run_step(i, step.placed, work, report)
        pack_logs(work, out / "logs.tar.gz")
        print(f"<< step {i}/{n} end after {time.monotonic() - t0:.0f} s", flush=True)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/gpu_selftest.sh", description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every visible one, at most 8)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its commands; run nothing")
    ap.add_argument("--out", default=None,
                    help="summary.txt and logs.tar.gz (default /tmp/megatron_zb_gpu_selftest-DATE)")
    ap.add_argument("--work", default=None, help="logs and run files (default: OUT's name + '-work', beside it)")
    ap.add_argument("--steps", default=None, help="comma-separated job keys: only these, never deferred")
    ap.add_argument("--full", action="store_true", help="add the opt-in jobs; budget one hour")
    ap.add_argument("--budget-s", type=float, default=None, help=f"critical-path budget, s (default {BUDGET_S:g})")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the jobs (default: this one)")
    return ap.parse_args(argv)


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _have_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, timeout=10).returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"
    return (sha or "unknown") + (" (with local changes)" if sha and dirty else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    args = _parse(argv)
    note = ""
    gpus = args.gpus if args.gpus is not None else _visible_gpus()
    if gpus == 0 and args.dry_run and args.gpus is None:
        gpus, note = 8, "no GPU visible here: the plan of an 8-GPU node (--gpus N for another count)"
    if gpus < 1:
        print("gpu_selftest: no CUDA device visible (torch.cuda.device_count() == 0); use --dry-run to see the plan",
              file=sys.stderr)
        return 2
    gpus = min(gpus, 8)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"{os.environ.get('TMPDIR', '/tmp')}/megatron_zb_gpu_selftest-{stamp}")
    work = Path(args.work or f"{out}-work")
    ctx = Context(gpus=gpus, work=work, python=args.python, cpus=os.cpu_count() or 1, have_te=_have_te())
    budget = args.budget_s if args.budget_s is not None else (FULL_BUDGET_S if args.full else BUDGET_S)
    try:
        plan = make_plan(ctx, full=args.full, budget_s=budget,
                         only=[s for s in args.steps.split(",") if s] if args.steps else None)
    except ValueError as e:
        print(f"gpu_selftest: {e}", file=sys.stderr)
        return 2
    head = [f"# megatron-zb GPU self-test: {gpus} GPU(s){', dry run: nothing is executed' if args.dry_run else ''}"]
    head += [f"# {note}"] if note else []
    head += [f"# results: {out}/summary.txt, {out}/logs.tar.gz (written as each job / step ends); logs in {work}"]
    print("\n".join(head + render(plan)), flush=True)
    if plan.over_budget:
        print(f"gpu_selftest: plan refused: its critical path {plan.critical_s:g} s is above the budget "
              f"{plan.budget_s:g} s (fewer --steps, or --budget-s)", file=sys.stderr)
        return 2
    if args.dry_run:
        return 0
    stamp_line = f"# date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}, commit {_commit()}"
    return run_plan(plan, out, work, head=[head[0], stamp_line, render(plan)[-1]])


if __name__ == "__main__":
    sys.exit(main())
