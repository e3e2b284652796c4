"""The machine a benchmark runs on: its description, load average and the CPU other processes use.

The numbers of a CPU benchmark on a shared machine mean little without the load next to them;
the ``cpu`` benchmark (:mod:`megatron_zb.bench.cpu`) records both with :class:`LoadSampler` and :func:`machine`.
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time

__all__ = ["LoadSampler", "OtherProcessesCpu", "loadavg", "machine"]


def loadavg() -> tuple[float, float, float]:
    try:
        a, b, c = open("/proc/loadavg").read().split()[:3]
        return float(a), float(b), float(c)
    except OSError:
        return (float("nan"),) * 3


def _busy_jiffies() -> tuple[int, int, int]:
    """Busy CPU time of the whole machine (all cores), its part stolen by the hypervisor (a virtual
    machine's CPU time the host gave to someone else) and all its CPU time (busy, idle and iowait:
    the cores times the time elapsed), in clock ticks, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest and guest_nice are counted in user/nice)
    steal = v[7] if len(v) > 7 else 0
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + steal
    return busy, steal, busy + v[3] + v[4]


def _own_jiffies(root: int) -> int:
    """CPU ticks of process ``root`` and its descendants, reaped children included (cutime/cstime)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)] = int(rest[1])
        ticks[int(d)] = sum(int(x) for x in rest[11:15])  # utime stime cutime cstime
    total = 0
    for pid, t in ticks.items():
        q = pid
        while q not in (0, 1) and q != root and q in parent:
            q = parent[q]
        if q == root:
            total += t
    return total


class LoadSampler:
    """Samples, every ``period`` seconds in a daemon thread, the 1-minute load average and the CPU
    used by processes *outside* this benchmark (machine busy time minus this process tree's)."""

    def __init__(self, period: float = 2.0) -> None:
        self.period = period
        self.samples: list[float] = []
        self.others: list[float] = []  # cores busy with other processes, per window
        self.steal: list[float] = []   # of which stolen by the hypervisor, per window
        self._marked = self._marked_load = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        window = OtherProcessesCpu()
        while not self._stop.is_set():
            self.samples.append(loadavg()[0])
            self._stop.wait(self.period)
            cores = window.cores()
            if cores == cores:  # not nan
                self.others.append(cores)
                self.steal.append(window.steal_cores())
            window = OtherProcessesCpu()

    def mark(self, name: str) -> str:
        """Describe the other processes' CPU use since the previous mark (one line per section)."""
        o = self.others[self._marked:]
        s = self.samples[self._marked_load:] or self.samples[-1:]  # the sampler may not have sampled the load since
        self._marked, self._marked_load = len(self.others), len(self.samples)
        if not o or not s:
            return f"{name}: -"
        st = self.steal[self._marked - len(o):self._marked] or [float("nan")]
        return (f"{name}: other processes {statistics.fmean(o):.2f} cores mean, {max(o):.2f} max (hypervisor "
                f"steal {statistics.fmean(st):.2f} mean, {max(st):.2f} max); 1-min load {min(s):.2f}-{max(s):.2f}")

    def stop(self) -> str:
        self._stop.set()
        self._t.join(self.period + 1.0)
        s = self.samples or [float("nan")]
        o = self.others or [float("nan")]
        st = self.steal or [float("nan")]
        return (f"1-min load average during the run (includes the benchmark's own processes): min {min(s):.2f}, "
                f"median {statistics.median(s):.2f}, max {max(s):.2f}; CPU used by other processes (machine busy "
                f"time minus this benchmark's process tree, {self.period:g}-s windows): mean "
                f"{statistics.fmean(o):.2f} cores, max {max(o):.2f} of {os.cpu_count()}, of which stolen by the "
                f"hypervisor (steal: this VM's CPU time the host gave to other guests) mean "
                f"{statistics.fmean(st):.2f}, max {max(st):.2f}")


def _snapshot() -> tuple[float, int, int, int, int] | None:
    """(monotonic seconds, machine busy ticks, this process tree's ticks, steal ticks, all ticks), or
    None without /proc."""
    try:
        busy, steal, total = _busy_jiffies()
        return time.monotonic(), busy, _own_jiffies(os.getpid()), steal, total
    except OSError:
        return None


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    try:
        from importlib.metadata import version
        mcore = version("megatron-core")
    except Exception:  # pragma: no cover - metadata missing
        mcore = "?"
    return (f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, megatron-core {mcore}, gloo, CPU only")


class OtherProcessesCpu:
    """CPU time other processes used while this one ran something: machine busy time minus this
    process tree's (children included once reaped), from /proc.

    ``start`` on construction; :meth:`cores` = mean cores the others kept busy since then (``nan``
    where /proc is not readable). This, not the load average, tells a quiet machine: the load
    average counts the measured run's own processes too.
    """

    def __init__(self) -> None:
        self._start = _snapshot()
        self._now: tuple[float, int, int, int, int] | None = None

    def _window_ticks(self) -> float:
        """Ticks of one core over the window (``nan`` before a reading): the machine's CPU time from
        the same /proc/stat snapshots as the busy time, divided by the cores, so that a busy share
        never exceeds the cores (wall-clock time, read apart from /proc/stat, can run a tick short)."""
        now, start = self._now, self._start
        if now is None or start is None or now[0] <= start[0] or now[4] <= start[4]:
            return float("nan")
        return (now[4] - start[4]) / (os.cpu_count() or 1)

    def cores(self) -> float:
        """Mean number of cores busy with other processes since construction (the hypervisor's steal
        included: on a virtual machine another guest taking the host's core delays this run alike)."""
        self._now = _snapshot()
        window = self._window_ticks()
        if window != window:  # nan
            return window
        now, start = self._now, self._start
        assert now is not None and start is not None
        others = (now[1] - start[1]) - (now[2] - start[2])
        return max(0.0, others / window)

    def steal_cores(self) -> float:
        """Of :meth:`cores`' last reading, the mean cores stolen by the hypervisor (``nan`` before a reading)."""
        window = self._window_ticks()
        if window != window:
            return window
        assert self._now is not None and self._start is not None
        return (self._now[3] - self._start[3]) / window
