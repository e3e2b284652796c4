"""The Transformer Engine route: TE modules built with ``delay_wgrad_compute`` into the store.

Transformer Engine (TE >= 2.3) defers weight gradients itself: a ``te.pytorch.Linear``,
``LayerNormLinear``, ``LayerNormMLP`` or ``GroupedLinear`` built with ``delay_wgrad_compute=True``
computes the input gradient in its backward and puts the weight-gradient GEMM into its own FIFO
(``module.wgrad_store``); each ``module.backward_dw()`` pops and runs the oldest entry (two for
``LayerNormMLP``), leaving the weight gradient in ``main_grad`` (``fuse_wgrad_accumulation``) or
in ``.grad`` and then calling the module's wgrad accumulation hooks (TE >= 2.7,
``register_wgrad_accumulation_and_reduce_hooks``).

This route is the ``"transformer-engine"`` row of :mod:`megatron_zb.runtime.routes` (a module
route): around every backward of a chunk it counts each delayed TE module's queue
(:func:`before_backward`); afterwards (:func:`after_backward`) a module whose queue grew queued
for this microbatch, and

* inside a B window, one store entry per such module goes into the current
  :class:`~megatron_zb.runtime.wgrad_store.WeightGradStore` for the W of the same (stage,
  microbatch): it calls the module's ``backward_dw()`` until exactly the entries this B queued
  are consumed;
* after a fused ``BW`` it runs them at once.

Because TE's queue is FIFO per module, a W runs the right microbatch's work only when every
stage runs its W's in its B's order; :func:`check_schedule` refuses other schedules (and split
schedules on TE modules built without delay, which would silently compute every weight
gradient in B).

Where the weight gradient lands, after ``backward_dw()``: exactly where the non-delayed path
puts it. TE assigns ``.grad`` (it does not add), so before each ``backward_dw()`` the module's
``.grad``'s are set aside and afterwards (in a hook registered through
``register_wgrad_accumulation_and_reduce_hooks`` on TE >= 2.7, directly on TE 2.3-2.6) what TE
left in ``.grad`` is added into ``main_grad`` -- what megatron-core DDP's gradient hook does --
or onto the set-aside ``.grad`` -- what autograd's accumulation does. With
``gradient_accumulation_fusion`` TE accumulates the weight gradient into ``main_grad`` itself.
What autograd hands the module's parameters in B is seen by a pre-hook on their gradient
accumulators (:class:`_TEModule`): a delayed weight's is dropped (never its gradient; for
``GroupedLinear`` on TE >= 2.8, an unfilled buffer), a bias whose gradient came in B (FP8,
debug, returned or row-parallel bias) gets a placeholder in its W so that TE's ``bgrad=None``
is never assigned, and a backward that reached delayed weights without queuing is refused
(:func:`after_backward`). :func:`check_schedule` also refuses TE's op fuser and megatron-core
DDP built with ``delay_wgrad_compute``.

:func:`enable_delayed_wgrad` switches delaying on in a megatron-core ``TransformerConfig``
before the model is built (megatron-core 0.16.1 otherwise asserts it is used only with MoE
overlap; see :func:`megatron_zb.megatron_compat.te.set_delay_wgrad_compute`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import torch

from ..megatron_compat.te import (TE_OP_FUSER_CLASSES, set_delay_wgrad_compute, te_delayed_weight_params,
                              te_drop_queued_wgrad, te_queued_wgrad)
from ..schedules.ir import Schedule
from ..schedules.order import w_order_matches_b
from .wgrad_store import WeightGradStore, WeightGradStoreError

__all__ = [
    "TE_HOOKS_VERSION", "TE_MIN_VERSION", "TransformerEngineUnavailable", "after_backward", "before_backward",
    "check_schedule", "enable_delayed_wgrad", "require_transformer_engine", "te_layer_spec",
    "transformer_engine_version",
]

TE_MIN_VERSION = "2.3"
"""Oldest Transformer Engine with ``delay_wgrad_compute`` and ``backward_dw()``."""

TE_HOOKS_VERSION = "2.7"
"""Oldest Transformer Engine with ``register_wgrad_accumulation_and_reduce_hooks``."""

_DIST_NAMES = ("transformer-engine", "transformer_engine", "transformer-engine-torch", "transformer_engine_torch")


class TransformerEngineUnavailable(RuntimeError):
    """Transformer Engine is missing or too old for the requested layer implementation."""


# ---------------------------------------------------------------------- availability
def transformer_engine_version() -> str | None:
    """The installed Transformer Engine version (from package metadata, TE is not imported),
    ``None`` when the ``transformer_engine`` package is not installed."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    for name in _DIST_NAMES:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def require_transformer_engine(*, min_version: str = TE_MIN_VERSION) -> str:
    """Return the installed TE version; raise :class:`TransformerEngineUnavailable` -- one line,
    ``"needs Transformer Engine >= 2.3 (...); <what was found>"`` -- when it is absent or older."""
    from packaging.version import InvalidVersion, Version

    found = transformer_engine_version()
    need = f"needs Transformer Engine >= {min_version} (pip package transformer-engine with its PyTorch extension)"
    if found is None:
        raise TransformerEngineUnavailable(f"{need}; Transformer Engine is not installed")
    try:
        too_old = Version(found).release < Version(min_version).release
    except InvalidVersion:
        raise TransformerEngineUnavailable(f"{need}; the installed version {found!r} cannot be read") from None
    if too_old:
        raise TransformerEngineUnavailable(f"{need}; found {found}")
    return found


