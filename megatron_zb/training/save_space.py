"""``--save``: a writable directory, room for the next checkpoint, and a failed write said in one line.

* :func:`save_directory_problem` (validation, before any process group): ``--save`` must be a
  directory, or creatable as one, that this process can write to -- ``os.access``, and as root
  (whom permission bits do not stop) a probe file created and removed.
* :func:`space_problem` (before each save, collective): the checkpoint's expected size -- the bytes
  of the tensors every rank writes (parameters, optimizer state, random states: what the save's
  sharded state dict holds, each shard counted once, on its main replica) plus
  :data:`SIZE_MARGIN` and :data:`SIZE_SLACK_PER_RANK` -- summed over the ranks (they write into one
  directory), against ``shutil.disk_usage`` of ``--save`` plus the bytes a partial directory of the
  same iteration already holds (they are written over). A checkpoint that does not fit is not
  started: the job stops with one line naming both numbers and the latest intact checkpoint.
* :func:`save_error_text`: a write that still fails (``ENOSPC``, or any ``OSError`` of a writer
  process, which megatron-core reports on every rank as torch's ``CheckpointException``) as one
  phrase naming the rank and the error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
from typing import Any, Iterator

__all__ = ["SIZE_MARGIN", "SIZE_SLACK_PER_RANK", "WRITER_LOGGER", "expected_bytes", "free_bytes", "save_directory_problem",
           "save_error_text", "space_problem", "state_bytes", "writer_errors_said_once"]

SIZE_MARGIN = 0.05
"""Fraction added to the tensors' bytes for the files' own framing (torch's pickles, the index)."""
SIZE_SLACK_PER_RANK = 1 << 20
"""Bytes added per rank for its small files (the common state, ``.metadata``, the manifest) [bytes]."""


def _existing_ancestor(path: str) -> str:
    """``path`` or its nearest existing ancestor."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _probe(directory: str) -> str | None:
    """Create and remove a file in ``directory``; the error's text when that fails."""
    probe = os.path.join(directory, f".megatron_zb_write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def save_directory_problem(path: str) -> str | None:
    """Why ``--save PATH`` cannot hold checkpoints (one phrase with the fix); ``None`` when it can."""
    existing = _existing_ancestor(path)
    if not os.path.isdir(existing):
        what = "is" if existing == os.path.abspath(path) else f"cannot be created: {existing} is"
        return f"{path} {what} a file, not a directory; give a directory (it is created if it does not exist)"
    where = "" if existing == os.path.abspath(path) else f" (to create {path} in)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the directory {existing}{where} is not writable by this user; give a writable directory"
    if os.geteuid() == 0 and (error := _probe(existing)) is not None:  # root passes os.access regardless
        return f"cannot create a file in the directory {existing}{where} ({error}); give a writable directory"
    return None


def _tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested dicts, lists and tuples)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def state_bytes(sharded_state_dict: dict[str, Any]) -> int:
    """Bytes this rank writes of ``sharded_state_dict`` (a save's) [bytes]: its sharded tensors, factories
    and objects whose main replica it holds; the plain tensors (common state) on global rank 0."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, is_main_replica

    total = 0
    for v in nested_values(sharded_state_dict):
        if isinstance(v, ShardedBase):
            if is_main_replica(v.replica_id):
                total += _tensor_bytes(v.data)
        elif dist.get_rank() == 0:
            total += _tensor_bytes(v)
    return total


def expected_bytes(total_state_bytes: int, world_size: int) -> int:
    """A checkpoint's expected size [bytes] from every rank's :func:`state_bytes` summed."""
    return int(total_state_bytes * (1 + SIZE_MARGIN)) + world_size * SIZE_SLACK_PER_RANK


def free_bytes(root: str, path: str) -> int:
    """Bytes the save into ``path`` under ``--save root`` may use: the file system's free bytes plus
    the files of ``path`` already there (a partial save of the same iteration, written over)."""
    usage = shutil.disk_usage(_existing_ancestor(root))
    held = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names) \
        if os.path.isdir(path) else 0
    return usage.free + held


def space_problem(root: str, path: str, sharded_state_dict: dict[str, Any]) -> str | None:
    """Collective: on global rank 0, why the checkpoint of ``sharded_state_dict`` does not fit into
    ``path`` (needed and free bytes); ``None`` when it fits and on the other ranks."""
    import torch.distributed as dist

    sizes: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, state_bytes(sharded_state_dict))
    if dist.get_rank() != 0:
        return None
    need = expected_bytes(sum(s or 0 for s in sizes), dist.get_world_size())
    free = free_bytes(root, path)
    if need <= free:
        return None
    return (f"it needs about {need} bytes ({need / 2**20:.1f} MiB: every rank's parameters, optimizer and "
            f"random states +{SIZE_MARGIN:.0%}) and the file system of {root} has {free} bytes free "
            f"({free / 2**20:.1f} MiB); nothing was written")


WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
"""megatron-core's writer's logger: it logs a writer process's error (``Local process 0 encountered an
error: ...``) on the failing rank before megatron-core raises it on every rank."""


@contextlib.contextmanager
def writer_errors_said_once() -> Iterator[None]:
    """Around a save: the writer's own error log line silenced -- the save's one-line error names the
    same error (:func:`save_error_text`). Its other levels' messages are unchanged."""
    logger = logging.getLogger(WRITER_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _root_cause(error: BaseException) -> BaseException:
    """The innermost ``__cause__`` (a writer's ``OSError`` under megatron-core's ``RuntimeError``)."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    return error


def save_error_text(error: BaseException) -> str:
    """``error`` of a checkpoint write as one phrase: torch's ``CheckpointException`` by its first failed
    rank's innermost error (``rank 1: OSError: [Errno 28] No space left on device: 'FILE'``)."""
    from megatron_zb.training.checkpoint_check import first_line

    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        failure = failures[rank]
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return f"rank {rank}: {first_line(_root_cause(inner))}"
    if failures is not None:  # megatron-core tells the failed ranks' errors to the coordinator only
        return "a write failed on another rank"
    return first_line(_root_cause(error))
