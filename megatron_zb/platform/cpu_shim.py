"""Run megatron-core (0.16.1, 0.19.x) on a CPU-only torch build.

megatron-core assumes a CUDA device in a handful of places. On a CPU build of torch these
raise ``Torch not compiled with CUDA enabled`` (or, for ``torch.cuda.manual_seed`` and
megatron's ``_set_cuda_rng_state``, silently do nothing). :func:`install_cpu_shim` redirects
each of them to the CPU; it does nothing at all when ``torch.cuda.is_available()`` is True.

The patches, narrowest first (``docs/cpu_support.md`` has the why and what is verified):

* megatron-core attributes:
  ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` use the CPU
  generator; ``WrappedTorchNorm`` accepts sequence parallelism (its parameters are marked
  ``sequence_parallel`` so ``finalize_model_grads`` all-reduces their grads over TP);
  ``ShardedTensor.init_data("cuda")`` allocates on CPU; the Transformer Engine names MoE's
  ``moe_utils`` references without defining them (``te_general_gemm``) are set to ``None``, as
  they would be without TE on a GPU machine (the router's GEMM then runs in torch).
* module-scoped ``torch``: inside the modules of ``megatron_compat.platform.CUDA_FACTORY_MODULES`` the name
  ``torch`` is a thin stand-in whose tensor factories (``torch.zeros(..., device="cuda")``
  and friends) allocate on CPU; every other attribute is the real ``torch``.
* module-scoped ``torch.cuda`` streams: inside the modules of ``megatron_compat.platform.CUDA_STREAM_MODULES``
  (MoE's alltoall token dispatcher; on megatron-core 0.19 also DDP's ``param_and_grad_buffer``) ``torch.cuda.Stream()`` and ``torch.cuda.current_stream()`` return one
  synchronous CPU stream whose ``wait_stream``, ``record_event`` and event ``synchronize`` do
  nothing, and ``torch.cuda.stream(s)`` is a no-op context (CPU work is synchronous); the same
  dispatcher's host copy of its split sizes returns NumPy arrays for CPU tensors too (as it does
  for CUDA tensors), which ``all_to_all_single`` needs.
* caller-scoped tensor methods: ``Tensor.cuda()`` called *from megatron-core code* returns
  the CPU tensor (a test harness may name more callers: :func:`allow_tensor_cuda_from`);
  ``Tensor.type()`` called from megatron-core's optimizer modules reports the ``torch.cuda.*``
  name those modules test for. Calls from anywhere else are untouched
  (``Tensor.cuda()`` still raises, as it does on any CPU build).
* ``torch.cuda`` functions that cannot work without CUDA: ``current_device`` returns
  ``torch.device("cpu")``; ``synchronize`` is a no-op (CPU work is synchronous);
  ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` act on the default CPU generator.
* megatron-core's point-to-point launchers (:data:`~megatron_zb.megatron_compat.platform.P2P_LAUNCHERS`) send
  a view of each tensor of their own (``tensor.detach()``: same storage, another tensor object), so
  ``deallocate_output_tensor``'s ``out.data = torch.empty(1)`` issued before the send completes (the
  interleaved schedule with ``overlap_p2p_comm``) no longer frees the memory gloo is still sending.
* a logging filter dropping megatron's "CPU RNG state changed within GPU RNG context" warning,
  which fires on every forked random op once the "CUDA" generator *is* the CPU generator.

Consequence of the RNG mapping: megatron's default "CUDA" RNG stream and torch's CPU stream
are the same generator, and ``CudaRNGStatesTracker.fork()`` swaps the CPU generator's state.
Runs stay deterministic for a given seed; they do not reproduce a GPU run's random numbers.

Every megatron-core module, class and private name patched here is named in
:mod:`megatron_zb.megatron_compat.platform`, the platform-shim part of :mod:`megatron_zb.megatron_compat`
(reviewed at each megatron-core upgrade).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import types
from typing import Any, Callable

import torch

from ..megatron_compat.platform import (MOE_HOST_COPY, MOE_TE_NAMES, P2P_LAUNCHERS, RNG_MODULE, RNG_STATE_HELPERS,
                               TENSOR_CUDA_CALLERS, TYPE_NAME_CALLERS, sharded_tensor_class, shim_modules,
                               torch_norm_class)

__all__ = ["allow_tensor_cuda_from", "cpu_torch_stand_in", "install_cpu_shim", "is_installed", "shim_modules",
           "tensor_cuda_callers"]

_TENSOR_FACTORIES: tuple[str, ...] = ("empty", "empty_like", "full", "ones", "tensor", "zeros", "zeros_like")
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"
_CPU = torch.device("cpu")

_installed = False
_tensor_cuda_callers: tuple[str, ...] = TENSOR_CUDA_CALLERS


def is_installed() -> bool:
    """True once :func:`install_cpu_shim` has patched this process."""
    return _installed


def install_cpu_shim() -> bool:
    """Patch megatron-core (and the CUDA-only parts of ``torch.cuda``) to run on CPU.

    Returns True when the shim is active in this process (installed now or by an earlier
    call), False when CUDA is available -- then nothing is changed. Idempotent; safe to call
    from every entry point. Importing :mod:`megatron_zb` calls it.
    """
    global _installed
    if _installed:
        return True
    if torch.cuda.is_available():
        return False
    _patch_torch_cuda()
    _patch_rng_helpers()
    _patch_factory_modules()
    _patch_tensor_methods()
    _patch_torch_norm()
    _patch_sharded_tensor_init()
    _patch_moe_te_names()
    _patch_stream_modules()
    _patch_p2p_sends()
    logging.getLogger(RNG_MODULE).addFilter(_drop_rng_fork_warning)
    _installed = True
    return True


# ---------------------------------------------------------------------- helpers
def _is_cuda(device: Any) -> bool:
    """True for ``"cuda"``, ``"cuda:N"`` and ``torch.device("cuda", ...)``."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":", 1)[0] == "cuda"


