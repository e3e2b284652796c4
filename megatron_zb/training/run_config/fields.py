"""What every section of the run configuration shares: the ``TransformerConfig`` marker and the
rule that reads a section's fields from validated ``args`` by name."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

__all__ = ["TC", "read_section"]

TC = {"transformer_config": True}
"""Field metadata: the field is passed to ``TransformerConfig`` under its own name."""

T = TypeVar("T")


def read_section(cls: type[T], args: Any, **given: Any) -> T:
    """``cls`` with every field not in ``given`` read from ``args`` by name (Megatron-LM's ``dest``)."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in given}  # type: ignore[arg-type]
    return cls(**values, **given)
