"""The route table: how each kind of megatron-core layer defers its weight gradient to W.

A *route* is one row of :data:`ROUTES`: a megatron-core object (an autograd function or a module
class, named by module path and attribute) that megatron-zb replaces, while installed, by a
version whose backward -- inside a B window, i.e. while a
:class:`~megatron_zb.runtime.wgrad_store.WeightGradStore` is current -- computes the input
gradient at once and queues the weight-gradient work with ``store.put(fn, params=...)``. Outside
a B window the replacement behaves exactly as the original, so installing a route never changes
a run that does not use a split-backward schedule.

:func:`install_routes` installs every row (the runtime and :func:`megatron_zb.patch_megatron` call
it); :func:`uninstall_routes` restores megatron-core's objects. Adding a layer kind is adding a
row: a :class:`LayerRoute` whose ``build`` returns the replacement (see ``docs/runtime.md``).

Rows today:

* ``linear`` -- megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication``, the
  autograd function behind ``ColumnParallelLinear`` and ``RowParallelLinear`` -- and therefore
  also MoE ``SequentialMLP`` experts, which are built from those two layers
  (:mod:`megatron_zb.runtime.linear_route`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..megatron_compat import LINEAR_AUTOGRAD_FUNCTION
from .linear_route import build_zb_linear_function


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


ROUTES: tuple[LayerRoute, ...] = (
    LayerRoute(
        name="linear",
        module=LINEAR_AUTOGRAD_FUNCTION[0],
        attribute=LINEAR_AUTOGRAD_FUNCTION[1],
        b_queues_w="B: input gradient (+ TP all-reduce / SP reduce-scatter) and bias gradient now; "
                   "W: grad_output^T @ input (SP: re-gathered) into main_grad or .grad",
        build=build_zb_linear_function,
    ),
)
"""Every route, installed in this order by :func:`install_routes`."""


def get_route(name: str) -> LayerRoute:
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
    """Restore megatron-core's objects for every installed route (idempotent)."""
    for route in reversed(ROUTES):
        route.uninstall()