def te_layer_spec(**kwargs: Any) -> Any:
    """megatron-core's Transformer Engine layer spec (``get_gpt_layer_with_transformer_engine_spec``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(**kwargs)


def enable_delayed_wgrad(config: Any) -> None:
    """Make the TE modules built from ``config`` (a validated ``TransformerConfig``) delay their
    weight gradients to ``backward_dw()``. Call before building the model.

    Raises ValueError for combinations TE or megatron-core do not support with it:
    ``overlap_moe_expert_parallel_comm`` (megatron-core's own combined schedule then runs
    ``backward_dw()``) and ``tp_comm_overlap`` (TE's userbuffers refuse delayed weight gradients).
    """
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise ValueError("delayed Transformer Engine weight gradients under a megatron-zb schedule cannot be "
                         "combined with overlap_moe_expert_parallel_comm (megatron-core's combined 1F1B runs "
                         "backward_dw itself)")
    if getattr(config, "tp_comm_overlap", False):
        raise ValueError("delayed Transformer Engine weight gradients cannot be combined with tp_comm_overlap "
                         "(TE: delayed weight grad computation is not supported with userbuffers)")
    set_delay_wgrad_compute(config)


# ---------------------------------------------------------------------- the modules of a chunk
def _te_wgrad_store(module: torch.nn.Module) -> Any:
    """The module's TE weight-gradient store when it is a TE module with ``backward_dw``, else None."""
    ws = getattr(module, "wgrad_store", None)
    if ws is None or not callable(getattr(ws, "delay_wgrad_compute", None)):
        return None
    return ws if callable(getattr(module, "backward_dw", None)) else None


class _TEModule:
    """megatron-zb's bookkeeping for one delayed TE module.

    ``outstanding`` counts the module's queue entries that store entries of this route will
    consume; it always equals the module's queue length between backwards (checked).

    What autograd hands each parameter in a backward is seen by a pre-hook on the parameter's
    gradient accumulator (:meth:`_arriving`):

    * a weight ``backward_dw()`` computes (:func:`~megatron_zb.megatron_compat.te.te_delayed_weight_params`):
      under delaying, TE's backward never hands it the weight gradient -- ``None``, a dummy
      (fused accumulation under megatron-core DDP) or, for ``GroupedLinear`` on TE >= 2.8
      without fused accumulation, the packed buffer the delayed GEMM fills later, uninitialised
      in B -- so it is dropped before DDP's hook or autograd's accumulation sees it; and the
      module's backward is known to have reached its weights (:func:`after_backward` then
      requires that it queued);
    * any other parameter: a gradient that arrives was computed in this backward (a bias under
      FP8 or TE's debug mode, a bias TE adds outside its GEMM -- returned, or row-parallel --,
      a norm's weight): noted, so that W gives it a placeholder for ``backward_dw()``
      (:meth:`_set_aside`).

    Under megatron-core DDP with ``overlap_grad_reduce`` (:attr:`ddp_overlap`), DDP's gradient
    hook asserts ``param.grad is not None`` in B: a parameter that gets no gradient (a weight,
    a bias inside the delayed GEMM) gets a zero placeholder in ``.grad`` with
    ``grad_added_to_main_grad`` set -- what TE's own fused path returns (``get_dummy_wgrad``) --
    so the hook adds nothing; W adds the real gradient (:meth:`_settle`) and megatron-zb's
    gradient sync reports it ready.
    """

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module, self.name = module, name
        self.params = tuple(module.parameters())
        self.outstanding = 0
        self.ddp_overlap = False
        self.reached_weights = False  # in the current backward
        self.b_grads: set[int] = set()  # ids of the non-weight parameters a gradient reached in it
        self._placeholders: dict[int, torch.Tensor] = {}
        self._stash: list[torch.Tensor | None] | None = None
        weights = {id(p) for p in te_delayed_weight_params(module)}
        self._nodes = []  # the gradient accumulators hooked (kept alive, as megatron-core DDP does)
        with torch.enable_grad():
            for p in self.params:
                if p.requires_grad:
                    node = p.expand_as(p).grad_fn.next_functions[0][0]
                    node.register_prehook(partial(self._arriving, p, id(p) in weights))
                    self._nodes.append(node)
        register = getattr(module, "register_wgrad_accumulation_and_reduce_hooks", None)
        self.hooked = callable(register)
        if self.hooked:
            register(self._settle)

    # -- B: what autograd hands the parameters
    def begin_backward(self) -> None:
        """Before a backward: nothing has reached the module's parameters yet."""
        self.reached_weights = False
        self.b_grads.clear()

    def _arriving(self, param: torch.nn.Parameter, is_weight: bool,
                  grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...] | None:
        """Gradient-accumulator pre-hook (see the class docstring); returns what the
        accumulator (and DDP's hook after it) receives: ``(None,)`` drops the gradient."""
        if is_weight:
            self.reached_weights = True
            if not self.module.wgrad_store.delay_wgrad_compute():
                return None  # a real gradient computed in B; after_backward refuses the run
            if self.ddp_overlap:
                _ddp_placeholder(param)
            return (None,)
        if grads[0] is not None:
            self.b_grads.add(id(param))
        elif self.ddp_overlap:
            _ddp_placeholder(param)
        return None

    # -- W: the module's backward_dw(), gradients settled where the non-delayed path puts them
    def run(self, entries: int, b_grads: frozenset[int]) -> None:
        """Call ``backward_dw()`` until ``entries`` queue entries are consumed; ``b_grads``: the
        parameters whose gradients the queuing backward computed (:meth:`_set_aside`)."""
        left = entries
        while left > 0:
            before = te_queued_wgrad(self.module)
            self._set_aside(b_grads)
            self.module.backward_dw()
            if self._stash is not None:
                if self.hooked:
                    raise WeightGradStoreError(f"Transformer Engine module {self.name}: backward_dw() did not call the "
                                               f"wgrad accumulation hook megatron-zb registered")
                self._settle()
            used = before - te_queued_wgrad(self.module)
            if not 0 < used <= left:
                raise WeightGradStoreError(f"Transformer Engine module {self.name}: backward_dw() consumed {used} "
                                           f"queued weight gradient(s); expected between 1 and {left}")
            left -= used
            self.outstanding -= used

    def _set_aside(self, b_grads: frozenset[int]) -> None:
        """Before ``backward_dw()``: every ``.grad`` set aside (TE assigns rather than adds, some
        versions only into an empty ``.grad``); a parameter whose gradient came in B gets a zero
        placeholder: TE assigns a bias ``bgrad.to(dtype)`` whenever its ``.grad`` is empty, and
        ``bgrad`` is ``None`` when its delayed GEMM did not compute the bias gradient (FP8,
        debug mode, a returned or row-parallel bias: ``module/base.py``, ``linear.py``)."""
        self._stash = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
            if id(p) in b_grads:
                z = self._placeholders.get(id(p))
                if z is None:
                    z = self._placeholders[id(p)] = torch.zeros_like(p)
                p.grad = z

    def _settle(self) -> None:
        """Add what ``backward_dw()`` left in ``.grad`` to ``main_grad`` (as megatron-core DDP's
        gradient hook does) or onto the set-aside ``.grad`` (as autograd accumulates)."""
        stash, self._stash = self._stash, None
        if stash is None:  # a backward_dw() not run by this route: leave it alone
            return
        placeholders = self._placeholders
        for p, old in zip(self.params, stash):
            new = p.grad
            if new is None or new is placeholders.get(id(p)):
                p.grad = old
                continue
            main = getattr(p, "main_grad", None)
            if main is not None:  # what TE left in .grad is never in main_grad yet (fused weights leave none)
                main.add_(new)
                p.grad = old
            else:
                p.grad = new if old is None else old.add_(new)

    def discard(self) -> None:
        """Drop every queued entry (the store dropped its W's after a failed iteration)."""
        te_drop_queued_wgrad(self.module)
        self.outstanding = 0


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _ddp_placeholder(param: torch.nn.Parameter) -> None:
    """A zero placeholder (a read-only broadcast view, shared) in ``.grad`` of a parameter of
    megatron-core DDP, marked as already added to ``main_grad`` (see :class:`_TEModule`)."""
    if not hasattr(param, "grad_added_to_main_grad"):
        return
    key = (param.dtype, param.device)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = torch.zeros((), dtype=param.dtype, device=param.device)
    param.grad = zero.expand(param.shape)
    param.grad_added_to_main_grad = True


class _DeferredDW:
    """A store entry: the W of one microbatch on one TE module (``entries`` queue entries;
    ``b_grads``: the parameters whose gradients that microbatch's B computed)."""

    __slots__ = ("te", "entries", "b_grads")

    def __init__(self, te: _TEModule, entries: int, b_grads: frozenset[int]) -> None:
        self.te, self.entries, self.b_grads = te, entries, b_grads

    def __call__(self) -> None:
        self.te.run(self.entries, self.b_grads)

    def discard(self) -> None:
        self.te.discard()


@dataclass(frozen=True)
class _ChunkModules:
    """The TE modules of one chunk: delayed ones (route bookkeeping), names of undelayed ones,
    names of op-fuser modules (:data:`~megatron_zb.megatron_compat.te.TE_OP_FUSER_CLASSES`), and
    whether the chunk's megatron-core DDP was built with ``delay_wgrad_compute``."""

    delayed: tuple[_TEModule, ...]
    undelayed: tuple[str, ...]
    op_fused: tuple[str, ...] = ()
    ddp_delays_wgrad: bool = False


_CHUNKS: "weakref.WeakKeyDictionary[torch.nn.Module, _ChunkModules]" = weakref.WeakKeyDictionary()
_STATE_ATTR = "_megatron_zb_te_route"  # the module's _TEModule, kept on the module (lives and dies with it)


def chunk_te_modules(chunk: torch.nn.Module) -> _ChunkModules:
    """The TE modules of ``chunk`` (found once per chunk, then cached; one bookkeeping object per
    TE module, whichever wrapper of it is passed as the chunk)."""
    found = _CHUNKS.get(chunk)
    if found is None:
        ddp_config = getattr(chunk, "ddp_config", None)
        overlap = bool(getattr(ddp_config, "overlap_grad_reduce", False))
        delayed, undelayed, op_fused = [], [], []
        for name, m in chunk.named_modules():
            if type(m).__name__ in TE_OP_FUSER_CLASSES:
                op_fused.append(name)
            ws = _te_wgrad_store(m)
            if ws is None:
                continue
            if ws.delay_wgrad_compute():
                te = m.__dict__.get(_STATE_ATTR)
                if te is None:
                    te = _TEModule(m, name)
                    m.__dict__[_STATE_ATTR] = te
                te.ddp_overlap = te.ddp_overlap or overlap
                delayed.append(te)
            else:
                undelayed.append(name)
        found = _CHUNKS[chunk] = _ChunkModules(tuple(delayed), tuple(undelayed), tuple(op_fused),
                                               bool(getattr(ddp_config, "delay_wgrad_compute", False)))
    return found


# ---------------------------------------------------------------------- the route's hooks
@dataclass
class _Backward:
    """What :func:`before_backward` hands to :func:`after_backward`."""

    modules: tuple[_TEModule, ...]
    queued: list[int]
    store: WeightGradStore
    deferred: bool


def before_backward(chunk: torch.nn.Module, store: WeightGradStore, deferred: bool) -> _Backward | None:
    """Before a backward of ``chunk`` (B when ``deferred``, else BW): count the TE queues.

    ``None`` when the chunk has no delayed TE module. Raises :class:`WeightGradStoreError` when
    a module holds queued work this route did not queue (a backward outside megatron-zb's
    runtime, e.g. megatron-core's own schedule, on a model built with delayed weight gradients).
    """
    mods = chunk_te_modules(chunk).delayed
    if not mods:
        return None
    queued = []
    for te in mods:
        n = te_queued_wgrad(te.module)
        if n != te.outstanding:
            raise WeightGradStoreError(
                f"Transformer Engine module {te.name} holds {n} queued weight gradient(s) but megatron-zb queued "
                f"{te.outstanding}: a backward ran outside megatron-zb's runtime (e.g. megatron-core's own schedule) "
                f"on a model built with delay_wgrad_compute, and its weight gradients were never computed")
        te.begin_backward()
        queued.append(n)
    return _Backward(mods, queued, store, deferred)


def after_backward(state: _Backward) -> None:
    """After the backward: queue one W entry per module that queued (B), or run it now (BW).

    Raises :class:`WeightGradStoreError` when a module's backward reached its weights but
    queued nothing: their gradients were computed in this backward, not deferred (TE's op
    fuser running the module's weights, ``delay_wgrad_compute`` switched off on the module).
    """
    for te, before in zip(state.modules, state.queued):
        delta = te_queued_wgrad(te.module) - before
        if delta <= 0:
            if te.reached_weights:
                raise WeightGradStoreError(
                    f"Transformer Engine module {te.name}: a backward reached its weights but queued no deferred "
                    f"weight gradient, so it computed them in the backward (e.g. Transformer Engine's op fuser -- "
                    f"use_te_op_fuser -- runs the module's weights, or its delay_wgrad_compute was switched off); "
                    f"build the layers without use_te_op_fuser and with delay_wgrad_compute")
            continue  # the microbatch did not use this module
        te.outstanding += delta
        entry = _DeferredDW(te, delta, frozenset(te.b_grads))
        if state.deferred:
            state.store.put(entry, params=te.params)
        else:
            with torch.no_grad():
                entry()


def check_schedule(schedule: Schedule, chunks: Sequence[torch.nn.Module]) -> list[str]:
    """Why ``schedule`` cannot run on these chunks' TE modules (empty: it can)."""
    found = [chunk_te_modules(c) for c in chunks]
    problems = []
    undelayed = [n for f in found for n in f.undelayed]
    name = schedule.name or "(given)"
    if undelayed and schedule.splits_backward:
        problems.append(
            f"schedule {name} splits the backward into B and W, but {len(undelayed)} Transformer Engine module(s) "
            f"(e.g. {undelayed[0]}) were built without delay_wgrad_compute and would compute every weight gradient "
            f"in B; call megatron_zb.runtime.te_route.enable_delayed_wgrad(config) before building the model")
    delayed = any(f.delayed for f in found)
    op_fused = [n for f in found for n in f.op_fused]
    if op_fused and (delayed or schedule.splits_backward):
        problems.append(
            f"{len(op_fused)} module(s) (e.g. {op_fused[0]}) run Transformer Engine's op fuser (use_te_op_fuser, "
            f"megatron-core's TEFusedMLP), whose linear ops have no deferred weight gradients and would compute "
            f"them in B; build the layer spec without use_te_op_fuser")
    if delayed and any(f.ddp_delays_wgrad for f in found):
        problems.append(
            "megatron-core DDP was built with DistributedDataParallelConfig(delay_wgrad_compute=True), which moves "
            "its gradient hook into Transformer Engine's backward_dw and would drop the gradients megatron-zb settles "
            "there; build DDP with delay_wgrad_compute=False (megatron-zb defers the weight gradients itself)")
    if delayed:
        bad = w_order_matches_b(schedule)
        if bad:
            more = f" (and {len(bad) - 1} more stage(s))" if len(bad) > 1 else ""
            problems.append(
                f"schedule {name} runs weight gradients out of their input gradients' order -- {bad[0]}{more}; "
                f"Transformer Engine computes each module's deferred weight gradients first-in first-out, so "
                f"every stage must run its W's in the microbatch order of its B's")
    return problems
