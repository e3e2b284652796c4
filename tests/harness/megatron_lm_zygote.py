"""Warm starts for the ranks of :func:`harness.megatron_lm.run_megatron_lm` (test code).

Importing torch, megatron-core and Megatron-LM's training package costs every rank 5-10 s of CPU on
the 2-core machine -- most of a 4-iteration run. A *zygote* does it once: ``python -m
harness.megatron_lm_zygote FOLDER`` applies the CPU workarounds for the Megatron-LM
``FOLDER`` (:func:`~harness.megatron_lm_workarounds.apply_workarounds`, which imports
megatron-core and Megatron-LM's training modules), imports what ``pretrain_gpt.py`` imports, prints
``ready`` and then forks one child per request line on stdin (JSON: ``argv``, ``env``, ``cwd``,
``log``). Each child

1. leads a session of its own (the launcher kills it with ``os.killpg(pid, SIGKILL)``);
2. takes the request's environment as its whole ``os.environ``, its ``cwd``, and ``log`` as its
   stdout and stderr;
3. runs :mod:`harness.megatron_lm_main` as ``__main__`` with ``argv`` (``runpy``: the
   ``__main__`` module is that file, so dist-checkpointing's spawned results process re-imports it,
   as when the rank is started as a script);
4. writes its exit status to ``log + ".rc"`` just before the process ends (``os._exit``, which the
   rank's own exit paths use); a child killed by a signal leaves no such file.

The zygote replies ``pid N`` per request and ignores SIGCHLD, so exited children are reaped at once
and :class:`ForkedRank` can tell a live child from a finished one with ``os.kill(pid, 0)``. It forks
from its only thread; the harness checks that no other thread exists before each fork. EOF on
stdin ends it.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MAIN_SCRIPT = Path(__file__).with_name("megatron_lm_main.py")


def status_path(log: str) -> str:
    """Where a forked rank writing to ``log`` leaves its exit status."""
    return log + ".rc"


def _child(request: dict[str, Any]) -> None:
    """In the forked child: session, environment, output, then the rank (never returns)."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    rc_path = status_path(request["log"])
    real_exit = os._exit

    def exit_with_record(code: int) -> None:
        with open(rc_path, "w") as f:
            f.write(str(code))
        real_exit(code)

    os._exit = exit_with_record  # type: ignore[assignment]
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [str(MAIN_SCRIPT), *request["argv"]]
    code = 0
    try:
        runpy.run_path(str(MAIN_SCRIPT), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- reported like an uncaught exception of a script
        sys.excepthook(*sys.exc_info())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(folder: str) -> None:
    """Import everything a rank needs, print ``ready``, then fork a child per request line."""
    from harness.megatron_lm_workarounds import apply_workarounds

    apply_workarounds(folder)
    for name in ("gpt_builders", "model_provider"):  # pretrain_gpt.py's own imports from its folder
        if (Path(folder) / f"{name}.py").exists():
            __import__(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped at once: no zombies
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        if others:
            print(f"error threads {others} would not survive fork", flush=True)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(json.loads(line))
        print(f"pid {pid}", flush=True)


# ---------------------------------------------------------------------- the launcher's side
class ForkedRank:
    """A rank forked by a :class:`Zygote`: the parts of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, pid: int, log: str) -> None:
        self.pid, self._rc_path = pid, status_path(log)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status once the child is gone (``-9`` when it left no status: killed), else None."""
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
                return None
            except ProcessLookupError:
                pass
            try:
                self.returncode = int(Path(self._rc_path).read_text())
            except (OSError, ValueError):
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float = 30.0) -> int:
        """Poll until the child is gone (it has been killed or has exited); its status."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"forked rank {self.pid} still alive after {timeout:g} s")
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class Zygote:
    """One zygote process (module docstring) for a Megatron-LM folder and environment."""

    def __init__(self, folder: str, env: dict[str, str], timeout: float = 300.0) -> None:
        self.stderr_path = os.path.join(tempfile.mkdtemp(prefix="mlm_zygote_"), "stderr.log")
        with open(self.stderr_path, "wb") as err:  # a file, not a pipe nobody reads
            self.proc = subprocess.Popen([sys.executable, "-u", "-m", "harness.megatron_lm_zygote", folder],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                         text=True, start_new_session=True)
        line = self._read_line(timeout)
        if line != "ready":
            self.close()
            err_text = Path(self.stderr_path).read_text(errors="replace")
            raise RuntimeError(f"the Megatron-LM zygote for {folder} did not start: {line!r}\n{err_text[-3000:]}")

    def _read_line(self, timeout: float) -> str:
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        return out[0].strip() if out else f"(nothing within {timeout:g} s)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, *, argv: list[str], env: dict[str, str], cwd: str, log: str) -> ForkedRank:
        """Fork one rank (module docstring); raises RuntimeError when the zygote does not answer."""
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        line = self._read_line(60.0)
        if not line.startswith("pid "):
            raise RuntimeError(f"the Megatron-LM zygote did not fork a rank: {line!r}")
        return ForkedRank(int(line.split()[1]), log)

    def close(self) -> None:
        """End the zygote (EOF on its stdin; killed after 10 s)."""
        if self.alive():
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1])
