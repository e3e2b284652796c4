"""Head-of-line probe: with one hardware queue, does an operation that cannot start block the others?

``python -m megatron_zb.testing.hol_probe --forms stream[,nccl]`` answers, under both
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue per GPU) and the variable unset (CUDA's
default of 8), whether work issued later on *another* stream waits behind an operation whose
same-stream predecessor has not finished. Each setting runs in a fresh child process (the variable
is read when CUDA creates its context).

* **stream form** (1 GPU; cannot hang): on stream ``s1`` a long kernel K1 (``torch.cuda._sleep``,
  about :data:`K1_MS` ms), then a tiny K2 on ``s1``, then, issued last by the host, a tiny K3 on
  each of :data:`K3_STREAMS` other streams; CUDA events give, from K1's start, when K1 and the
  earliest K3 were done. With several queues K3 finishes long before K1 ends; with one queue K2
  waits at the head of the queue for K1, and K3 behind it (:func:`verdict`).
* **nccl form** (2 GPUs): the pipeline's real hazard. Two ranks, one process group per direction
  (as megatron-zb's ``Channels``); each rank issues two ``isend`` of :data:`NCCL_BYTES` (64 MiB:
  NCCL cannot buffer them, a send runs until the peer receives) and only then the two ``irecv``
  its peer's sends need. With several queues the receives start beside the running first send;
  with one queue the second send waits at the head of the queue for the first, the receives behind
  it, and both ranks wait forever. Each rank polls its four operations for at most ``--wait-s``
  seconds and reports ``completed`` or ``blocked`` (then the process is ended; nothing is waited
  for after that).

The probe measures; it does not judge the runtime. Exit status 0 when every form gave an answer
(whatever it is), 1 when a child crashed or overran its time, 2 for a bad command line. The last line
sums up both settings. On CPU the nccl form runs with gloo and small tensors (``--backend gloo
--bytes 1024``) for the tests; the stream form needs CUDA. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["CONNECTION_SETTINGS", "NCCL_CHILD_TIMEOUT_S", "STREAM_CHILD_TIMEOUT_S", "Verdict", "child_env", "main",
           "planned_seconds", "verdict"]

K1_MS = 200.0
"""Length of the long kernel K1 in milliseconds."""
K3_STREAMS = 3
"""Streams that each get a tiny K3 (more than one: CUDA maps streams to queues by itself)."""
REPEATS = 3
"""Measurements per setting in the stream form; the verdict reads their medians."""
NCCL_BYTES = 64 * 2**20
"""Bytes of each send of the nccl form (above NCCL's buffers)."""
BLOCKED_AT = 0.9
"""K3 done at or after this fraction of K1's time: head-of-line blocking."""
FREE_BELOW = 0.25
"""K3 done before this fraction of K1's time: no blocking."""
STREAM_CHILD_TIMEOUT_S = 15.0
"""Hard limit of one stream-form child (torch import and CUDA start included), seconds."""
NCCL_WAIT_S = 8.0
"""How long each rank of the nccl form polls its operations before reporting ``blocked``, seconds."""
NCCL_CHILD_TIMEOUT_S = 25.0
"""Hard limit of one nccl-form launch (both ranks), seconds."""
CONNECTION_SETTINGS: tuple[str | None, ...] = ("1", None)
"""``CUDA_DEVICE_MAX_CONNECTIONS`` values probed: one queue, then unset (CUDA's default)."""
MARK = "HOL_RESULT "


def setting_name(value: str | None) -> str:
    """How a setting is printed."""
    return "unset (CUDA's default, 8 queues)" if value is None else f"CUDA_DEVICE_MAX_CONNECTIONS={value}"


def planned_seconds(forms: Sequence[str]) -> float:
    """The longest the driver takes for ``forms`` (every child at its hard limit), seconds."""
    per = {"stream": STREAM_CHILD_TIMEOUT_S, "nccl": NCCL_CHILD_TIMEOUT_S}
    return len(CONNECTION_SETTINGS) * sum(per[f] for f in forms)


@dataclass(frozen=True)
class Verdict:
    """The stream form's answer: ``kind`` is ``blocking``, ``none`` or ``inconclusive``."""

    kind: str
    line: str


def verdict(k1_ms: float, k3_ms: float) -> Verdict:
    """Read the times (ms from K1's start) at which K1 and the earliest K3 were done."""
    times = f"K3 done after {k3_ms:.2f} ms, K1 {k1_ms:.1f} ms"
    if k1_ms <= 0:
        return Verdict("inconclusive", f"inconclusive: K1 took {k1_ms:.2f} ms (the long kernel did not run)")
    if k3_ms >= BLOCKED_AT * k1_ms:
        return Verdict("blocking", f"head-of-line blocking observed ({times})")
    if k3_ms <= FREE_BELOW * k1_ms:
        return Verdict("none", f"no head-of-line blocking ({times})")
    return Verdict("inconclusive", f"inconclusive ({times}: between {FREE_BELOW:g} and {BLOCKED_AT:g} of K1)")


# ---------------------------------------------------------------------------- stream form (child)
def _cycles_per_ms(torch: Any) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # load the kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def _stream_once(torch: Any, cycles: int) -> tuple[float, float]:
    """One measurement: (K1 done, earliest K3 done), ms from K1's start."""
    s1 = torch.cuda.Stream()
    others = [torch.cuda.Stream() for _ in range(K3_STREAMS)]
    x = torch.zeros(K3_STREAMS + 1, device="cuda")
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e3 = [torch.cuda.Event(enable_timing=True) for _ in others]
    with torch.cuda.stream(s1):
        e0.record()
        torch.cuda._sleep(cycles)  # K1
        e1.record()
        x[0].add_(1)  # K2: cannot start before K1 ends
    for i, (s, e) in enumerate(zip(others, e3)):
        with torch.cuda.stream(s):
            x[i + 1].add_(1)  # K3, issued last
            e.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1), min(e0.elapsed_time(e) for e in e3)


