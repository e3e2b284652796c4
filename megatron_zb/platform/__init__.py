"""Platform adaptation. Importing this package installs the CPU shim when CUDA is absent.

See :mod:`megatron_zb.platform.cpu_shim` and ``docs/cpu_support.md``.
"""

from megatron_zb.platform.cpu_shim import install_cpu_shim, is_installed

CPU_SHIM_ACTIVE: bool = install_cpu_shim()
"""True when this process runs megatron-core through the CPU shim (CUDA unavailable)."""

__all__ = ["CPU_SHIM_ACTIVE", "install_cpu_shim", "is_installed"]
