"""``patch_megatron()``: route an unmodified megatron-core training loop through megatron-zb.

After ``megatron_zb.patch_megatron(schedule="zb", ...)``:

* megatron-core's ``get_forward_backward_func()`` returns megatron-zb's drop-in function whenever
  pipeline parallelism is on (``pp_size > 1``), with the given schedule and options; with
  ``pp_size == 1`` it returns megatron-core's own no-pipelining function;
* every layer route of :mod:`megatron_zb.runtime.routes` is installed (megatron-core's linear
  layers into the weight-gradient store), which changes nothing outside a B pass.

Modules that imported ``get_forward_backward_func`` by name before the call (Megatron-LM's
``megatron.training.training`` does) are patched too. :func:`unpatch_megatron` restores all.

Teams that prefer a source change over a runtime hook apply
``patches/megatron-core-0.16.1-zero-bubble.patch`` to megatron-core: its
``get_forward_backward_func`` then calls :func:`forward_backward_from_env` when the environment
variable ``MEGATRON_ZB_SCHEDULE`` names a schedule (``MEGATRON_ZB_MEMORY_LIMIT`` optionally sets
the memory limit in units of one stage's activation memory) and behaves as before otherwise.
"""

from __future__ import annotations

from typing import Any, Callable

from .rebind import Rebinds

_PATCHED = Rebinds()
"""Where :func:`patch_megatron` replaced megatron-core's ``get_forward_backward_func``."""
_FROM_ENV: dict[tuple[str, str], Any] = {}


def forward_backward_from_env() -> Any:
    """megatron-zb's forward_backward_func configured by ``MEGATRON_ZB_SCHEDULE`` (and
    ``MEGATRON_ZB_MEMORY_LIMIT``); one instance per configuration, so the schedule is built once."""
    import os

    from ..runtime.forward_backward import get_forward_backward_func
    from ..runtime.routes import install_routes

    name = os.environ.get("MEGATRON_ZB_SCHEDULE", "")
    if not name:
        raise RuntimeError("MEGATRON_ZB_SCHEDULE is not set: name a megatron-zb schedule, e.g. zb")
    limit = os.environ.get("MEGATRON_ZB_MEMORY_LIMIT", "")
    key = (name, limit)
    if key not in _FROM_ENV:
        install_routes()
        _FROM_ENV[key] = get_forward_backward_func(name, memory_limit=float(limit) if limit else None)
    return _FROM_ENV[key]


def patch_megatron(schedule: str = "zb", *, wrapper: Callable[[Any], Callable] | None = None,
                   **options: Any) -> None:
    """Make megatron-core's ``get_forward_backward_func`` return megatron-zb's (see module doc).

    Args:
        schedule: schedule name, as for :func:`megatron_zb.get_forward_backward_func`.
        wrapper: called once with megatron-zb's ``forward_backward_func``; what it returns (a callable
            with megatron-core's ``forward_backward_func`` signature) is returned instead, e.g.
            :class:`megatron_zb.megatron_lm.ReplanningForwardBackward`.
        **options: :class:`megatron_zb.runtime.ZeroBubbleOptions` fields.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    from ..megatron_compat import check_schedule_selection
    from ..runtime.forward_backward import get_forward_backward_func
    from ..runtime.routes import install_routes

    unpatch_megatron()
    install_routes()
    original = schedules.get_forward_backward_func
    ours = get_forward_backward_func(schedule, **options)
    if wrapper is not None:
        ours = wrapper(ours)

    def patched_get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None, **kwargs: Any):
        """megatron-zb's forward_backward_func when pipelining, megatron-core's otherwise. ``kwargs``:
        what the installed release's selector takes besides (megatron_compat's
        ``get_forward_backward_func`` row), checked by ``megatron_compat.check_schedule_selection``."""
        if pp_size is None:
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        if pp_size > 1:
            check_schedule_selection(kwargs)
            return ours
        return original(pp_size=pp_size, vp_size=vp_size, **kwargs)

    _PATCHED.everywhere(original, patched_get_forward_backward_func)


def unpatch_megatron() -> None:
    """Undo :func:`patch_megatron` (the layer routes stay installed; they are inert outside B)."""
    _PATCHED.restore()