def stream_child() -> dict[str, Any]:
    """The stream form in this process (its ``CUDA_DEVICE_MAX_CONNECTIONS`` as started)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("hol_probe: the stream form needs a CUDA GPU (none visible)")
    cycles = int(_cycles_per_ms(torch) * K1_MS)
    runs = [_stream_once(torch, cycles) for _ in range(REPEATS)]
    k1 = statistics.median(r[0] for r in runs)
    k3 = statistics.median(r[1] for r in runs)
    return {"k1_ms": k1, "k3_ms": k3, "runs": runs, "gpu": torch.cuda.get_device_name(0)}


# ---------------------------------------------------------------------------- nccl form (child ranks)
def _exchange(dist: Any, tensors: list[Any], peer: int, send_group: Any, recv_group: Any, wait_s: float
              ) -> tuple[str, float, list[bool]]:
    """Two isends on ``send_group``, then two irecvs on ``recv_group``; until done or ``wait_s``: poll
    them (NCCL: ``is_completed`` reads each operation's CUDA event), or wait with the time left (gloo,
    whose point-to-point works complete only in ``wait``)."""
    t0 = time.perf_counter()
    works = [dist.isend(tensors[0], peer, group=send_group), dist.isend(tensors[1], peer, group=send_group),
             dist.irecv(tensors[2], peer, group=recv_group), dist.irecv(tensors[3], peer, group=recv_group)]
    if dist.get_backend(send_group) == "gloo":
        import datetime

        done = []
        for w in works:
            left = max(0.001, wait_s - (time.perf_counter() - t0))
            try:
                done.append(bool(w.wait(timeout=datetime.timedelta(seconds=left))))
            except RuntimeError:
                done.append(False)
        return ("completed" if all(done) else "blocked"), time.perf_counter() - t0, done
    while True:
        done = [w.is_completed() for w in works]
        elapsed = time.perf_counter() - t0
        if all(done):
            return "completed", elapsed, done
        if elapsed > wait_s:
            return "blocked", elapsed, done
        time.sleep(0.001)


def _warm_up(dist: Any, torch: Any, device: Any, rank: int, forward: Any, backward: Any) -> None:
    """One small transfer each way in an order that cannot block (the communicators start here)."""
    t = torch.zeros(256, dtype=torch.bfloat16, device=device)
    if rank == 0:
        dist.send(t, 1, group=forward)
        dist.recv(t, 1, group=backward)
    else:
        dist.recv(t, 0, group=forward)
        dist.send(t, 0, group=backward)
    if device.type == "cuda":
        torch.cuda.synchronize()


def nccl_child(rank: int, port: int, backend: str, nbytes: int, wait_s: float) -> dict[str, Any]:
    """One rank of the nccl form; returns its outcome (the caller ends the process)."""
    import datetime

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=4 * wait_s))
    forward, backward = dist.new_group([0, 1]), dist.new_group([0, 1])  # one communicator per direction
    _warm_up(dist, torch, device, rank, forward, backward)
    send_group, recv_group = (forward, backward) if rank == 0 else (backward, forward)
    big = [torch.full((nbytes // 2,), float(i % 2), dtype=torch.bfloat16, device=device) for i in range(4)]
    big[2].fill_(-1.0)
    big[3].fill_(-1.0)
    state, seconds, done = _exchange(dist, big, 1 - rank, send_group, recv_group, wait_s)
    if state == "completed" and (float(big[2][-1]) != 0.0 or float(big[3][-1]) != 1.0):
        state = "error"  # the receives got the wrong data
    return {"rank": rank, "state": state, "seconds": seconds, "done": done,
            "note": "received the wrong data" if state == "error" else ""}


# ---------------------------------------------------------------------------- driver
def child_env(value: str | None) -> dict[str, str]:
    """This process's environment with ``CUDA_DEVICE_MAX_CONNECTIONS`` set to ``value`` (``None``: removed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if value is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = value
    return env


