"""Progress lines of the benchmarks: one per round, with elapsed time and an estimate of what is left.

The benchmark bodies run inside :func:`megatron_zb.testing.run_distributed` ranks, whose stderr
is the benchmark's; only the rank that is told to (rank 0) prints, so a run of ``n`` rounds
writes ``n`` lines such as::

    [12:03:41] real m=8 round 3/32: megatron-1f1b 167.2, 1f1b 166.0, zb-2p 156.1 ms; elapsed 41 s, ETA 6 min 50 s

A step that prints nothing itself for longer (one whole training run of ``bench vocab``) runs under
:func:`heartbeat`: a line every few seconds naming it and the time so far.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, Mapping, TextIO


def log(msg: str, *, stream: TextIO | None = None) -> None:
    """One time-stamped line on stderr (flushed: the benchmark's processes share the terminal)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=stream or sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """``41 s``, ``6 min 50 s``, ``1 h 02 min`` (seconds rounded)."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class RoundProgress:
    """Counts the rounds of one benchmark phase and prints a line per round.

    Args:
        section: what runs (``"real"``, ``"emulated p=8"``, ...), the start of every line.
        total: rounds the phase will run (all microbatch counts together), for the ETA.
        enabled: print at all (``True`` on one rank only).
    """

    def __init__(self, section: str, total: int, *, enabled: bool = True) -> None:
        self.section, self.total, self.enabled = section, max(1, int(total)), enabled
        self.done = 0
        self._t0 = time.perf_counter()

    def line(self, *, m: int | None, times_ms: Mapping[str, float], what: str = "round") -> str:
        """Count one round and return its line: variant times (ms) of the round, elapsed, ETA."""
        self.done += 1
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / self.done * (self.total - self.done)
        where = f" m={m}" if m is not None else ""
        variants = ", ".join(f"{v} {t:.1f}" for v, t in times_ms.items())
        return (f"{self.section}{where} {what} {self.done}/{self.total}: {variants or '-'} ms; "
                f"elapsed {duration(elapsed)}, ETA {duration(eta)}")

    def round(self, *, m: int | None, times_ms: Mapping[str, float], what: str = "round") -> None:
        """:meth:`line`, printed (when enabled)."""
        text = self.line(m=m, times_ms=times_ms, what=what)
        if self.enabled:
            log(text)


@contextlib.contextmanager
def heartbeat(what: str, *, every_s: float = 5.0, stream: TextIO | None = None) -> Iterator[None]:
    """While the body runs, a :func:`log` line ``<what>: running, <elapsed>`` every ``every_s`` seconds
    (from a daemon thread of this process, stopped and joined when the body ends or raises)."""
    stop = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not stop.wait(every_s):
            log(f"{what}: running, {duration(time.perf_counter() - t0)}", stream=stream)

    thread = threading.Thread(target=beat, name="bench-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
