"""What users and the GPU self-test run: the local multi-process harness (:mod:`megatron_zb.testing.distributed`),
the tiny GPT, the self-test (``scripts/gpu_selftest.sh``) and its probes, the compatibility matrix
(``scripts/compat_matrix.py``), the Transformer Engine source check (``scripts/check_te_source.py``), the
PyTorch-pipelining model of the benchmarks and the GPU benchmark. Installed with the package, so nothing here imports
pytest or ``tests/`` (``tests/test_package_layout.py``); the harnesses only tests use live in
``tests/harness/`` (docs/architecture.md).
"""

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
