"""Platform adaptation. Importing this package makes megatron-core usable on a CPU-only torch.

When CUDA is absent the CPU shim (:mod:`megatron_zb.platform.cpu_shim`) is installed: at once if
megatron-core is already imported, otherwise the moment ``megatron.core`` is first imported (an
import hook), so tools that never touch megatron-core -- the schedule CLI, the simulator -- do
not pay for importing it. When CUDA is available nothing is patched and nothing is imported.
See ``docs/cpu_support.md``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Sequence

import torch

from megatron_zb.platform.cpu_shim import install_cpu_shim, is_installed

CPU_SHIM_ACTIVE: bool = not torch.cuda.is_available()
"""True when this process runs megatron-core through the CPU shim (CUDA unavailable)."""


class _InstallAfterMegatronCore(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook: lets ``megatron.core`` load normally, then installs the CPU shim."""

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
        self._loader.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        install_cpu_shim()


if CPU_SHIM_ACTIVE:
    if "megatron.core" in sys.modules:
        install_cpu_shim()
    elif not any(isinstance(f, _InstallAfterMegatronCore) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterMegatronCore())

__all__ = ["CPU_SHIM_ACTIVE", "install_cpu_shim", "is_installed"]
