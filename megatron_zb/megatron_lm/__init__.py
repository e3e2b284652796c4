"""megatron-zb's routes into NVIDIA Megatron-LM and megatron-core's own loop.

* :mod:`.route` -- inside Megatron-LM's ``pretrain_gpt.py``: ``import megatron_zb.megatron_lm`` then
  ``megatron_zb.megatron_lm.install()`` (its names are this package's: ``install``, ``uninstall``,
  ``configure``, ``add_flags``, ``planner_config``, ``ReplanningForwardBackward``, ``v_model_provider``,
  ``NOT_YET``; docs/megatron_lm.md);
* :mod:`.optimizer` -- optimizer post-validation in Megatron-LM's loop;
* :mod:`.v` -- the V schedules there (the model-provider wrapper, the wrapped model builder);
* :mod:`.patching` -- :func:`megatron_zb.patch_megatron`: megatron-core's ``get_forward_backward_func``
  routed to megatron-zb (also on its own, without Megatron-LM);
* :mod:`.rebind` -- the one rule for rebinding a name in every module that imported it, and undoing it.

The route is imported on first use of one of its names: ``import megatron_zb`` (which exports
``patch_megatron``) must import neither torch nor megatron-core.
"""

from __future__ import annotations

from typing import Any

ROUTE_NAMES = ("NOT_YET", "ReplanningForwardBackward", "add_flags", "configure", "install", "planner_config",
               "refused_with_a_schedule", "uninstall", "v_model_provider")
"""The names of :mod:`.route` this package exports."""

__all__ = list(ROUTE_NAMES)


def __getattr__(name: str) -> Any:
    """A name of :mod:`.route`, imported on first use (module docstring)."""
    if name in ROUTE_NAMES:
        from . import route

        return getattr(route, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
