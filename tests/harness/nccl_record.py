"""What a real run asks of ``torch.distributed``, recorded as the NCCL model's calls (CPU tests).

The NCCL model (:mod:`megatron_zb.runtime.nccl_model`) certifies the programs the runtime plans;
this module checks that the runtime does what it planned, and gives the model its control: inside
:func:`recording` every ``torch.distributed`` call of this process -- megatron-zb's and
megatron-core's alike -- is kept as a :class:`~megatron_zb.runtime.nccl_model.Call`, with the
communicator NCCL would use for it:

* an unbatched ``isend`` / ``irecv`` on group ``g``: the pair communicator of the two ranks in
  ``g`` (ProcessGroupNCCL keys unbatched p2p by the pair);
* ``batch_isend_irecv`` (megatron-core's ``batch_p2p_comm``): one group of ops on ``g``'s own
  communicator;
* a collective on ``g`` (``all_reduce``, ``broadcast``, ``all_gather``, ``reduce_scatter``, the object
  collectives): an op on ``g``'s communicator, followed by a stream wait when it is not async;
  ``barrier`` by a host wait (NCCL's barrier blocks the host);
* ``new_group``: a host rendezvous of every rank (a store barrier);
* ``Work.wait()``: a stream wait for the op(s) of that work -- what NCCL's wait without a timeout
  is, whatever gloo did on this CPU run.

Each call also carries the host thread that made it (the model refuses NCCL calls from two). The
``Work`` objects are wrapped by a recording proxy (the real gloo works underneath: the run is real).
Not recorded: host syncs (``.item()`` and the like; :mod:`~harness.hot_path` counts those),
and ``_coalescing_manager`` groups of collectives (megatron-core's data-parallel buckets), each
collective of which is recorded on its own.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_zb.runtime.nccl_model import Call, Entry, Kind

__all__ = ["Recorder", "record_calls", "record_run", "record_trainer", "recording"]

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_gather_object", "broadcast_object_list", "all_to_all_single")


class Recorder:
    """The calls of one process (global rank ``rank``) in issue order (module docstring)."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.calls: list[Entry] = []
        self._batch: list[Call] | None = None
        self._depth = 0            # > 0 inside a recorded call (its inner calls are not recorded)
        self._ids = itertools.count()

    def add(self, call: Call) -> None:
        if self._batch is not None and call.kind in (Kind.SEND, Kind.RECV):
            self._batch.append(call)
        else:
            self.calls.append(call)

    def op(self, kind: Kind, group: Any, key: Any, *, peer: int | None = None) -> Call:
        """A new op of this rank on ``group``'s communicator (module docstring) and its unique ref."""
        group = group if group is not None else c10d._get_default_group()
        members = tuple(dist.get_process_group_ranks(group))
        if peer is not None and self._batch is None:   # unbatched p2p: the pair's communicator
            pair = tuple(sorted((self.rank, peer)))
            comm: tuple = ("pair", group.group_name) + pair
            members = pair
        else:
            comm = ("pg", group.group_name)
        ref = ("op", self.rank, next(self._ids))
        return Call(kind, comm=comm, members=members, peer=peer, key=key, ref=ref, thread=_thread())


class _RecordedWork:
    """A real ``Work`` whose ``wait`` is recorded as a stream wait for its ops (a thin shell)."""

    def __init__(self, work: Any, rec: Recorder, keys: list[Any]) -> None:
        self._work, self._rec, self._keys = work, rec, keys

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        for k in self._keys:
            self._rec.add(Call(Kind.WAIT, key=k, thread=_thread()))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _thread() -> str:
    return threading.current_thread().name


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[Recorder]:
    """Record this process's ``torch.distributed`` calls into ``rec`` inside the block (module docstring)."""
    originals = {name: getattr(c10d, name) for name in ("isend", "irecv", "batch_isend_irecv", "barrier",
                                                         "new_group") + COLLECTIVES if hasattr(c10d, name)}
    wrappers = {name: _wrap(name, fn, rec) for name, fn in originals.items()}
    try:
        for name, fn in wrappers.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        yield rec
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


