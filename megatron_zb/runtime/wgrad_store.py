"""The weight-gradient store: B now, W later, for every layer with a route into it.

During a ``B`` action the runtime opens :meth:`WeightGradStore.deferring` for the (stage,
microbatch) being back-propagated; that makes the store the *current* one
(:func:`current_store`). A layer with a route into the store (see
:mod:`megatron_zb.runtime.routes`, e.g. megatron-core's linear layers) finds it there during its
backward, computes its input gradient at once and queues its weight-gradient work with
:meth:`WeightGradStore.put` -- a callable plus the parameters it accumulates into. The matching
``W`` action calls :meth:`WeightGradStore.run`, which runs that queue.

Outside a deferring window (``BW`` actions, forward-only, megatron-core's own schedules) no store
is current and every routed layer behaves exactly as megatron-core's.

Parameter bookkeeping (for overlapping the data-parallel gradient reduction with the
schedule): the runtime tells the store, per iteration, how many W actions each stage runs
(:meth:`WeightGradStore.begin_iteration`). The store then knows how many W's of a parameter's
stage are still to come (:meth:`WeightGradStore.remaining_w`) and calls
:attr:`WeightGradStore.on_params_done` after the last W of a stage with every parameter whose
weight-gradient work was queued on that stage this iteration: their gradients are final.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping, Protocol

import torch


class WeightGradStoreError(RuntimeError):
    """Misuse of the store: W without its B, a W run twice, or W left pending at iteration end."""


_CURRENT: "WeightGradStore | None" = None  # the store whose deferring window is open, if any


def current_store() -> WeightGradStore | None:
    """The store whose :meth:`~WeightGradStore.deferring` window is open (``None`` outside a B).

    Process-wide, not per thread: on GPU, autograd runs backward functions on its own device
    threads, which must see the window the executor's thread opened.
    """
    return _CURRENT


class WeightGradStore:
    """Queues of deferred weight-gradient computations, one per (pipeline stage, microbatch).

    ``stage`` is always the global pipeline stage index of the schedule (the ``Action.stage`` of
    the B and W), not the index of a model chunk on this rank.

    Each queue entry is ``(fn, params)``: ``fn()`` adds a weight gradient into the gradients
    of ``params`` (``.main_grad`` or ``.grad``). The runtime's
    :class:`~megatron_zb.runtime.ZeroBubbleForwardBackward` owns one store; routes find it
    through :func:`current_store` while its B window is open.

    Attributes:
        executed: queue entries run by W since creation (for tests and statistics).
        on_params_done: called after the last W of a stage in an iteration (see
            :meth:`begin_iteration`) with the parameters whose weight-gradient work that stage
            queued in the iteration, in first-queued order; ``None``: nobody is told. Setting it
            requires :meth:`begin_iteration` before every iteration.
        binder: told of every W group's entries before it runs, and before and after each entry
            (:class:`Binder`; sharded gradients bind an entry's bucket to a work buffer before it and
            reduce-scatter a bucket right after the group's last entry into it:
            :mod:`megatron_zb.runtime.sharded_grads`); ``None``: nobody.
        report_per_entry: when ``True``, ``on_params_done`` is called in pieces during the
            stage's last W instead of once after it: first with the parameters that W does not
            touch (their work ran in earlier W's), then after each queued entry with the
            parameters whose last entry that was -- every parameter once, as soon as nothing
            more is added into its gradient (the contract of Transformer Engine's
            ``register_wgrad_accumulation_and_reduce_hooks``: a hook per weight right after its
            delayed wgrad accumulation). Used by :mod:`megatron_zb.runtime.grad_sync`.
    """

    def __init__(self) -> None:
        self._queues: dict[tuple[int, int], list[tuple[Callable[[], None], tuple[torch.Tensor, ...]]]] = {}
        self._active: tuple[int, int] | None = None
        self._early: set[tuple[int, int]] = set()  # queues opened by queue_for before their B
        self._w_left: dict[int, int] = {}        # stage -> W actions still to run this iteration
        self._params: dict[int, dict[int, torch.Tensor]] = {}  # stage -> {id(param): param} queued
        self.executed = 0
        self.on_params_done: Callable[[tuple[torch.Tensor, ...]], None] | None = None
        self.report_per_entry = False
        self.binder: Binder | None = None

    # ------------------------------------------------------------------ B: queue
    @contextlib.contextmanager
    def deferring(self, stage: int, microbatch: int) -> Iterator[None]:
        """Make this store current and queue routed weight-gradient work for ``(stage, mb)``."""
        global _CURRENT
        key = (stage, microbatch)
        if _CURRENT is not None:
            s, m = _CURRENT._active or (None, None)
            raise WeightGradStoreError(f"B of stage {stage} microbatch {microbatch} started while "
                                       f"B of stage {s} microbatch {m} is open")
        if key in self._queues and key not in self._early:
            raise WeightGradStoreError(f"B of stage {stage} microbatch {microbatch} ran twice before its W")
        self._queues.setdefault(key, [])
        self._early.discard(key)
        self._active = key
        _CURRENT = self
        try:
            yield
        finally:
            self._active = None
            _CURRENT = None

    @property
    def is_deferring(self) -> bool:
        """Whether this store's deferring window is open."""
        return self._active is not None

    def put(self, fn: Callable[[], None], *, params: tuple[torch.Tensor, ...]) -> None:
        """Queue ``fn`` (which adds into the gradients of ``params``) for the W of the open (stage, mb).

        A ``fn`` with a ``prefetch()`` method has it called before the previous entry of its W
        runs, to launch its communication early (see :func:`_run_entries`)."""
        key = self._active
        if key is None:
            raise WeightGradStoreError("weight-gradient work queued outside a B pass")
        self._queues[key].append((fn, params))
        if self._w_left:  # counting W's this iteration (begin_iteration): note whose gradients they touch
            known = self._params.get(key[0])
            if known is None:
                known = self._params[key[0]] = {}
            for p in params:
                known[id(p)] = p

    def find_open(self, match: Callable[[Callable[[], None]], bool]) -> Callable[[], None] | None:
        """The first entry queued in the open B window for which ``match(fn)`` holds, or ``None`` (also
        outside a window): how a route finds the work it queued earlier in the same B (a weight used
        twice by one microbatch, whose gradients autograd would sum before adding them)."""
        if self._active is None:
            return None
        return next((fn for fn, _ in self._queues[self._active] if match(fn)), None)

    def queue_for(self, stage: int, microbatch: int, fn: Callable[[], None], *, params: tuple[torch.Tensor, ...]
                  ) -> None:
        """Queue ``fn`` for the W of ``(stage, microbatch)`` from outside a B window, before or after
        that B (a vocabulary-parallel ``T`` pass's weight gradient, run by the rank's W of the microbatch)."""
        key = (stage, microbatch)
        if key not in self._queues:
            self._queues[key] = []
            self._early.add(key)
        saved, self._active = self._active, key
        try:
            self.put(fn, params=params)
        finally:
            self._active = saved

    # ------------------------------------------------------------------ W: run
    def run(self, stage: int, microbatch: int) -> int:
        """Run (and drop) the queued weight-gradient work of ``(stage, microbatch)``; return its size."""
        return self.run_group(stage, (microbatch,))

    def run_group(self, stage: int, microbatches: tuple[int, ...]) -> int:
        """Run (and drop) the W's of ``stage`` for ``microbatches`` as one group, layer-major
        (:func:`layer_major`: each layer's entries of every micro batch back to back, so a layer's
        gradient is complete for the group before the next layer starts); return the entries run.

        Each parameter still receives its micro batches' contributions in micro batch order, so the
        gradients are bit for bit those of the same W's run one by one. Counts as ``len(microbatches)``
        W actions (:meth:`begin_iteration`)."""
        for mb in microbatches:
            if (stage, mb) not in self._queues:
                raise WeightGradStoreError(
                    f"W of stage {stage} microbatch {mb} has nothing to run: its B has not run (or this W "
                    f"already ran)")
        left = self._w_left.get(stage)
        if left is not None and left < len(microbatches):
            raise WeightGradStoreError(f"W of stage {stage} microbatch {microbatches[-1]} is one more W than "
                                       f"begin_iteration announced for stage {stage}")
        if left is None and self.on_params_done is not None:
            raise WeightGradStoreError(f"W of stage {stage} ran with on_params_done set but no W count for "
                                       f"stage {stage}: call begin_iteration first")
        if left is None and self.binder is not None:
            raise WeightGradStoreError(f"W of stage {stage} ran with a binder but no W count for stage {stage}: "
                                       f"call begin_iteration first")
        queues = [self._queues.pop((stage, mb)) for mb in microbatches]
        queue = queues[0] if len(queues) == 1 else layer_major(queues)
        last = left == len(microbatches)
        if left is not None:
            self._w_left[stage] = left - len(microbatches)
        binder = self.binder
        if binder is not None:
            binder.begin_group(stage, tuple(params for _, params in queue), final=last)
            _run_entries(queue, lambda i, _: binder.after_entry(stage, i), before=lambda i, _: binder.before_entry(stage, i))
            binder.after_group(stage)
        elif last and self.on_params_done is not None and self.report_per_entry:
            self._run_reporting(stage, queue, self.on_params_done)
        else:
            _run_entries(queue)
            if last and self.on_params_done is not None:
                done = tuple(self._params.get(stage, {}).values())
                if done:
                    self.on_params_done(done)
        self.executed += len(queue)
        return len(queue)

    def _run_reporting(self, stage: int, queue: list[tuple[Callable[[], None], tuple[torch.Tensor, ...]]],
                       report: Callable[[tuple[torch.Tensor, ...]], None]) -> None:
        """The stage's last W with per-entry reports (see :attr:`report_per_entry`)."""
        last_entry: dict[int, int] = {}
        for i, (_, params) in enumerate(queue):
            for p in params:
                last_entry[id(p)] = i
        untouched = tuple(p for k, p in self._params.get(stage, {}).items() if k not in last_entry)
        if untouched:
            report(untouched)

        def after(i: int, params: tuple[torch.Tensor, ...]) -> None:
            done = {id(p): p for p in params if last_entry[id(p)] == i}
            if done:
                report(tuple(done.values()))

        _run_entries(queue, after)

    # ------------------------------------------------------------------ per-iteration bookkeeping
    def begin_iteration(self, w_per_stage: Mapping[int, int]) -> None:
        """Start an iteration in which stage ``s`` runs ``w_per_stage[s]`` W actions."""
        if self._queues:
            raise WeightGradStoreError("an iteration started with weight gradients still pending for "
                                       + self._pending_text())
        self._w_left = dict(w_per_stage)
        self._params.clear()

    def remaining_w(self, param: torch.Tensor) -> int | None:
        """W actions still to run this iteration on the stage that queued work for ``param``.

        0 once the last one ran: nothing is added into the gradient of ``param`` any more this
        iteration. ``None`` when no work for ``param`` was queued this iteration, or no W counts
        were given (:meth:`begin_iteration`). Counted per stage because a W runs everything its
        stage's B queued; a layer a microbatch skipped contributes nothing to that W.
        """
        for stage, left in self._w_left.items():
            if id(param) in self._params.get(stage, ()):
                return left
        return None

    def pending(self) -> list[tuple[int, int]]:
        """(stage, microbatch) pairs whose W has not run yet."""
        return sorted(self._queues)

    def _pending_text(self) -> str:
        return ", ".join(f"(stage {s}, microbatch {m})" for s, m in self.pending())

    def assert_empty(self) -> None:
        """Raise when an iteration ends with W still pending (a schedule that lost a W)."""
        if self._queues:
            raise WeightGradStoreError(f"iteration ended with weight gradients still pending for "
                                       f"{self._pending_text()}")

    def clear(self) -> None:
        """Drop every queue and the iteration's bookkeeping (after a failed iteration).

        A queued ``fn`` with a ``discard()`` method is told (e.g. the Transformer Engine route
        then empties the TE module's own queue, whose work this W would have run).
        """
        global _CURRENT
        for queue in self._queues.values():
            for fn, _ in queue:
                discard = getattr(fn, "discard", None)
                if discard is not None:
                    discard()
        self._queues.clear()
        self._early.clear()
        self._w_left.clear()
        self._params.clear()
        if _CURRENT is self:
            _CURRENT = None
        self._active = None


_Queue = list[tuple[Callable[[], None], tuple[torch.Tensor, ...]]]


class Binder(Protocol):
    """What the store tells about the W's it runs (:attr:`WeightGradStore.binder`): a group's entries up front,
    then each entry before and after it runs, then the group's end."""

    def begin_group(self, stage: int, entries: tuple[tuple[torch.Tensor, ...], ...], *, final: bool) -> None:
        """A group of ``stage``'s W's starts: ``entries[i]`` are the parameters its ``i``-th entry adds into, in
        run order (``final``: the stage's last group this iteration)."""

    def before_entry(self, stage: int, index: int) -> None:
        """The group's entry ``index`` runs next."""

    def after_entry(self, stage: int, index: int) -> None:
        """The group's entry ``index`` ran."""

    def after_group(self, stage: int) -> None:
        """The group ran."""


def layer_major(queues: list[_Queue]) -> _Queue:
    """The entries of several micro batches' queues (given in micro batch order) regrouped layer-major:
    the entries that add into a layer's parameters -- any entries sharing a parameter, transitively --
    back to back for every micro batch, micro batch by micro batch, the layers in the order they first
    appear. Every parameter then receives its contributions in the order the queues run one by one
    would add them, so the gradients are bitwise the same."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = x = parent[parent[x]]
        return x

    for queue in queues:  # 1. layers: parameters joined by the entries that touch them together
        for _, params in queue:
            ids = [id(p) for p in params]
            for other in ids[1:]:
                parent[root(other)] = root(ids[0])
    by_layer: dict[object, _Queue] = {}  # 2. each layer's entries, micro batch order (the queues' order)
    for queue in queues:
        for entry in queue:
            key: object = root(id(entry[1][0])) if entry[1] else id(entry)
            by_layer.setdefault(key, []).append(entry)
    return [entry for entries in by_layer.values() for entry in entries]


def _run_entries(queue: _Queue, after: Callable[[int, tuple[torch.Tensor, ...]], None] | None = None, *,
                 before: Callable[[int, tuple[torch.Tensor, ...]], None] | None = None) -> None:
    """Run a W's entries in order (``before(i, params)`` before entry ``i`` -- ahead of the next entry's
    prefetch --, ``after(i, params)`` after it, if given).

    Before entry ``i`` runs, entry ``i + 1``'s ``prefetch()`` is called when its ``fn`` has one:
    the next entry's communication (e.g. the linear route's sequence-parallel all-gather) is then
    in flight during entry ``i``'s GEMM. An entry must not rely on it: run without it (the first
    entry, or a store-less call), ``fn`` launches what ``prefetch`` would have.
    """
    for i, (fn, params) in enumerate(queue):
        if before is not None:
            before(i, params)
        with torch.no_grad():  # as inside autograd's backward: no graph for gradient math
            if i + 1 < len(queue):
                prefetch = getattr(queue[i + 1][0], "prefetch", None)
                if prefetch is not None:
                    prefetch()
            fn()
        if after is not None:
            after(i, params)
