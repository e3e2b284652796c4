"""Wait for a peer with a deadline, and name what is waited on: the one rule of every collective the
zero-bubble path adds (pipeline p2p, the data-parallel reduces launched from W, post-validation's
reductions).

A wait is described by an :class:`Awaited` (who waits, for which operation -- stage, bucket,
iteration --, on which peer ranks); when the deadline passes, :meth:`Awaited.error` is the one
:class:`PipelineTimeoutError` message::

    rank 0: data-parallel all-reduce of stage 0, bucket 0 (iteration 2) with peer rank 1 did not
    complete within 3 s: a peer process died, is frozen or never reached this collective
    (RuntimeError: Operation timed out!)

How the deadline is kept depends on the backend (:class:`WaitPolicy`), so that no host-blocking wait
is added to the GPU's hot path:

* ``HOST`` (gloo): :func:`wait_host` calls ``Work.wait(timeout)`` at the point where the result is
  needed -- gloo's own untimed wait would block the host there anyway, so the deadline costs nothing.
* ``STREAM`` (NCCL): the caller keeps megatron-core's untimed ``Work.wait()``, which only makes the
  compute stream wait (PyTorch's NCCL ``wait`` with a timeout spins on the host until the collective
  completes, so the host could not queue the next kernels ahead). A :class:`Watchdog` thread looks at
  the watched works every ``min(5 s, timeout / 4)`` with the non-blocking ``is_completed()`` -- no
  ``.item()``, no ``synchronize()``, no timed wait. Once one is older than the timeout it prints the
  named error to stderr at once and keeps it; the main thread raises it at its next
  :meth:`Watchdog.check`. If the main thread has not raised it :data:`EXIT_GRACE_S` (or one watchdog
  period, if longer) later, it is blocked behind the stuck collective (a host synchronisation,
  which no Python code can interrupt), and the watchdog ends the process with exit status :data:`PEER_TIMEOUT_EXIT_STATUS` -- what
  NCCL's own watchdog does at the process group's timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), only
  earlier and with the operation and the peers named. That path was run on gloo only (the main
  thread blocked in gloo's untimed wait); no NCCL run has checked it.

The deadline of the p2p transfers and the data-parallel reduces is ``--pipeline-timeout-seconds``
(``ZeroBubbleOptions.timeout``): the zero-bubble path's own "how long may a peer take". Megatron-LM's
``--distributed-timeout-minutes`` is the process groups' own timeout (NCCL's watchdog, gloo's),
given by megatron-core to every group it creates; the named error has to come before it, so it
cannot be the same value (and minutes cannot express a test's seconds). Post-validation's waits
take the wrapper's ``timeout`` (``PostValidationConfig``).

No torch import here: the works are duck-typed (``wait(timeout=timedelta)``, ``is_completed()``).
"""

from __future__ import annotations

import datetime
import enum
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

__all__ = ["Awaited", "PEER_TIMEOUT_EXIT_STATUS", "PipelineTimeoutError", "WaitPolicy", "Watchdog", "wait_host"]

PEER_TIMEOUT_EXIT_STATUS = 1
"""Exit status of a process the :class:`Watchdog` ends (its main thread blocked behind a late collective)."""

EXIT_GRACE_S = 2.0
"""Seconds the :class:`Watchdog` leaves the main thread to raise its error before it ends the process."""

HINT = "a peer process died, is frozen or never reached this collective"


class PipelineTimeoutError(RuntimeError):
    """A collective of the zero-bubble path did not complete in time (a peer died or froze, or the
    ranks disagree on what to run). The message names the waiting rank, the operation and the peers;
    :attr:`blame` (set by :class:`Awaited`), the one line that says whom to look at."""

    blame: str | None = None
    """``rank R waited for rank F (frozen or slow): OPERATION did not complete within T s; look at rank F,
    ...`` in global ranks (``... (dead or gone): OPERATION failed; ...`` when the backend gave up at once):
    torchrun's "root cause" is the rank that noticed, i.e. R, not the frozen F."""


class WaitPolicy(enum.Enum):
    """How a wait keeps its deadline (module docstring)."""

    HOST = "host"        # gloo: Work.wait(timeout) blocks the host; a late collective raises at once
    STREAM = "stream"    # NCCL: Work.wait() makes the compute stream wait; a watchdog keeps the timeout

    @staticmethod
    def for_backend(backend: str) -> "WaitPolicy":
        """``STREAM`` for NCCL (also a mixed ``"cpu:gloo,cuda:nccl"`` group), ``HOST`` otherwise."""
        return WaitPolicy.STREAM if "nccl" in str(backend) else WaitPolicy.HOST


def _peers(peers: Sequence[int]) -> str:
    return f"peer rank {peers[0]}" if len(peers) == 1 else "peer ranks " + ", ".join(str(p) for p in peers)


