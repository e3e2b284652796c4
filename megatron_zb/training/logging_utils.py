"""Megatron's training log format, rank-aware printing, the schedule report, TensorBoard.

The per-iteration line (:func:`format_iteration_line`) is Megatron's, field for field, e.g.::

     [2026-11-21 10:00:00] iteration       10/     100 | consumed samples:          320 | elapsed time per
     iteration (ms): 812.4 | throughput (samples/s): 39.4 | learning rate: 1.000000E-04 | global batch
     size:    32 | lm loss: 7.123456E+00 | loss scale: 1.0 | grad norm: 2.345 | number of skipped
     iterations:   0 | number of rollbacks:   0 |

(one line; wrapped here). :func:`parse_iteration_line` reads it back (tests, benchmark scripts).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
from typing import Any, Mapping, Sequence

__all__ = [
    "TensorBoardWriter",
    "format_iteration_line",
    "format_schedule_report",
    "is_last_rank",
    "is_rank_0",
    "parse_iteration_line",
    "print_rank_0",
    "print_rank_last",
    "tensorboard_writer",
    "WandbWriter",
]

TIMESTAMP_FORMAT = "%Y-%m-%d %H:%M:%S"


# ---------------------------------------------------------------------------- ranks and printing
def set_logging_level(level: int | None) -> None:
    """Megatron-LM's ``setup_logging``: the root logger's level from ``--logging-level`` (``level``),
    else from ``$MEGATRON_LOGGING_LEVEL``; unchanged when neither is given."""
    env = os.getenv("MEGATRON_LOGGING_LEVEL")
    if level is None and env is not None:
        level = int(env)
    if level is not None:
        logging.getLogger().setLevel(level)


def _rank_and_size() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_rank_0() -> bool:
    """True on global rank 0, or when ``torch.distributed`` is not initialised."""
    return _rank_and_size()[0] == 0


def is_last_rank() -> bool:
    """True on the last global rank (which holds the loss in Megatron's layout), or without a group."""
    rank, size = _rank_and_size()
    return rank == size - 1


def print_rank_0(message: str, *, file: Any = None) -> None:
    """Print ``message`` on global rank 0 only, flushed at once."""
    if is_rank_0():
        print(message, file=file if file is not None else sys.stdout, flush=True)


def print_rank_last(message: str, *, file: Any = None) -> None:
    """Print ``message`` on the last global rank only (Megatron prints the iteration line there), flushed."""
    if is_last_rank():
        print(message, file=file if file is not None else sys.stdout, flush=True)


# ---------------------------------------------------------------------------- the iteration line
def format_iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    learning_rate: float,
    global_batch_size: int,
    losses: Mapping[str, float],
    loss_scale: float,
    grad_norm: float | None = None,
    throughput: float | None = None,
    tflops_per_gpu: float | None = None,
    num_zeros_in_grad: float | None = None,
    params_norm: float | None = None,
    skipped_iterations: int = 0,
    nan_iterations: int | None = None,
    rollbacks: int | None = None,
    timestamp: datetime.datetime | str | None = None,
) -> str:
    """One Megatron training log line.

    Args:
        iteration / train_iters: current iteration (1-based) and total.
        consumed_samples: training samples consumed so far (all data-parallel ranks).
        elapsed_ms: average wall time per iteration since the last line, milliseconds.
        learning_rate: current learning rate.
        global_batch_size: samples per iteration.
        losses: average loss per name over the logged iterations (e.g. ``{"lm loss": 7.12}``),
            printed in order.
        loss_scale: current loss scale (1.0 without fp16).
        grad_norm / num_zeros_in_grad / params_norm: printed when not ``None``.
        throughput: samples per second; printed as ``throughput (samples/s)`` when not ``None``.
        tflops_per_gpu: model TFLOP/s per process (``--log-throughput``); printed as Megatron's
            ``throughput per GPU (TFLOP/s/GPU)`` when not ``None``.
        skipped_iterations: iterations skipped (inf/NaN gradients) since the last line.
        nan_iterations: Megatron's ``number of nan iterations``, printed when not ``None``.
        rollbacks: optimizer post-validation rollbacks since the last line, printed when not ``None``.
        timestamp: defaults to now (local time).
    """
    if timestamp is None:
        timestamp = datetime.datetime.now()
    if isinstance(timestamp, datetime.datetime):
        timestamp = timestamp.strftime(TIMESTAMP_FORMAT)
    s = f" [{timestamp}]"
    s += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    s += " consumed samples: {:12d} |".format(consumed_samples)
    s += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms)
    if throughput is not None:
        s += " throughput (samples/s): {:.1f} |".format(throughput)
    if tflops_per_gpu is not None:
        s += " throughput per GPU (TFLOP/s/GPU): {:.1f} |".format(tflops_per_gpu)
    s += " learning rate: {:.6E} |".format(learning_rate)
    s += " global batch size: {:5d} |".format(global_batch_size)
    for name, value in losses.items():
        s += " {}: {:.6E} |".format(name, value)
    s += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        s += " grad norm: {:.3f} |".format(grad_norm)
    if num_zeros_in_grad is not None:
        s += " num zeros: {:.1f} |".format(num_zeros_in_grad)
    if params_norm is not None:
        s += " params norm: {:.3f} |".format(params_norm)
    s += " number of skipped iterations: {:3d} |".format(skipped_iterations)
    if nan_iterations is not None:
        s += " number of nan iterations: {:3d} |".format(nan_iterations)
    if rollbacks is not None:
        s += " number of rollbacks: {:3d} |".format(rollbacks)
    return s


