"""megatron-zb: zero-bubble pipeline parallelism for megatron-core.

``import megatron_zb`` makes megatron-core usable on a CPU-only machine (the CPU shim installs
itself only when CUDA is unavailable; nothing changes when it is available).

Public entry points:

* :func:`get_forward_backward_func` -- megatron-core's ``forward_backward_func`` signature,
  running any schedule of :mod:`megatron_zb.schedules` (``"1f1b"``, ``"zb-h1"``, ``"zb-h2"``,
  ``"zb"``, ...);
* :func:`patch_megatron` -- route an unmodified megatron-core training loop through it.
"""

__version__ = "0.1.0"

from megatron_zb import platform as _platform  # noqa: E402,F401  -- installs the CPU shim when CUDA is absent
from megatron_zb.patching import patch_megatron, unpatch_megatron  # noqa: E402
from megatron_zb.runtime import get_forward_backward_func  # noqa: E402

__all__ = ["get_forward_backward_func", "patch_megatron", "unpatch_megatron", "__version__"]