def _result_of(output: str) -> dict[str, Any] | None:
    for line in output.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return None


def run_stream(value: str | None) -> tuple[bool, str]:
    """The stream form under one setting: (answered, line)."""
    cmd = [sys.executable, "-m", "megatron_zb.testing.hol_probe", "--child", "stream"]
    try:
        proc = subprocess.run(cmd, env=child_env(value), capture_output=True, text=True,
                              timeout=STREAM_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"stream form did not finish within {STREAM_CHILD_TIMEOUT_S:g} s"
    res = _result_of(proc.stdout)
    if proc.returncode != 0 or res is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return False, f"stream form failed (exit {proc.returncode}): {tail[0][:300]}"
    v = verdict(res["k1_ms"], res["k3_ms"])
    return v.kind != "inconclusive", v.line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nccl(value: str | None, *, backend: str, nbytes: int, wait_s: float) -> tuple[bool, str]:
    """The nccl form under one setting (two rank processes): (answered, line)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "megatron_zb.testing.hol_probe", "--child", "nccl",
                               "--rank", str(r), "--port", str(port), "--backend", backend, "--bytes", str(nbytes),
                               "--wait-s", str(wait_s)], env=child_env(value), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(2)]
    deadline = time.monotonic() + NCCL_CHILD_TIMEOUT_S
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    results = [_result_of(o) for o in outs]
    size = f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes} B"
    if any(r is None for r in results):
        bad = next(o for o, r in zip(outs, results) if r is None).strip().splitlines()[-1:] or ["no output"]
        return False, f"two isends of {size} before the irecvs: no answer ({bad[0][:300]})"
    states = {r["state"] for r in results}
    if "error" in states:
        return False, f"two isends of {size} before the irecvs: {results[0].get('note') or results[1].get('note')}"
    if states == {"completed"}:
        secs = max(r["seconds"] for r in results)
        return True, f"two isends of {size} before the irecvs: completed ({1e3 * secs:.1f} ms)"
    return True, (f"two isends of {size} before the irecvs: blocked (no progress within {wait_s:g} s; per rank "
                  f"done [send, send, recv, recv]: {[r['done'] for r in results]})")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_zb.testing.hol_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--forms", default="stream", help="comma-separated: stream (1 GPU), nccl (2 GPUs)")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="nccl form's backend (gloo: CPU test)")
    ap.add_argument("--bytes", type=int, default=NCCL_BYTES, help=f"bytes per send (default {NCCL_BYTES})")
    ap.add_argument("--wait-s", type=float, default=NCCL_WAIT_S, help="nccl form: seconds each rank polls")
    ap.add_argument("--child", choices=("stream", "nccl"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _child_main(args: argparse.Namespace) -> int:
    if args.child == "stream":
        res = stream_child()
    else:
        res = nccl_child(args.rank, args.port, args.backend, args.bytes, args.wait_s)
    print(MARK + json.dumps(res), flush=True)
    sys.stderr.flush()
    os._exit(0)  # never wait for blocked operations or the process group's teardown


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    args = _parse(argv)
    if args.child is not None:
        return _child_main(args)
    forms = [f for f in args.forms.split(",") if f]
    if not forms or any(f not in ("stream", "nccl") for f in forms) or args.bytes < 2 or args.wait_s <= 0:
        print(f"hol_probe: --forms takes stream and/or nccl (got {args.forms!r}); --bytes >= 2, --wait-s > 0",
              file=sys.stderr)
        return 2
    ok, summary = True, []
    for value in CONNECTION_SETTINGS:
        for form in forms:
            t0 = time.monotonic()
            print(f"head-of-line probe, {form} form, {setting_name(value)}: start", flush=True)
            answered, line = (run_stream(value) if form == "stream" else
                              run_nccl(value, backend=args.backend, nbytes=args.bytes, wait_s=args.wait_s))
            ok &= answered
            queue = "one hardware queue" if value == "1" else "default queues"
            summary.append(f"{form}, {queue}: {line}")
            print(f"  {setting_name(value)}, {form} form ({time.monotonic() - t0:.1f} s): {line}", flush=True)
    print(f"head-of-line probe: {'ANSWERED' if ok else 'FAIL'}: " + "; ".join(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
