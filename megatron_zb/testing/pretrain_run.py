"""Run ``pretrain_gpt_zb.py`` under torchrun and check what it leaves: the GPU self-test's pretrain steps.

``python -m megatron_zb.testing.pretrain_run --nproc N --out DIR -- <pretrain_gpt_zb.py flags>``

1. starts ``python -m torch.distributed.run --standalone --nproc_per_node N`` on this module in
   *rank mode*, which runs the repository's ``pretrain_gpt_zb.py`` itself (``runpy``, as
   ``__main__``, with the given flags) and, when it returns, writes the rank's peak CUDA memory
   (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of its device, over the whole run)
   to ``DIR/memory_rank<R>.json``;
2. stops the whole launch after ``--timeout`` seconds (SIGTERM to torchrun, which stops its
   workers, then SIGKILL after ``--kill-grace`` seconds; a hang becomes a FAIL);
3. checks the outcome: exit status 0; with ``--loss-log-json FILE`` among the flags, at least one
   iteration logged and every lm loss finite; with ``--profile-out FILE``, the file written (the
   profile-then-replan window ran to its end); on CUDA, a memory record from every rank. With a
   profile it also reports (information, not a verdict) how much of the measured iteration the
   profiled compute explains: the busiest pipeline rank's ``m x sum(T_F + T_B + T_W)`` over its
   stages against the median logged iteration time after the window (the launch's output is kept
   in ``DIR/train.log``). Actions timed by the host while CUDA kernels still run asynchronously
   (launch-time profiles) explain much less than a profile that waits for the kernels;
4. writes ``DIR/result.json`` (exit status, losses, per-rank peaks, device) -- what
   :mod:`megatron_zb.testing.memory_check` compares with ``megatron-zb plan`` -- and prints one
   last line, ``pretrain <label>: PASS: ...`` or ``pretrain <label>: FAIL: <why>``.

Exit status: 0 on PASS, 1 on FAIL, 2 for a bad command line. Runs on CPU too (gloo, tiny sizes);
``scripts/gpu_selftest.sh`` runs it on CUDA with NCCL. Nothing is downloaded: give ``--mock-data``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["PRETRAIN_SCRIPT", "Launch", "check_run", "flag_value", "launch", "main", "profile_coverage",
           "summary_line"]

PRETRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "pretrain_gpt_zb.py"
"""The repository's ``pretrain_gpt_zb.py`` (what the launch scripts run)."""
GIB = 2**30


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in an argv list (``--x V`` or ``--x=V``; the last one wins), else None."""
    value = None
    for i, a in enumerate(flags):
        if a == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _rank_mode(record_dir: str, flags: list[str]) -> int:
    """Inside one torchrun process: run pretrain_gpt_zb.py, then write this rank's memory record."""
    code: Any = 0
    sys.argv = [str(PRETRAIN_SCRIPT), *flags]
    try:
        runpy.run_path(str(PRETRAIN_SCRIPT), run_name="__main__")
    except SystemExit as e:
        code = e.code
    code = 0 if code is None else (code if isinstance(code, int) else 1)
    record: dict[str, Any] = {"rank": int(os.environ.get("RANK", "0")), "exit": code, "device": "cpu"}
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        record.update(device=f"cuda:{dev} {props.name}", total_bytes=int(props.total_memory),
                      max_allocated_bytes=int(torch.cuda.max_memory_allocated(dev)),
                      max_reserved_bytes=int(torch.cuda.max_memory_reserved(dev)))
    Path(record_dir, f"memory_rank{record['rank']}.json").write_text(json.dumps(record) + "\n")
    return code