def _caller_module(depth: int) -> str:
    """``__name__`` of the module ``depth`` frames above the caller of this function."""
    return sys._getframe(depth + 1).f_globals.get("__name__", "")


def _drop_rng_fork_warning(record: logging.LogRecord) -> bool:
    return _RNG_WARNING not in record.getMessage()


# ---------------------------------------------------------------------- torch.cuda
def _cpu_current_device() -> torch.device:
    """``torch.cuda.current_device()`` on CPU: the device megatron should allocate on."""
    return _CPU


def _cpu_synchronize(device: Any = None) -> None:
    """``torch.cuda.synchronize()`` on CPU: nothing is asynchronous, nothing to wait for."""


def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """``torch.cuda.get_rng_state()`` on CPU: the default CPU generator's state (a copy)."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """``torch.cuda.set_rng_state()`` on CPU: set the default CPU generator's state."""
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    """``torch.cuda.manual_seed()`` on CPU: seed the default CPU generator."""
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _cpu_synchronize
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed


# ---------------------------------------------------------------------- megatron RNG helpers
def _patch_rng_helpers() -> None:
    import importlib

    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        """CPU replacement for megatron's ``_get_cuda_rng_state`` (no CUDA-graph-safe states)."""
        if graph_safe:
            raise RuntimeError("graph-safe (CUDA graph) RNG states need CUDA; disable cuda graphs on CPU")
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        """CPU replacement for megatron's ``_set_cuda_rng_state`` (which lazily no-ops on CPU)."""
        if graph_safe:
            raise RuntimeError("graph-safe (CUDA graph) RNG states need CUDA; disable cuda graphs on CPU")
        torch.set_rng_state(new_state)

    mrandom = importlib.import_module(RNG_MODULE)
    get_name, set_name = RNG_STATE_HELPERS
    setattr(mrandom, get_name, _get_cuda_rng_state)
    setattr(mrandom, set_name, _set_cuda_rng_state)


# ---------------------------------------------------------------------- device="cuda" factories
def _cpu_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)

    factory.__name__ = factory.__qualname__ = fn.__name__
    factory.__doc__ = f"``torch.{fn.__name__}`` with ``device='cuda'`` mapped to CPU (megatron_zb CPU shim)."
    return factory


class _CpuFactoryTorch(types.ModuleType):
    """Stand-in for ``torch`` inside one megatron-core module.

    Tensor factories map ``device="cuda"`` to CPU; every other attribute is looked up on the
    real ``torch`` module at access time, so the stand-in never goes stale.
    """

    def __init__(self) -> None:
        super().__init__("torch", "megatron_zb CPU shim stand-in for torch (device='cuda' -> CPU)")
        for name in _TENSOR_FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def __repr__(self) -> str:
        return "<torch stand-in of megatron_zb.platform.cpu_shim (device='cuda' factories -> CPU)>"


