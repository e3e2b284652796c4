"""What every flag group of the command line shares: the error type, flag names, logged adjustments.

:class:`ArgumentError` carries a list of :class:`Problem` s (the flag to change and one line saying
why and how): one for a single failed check (``str(e)`` is then ``"--flag: message"``, as before),
several when the parser or :func:`~.validation.validate_args_and_schedule` report everything wrong
with a command line at once (:meth:`ArgumentError.combine`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

__all__ = ["NOTICES", "ArgumentError", "Problem", "flag", "notice"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a command line: ``flag`` to change, ``text`` the whole line (it names the
    flag, the reason and the fix)."""

    flag: str
    text: str


class ArgumentError(ValueError):
    """Bad flags or flag combinations; ``problems`` lists each (flag, line), ``flag`` is the first's.

    ``ArgumentError(flag, message)`` is one problem whose line is ``"{flag}: {message}"``.
    """

    problems: tuple[Problem, ...]

    def __init__(self, flag: str, message: str) -> None:
        self._set((Problem(flag, f"{flag}: {message}"),))

    def _set(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        ValueError.__init__(self, self._text())

    @property
    def flag(self) -> str:
        """The flag of the first problem (the one to change first)."""
        return self.problems[0].flag

    def _text(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0].text
        lines = "\n".join(f"  {p.text}" for p in self.problems)
        return f"{len(self.problems)} problems with the command line (each names the flag and the fix):\n{lines}"

    def __str__(self) -> str:
        return self._text()

    @classmethod
    def combine(cls, errors: Sequence[ArgumentError]) -> ArgumentError:
        """One error holding every problem of ``errors`` in order (the error itself when there is one)."""
        if not errors:
            raise ValueError("combine() needs at least one ArgumentError")
        if len(errors) == 1:
            return errors[0]
        combined = cls.__new__(cls)
        combined._set([p for e in errors for p in e.problems])
        return combined


def flag(dest: str) -> str:
    """The command-line flag of an ``args`` attribute: ``"num_layers"`` -> ``"--num-layers"``."""
    return "--" + dest.replace("_", "-")


NOTICES = "validation_notices"
"""The ``args`` attribute holding the start-up log lines validation adds (reset by each validation)."""


def notice(args: argparse.Namespace, line: str) -> None:
    """Add a start-up log line (global rank 0 prints them before the run starts): a flag validation
    adjusted or accepted without effect (``"WARNING: ..."``, as Megatron-LM), or a resolved default."""
    lines = getattr(args, NOTICES, None)
    if lines is None:
        lines = []
        setattr(args, NOTICES, lines)
    lines.append(line)