_HEAD = re.compile(r"\[(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})\] iteration\s+(?P<it>\d+)/\s*(?P<total>\d+) \|")
_FIELD = re.compile(r"^\s*(?P<key>[^|:]+?):\s*(?P<val>[-+0-9.eEinfINFaA]+)\s*$")


def parse_iteration_line(line: str) -> dict[str, Any]:
    """Read a line written by :func:`format_iteration_line` (or by Megatron) back.

    Returns ``{"timestamp": str, "iteration": int, "train_iters": int, <field>: value, ...}``
    where every other ``name: value`` field keeps its printed name (``"consumed samples"``,
    ``"lm loss"``, ``"elapsed time per iteration (ms)"``, ...) and its value is an ``int`` when
    printed without a decimal point or exponent, else a ``float``. Text before the timestamp
    (e.g. a launcher's rank prefix) is ignored. Raises :class:`ValueError` when the line is not
    an iteration line.
    """
    m = _HEAD.search(line)
    if m is None:
        raise ValueError(f"not a training iteration line: {line!r}")
    out: dict[str, Any] = {"timestamp": m.group("ts"), "iteration": int(m.group("it")),
                           "train_iters": int(m.group("total"))}
    for part in line[m.end():].split("|"):
        if not part.strip():
            continue
        f = _FIELD.match(part)
        if f is None:
            raise ValueError(f"cannot parse field {part.strip()!r} of {line!r}")
        raw = f.group("val")
        out[f.group("key").strip()] = int(raw) if re.fullmatch(r"[-+]?\d+", raw) else float(raw)
    return out


# ---------------------------------------------------------------------------- schedule report
def cpu_oversubscription() -> tuple[int, int] | None:
    """``(processes on this node, CPU cores this process may use)`` when a CPU run's processes
    outnumber the cores (then measured idle time is mostly time-slicing), else ``None``. Processes:
    the launcher's ``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``; never on CUDA."""
    import os

    import torch

    if torch.cuda.is_available():
        return None
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return (processes, cores) if processes > cores else None


def format_schedule_report(
    *,
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    predicted_bubble_rate: float | None = None,
    peak_activation_memory: Sequence[float] | None = None,
    memory_unit: str = "M_B",
    memory_limit: float | None = None,
    measured_idle_fraction: Sequence[float] | None = None,
    measured_costs: Mapping[str, float] | None = None,
    title: str = "schedule report",
) -> str:
    """A one-time, multi-line report on the pipeline schedule in use.

    Args:
        schedule: schedule name (e.g. ``"zb"``).
        num_ranks / num_microbatches: pipeline size ``p`` and micro batches per iteration ``m``.
        predicted_bubble_rate: simulated idle fraction of the pipeline (0..1) -- printed in percent.
        peak_activation_memory: simulated peak activation memory per pipeline rank, in
            ``memory_unit`` (e.g. ``"M_B"`` = one stage's activations of one micro batch, or ``"MiB"``).
        memory_limit: the limit the schedule was built for, same unit.
        measured_idle_fraction: measured idle fraction per pipeline rank (0..1), when available.
        measured_costs: profiled per-micro-batch costs in milliseconds, keys among ``T_F``, ``T_B``,
            ``T_W``, ``T_comm`` (any other keys are printed after them).
    """
    def pct(x: float) -> str:
        return f"{100.0 * x:.1f}%"

    lines = [f"> {title}:",
             f"    schedule: {schedule}",
             f"    pipeline ranks: {num_ranks}, micro batches per iteration: {num_microbatches}"]
    if predicted_bubble_rate is not None:
        lines.append(f"    predicted bubble rate: {pct(predicted_bubble_rate)}")
    if memory_limit is not None:
        lines.append(f"    activation memory limit per rank: {memory_limit:.2f} {memory_unit}")
    if peak_activation_memory is not None:
        vals = ", ".join(f"{v:.2f}" for v in peak_activation_memory)
        lines.append(f"    predicted peak activation memory per rank ({memory_unit}): [{vals}]")
    if measured_idle_fraction is not None:
        vals = ", ".join(pct(v) for v in measured_idle_fraction)
        lines.append(f"    measured idle fraction per rank: [{vals}]")
        shared = cpu_oversubscription()
        if shared is not None:
            lines.append(f"    note: {shared[0]} processes share {shared[1]} CPU core(s) on this machine, so the "
                         f"measured idle time includes waiting for a core; it is not comparable with the "
                         f"predicted bubble rate")
    else:
        lines.append("    measured idle fraction per rank: not measured")
    if measured_costs:
        order = [k for k in ("T_F", "T_B", "T_W", "T_comm") if k in measured_costs]
        order += [k for k in measured_costs if k not in order]
        lines.append("    measured costs (ms): " + ", ".join(f"{k}={measured_costs[k]:.3f}" for k in order))
    else:
        lines.append("    measured costs: not profiled")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- TensorBoard
