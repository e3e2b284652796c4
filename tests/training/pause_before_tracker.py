"""``pretrain_gpt_zb.py`` with a pause in its checkpoint save: the fault injection of
``tests/training/test_checkpoint_failures.py`` (a job killed while a checkpoint is being written).

``torchrun ... tests/training/pause_before_tracker.py ITERATION:SECONDS [pretrain_gpt_zb.py's arguments]``
installs, through :func:`megatron_zb.training.checkpointing.set_before_tracker_hook`, a hook that makes
the save of ``ITERATION`` print a line on rank 0 and sleep ``SECONDS`` on every rank between its files
and the tracker, then runs the repository's ``pretrain_gpt_zb.py`` unchanged as ``__main__`` (``runpy``,
the project root first on ``sys.path``, as running the script by its path puts it).
"""

from __future__ import annotations

import runpy
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "pretrain_gpt_zb.py"


def pause_before_tracker(at: int, seconds: float) -> Callable[[int], None]:
    """The hook: in the save of iteration ``at``, say so on rank 0, then sleep ``seconds`` on every rank."""

    def pause(iteration: int) -> None:
        if iteration != at:
            return
        import torch.distributed as dist

        if dist.get_rank() == 0:
            print(f"TEST HOOK pause_before_tracker: iteration {iteration}'s files are written; pausing {seconds:g} s "
                  f"before the tracker", file=sys.stderr, flush=True)
        time.sleep(seconds)

    return pause


def main() -> None:
    at, seconds = sys.argv[1].split(":")
    sys.argv = [str(SCRIPT), *sys.argv[2:]]
    sys.path.insert(0, str(ROOT))
    with warnings.catch_warnings():  # megatron-core's import-time notices, which the script itself silences
        warnings.simplefilter("ignore")
        from megatron_zb.training.checkpointing import set_before_tracker_hook

    set_before_tracker_hook(pause_before_tracker(int(at), float(seconds)))
    runpy.run_path(str(SCRIPT), run_name="__main__")


if __name__ == "__main__":
    main()