def _patch_factory_modules() -> None:
    import importlib

    stand_in = _CpuFactoryTorch()
    for name in shim_modules()[0]:
        module = importlib.import_module(name)
        if module.__dict__.get("torch") is not torch:
            raise RuntimeError(f"megatron_zb CPU shim: {name}.torch is not the torch module; megatron-core changed?")
        module.torch = stand_in


# ---------------------------------------------------------------------- tensor methods
def tensor_cuda_callers() -> tuple[str, ...]:
    """Module-name prefixes whose ``Tensor.cuda()`` calls return the CPU tensor (see :func:`allow_tensor_cuda_from`)."""
    return _tensor_cuda_callers


def allow_tensor_cuda_from(*prefixes: str) -> None:
    """Also answer ``Tensor.cuda()`` with the CPU tensor when it is called from a module whose
    ``__name__`` starts with one of ``prefixes`` (e.g. ``"megatron.training."`` for a harness running
    Megatron-LM's loop on CPU). The caller is judged inside the shim's own wrapper, so a harness adds
    prefixes here instead of wrapping ``Tensor.cuda`` again (which would hide the real caller).
    Idempotent; takes effect at once, whether or not the shim is installed yet.
    """
    global _tensor_cuda_callers
    for prefix in prefixes:
        if not prefix or not isinstance(prefix, str):
            raise ValueError(f"a caller prefix must be a non-empty module-name prefix, got {prefix!r}")
        if prefix not in _tensor_cuda_callers:
            _tensor_cuda_callers = (*_tensor_cuda_callers, prefix)


def _patch_tensor_methods() -> None:
    real_cuda = torch.Tensor.cuda
    real_type = torch.Tensor.type

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``Tensor.cuda()``; called from megatron-core (:func:`tensor_cuda_callers`) on a CPU-only build it
        returns the CPU tensor."""
        if _caller_module(1).startswith(_tensor_cuda_callers):
            return self if self.device.type == "cpu" else self.cpu()
        return real_cuda(self, *args, **kwargs)

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """``Tensor.type()``; megatron-core's optimizers see CPU tensors under their ``torch.cuda.*`` name."""
        name = real_type(self, *args, **kwargs)
        if (not args and not kwargs and self.device.type == "cpu" and name.startswith("torch.")
                and _caller_module(1).startswith(TYPE_NAME_CALLERS)):
            return "torch.cuda." + name[len("torch."):]
        return name

    cuda.__wrapped__ = real_cuda  # type: ignore[attr-defined]
    type_.__wrapped__ = real_type  # type: ignore[attr-defined]
    type_.__name__ = type_.__qualname__ = "type"
    torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    torch.Tensor.type = type_  # type: ignore[method-assign, assignment]