@dataclass(frozen=True)
class Awaited:
    """What one wait waits for.

    Attributes:
        who: the waiting rank, as the message starts (``"rank 3"``, ``"pipeline rank 1"``).
        operation: the collective, with where it belongs (``"data-parallel all-reduce of stage 0,
            bucket 1 (iteration 7)"``, ``"receive for RECV_B(mb=0, stage=1, peer=1)"``).
        peers: the ranks it waits on (global ranks; the pipeline layer uses pipeline-group ranks).
        global_ranks: where ``who`` and ``peers`` are not global ranks (the pipeline layer's): the waiting
            rank's and the peers' global ranks, for :meth:`blame`.
    """

    who: str
    operation: str
    peers: tuple[int, ...]
    global_ranks: tuple[int, tuple[int, ...]] | None = None

    def error(self, timeout_s: float, detail: str = "", *,
              error_type: type[RuntimeError] = PipelineTimeoutError) -> RuntimeError:
        """The named error of this wait after ``timeout_s`` seconds (``detail``: the backend's own words)."""
        err = error_type(f"{self.who}: {self.operation} with {_peers(self.peers)} did not complete within "
                         f"{timeout_s:g} s: {HINT}{detail}")
        err.blame = self.blame(f"did not complete within {timeout_s:g} s",  # type: ignore[attr-defined]
                               "frozen or slow")
        return err

    def failure(self, detail: str, *, error_type: type[RuntimeError] = PipelineTimeoutError) -> RuntimeError:
        """The named error of this wait when the backend gave up before the deadline (gloo: a peer's
        connection closed, i.e. the peer process died)."""
        err = error_type(f"{self.who}: {self.operation} with {_peers(self.peers)} failed: {HINT}{detail}")
        err.blame = self.blame("failed", "dead or gone")  # type: ignore[attr-defined]
        return err

    def blame(self, outcome: str, state: str) -> str:
        """``rank R waited for rank F (STATE): OPERATION OUTCOME; look at rank F, ...`` in global ranks
        (:attr:`PipelineTimeoutError.blame`); several peers: ``rank F or rank G``."""
        if self.global_ranks is None:
            who, peers = self.who, " or ".join(f"rank {p}" for p in self.peers)
        else:
            me, ranks = self.global_ranks
            kind = self.who.rsplit(" ", 1)[0]  # "pipeline rank"
            who = f"rank {me} ({self.who})"
            peers = " or ".join(f"rank {g} ({kind} {p})" for g, p in zip(ranks, self.peers))
        return (f"{who} waited for {peers} ({state}): {self.operation} {outcome}; look at {peers}, not at the rank "
                f"torchrun names as the root cause (the one that waited)")


def wait_host(work: Any, awaited: Awaited, timeout_s: float, *,
              error_type: type[RuntimeError] = PipelineTimeoutError) -> None:
    """``WaitPolicy.HOST``: wait for ``work`` at most ``timeout_s`` seconds; raise ``awaited``'s error
    (of ``error_type``) if it did not complete. gloo raises ``RuntimeError`` on expiry ("timed out":
    :meth:`Awaited.error`), and at once when a peer's connection closed, a killed process
    (:meth:`Awaited.failure`); its first line is kept as the detail. A ``False`` return counts as
    expiry too."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        detail = f" ({e.__class__.__name__}: {_first_line(e)})"
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise awaited.error(timeout_s, detail, error_type=error_type) from None
        raise awaited.failure(detail, error_type=error_type) from None
    if ok is False:
        raise awaited.error(timeout_s, error_type=error_type)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


Watched = tuple[Any, float, Awaited]
"""A watched wait: (its ``Work``, ``time.monotonic()`` when it was issued [s], what it is)."""


class Watchdog:
    """The deadline of ``WaitPolicy.STREAM`` waits, kept by a daemon thread (module docstring).

    Args:
        watched: returns the waits to check now (called from the thread; the works still issued).
        timeout_s: seconds a wait may take.
        name: the thread's name.
        exit_when_unraised: end the process when the main thread has not raised the error
            :data:`EXIT_GRACE_S` after it was found (the main thread is blocked behind the
            collective). Off only in tests that look at the error themselves.
        stop_when_idle: stop the thread once every watched work completed (a fixed set of waits, e.g.
            one iteration's data-parallel reduces); otherwise it runs until :meth:`stop`.
    """

    def __init__(self, watched: Callable[[], Iterable[Watched]], *, timeout_s: float, name: str,
                 exit_when_unraised: bool = True, stop_when_idle: bool = False) -> None:
        self.watched, self.timeout_s = watched, timeout_s
        self.error: RuntimeError | None = None
        self.period = min(5.0, timeout_s / 4)
        self._exit, self._idle_stop = exit_when_unraised, stop_when_idle
        self._raised = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def find(self, now: float) -> RuntimeError | None:
        """The error of the oldest-listed wait past the timeout at ``now`` (``time.monotonic``), if any."""
        for work, since, awaited in self.watched():
            if now - since > self.timeout_s and not work.is_completed():
                return awaited.error(self.timeout_s)
        return None

    def check(self) -> None:
        """In the main thread: raise the error the watchdog found, if any."""
        if self.error is not None:
            self._raised.set()
            raise self.error

    def stop(self) -> None:
        """Stop watching (the waits completed, or the work was abandoned)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if self._idle_stop and not any(not w.is_completed() for w, _, _ in self.watched()):
                return
            err = self.find(time.monotonic())
            if err is None:
                continue
            self.error = err
            print(f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
            if self._exit and not self._raised.wait(max(EXIT_GRACE_S, self.period)) and not self._stop.is_set():
                print(f"{type(err).__name__}: the main thread is blocked behind this collective; ending the "
                      f"process (exit status {PEER_TIMEOUT_EXIT_STATUS})", file=sys.stderr)
                print(f"error: {getattr(err, 'blame', None) or err}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(PEER_TIMEOUT_EXIT_STATUS)
            return
