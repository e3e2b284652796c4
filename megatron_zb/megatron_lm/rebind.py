"""The one rule for replacing a name in modules megatron-zb does not own, and undoing it.

Megatron-LM's scripts import functions by name (``from megatron.training import get_args``,
``from megatron.core.pipeline_parallel import get_forward_backward_func``) before megatron-zb runs, so
replacing a function in its defining module is not enough: every module that holds the original under
that name gets the replacement (:meth:`Rebinds.everywhere`). Every replacement is recorded, and
:meth:`Rebinds.restore` puts the originals back, last first.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Rebinds"]


class Rebinds:
    """The replacements one install made, in order (module docstring)."""

    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any]] = []

    def __bool__(self) -> bool:
        """Whether any replacement is in place."""
        return bool(self._done)

    def set(self, holder: Any, name: str, value: Any) -> None:
        """Replace ``holder.name`` with ``value`` (a module, a class or an object), recording the original."""
        self._done.append((holder, name, getattr(holder, name)))
        setattr(holder, name, value)

    def everywhere(self, original: Any, replacement: Any, name: str | None = None) -> int:
        """Replace ``original`` with ``replacement`` in every loaded module that holds it under ``name``
        (default: ``original.__name__``); returns how many modules did."""
        name = name or original.__name__
        holders = [m for m in list(sys.modules.values()) if m is not None and getattr(m, name, None) is original]
        for module in holders:
            self.set(module, name, replacement)
        return len(holders)

    def restore(self) -> None:
        """Put every original back, the last replacement first."""
        while self._done:
            holder, name, original = self._done.pop()
            setattr(holder, name, original)
