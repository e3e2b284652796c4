"""What the CPU shim replaces inside megatron-core when CUDA is absent, per release: a part of
:mod:`megatron_zb.megatron_compat`.

See ``megatron_zb/platform/cpu_shim.py`` and docs/cpu_support.md for why each is patched. The
installed release is asked of :func:`megatron_zb.megatron_compat.release` (the one place that asks
it); re-read these names at each megatron-core upgrade, with the table of that module.
"""

from __future__ import annotations

from . import release


_CUDA_FACTORY_MODULES_016: tuple[str, ...] = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = torch.zeros(..., device="cuda")
    "megatron.core.optimizer.optimizer",  # FP32Optimizer._scale, mixed-precision found_inf
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors (fp16 only)
    "megatron.core.optimizer.clip_grads",  # grad-norm and dummy-overflow buffers
    "megatron.core.dist_checkpointing.exchange_utils",  # exchange buffers for fully-parallel load
    "megatron.core.transformer.utils",  # get_default_causal_mask (attention_mask=None, causal)
    "megatron.core.utils",  # local_multi_tensor_l2_norm: grad-norm for clip_grads without apex/TE
    "megatron.core.rerun_state_machine",  # RerunStateMachine._reduce_any: torch.tensor(..., device="cuda"), every step
    "megatron.core.tensor_parallel.data",  # _build_key_size_numel_dictionaries: sizes_cuda (broadcast_data, TP > 1)
)
CUDA_FACTORY_MODULES: dict[str, tuple[str, ...]] = {
    # track_moe_metrics (moe_utils.py:998): a tracked aux loss no router recorded is zeros(device="cuda"),
    # e.g. Megatron-LM's "load_balancing_loss" beside --moe-router-load-balancing-type seq_aux_loss
    # ("aux_loss" in "seq_aux_loss"); megatron-core 0.19 allocates it on the current device.
    "0.16": (*_CUDA_FACTORY_MODULES_016, "megatron.core.transformer.moe.moe_utils"),
    "0.19": _CUDA_FACTORY_MODULES_016,
}
"""Per release: megatron-core modules whose module-global ``torch`` the CPU shim replaces (they
create tensors with ``device="cuda"``). :func:`shim_modules` gives the installed release's."""

TENSOR_CUDA_CALLERS: tuple[str, ...] = ("megatron.core.",)
"""Module prefixes whose ``Tensor.cuda()`` calls the CPU shim answers with the CPU tensor (more can be
added at run time with ``cpu_shim.allow_tensor_cuda_from``, e.g. by a harness running Megatron-LM)."""

TYPE_NAME_CALLERS: tuple[str, ...] = ("megatron.core.optimizer.",)
"""Module prefixes whose code classifies parameters by ``Tensor.type()`` names (``torch.cuda.*``)."""

RNG_MODULE: str = "megatron.core.tensor_parallel.random"
"""The module of megatron's RNG tracker; also the name of the logger whose fork warning the shim drops."""

RNG_STATE_HELPERS: tuple[str, str] = ("_get_cuda_rng_state", "_set_cuda_rng_state")
"""Private (get, set) CUDA RNG state helpers of :data:`RNG_MODULE` the shim replaces."""


IMPORT_NOTICES: tuple[tuple[str, str], ...] = (
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
)
"""(logger, message start) of what importing megatron-core makes torch log on a machine without a
GPU, which the CPU shim drops (installed by ``megatron_zb.platform``'s import hook *before*
``megatron.core`` loads). megatron-core 0.19's ``tensor_parallel/random.py`` imports
``torch.utils.cpp_extension`` (``load_inline``) at module level, whose import logs
"No CUDA runtime is found, using CUDA_HOME=..." when ``nvcc`` or ``CUDA_HOME`` is found but no GPU
(0.16.1 does not import it; the filter is harmless there)."""


MOE_TE_NAMES: tuple[str, tuple[str, ...]] = ("megatron.core.transformer.moe.moe_utils", ("te_general_gemm",))
"""(module, names): Transformer Engine functions ``moe_utils`` tests with ``is not None`` but only
defines when TE imports (the router's ``RouterGatingLinearFunction``); the shim sets them to ``None``."""

_MOE_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"  # alltoall: torch.cuda.Stream() at construction
CUDA_STREAM_MODULES: dict[str, tuple[str, ...]] = {
    "0.16": (_MOE_DISPATCHER,),
    # 0.19's DDP bucket groups call torch.cuda.current_stream() in every start_grad_sync (to wait
    # for CUDA-graph weight-gradient events)
    "0.19": (_MOE_DISPATCHER, "megatron.core.distributed.param_and_grad_buffer"),
}
"""Per release: megatron-core modules whose module-global ``torch`` the CPU shim replaces by a
stand-in whose ``torch.cuda`` has CPU streams (``Stream``, ``current_stream``, ``stream``: one
synchronous stream). :func:`shim_modules` gives the installed release's."""


def shim_modules() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(:data:`CUDA_FACTORY_MODULES`, :data:`CUDA_STREAM_MODULES`) of the installed release."""
    return CUDA_FACTORY_MODULES[release()], CUDA_STREAM_MODULES[release()]


MOE_HOST_COPY: tuple[str, str] = ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu")
"""(module, name) of the alltoall dispatcher's device-to-host copy of its split sizes. It converts
to NumPy only tensors that are on CUDA, so on CPU the split sizes stay tensors, which
``all_to_all_single`` rejects; the shim's version converts CPU tensors too when asked for NumPy."""


P2P_LAUNCHERS: tuple[str, tuple[str, ...]] = (
    "megatron.core.pipeline_parallel.p2p_communication", ("_p2p_ops", "_batched_p2p_ops"))
"""(module, names) of megatron-core's point-to-point launchers: keyword-only ``tensor_send_prev`` /
``tensor_send_next`` (and the receive buffers, group, ranks); ``P2PCommunicator._communicate`` looks
them up in the module at every call. The CPU shim wraps them so each send holds its own view of the
data (``deallocate_output_tensor`` may run before the send completes; docs/cpu_support.md)."""


def torch_norm_class() -> type:
    """``WrappedTorchNorm`` (the local spec's norm without apex); the shim wraps its ``__new__``."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def sharded_tensor_class() -> type:
    """``dist_checkpointing``'s ``ShardedTensor``; the shim wraps its ``init_data``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor
