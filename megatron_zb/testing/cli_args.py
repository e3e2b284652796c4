"""Small command-line helpers shared by the GPU self-test's modules (``python -m megatron_zb.testing.*``)."""

from __future__ import annotations

import os
import sys
from typing import Sequence


def split_passthrough(argv: Sequence[str], *, prog: str, what: str) -> tuple[list[str], list[str]] | None:
    """``(own flags, flags after '--')``; ``None`` (after one line on stderr) when there is no ``--``.

    ``prog`` names the tool in that line, ``what`` the flags expected after ``--``.
    """
    argv = list(argv)
    if "--" not in argv:
        print(f"{prog}: give {what} after '--'", file=sys.stderr)
        return None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def pipeline_ranks_from_gpus(pp: int | None) -> int:
    """``pp`` when given, else the visible GPUs with ``MEGATRON_ZB_TEST_DEVICE=cuda`` (0 on CPU)."""
    import torch

    from .distributed import DEVICE_ENV

    if pp is not None:
        return pp
    return torch.cuda.device_count() if os.environ.get(DEVICE_ENV, "cpu") == "cuda" else 0
