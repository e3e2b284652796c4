"""The ``megatron-zb`` command line, one module per job.

* :mod:`.main` -- the parser, the ``schedule`` / ``simulate`` / ``list`` verbs and :func:`main`;
* :mod:`.ops` -- what those verbs compute, callable from Python (:class:`Costs`,
  :func:`build_and_simulate`, :func:`schedule_table`, :class:`CLIError`);
* :mod:`.plan` -- the ``plan`` verb (the planner of :mod:`megatron_zb.planning`).
"""

from .main import build_parser, main
from .ops import CLIError, Costs, build_and_simulate, schedule_table

__all__ = ["CLIError", "Costs", "build_and_simulate", "build_parser", "main", "schedule_table"]