# ---------------------------------------------------------------------- WrappedTorchNorm
def _patch_torch_norm() -> None:
    WrappedTorchNorm = torch_norm_class()
    real_new = WrappedTorchNorm.__dict__["__new__"].__func__

    def __new__(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any,
                **kwargs: Any) -> torch.nn.Module:
        """Build the torch norm; with sequence parallelism mark its params ``sequence_parallel``.

        Under sequence parallelism each TP rank normalises its own sequence shard, so the norm's
        weight/bias grads are partial sums; ``finalize_model_grads`` all-reduces exactly the
        params carrying ``sequence_parallel=True`` over the TP group (as megatron's fused norms).
        """
        if not config.sequence_parallel:
            return real_new(cls, config, hidden_size, eps, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = real_new(cls, plain, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)


# ---------------------------------------------------------------------- dist-ckpt
def _patch_sharded_tensor_init() -> None:
    ShardedTensor = sharded_tensor_class()
    real_init_data = ShardedTensor.init_data

    def init_data(self: Any, device: Any, init_fn: Callable[..., torch.Tensor] = torch.empty) -> None:
        """``ShardedTensor.init_data``; a ``"cuda"`` device allocates on CPU (exchange buffers)."""
        return real_init_data(self, _CPU if _is_cuda(device) else device, init_fn)

    ShardedTensor.init_data = init_data


# ---------------------------------------------------------------------- MoE
def _patch_moe_te_names() -> None:
    import importlib

    module_name, names = MOE_TE_NAMES
    module = importlib.import_module(module_name)
    for name in names:
        if not hasattr(module, name):  # without Transformer Engine the import that defines it failed
            setattr(module, name, None)


class _CpuEvent:
    """A CUDA event on CPU: work is synchronous, so it is always complete."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


class _CpuStream:
    """The one CPU "stream": every ``torch.cuda.Stream()`` and ``current_stream()`` is this object."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for (CPU work is synchronous)."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


class _CpuStreamCuda(types.ModuleType):
    """Stand-in for ``torch.cuda`` inside one megatron-core module: streams are :data:`_CPU_STREAM`;
    every other attribute is the real ``torch.cuda``'s (looked up at access time)."""

    def __init__(self) -> None:
        super().__init__("torch.cuda", "megatron_zb CPU shim stand-in for torch.cuda (one synchronous stream)")

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:  # noqa: N802 (torch's name)
        """``torch.cuda.Stream()`` on CPU: the synchronous CPU stream."""
        return _CPU_STREAM

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        """``torch.cuda.current_stream()`` on CPU: the synchronous CPU stream."""
        return _CPU_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        """``torch.cuda.stream(s)`` on CPU: nothing to switch."""
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def cpu_torch_stand_in(**cuda_overrides: Any) -> types.ModuleType:
    """A ``torch`` stand-in for one module's globals: ``device="cuda"`` factories allocate on CPU and its
    ``torch.cuda`` has the synchronous CPU stream (``Stream``, ``current_stream``, ``stream``); every
    other attribute is the real ``torch`` / ``torch.cuda``. ``cuda_overrides`` set more ``torch.cuda``
    attributes of this stand-in only (a test harness answering e.g. ``device_count`` for one module).
    """
    stand_in = _CpuFactoryTorch()
    cuda = _CpuStreamCuda()
    for name, value in cuda_overrides.items():
        setattr(cuda, name, value)
    stand_in.cuda = cuda  # type: ignore[attr-defined]
    return stand_in


def _cpu_host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` on CPU: the tensor is on the host already; NumPy if asked."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _patch_stream_modules() -> None:
    import importlib

    module_name, name = MOE_HOST_COPY
    module = importlib.import_module(module_name)
    if not callable(getattr(module, name, None)):
        raise RuntimeError(f"megatron_zb CPU shim: {module_name}.{name} is missing; megatron-core changed?")
    setattr(module, name, _cpu_host_copy)

    stand_in = cpu_torch_stand_in()
    for name in shim_modules()[1]:
        module = importlib.import_module(name)
        if module.__dict__.get("torch") is not torch:
            raise RuntimeError(f"megatron_zb CPU shim: {name}.torch is not the torch module; megatron-core changed?")
        module.torch = stand_in


# ---------------------------------------------------------------------- p2p sends
def _own_view(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor object of its own over ``tensor``'s storage (None stays None)."""
    return None if tensor is None else tensor.detach()


def _sending_own_views(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``launch`` (a megatron-core p2p launcher) with each tensor to send replaced by its own view."""

    def launch_own_views(*, tensor_send_prev: torch.Tensor | None, tensor_send_next: torch.Tensor | None,
                         **kwargs: Any) -> Any:
        return launch(tensor_send_prev=_own_view(tensor_send_prev), tensor_send_next=_own_view(tensor_send_next),
                      **kwargs)

    launch_own_views.__wrapped__ = launch  # type: ignore[attr-defined]
    launch_own_views.__doc__ = launch.__doc__
    return launch_own_views


def _patch_p2p_sends() -> None:
    """megatron-core's interleaved schedule with ``overlap_p2p_comm`` (Megatron-LM's default with virtual
    stages) starts a stage output's ``isend`` and pseudo-frees the output (``deallocate_output_tensor``:
    ``out.data = torch.empty(1)``) before it waits on the send (schedules.py, e.g. the warm-up's
    ``send_forward_recv_forward(..., overlap_p2p_comm=True)`` then ``deallocate_output_tensor``).
    ``.data =`` swaps the storage of the very tensor object the gloo work holds, so the old storage is
    freed while gloo still reads it (the peer receives whatever reuses that memory: measured, every time).
    On CUDA the caching allocator keeps a block recorded on the NCCL stream until the communication
    passes (not tested here); on CPU nothing does. Each send gets a tensor object of its own over the same
    storage, which keeps the memory alive until the work is dropped -- as megatron-zb's runtime sends."""
    import importlib

    module_name, names = P2P_LAUNCHERS
    module = importlib.import_module(module_name)
    for name in names:
        launch = getattr(module, name, None)
        if not callable(launch):
            raise RuntimeError(f"megatron_zb CPU shim: {module_name}.{name} is missing; megatron-core changed?")
        setattr(module, name, _sending_own_views(launch))
