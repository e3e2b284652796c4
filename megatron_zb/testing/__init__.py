"""Test support: the local multi-process harness (:mod:`megatron_zb.testing.distributed`)."""

from megatron_zb.testing.distributed import (
    DistributedError,
    DistributedTimeout,
    NotEnoughDevices,
    RemoteTraceback,
    backend_from_env,
    device_from_env,
    init_parallel_state,
    run_distributed,
)

__all__ = ["DistributedError", "DistributedTimeout", "NotEnoughDevices", "RemoteTraceback", "backend_from_env",
           "device_from_env", "init_parallel_state", "run_distributed"]
