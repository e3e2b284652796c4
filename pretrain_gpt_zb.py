#!/usr/bin/env python
"""Pretrain a GPT model with megatron-core and a zero-bubble pipeline schedule.

Takes Megatron-LM's ``pretrain_gpt.py`` command line; add ``--enable-zero-bubble`` (greedy
zero-bubble schedule under 1F1B's activation memory), ``--zero-bubble-v-schedule`` (ZB-V
family) or ``--schedule NAME`` (any schedule of the library). Launch with torchrun, e.g.::

    torchrun --nproc_per_node 4 pretrain_gpt_zb.py --pipeline-model-parallel-size 4 \\
        --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 2 --global-batch-size 16 --train-iters 30 --lr 1e-3 \\
        --mock-data --enable-zero-bubble --log-interval 1

``python pretrain_gpt_zb.py --help`` lists every flag; ``docs/training.md`` describes the run.
A bad flag prints one line naming it and exits with status 2 before any process group starts.
A peer that died or froze in a collective of the zero-bubble path ends the rank with the named
``PipelineTimeoutError`` (``megatron_zb/runtime/peer_wait.py``), its traceback and one last line
``pretrain_gpt_zb.py: error: rank R waited for rank F (frozen or slow): ...`` (torchrun's "root cause"
names R, the rank that noticed) and exit status 1, without tearing the process
groups down: the late collective is still pending in the backend, and destroying its group would wait
for it (as NCCL's own watchdog, this exits without clean-up). Each rank started by torchrun also starts
a reaper (``megatron_zb/platform/reaper.py``): a killed rank or torchrun leaves no process behind.
"""

import os
import sys
import traceback
import warnings

# Known, harmless notices of megatron-core / torch on a CPU-only or apex-less install; each is
# printed once per process, i.e. a dozen times per rank, and would bury the training log.
_QUIET = (
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed"),
    (UserWarning, r"full scope is deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed"),
)


def _quiet() -> None:
    """Silence megatron-core's import-time notices (:data:`_QUIET`): before anything imports it."""
    for category, message in _QUIET:
        warnings.filterwarnings("ignore", message=message, category=category)


def main() -> int:
    _quiet()
    from megatron_zb.platform.reaper import install as install_reaper  # no torch import

    install_reaper()  # before any child process: a killed rank (or torchrun) leaves none behind
    if os.environ.get("RANK", "0") == "0" and not any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(f"{os.path.basename(__file__)}: loading torch and megatron-core ...", flush=True)
    from megatron_zb.training.pretrain import main as run  # imports torch, megatron-core, the CPU shim

    return run(sys.argv[1:])


if __name__ == "__main__":  # required: megatron-core's checkpoint writer starts processes
    _quiet()  # the runtime package imports torch and megatron-core
    from megatron_zb.runtime.peer_wait import PEER_TIMEOUT_EXIT_STATUS, PipelineTimeoutError

    try:
        sys.exit(main())
    except PipelineTimeoutError as e:  # module docstring: no process-group teardown
        traceback.print_exc()
        print(f"{os.path.basename(__file__)}: error: {e.blame or e}", file=sys.stderr)  # whom to look at
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PEER_TIMEOUT_EXIT_STATUS)