class TensorBoardWriter:
    """Thin wrapper over ``torch.utils.tensorboard.SummaryWriter``; every call is a no-op when disabled."""

    def __init__(self, log_dir: str | None) -> None:
        self.log_dir = log_dir
        self.reason = ""
        self._writer: Any = None
        if log_dir is None:
            self.reason = "--tensorboard-dir not given"
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            self.reason = (f"--tensorboard-dir {log_dir} was given but TensorBoard is not importable ({e}); "
                           f"pip install tensorboard to write scalars. Training continues without TensorBoard.")
            return
        self._writer = SummaryWriter(log_dir=log_dir)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self._writer is not None:
            self._writer.add_scalar(tag, value, step)

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        """One ``add_scalar`` per item (tags as given, e.g. ``"lm loss"``, ``"learning-rate"``)."""
        for tag, value in values.items():
            self.add_scalar(tag, value, step)

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        if self._writer is not None:
            self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def tensorboard_writer(log_dir: str | None, *, only_last_rank: bool = True) -> TensorBoardWriter:
    """A :class:`TensorBoardWriter` for ``--tensorboard-dir`` on the last rank (as Megatron), no-op elsewhere.

    When ``log_dir`` is given but TensorBoard cannot be imported, a warning saying so is printed
    (flushed, to stderr) and a disabled writer is returned.
    """
    if only_last_rank and not is_last_rank():
        return TensorBoardWriter(None)
    w = TensorBoardWriter(log_dir)
    if log_dir is not None and not w.enabled:
        print(f"WARNING: {w.reason}", file=sys.stderr, flush=True)
    return w


# ---------------------------------------------------------------------------- Weights & Biases
def _wandb_reachable(timeout: float = 3.0) -> bool:
    """Whether W&B's server answers a TCP connection (else the run logs offline)."""
    import socket

    try:
        with socket.create_connection(("api.wandb.ai", 443), timeout=timeout):
            return True
    except OSError:
        return False


class WandbWriter:
    """Weights & Biases run of ``--wandb-project`` on the last rank (as Megatron); no-op elsewhere.

    Mode: ``WANDB_MODE`` when set, else ``offline`` when ``api.wandb.ai`` is unreachable, else
    online. Files go to ``--wandb-save-dir`` (default ``SAVE/wandb`` with ``--save``, else
    ``./wandb``). ``wandb`` is an optional dependency; validation refuses ``--wandb-project``
    without it.
    """

    def __init__(self, logging: Any, *, save: str | None) -> None:
        """``logging``: the run's :class:`~megatron_zb.training.run_config.LoggingConfig` (``--wandb-*``
        and the run config it gives W&B); ``save``: ``--save``."""
        self._run: Any = None
        self.mode = ""
        if logging.wandb_project is None or not is_last_rank():
            return
        import os

        import wandb

        save_dir = logging.wandb_save_dir or os.path.join(save or ".", "wandb")
        os.makedirs(save_dir, exist_ok=True)
        self.mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_reachable() else "offline")
        self._run = wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name, dir=save_dir,
                               mode=self.mode, config=dict(logging.wandb_config))
        print(f"> wandb: project {logging.wandb_project!r}, {self.mode} mode, files in {save_dir}", flush=True)

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def log(self, values: Mapping[str, float], step: int) -> None:
        if self._run is not None:
            self._run.log(dict(values), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