def _wrap(name: str, fn: Callable, rec: Recorder) -> Callable:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if rec._depth:
            return fn(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if name == "batch_isend_irecv":
            return _batch(fn, rec, a["p2p_op_list"])
        if name == "new_group":
            world = tuple(range(dist.get_world_size()))
            rec.add(Call(Kind.CREATE, comm=("new_group", next(rec._ids)), members=world, thread=_thread()))
            return _inside(rec, fn, args, kwargs)
        if name in ("isend", "irecv"):
            return _p2p(name, fn, rec, a, args, kwargs)
        return _collective(name, fn, rec, a, args, kwargs)
    return call


def _inside(rec: Recorder, fn: Callable, args: tuple, kwargs: dict) -> Any:
    rec._depth += 1
    try:
        return fn(*args, **kwargs)
    finally:
        rec._depth -= 1


def _p2p(name: str, fn: Callable, rec: Recorder, a: dict, args: tuple, kwargs: dict) -> Any:
    tensor, group = a["tensor"], a.get("group")
    peer = a.get("dst") if name == "isend" else a.get("src")
    local = a.get("group_dst") if name == "isend" else a.get("group_src")
    if peer is None and local is not None:
        peer = dist.get_global_rank(group, local)
    kind = Kind.SEND if name == "isend" else Kind.RECV
    call = rec.op(kind, group, (tuple(tensor.shape), str(tensor.dtype)), peer=peer)
    rec.add(call)
    work = _inside(rec, fn, args, kwargs)
    if rec._batch is not None:
        return work
    return _RecordedWork(work, rec, [call.ref])


def _batch(fn: Callable, rec: Recorder, ops: list) -> list:
    rec._batch = []
    try:
        works = fn(ops)
        group = tuple(rec._batch)
    finally:
        rec._batch = None
    rec.calls.append(group)
    keys = [c.ref for c in group]
    if len(works) == len(keys):
        return [_RecordedWork(w, rec, [k]) for w, k in zip(works, keys)]
    return [_RecordedWork(w, rec, keys) for w in works]


def _collective(name: str, fn: Callable, rec: Recorder, a: dict, args: tuple, kwargs: dict) -> Any:
    tensor = a.get("tensor", a.get("output", a.get("output_tensor")))
    shape = (tuple(tensor.shape), str(tensor.dtype)) if isinstance(tensor, torch.Tensor) else ()
    call = rec.op(Kind.COLL, a.get("group"), (name,) + shape)
    rec.add(call)
    work = _inside(rec, fn, args, kwargs)
    if name == "barrier":
        rec.add(Call(Kind.HOST_WAIT, key=call.ref, thread=_thread()))
    elif a.get("async_op"):
        return _RecordedWork(work, rec, [call.ref])
    else:
        rec.add(Call(Kind.WAIT, key=call.ref, thread=_thread()))
    return work


def record_calls(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Entry]:
    """In a rank of :func:`~megatron_zb.testing.distributed.run_distributed`: the calls of ``fn(*args,
    **kwargs)`` (its result dropped), e.g. :func:`~megatron_zb.testing.tiny_gpt.run_step` at TP = 2 or
    :func:`~harness.dp_overlap.run_dp_iterations` with data-parallel overlap."""
    rec = Recorder()
    with recording(rec):
        fn(*args, **kwargs)
    return rec.calls


def record_trainer(argv: list[str]) -> list[Entry]:
    """In a rank of :func:`~megatron_zb.testing.distributed.run_distributed`: the calls of a whole
    ``pretrain_gpt_zb.py`` run (its command line ``argv``; parsing, set-up, every iteration, the exit), its
    printed output dropped."""
    import io

    from megatron_zb.training.pretrain import parse_command_line
    from megatron_zb.training.trainer import Trainer

    def run() -> None:
        validated = parse_command_line(argv, world_size=dist.get_world_size())
        trainer = Trainer(validated.args, schedule=validated.schedule)
        try:
            assert trainer.run() == 0
        finally:
            trainer.close()

    with contextlib.redirect_stdout(io.StringIO()):
        return record_calls(run)


def record_run(cfg: Any, *, schedule: str | None, iterations: int = 2, vocab: bool = False,
               interleaved: bool = False, overlap_p2p_comm: bool = False) -> list[Entry]:
    """In a rank of :func:`~megatron_zb.testing.distributed.run_distributed`: ``iterations`` training
    iterations of the tiny GPT ``cfg`` (:class:`~megatron_zb.testing.tiny_gpt.TinyGPT`), everything from
    the parallel state's set-up on recorded. ``schedule``: megatron-zb's (``vocab``: its vocabulary form, run
    by :func:`~harness.vocab_gpt.run_vocab_step`), or ``None``: megatron-core's own 1F1B, or with
    ``interleaved`` its interleaved 1F1B over 2 model chunks per rank (``overlap_p2p_comm`` as megatron-core's
    config field; ``batch_p2p_comm`` is its negation, as Megatron-LM sets it)."""
    from megatron_zb.testing.tiny_gpt import build, forward_backward
    from harness.vocab_gpt import run_vocab_step

    rec = Recorder()
    with recording(rec):
        if vocab:
            run_vocab_step(cfg, schedule=schedule, iterations=iterations)
            return rec.calls
        modules = _megatron_interleaved(cfg, overlap_p2p_comm) if interleaved else build(cfg, schedule)[1]
        if schedule is None:
            from megatron.core.pipeline_parallel import get_forward_backward_func
            fb = get_forward_backward_func()
        else:
            from megatron_zb.runtime import get_forward_backward_func as zb_func
            fb = zb_func(schedule, **cfg.schedule_options)
        for _ in range(iterations):
            forward_backward(fb, modules, cfg.microbatches(), seq=cfg.seq, micro_batch=cfg.micro_batch)
    return rec.calls


def _megatron_interleaved(cfg: Any, overlap_p2p_comm: bool) -> list[Any]:
    """This rank's 2 chunks for megatron-core's interleaved schedule (virtual pipeline size 2)."""
    from megatron_zb.schedules.ir import Placement
    from megatron_zb.testing.distributed import init_parallel_state
    from megatron_zb.testing.tiny_gpt import build_chunks

    init_parallel_state(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp, seed=cfg.seed,
                        virtual_pipeline_model_parallel_size=2)
    chunks = build_chunks(cfg, Placement.INTERLEAVED.stage_to_rank(cfg.pp, 2))
    for c in chunks:
        c.module.config.virtual_pipeline_model_parallel_size = len(chunks)
        c.module.config.microbatch_group_size_per_vp_stage = cfg.pp
        c.module.config.overlap_p2p_comm = overlap_p2p_comm
        c.module.config.batch_p2p_comm = not overlap_p2p_comm
    return [c.module for c in chunks]
