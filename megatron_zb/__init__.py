"""megatron-zb: zero-bubble pipeline parallelism for megatron-core.

``import megatron_zb`` makes megatron-core usable on a CPU-only machine (the CPU shim installs
itself when megatron-core is imported, only when CUDA is unavailable; nothing changes when it is
available). It imports neither torch nor megatron-core: the schedule library
(:mod:`megatron_zb.schedules`) and the planner (:mod:`megatron_zb.planning`) run without them.

Public entry points:

* :func:`get_forward_backward_func` -- megatron-core's ``forward_backward_func`` signature,
  running any schedule of :mod:`megatron_zb.schedules` (``"1f1b"``, ``"zb-h1"``, ``"zb-h2"``,
  ``"zb"``, ...);
* :func:`patch_megatron` -- route an unmodified megatron-core training loop through it.
"""

__version__ = "0.1.0"

from typing import Any

from megatron_zb import platform as _platform  # noqa: F401  -- installs the CPU shim when CUDA is absent
from megatron_zb.megatron_lm.patching import patch_megatron, unpatch_megatron

__all__ = ["get_forward_backward_func", "patch_megatron", "unpatch_megatron", "__version__"]


def __getattr__(name: str) -> Any:
    """``get_forward_backward_func`` is imported on first use: ``import megatron_zb.schedules`` (and
    the planner) must not import torch, and Python imports this package first."""
    if name == "get_forward_backward_func":
        from megatron_zb.runtime import get_forward_backward_func

        return get_forward_backward_func
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
