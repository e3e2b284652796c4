"""``patch_megatron()``: route an unmodified megatron-core training loop through megatron-zb.

After ``megatron_zb.patch_megatron(schedule="zb", ...)``:

* megatron-core's ``get_forward_backward_func()`` returns megatron-zb's drop-in function whenever
  pipeline parallelism is on (``pp_size > 1``), with the given schedule and options; with
  ``pp_size == 1`` it returns megatron-core's own no-pipelining function;
* megatron-core's linear layers are routed through the weight-gradient store
  (:mod:`megatron_zb.runtime.wgrad_store`), which changes nothing outside a B pass.

Modules that imported ``get_forward_backward_func`` by name before the call (Megatron-LM's
``megatron.training.training`` does) are patched too. :func:`unpatch_megatron` restores all.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

_PATCHED: list[tuple[object, str, Callable]] = []


def patch_megatron(schedule: str = "zb", **options: Any) -> None:
    """Make megatron-core's ``get_forward_backward_func`` return megatron-zb's (see module doc).

    Args:
        schedule: schedule name, as for :func:`megatron_zb.get_forward_backward_func`.
        **options: :class:`megatron_zb.runtime.ZeroBubbleOptions` fields.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    from .runtime.forward_backward import get_forward_backward_func
    from .runtime.wgrad_store import install

    unpatch_megatron()
    install()
    original = schedules.get_forward_backward_func
    ours = get_forward_backward_func(schedule, **options)

    def patched_get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None):
        """megatron-zb's forward_backward_func when pipelining, megatron-core's otherwise."""
        if pp_size is None:
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        if pp_size > 1:
            return ours
        return original(pp_size=pp_size, vp_size=vp_size)

    for mod in list(sys.modules.values()):
        if mod is not None and getattr(mod, "get_forward_backward_func", None) is original:
            _PATCHED.append((mod, "get_forward_backward_func", original))
            setattr(mod, "get_forward_backward_func", patched_get_forward_backward_func)


def unpatch_megatron() -> None:
    """Undo :func:`patch_megatron` (the linear layers keep the store, which is inert outside B)."""
    while _PATCHED:
        mod, name, original = _PATCHED.pop()
        setattr(mod, name, original)
