"""Platform adaptation. Importing this package makes megatron-core usable on a CPU-only torch.

When CUDA is absent the CPU shim (:mod:`megatron_zb.platform.cpu_shim`) is installed: at once if
megatron-core is already imported, otherwise the moment ``megatron.core`` is first imported (an
import hook, which asks torch whether CUDA is available only then), so tools that never touch
megatron-core -- the schedule CLI, the simulator, the planner -- import neither megatron-core nor
torch. Without CUDA the hook also drops, before megatron-core loads, the notices its import makes
torch log (``megatron_compat.platform.IMPORT_NOTICES``). When CUDA is available nothing is patched.
See ``docs/cpu_support.md``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Sequence

__all__ = ["CPU_SHIM_ACTIVE", "install_cpu_shim", "is_installed"]


def _cuda_absent() -> bool:
    """Whether CUDA is unavailable (imports torch: called only once megatron-core, which needs it, loads)."""
    import torch

    return not torch.cuda.is_available()


def _drop_import_notices() -> None:
    """Drop the log records of :data:`megatron_zb.megatron_compat.platform.IMPORT_NOTICES` (what importing
    megatron-core makes torch say on a machine without a GPU); called before megatron-core loads."""
    import logging

    from megatron_zb.megatron_compat.platform import IMPORT_NOTICES

    for logger, start in IMPORT_NOTICES:
        logging.getLogger(logger).addFilter(lambda r, start=start: not r.getMessage().startswith(start))


def _install_if_cpu() -> None:
    if _cuda_absent():
        from megatron_zb.platform.cpu_shim import install_cpu_shim

        install_cpu_shim()


class _InstallAfterMegatronCore(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook: lets ``megatron.core`` load normally, then installs the CPU shim if CUDA is absent."""

    def __init__(self) -> None:
        self._loader: Any = None

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "megatron.core":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                self._loader, spec.loader = spec.loader, self
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if _cuda_absent():
            _drop_import_notices()
        self._loader.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _install_if_cpu()


def __getattr__(name: str) -> Any:
    """``CPU_SHIM_ACTIVE`` (True when CUDA is unavailable, so megatron-core runs through the CPU
    shim), ``install_cpu_shim`` and ``is_installed``: looked up on first use, so that importing this
    package -- which every ``import megatron_zb`` does -- needs no torch."""
    if name == "CPU_SHIM_ACTIVE":
        value: Any = _cuda_absent()
    elif name in ("install_cpu_shim", "is_installed"):
        from megatron_zb.platform import cpu_shim

        value = getattr(cpu_shim, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


if "megatron.core" in sys.modules:
    _install_if_cpu()
elif not any(isinstance(f, _InstallAfterMegatronCore) for f in sys.meta_path):
    sys.meta_path.insert(0, _InstallAfterMegatronCore())
