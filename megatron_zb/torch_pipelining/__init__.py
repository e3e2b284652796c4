"""megatron-zb schedules in PyTorch's own pipeline runtime (``torch.distributed.pipelining``).

:mod:`.export` turns any megatron-zb :class:`~megatron_zb.schedules.ir.Schedule` into PyTorch's
compute-only actions and the compute-only CSV that ``_PipelineScheduleRuntime._load_csv`` reads (and torchtitan, not tested;
docs/torch_pipelining.md). Importing this package imports nothing; importing
:mod:`.export` imports torch. The reverse direction (PyTorch's schedules into our IR) is
:mod:`megatron_zb.schedules.torch_import`.
"""

from pathlib import Path


def write_csv(schedule: object, path: "str | Path") -> str:
    """What ``--torch-csv FILE`` does (``megatron-zb schedule`` and ``plan``): write ``schedule``'s
    compute-only CSV with :func:`.export.write_torch_csv`; return its placement line for the report.

    Raises:
        ValueError: one line -- PyTorch is missing, or the export refuses (the reason and the fix).
    """
    try:
        from .export import write_torch_csv
    except ImportError as e:
        raise ValueError(f"needs PyTorch with torch.distributed.pipelining (pip install 'torch==2.13.*'): {e}") \
            from None
    return write_torch_csv(schedule, path).describe()  # type: ignore[arg-type]
