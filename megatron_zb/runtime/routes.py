"""The route table: how each kind of layer defers its weight gradient to W.

A *route* is one row of :data:`ROUTES`. Two kinds of rows exist:

* :class:`LayerRoute` -- a megatron-core object (an autograd function or a module class, named
  by module path and attribute) that megatron-zb replaces, while installed, by a version whose
  backward -- inside a B window, i.e. while a
  :class:`~megatron_zb.runtime.wgrad_store.WeightGradStore` is current -- computes the input
  gradient at once and queues the weight-gradient work with ``store.put(fn, params=...)``;
* :class:`ModuleRoute` -- for layers that defer their weight gradients themselves (Transformer
  Engine's ``delay_wgrad_compute``): nothing is replaced; hooks run before and after every
  backward of a chunk (:func:`backward_window`), see which of the chunk's modules queued work
  for that microbatch and put one store entry per such module (or, after a fused ``BW``, run it
  at once); a per-row schedule check (:func:`check_schedule`) refuses schedules the layer kind
  cannot follow.

Outside a B window a row behaves exactly as the original layer, so installing a route never
changes a run that does not use a split-backward schedule.

:func:`install_routes` installs every row (the runtime and :func:`megatron_zb.patch_megatron` call
it); :func:`uninstall_routes` restores megatron-core's objects and switches module hooks off.
Adding a layer kind is adding a row (see ``docs/runtime.md``).

Rows today:

* ``linear`` -- megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication``, the
  autograd function behind ``ColumnParallelLinear`` and ``RowParallelLinear`` -- and therefore
  also MoE ``SequentialMLP`` experts, which are built from those two layers
  (:mod:`megatron_zb.runtime.linear_route`).
* ``transformer-engine`` -- Transformer Engine modules built with ``delay_wgrad_compute``
  (:mod:`megatron_zb.runtime.te_route`).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..megatron_compat import LINEAR_AUTOGRAD_FUNCTION
from ..schedules.ir import Schedule, ScheduleError
from . import te_route
from .linear_route import build_zb_linear_function

if TYPE_CHECKING:
    import torch

    from .wgrad_store import WeightGradStore


def _always() -> bool:
    return True


@dataclass(eq=False)
class LayerRoute:
    """One row of the route table.

    Attributes:
        name: short name of the route (``"linear"``).
        module: import path of the megatron-core module holding the hooked object.
        attribute: name, in ``module``, of the object the route replaces while installed (an
            autograd function or a module class that megatron-core looks up by that name when
            it builds or runs the layer).
        b_queues_w: one line: what the replacement's B computes now and what it queues for W.
        build: ``original -> replacement``; called by :meth:`install` with the object found at
            ``module.attribute``. The replacement's backward must call
            ``store.put(fn, params=...)`` on :func:`~megatron_zb.runtime.wgrad_store.current_store`
            when one is current, and behave as the original otherwise.
        available: whether the layer kind can exist in this process (e.g. its library is
            importable); :func:`install_routes` skips a route that is not -- no layer of that
            kind can be built then. Default: always.
    """

    name: str
    module: str
    attribute: str
    b_queues_w: str
    build: Callable[[Any], Any]
    available: Callable[[], bool] = _always
    _original: Any = field(default=None, init=False, repr=False)
    _replacement: Any = field(default=None, init=False, repr=False)

    @property
    def installed(self) -> bool:
        """Whether the replacement is in place."""
        return self._replacement is not None

    @property
    def replacement(self) -> Any:
        """The installed replacement (``None`` while not installed)."""
        return self._replacement

    def install(self) -> None:
        """Put the replacement in place of ``module.attribute`` (idempotent)."""
        if self._replacement is not None:
            return
        mod = importlib.import_module(self.module)
        original = getattr(mod, self.attribute)
        replacement = self.build(original)
        setattr(mod, self.attribute, replacement)
        self._original, self._replacement = original, replacement

    def uninstall(self) -> None:
        """Restore megatron-core's own object (idempotent).

        Raises RuntimeError when ``module.attribute`` no longer holds this route's replacement
        (something else replaced it meanwhile; restoring would undo that silently).
        """
        if self._replacement is None:
            return
        mod = importlib.import_module(self.module)
        if getattr(mod, self.attribute) is not self._replacement:
            raise RuntimeError(f"route {self.name!r}: {self.module}.{self.attribute} was replaced by something "
                               f"else after megatron-zb installed its route; not restoring it")
        setattr(mod, self.attribute, self._original)
        self._original = self._replacement = None


@dataclass(eq=False)
class ModuleRoute:
    """One row of the route table for layers that queue their weight gradients themselves.

    Nothing is replaced; while installed, :func:`backward_window` calls the hooks around every
    backward of a chunk run by the executor.

    Attributes:
        name: short name of the route (``"transformer-engine"``).
        b_queues_w: one line: what B computes now and what the W entry runs.
        before_backward: ``(chunk, store, deferred) -> state`` before a backward of ``chunk``
            (``deferred``: a B whose W comes later; else a fused BW); ``None`` when the chunk
            has no layer of this kind (then ``after_backward`` is not called).
        after_backward: ``state -> None`` after that backward: for each layer that queued work,
            ``store.put(fn, params=...)`` (B; the store's window is still open) or run it (BW).
        check_schedule: ``(schedule, chunks) -> problems``; non-empty when ``schedule`` cannot
            run on these chunks' layers of this kind (:func:`check_schedule` raises).
        available: whether the layer kind can exist in this process (default: always).
    """

    name: str
    b_queues_w: str
    before_backward: Callable[["torch.nn.Module", "WeightGradStore", bool], Any]
    after_backward: Callable[[Any], None]
    check_schedule: Callable[[Schedule, Sequence["torch.nn.Module"]], list[str]]
    available: Callable[[], bool] = _always
    _installed: bool = field(default=False, init=False, repr=False)

    @property
    def installed(self) -> bool:
        """Whether the hooks run."""
        return self._installed

    def install(self) -> None:
        """Switch the hooks on (idempotent)."""
        self._installed = True

    def uninstall(self) -> None:
        """Switch the hooks off (idempotent)."""
        self._installed = False


ROUTES: tuple[LayerRoute | ModuleRoute, ...] = (
    LayerRoute(
        name="linear",
        module=LINEAR_AUTOGRAD_FUNCTION[0],
        attribute=LINEAR_AUTOGRAD_FUNCTION[1],
        b_queues_w="B: input gradient (+ TP all-reduce / SP reduce-scatter, async after its GEMM) and bias "
                   "gradient now; W: grad_output^T @ input (SP: re-gathered, the gather launched before the previous "
                   "entry's GEMM) into main_grad or .grad",
        build=build_zb_linear_function,
    ),
    ModuleRoute(
        name="transformer-engine",
        b_queues_w="B: TE's backward with delay_wgrad_compute (input gradient now, weight-gradient GEMM into the "
                   "module's FIFO); W: backward_dw() on each module that queued in that B, gradients into "
                   "main_grad or .grad",
        before_backward=te_route.before_backward,
        after_backward=te_route.after_backward,
        check_schedule=te_route.check_schedule,
    ),
)
"""Every route, installed in this order by :func:`install_routes`."""

_MODULE_ROUTES: tuple[ModuleRoute, ...] = tuple(r for r in ROUTES if isinstance(r, ModuleRoute))


def get_route(name: str) -> LayerRoute | ModuleRoute:
    """The row of :data:`ROUTES` called ``name``."""
    for route in ROUTES:
        if route.name == name:
            return route
    raise KeyError(f"no layer route named {name!r}; routes: {', '.join(r.name for r in ROUTES)}")


def install_routes() -> None:
    """Install every available route of :data:`ROUTES` (idempotent)."""
    for route in ROUTES:
        if route.available():
            route.install()


def uninstall_routes() -> None:
    """Restore megatron-core's objects and switch module hooks off for every route (idempotent)."""
    for route in reversed(ROUTES):
        route.uninstall()


@contextlib.contextmanager
def backward_window(*, store: "WeightGradStore", deferred: bool, chunk: "torch.nn.Module", stage: int,
                    microbatch: int) -> Iterator[None]:
    """The context of one backward of ``chunk`` run by the executor.

    ``deferred`` (a B): ``store``'s deferring window for ``(stage, microbatch)`` is open, so
    layer routes queue into it; installed module routes queue their layers' W entries at the
    end. Otherwise (a fused BW) only the module routes act, running their layers' weight
    gradients right after the backward.
    """
    window = store.deferring(stage, microbatch) if deferred else contextlib.nullcontext()
    with window:
        states = []
        for route in _MODULE_ROUTES:
            if route.installed:
                state = route.before_backward(chunk, store, deferred)
                if state is not None:
                    states.append((route, state))
        yield
        for route, state in states:
            route.after_backward(state)


def check_schedule(schedule: Schedule, chunks: Sequence["torch.nn.Module"]) -> None:
    """Raise :class:`~megatron_zb.schedules.ScheduleError` when an installed module route cannot
    follow ``schedule`` on ``chunks`` (e.g. Transformer Engine modules and a schedule whose W's
    leave their B's order); the message names the route and the first problem."""
    problems = []
    for route in _MODULE_ROUTES:
        if route.installed:
            problems += [f"{route.name} route: {p}" for p in route.check_schedule(schedule, chunks)]
    if problems:
        raise ScheduleError("; ".join(problems))