def profile_coverage(profile: dict[str, Any], log_lines: Sequence[str],
                     after_iteration: int) -> dict[str, float] | None:
    """The busiest rank's profiled compute per iteration against the median logged iteration time of the
    iterations after ``after_iteration`` (ms); ``None`` without such iterations."""
    from ..training.logging_utils import parse_iteration_line

    times = []
    for line in log_lines:
        try:
            rec = parse_iteration_line(line)
        except ValueError:
            continue
        if rec["iteration"] > after_iteration and "elapsed time per iteration (ms)" in rec:
            times.append(float(rec["elapsed time per iteration (ms)"]))
    if not times:
        return None
    m = profile["parallel"]["num_microbatches"]
    busy: dict[int, float] = {}
    for rank, st in zip(profile["stage_to_rank"], profile["stages"]):
        busy[rank] = busy.get(rank, 0.0) + m * (st["t_f_ms"] + st["t_b_ms"] + st["t_w_ms"])
    times.sort()
    iteration = times[len(times) // 2]
    return {"busy_ms": max(busy.values()), "iteration_ms": iteration, "ratio": max(busy.values()) / iteration}


def check_run(out: Path, flags: Sequence[str], *, nproc: int, exit_code: int | None, seconds: float,
              timeout: float, label: str, log_lines: Sequence[str] = (), profile_required: bool = True
              ) -> dict[str, Any]:
    """The verdict of one launch (see the module doc); also written to ``out/result.json``.
    ``profile_required=False``: a ``--profile-out`` file not written is a note (``res["notes"]``), not a
    problem (at PP=1 the trainer measures but does not write it)."""
    res: dict[str, Any] = {"label": label, "nproc": nproc, "exit": exit_code, "seconds": round(seconds, 1),
                           "flags": list(flags), "problems": [], "notes": []}
    problems: list[str] = res["problems"]
    if exit_code is None:
        problems.append(f"did not finish within {timeout:g} s (killed; a hang?)")
    elif exit_code != 0:
        problems.append(f"exit status {exit_code}")
    records = []
    for path in sorted(glob.glob(str(out / "memory_rank*.json"))):
        records.append(json.loads(Path(path).read_text()))
    records.sort(key=lambda r: r["rank"])
    res["ranks"] = records
    res["peak_bytes"] = [r.get("max_allocated_bytes") for r in records]
    cuda = any(r.get("device", "cpu") != "cpu" for r in records)
    if exit_code == 0 and cuda and len(records) != nproc:
        problems.append(f"memory records from {len(records)} of {nproc} ranks")
    loss_json = flag_value(flags, "--loss-log-json")
    if loss_json is not None and exit_code == 0:
        try:
            train = json.loads(Path(loss_json).read_text())["train"]
            losses = [it["lm loss"] for it in train]
            res["losses"] = losses
            if not losses:
                problems.append(f"{loss_json}: no iteration logged")
            elif not all(math.isfinite(x) for x in losses):
                problems.append(f"non-finite lm loss: {losses}")
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"--loss-log-json {loss_json} unreadable: {e}")
    profile = flag_value(flags, "--profile-out")
    if profile is not None and exit_code == 0:
        res["profile"] = profile
        if not Path(profile).is_file():
            why = next((ln.split("not written", 1)[1].strip(" :\n") for ln in log_lines
                        if "--profile-out" in ln and "not written" in ln),
                       "the log says why: the profiling window did not end, or the trainer could not write it")
            (problems if profile_required else res["notes"]).append(f"--profile-out {profile} not written ({why})")
        else:
            end = int(flag_value(flags, "--zero-bubble-pipeline-timers-end-iter") or 3)
            try:
                res["coverage"] = profile_coverage(json.loads(Path(profile).read_text()), log_lines, end - 1)
            except (ValueError, KeyError) as e:
                problems.append(f"--profile-out {profile} unreadable: {e}")
    res["status"] = "FAIL" if problems else "PASS"
    (out / "result.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def summary_line(res: dict[str, Any]) -> str:
    """One line: PASS with what ran, or FAIL with why."""
    head = f"pretrain {res['label']} ({res['nproc']} process{'es' if res['nproc'] > 1 else ''})"
    if res["status"] == "FAIL":
        return f"{head}: FAIL: {'; '.join(res['problems'])}"
    parts = [f"{res['seconds']:g} s"]
    losses = res.get("losses")
    if losses:
        parts.append(f"{len(losses)} iterations, lm loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if res.get("profile"):
        parts.append(f"profile written to {res['profile']}")
    cov = res.get("coverage")
    if cov:
        parts.append(f"profiled compute of the busiest rank {cov['busy_ms']:.1f} ms = {100 * cov['ratio']:.0f}% of "
                     f"the measured iteration {cov['iteration_ms']:.1f} ms")
    peaks = [p for p in res["peak_bytes"] if p is not None]
    if peaks:
        parts.append("peak CUDA memory per rank " + ", ".join(f"{p / GIB:.2f}" for p in peaks) + " GiB")
    parts += res.get("notes", [])
    return f"{head}: PASS: {'; '.join(parts)}"


def _tee(stream: Any, path: Path, lines: list[str]) -> None:
    """Copy the launch's output to this process's stdout and to ``path``, keeping the lines."""
    with open(path, "w") as f:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()
            f.write(line)
            lines.append(line)


@dataclass
class Launch:
    """What one torchrun launch left: exit status (``None``: killed at the timeout), seconds, output lines."""

    exit_code: int | None
    seconds: float
    log_lines: list[str]


def launch(flags: Sequence[str], *, nproc: int, out: Path, timeout: float, kill_grace: float) -> Launch:
    """Run ``pretrain_gpt_zb.py flags`` under torchrun on ``nproc`` processes (output also in
    ``out/train.log``); stopped after ``timeout`` s (SIGTERM to torchrun, SIGKILL ``kill_grace`` s later)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in glob.glob(str(out / "memory_rank*.json")) + [str(out / "result.json")]:
        Path(stale).unlink(missing_ok=True)
    for flag in ("--loss-log-json", "--profile-out"):
        path = flag_value(flags, flag)
        if path is not None:
            Path(path).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "megatron_zb.testing.pretrain_run", "--rank-record", str(out), "--", *flags]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    log_lines: list[str] = []
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    reader = threading.Thread(target=_tee, args=(proc.stdout, out / "train.log", log_lines), daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in its own session: SIGTERM lets it stop them; only then is its
        # own process group killed
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=kill_grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        code = None
    reader.join(timeout=min(30.0, kill_grace + 5))
    return Launch(code, time.monotonic() - t0, log_lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    from .cli_args import split_passthrough

    parts = split_passthrough(sys.argv[1:] if argv is None else argv, prog="pretrain_run",
                              what="the pretrain_gpt_zb.py flags")
    if parts is None:
        return 2
    own, flags = parts
    ap = argparse.ArgumentParser(prog="python -m megatron_zb.testing.pretrain_run",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=1, help="processes (torchrun --nproc_per_node)")
    ap.add_argument("--out", default=None, help="directory for the memory records and result.json")
    ap.add_argument("--label", default=None, help="name in the verdict line (default: the schedule flags)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="hard limit of the launch, seconds")
    ap.add_argument("--kill-grace", type=float, default=60.0,
                    help="seconds torchrun gets to stop its workers after the timeout (default 60)")
    ap.add_argument("--rank-record", default=None, help=argparse.SUPPRESS)  # rank mode (started by torchrun)
    args = ap.parse_args(own)
    if args.rank_record is not None:
        return _rank_mode(args.rank_record, flags)
    if args.out is None:
        print("pretrain_run: --out DIR is required", file=sys.stderr)
        return 2
    out = Path(args.out)
    label = args.label or " ".join(a for a in flags if a in ("--enable-zero-bubble", "--zero-bubble-v-schedule")
                                   ) or (flag_value(flags, "--schedule") or "1f1b")
    run = launch(flags, nproc=args.nproc, out=out, timeout=args.timeout, kill_grace=args.kill_grace)
    res = check_run(out, flags, nproc=args.nproc, exit_code=run.exit_code, seconds=run.seconds,
                    timeout=args.timeout, label=label, log_lines=run.log_lines)
    print(summary_line(res), flush=True)
    return 0 if res["status"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
