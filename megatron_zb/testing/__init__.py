"""Test support: the local multi-process harness (:mod:`megatron_zb.testing.distributed`)."""

from megatron_zb.testing.distributed import (
    DistributedError,
    DistributedTimeout,
    RemoteTraceback,
    init_parallel_state,
    run_distributed,
)

__all__ = ["DistributedError", "DistributedTimeout", "RemoteTraceback", "init_parallel_state", "run_distributed"]
