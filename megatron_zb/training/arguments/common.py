"""What every flag group of the command line shares: the error type and flag names."""

from __future__ import annotations

__all__ = ["ArgumentError", "flag"]


class ArgumentError(ValueError):
    """A bad flag or flag combination; ``flag`` is the flag to change, the message says how."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        super().__init__(f"{flag}: {message}")


def flag(dest: str) -> str:
    """The command-line flag of an ``args`` attribute: ``"num_layers"`` -> ``"--num-layers"``."""
    return "--" + dest.replace("_", "-")
