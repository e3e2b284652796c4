"""The linear route: megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` into the store.

:func:`build_zb_linear_function` subclasses megatron-core's linear autograd function
(``LinearWithGradAccumulationAndAsyncCommunication``, located through
:data:`megatron_zb.megatron_compat.LINEAR_AUTOGRAD_FUNCTION`); the ``"linear"`` row of
:mod:`megatron_zb.runtime.routes` installs the subclass in its place. Inside a B window
(:func:`~megatron_zb.runtime.wgrad_store.current_store` is set) its backward computes the input
gradient at once -- with its tensor-parallel all-reduce or, under sequence parallelism,
reduce-scatter -- and the bias gradient, and queues the weight-gradient GEMM with
``store.put(fn, params=(weight,))``:

* with ``gradient_accumulation_fusion``: the fused ``wgrad_gemm_accum_fp32/fp16`` kernel
  accumulates into ``weight.main_grad`` (apex's ``fused_weight_gradient_mlp_cuda`` on GPU; on a
  CPU-only machine :mod:`megatron_zb.runtime.wgrad_kernels` provides a matmul fallback with the
  same signature, so the same code path runs and is tested here);
* otherwise a matmul, added into ``weight.main_grad`` (megatron-core DDP, exactly what DDP's
  grad-accumulation hook would add) or into ``weight.grad``.

Communication overlap, as megatron-core's backward arranges it (it relies on
``CUDA_DEVICE_MAX_CONNECTIONS=1`` so that a collective launched before a GEMM is scheduled before
it; :func:`check_device_max_connections`):

* B launches the input gradient's all-reduce / reduce-scatter asynchronously right after the
  input-gradient GEMM -- where megatron-core launches it -- computes the bias gradient and queues
  the W entry while it runs, and waits last. The weight-gradient GEMM megatron-core hides it
  behind is W's now, so in B only the bias reduction runs under it.
* Under sequence parallelism W re-gathers the sequence-sharded input over the tensor-parallel
  group (every TP rank runs the same schedule, so the collectives line up), trading one
  all-gather for not keeping the gathered input alive between B and W. The gather is the
  entry's ``prefetch()``: the store launches it before the *previous* entry's weight-gradient
  GEMM and the entry waits for it just before its own GEMM -- the gather hides behind a GEMM, as
  megatron-core's hides behind the input-gradient GEMM. The first entry of a W has no GEMM before
  it. Two gather buffers alternate (megatron-core's ``"mpu"`` buffer and one more of the same
  kind, :data:`GATHER_BUFFERS`).

Outside a B window, and for megatron-core's own deferral (``grad_output_buffer``, the embedding
wgrad deferral), the backward is megatron-core's (its overlap unchanged); so it is for a weight marked
:data:`~megatron_zb.param_marks.WGRAD_IN_B`. A weight used twice in one B (the output layer, once per multi-token prediction
depth) gets one W entry summing its gradients in arrival order before the one addition, as autograd
sums them before DDP's hook adds them (:meth:`_WeightGradEntry.fold`): bitwise megatron-core's.
"""

from __future__ import annotations

import itertools
import os
import warnings
from typing import Any

import torch

from ..param_marks import WGRAD_IN_B
from .wgrad_store import current_store

GATHER_BUFFERS: tuple[str, str] = ("mpu", "zb-wgrad-prefetch")
"""Names, in megatron-core's global memory buffer, of the two buffers W's sequence-parallel
all-gathers alternate between (the one in flight and the one its GEMM reads)."""

_gather_slots = itertools.cycle(GATHER_BUFFERS)
_warned_max_connections = False


def check_device_max_connections(device: torch.device) -> bool:
    """Warn once per process, as megatron-core's linear layer does, when a tensor-parallel
    collective of the route runs on CUDA without ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (then the GPU
    may schedule the GEMM before the collective launched ahead of it, and they do not overlap).

    Checked on CUDA only: on CPU, gloo's collectives run on its own threads and the variable has
    no meaning. Returns whether it warned now.
    """
    global _warned_max_connections
    if device.type != "cuda" or _warned_max_connections or os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return False
    _warned_max_connections = True
    warnings.warn("megatron-zb linear route: tensor-parallel communication overlaps the GEMMs only with the "
                  "environment variable CUDA_DEVICE_MAX_CONNECTIONS=1 (as megatron-core's linear layers); "
                  "set it to 1 for maximum speedup")
    return True


def mark_tied_mtp_weights(chunks: list[torch.nn.Module]) -> int:
    """Mark the shared word embedding of every megatron-core GPT chunk in ``chunks`` (any wrapper
    around it) that holds multi-token prediction layers with tied embeddings :data:`WGRAD_IN_B`: its
    output-layer weight gradient is then computed in B, where autograd sums it with the MTP layers'
    lookup gradient before DDP's hook adds it once, as megatron-core does (the rule of
    :func:`megatron_zb.model.mtp.tie_mtp_stage`, for chunks megatron-zb did not build: Megatron-LM's
    loop, ``patch_megatron``). Idempotent; returns how many weights are marked."""
    marked = 0
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "mtp_process", False) and getattr(module, "share_embeddings_and_output_weights", False):
                setattr(module.shared_embedding_or_output_weight(), WGRAD_IN_B, True)
                marked += 1
    return marked


def _accumulate_wgrad(weight: torch.Tensor, main_grad: torch.Tensor | None, fusion: bool,
                      grad_output: torch.Tensor, total_input: torch.Tensor) -> None:
    """Add ``grad_output^T @ total_input`` to the weight's gradient, as megatron-core would."""
    from ..model.grad_accumulation import add_weight_grad
    from .wgrad_kernels import wgrad_gemm_accum

    if fusion:
        assert main_grad is not None, "gradient_accumulation_fusion needs weight.main_grad"
        wgrad_gemm_accum(total_input, grad_output, main_grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        return
    add_weight_grad(weight, grad_output.t().matmul(total_input))


class _DummyWgrads:
    """The dummy weight gradients B returns, one per (shape, dtype, device) -- a zero-filled one
    apart -- allocated once, as megatron-core does through Transformer Engine's
    ``get_dummy_wgrad``.

    Each is returned as ``detach()``: autograd's ``AccumulateGrad`` may then take that alias as
    ``param.grad`` without a copy (megatron-core DDP's hook sets ``param.grad = None`` right after),
    and autograd never sums into it in place (its storage has a second owner, this cache). The
    version counter, which every alias shares, is checked at each use: an in-place write through
    any alias raises instead of handing a garbage (or no longer zero) dummy to the next B.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[torch.Tensor, int]] = {}

    def get(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, *, zero: bool) -> torch.Tensor:
        """The cached dummy for this key (a new alias of it)."""
        key = (tuple(shape), dtype, device, zero)
        entry = self._buffers.get(key)
        if entry is None:
            if zero:
                buf = torch.zeros(shape, dtype=dtype, device=device, requires_grad=False)
            else:
                buf = torch.empty(shape, dtype=dtype, device=device, requires_grad=False)
            entry = self._buffers[key] = (buf, buf._version)
        buf, version = entry
        if buf._version != version:
            raise RuntimeError(f"linear route: the cached dummy weight gradient {tuple(shape)} {dtype} was written "
                               f"to in place (version {version} -> {buf._version}); something kept it as a "
                               f"parameter's .grad (megatron-core DDP's gradient hook clears it)")
        return buf.detach()

    def buffers(self, *, zero: bool) -> list[torch.Tensor]:
        """The cached dummies of one kind (zero-filled or not), in allocation order (for tests)."""
        return [buf for key, (buf, _) in self._buffers.items() if key[3] == zero]

    def clear(self) -> None:
        """Drop every cached dummy."""
        self._buffers.clear()


DUMMY_WGRADS = _DummyWgrads()
"""The process's cache of dummy weight gradients (:func:`dummy_wgrad`)."""


def dummy_wgrad(weight: torch.Tensor) -> torch.Tensor | None:
    """What B returns as the weight gradient of a megatron-core DDP parameter: a dummy, with
    ``grad_added_to_main_grad`` set, exactly as megatron-core's fused-accumulation backward does
    (zero-filled when the parameter has ``zero_out_wgrad``, which DDP's hook then adds).

    DDP's gradient-accumulator hook then adds nothing (W adds the real gradient later) and, with
    ``overlap_grad_reduce``, finds the ``param.grad`` it asserts on. Parameters outside DDP get
    ``None`` (their ``.grad`` is written by W). The dummy is cached (:data:`DUMMY_WGRADS`).
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    zero = bool(getattr(weight, "zero_out_wgrad", False))
    return DUMMY_WGRADS.get(weight.shape, weight.dtype, weight.device, zero=zero)


class _WeightGradEntry:
    """One queued W entry: (sequence parallel: all-gather the input) then the weight-gradient GEMM.

    :meth:`prefetch` launches the all-gather asynchronously (the store calls it before the
    previous entry's GEMM); calling the entry waits for it -- launching it first if nobody did --
    and accumulates the gradient.
    """

    def __init__(self, *, param: torch.Tensor, main_grad: torch.Tensor | None, fusion: bool,
                 grad_output: torch.Tensor, input: torch.Tensor, tp_group: Any, sequence_parallel: bool,
                 prepare: Any) -> None:
        self._param, self._main_grad, self._fusion = param, main_grad, fusion
        self._grad_output, self._input, self._tp_group = grad_output, input, tp_group
        self._prepare = prepare
        self._total_input: torch.Tensor | None = None if sequence_parallel else input
        self._handle: Any = None
        self._folded: list[_WeightGradEntry] = []

    def prefetch(self) -> None:
        """Sequence parallelism: launch the input's all-gather over the TP group (async); else nothing."""
        if self._total_input is not None:
            return
        from megatron.core.parallel_state import get_global_memory_buffer

        size = list(self._input.size())
        size[0] *= self._tp_group.size()
        check_device_max_connections(self._input.device)
        self._total_input = get_global_memory_buffer().get_tensor(size, self._input.dtype, next(_gather_slots))
        self._handle = torch.distributed.all_gather_into_tensor(self._total_input, self._input.contiguous(),
                                                                group=self._tp_group, async_op=True)

    def folds(self, param: torch.Tensor, fusion: bool) -> bool:
        """Whether a later use of ``param`` in the same B is summed into this entry (:meth:`fold`):
        without fused accumulation, where megatron-core's autograd sums a weight's gradients of one
        backward before DDP's hook adds them to ``main_grad`` once."""
        return self._param is param and not fusion and not self._fusion

    def fold(self, later: "_WeightGradEntry") -> None:
        """Sum ``later``'s gradient (the same weight, a later use in the same B) into this entry's,
        in arrival order, as autograd's input buffer does: one addition into the weight's gradient."""
        self._folded.append(later)

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prepared ``(grad_output, total_input)`` of the GEMM (waits for the input's gather)."""
        self.prefetch()
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        g, x = self._prepare(self._grad_output, self._total_input)
        self._grad_output = self._input = self._total_input = None  # run once; free what it held
        return g, x

    def __call__(self) -> None:
        g, x = self._inputs()
        if not self._folded:  # main_grad as it is now (sharded gradients bind it to a work buffer for W)
            main_grad = getattr(self._param, "main_grad", None)
            _accumulate_wgrad(self._param, self._main_grad if main_grad is None else main_grad, self._fusion, g, x)
            return
        from ..model.grad_accumulation import add_weight_grad

        total = g.t().matmul(x)
        for later in self._folded:
            g, x = later._inputs()
            total = total + g.t().matmul(x)
        self._folded = []
        add_weight_grad(self._param, total)


def build_zb_linear_function(base: Any) -> Any:
    """A subclass of megatron-core's linear autograd function ``base`` whose weight gradient is
    deferred to W inside a B window (see the module docstring). Reads the ``ctx`` fields listed
    in :data:`megatron_zb.megatron_compat.LINEAR_CTX_FIELDS`."""
    from ..megatron_compat import check_linear_ctx, linear_backward_grads, linear_custom_bwd, prepare_wgrad_inputs

    custom_bwd = linear_custom_bwd()
    prepare_input_tensors_for_wgrad_compute = prepare_wgrad_inputs()

    class ZBLinearFunction(base):  # type: ignore[misc, valid-type]
        """megatron-core's linear autograd function with the weight gradient deferrable to W."""

        @staticmethod
        def forward(ctx, input, weight, *args):  # noqa: D401 - autograd signature
            # Keep the Parameter object itself: what ctx.saved_tensors returns may be an alias
            # (e.g. under saved-tensor hooks), and gradients must land on the real parameter.
            ctx.zb_weight = weight
            return base.forward(ctx, input, weight, *args)

        @staticmethod
        @custom_bwd
        def backward(ctx, grad_output):  # noqa: D401 - autograd signature
            store = current_store()
            if store is None or ctx.grad_output_buffer is not None or getattr(ctx.zb_weight, WGRAD_IN_B, False):
                if not ctx.gradient_accumulation_fusion and hasattr(ctx.zb_weight, "grad_added_to_main_grad"):
                    ctx.zb_weight.grad_added_to_main_grad = False  # a B of this iteration may have set it
                return base.backward(ctx, grad_output)
            check_linear_ctx(ctx)
            input, weight = ctx.saved_tensors
            param = ctx.zb_weight
            tp_group = ctx.tp_group
            main_grad = ctx.main_grad
            fusion = ctx.gradient_accumulation_fusion
            if fusion:
                param.main_grad = main_grad
            # 1. the input gradient, now: it is on the critical path. Its collective is launched
            #    right after the GEMM, where megatron-core launches it (see the module docstring).
            grad_input = grad_output.matmul(weight)
            handle = None
            if ctx.allreduce_dgrad:
                check_device_max_connections(grad_input.device)
                handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
            if ctx.sequence_parallel:
                assert not ctx.allreduce_dgrad
                check_device_max_connections(grad_input.device)
                sub_grad_input = torch.empty(list(input.size()), dtype=input.dtype, device=input.device)
                handle = torch.distributed.reduce_scatter_tensor(sub_grad_input, grad_input, group=tp_group,
                                                                 async_op=True)
            if ctx.use_bias:  # as megatron-core: sum over the flattened [s*b, h] gradient
                flat = grad_output.contiguous()
                flat = flat.view(-1, flat.shape[-1]) if flat.dim() == 3 else flat
                grad_bias = flat.sum(dim=0)
            else:
                grad_bias = None

            # 2. the weight gradient, later: queued for this (chunk, microbatch)'s W -- summed into
            #    the entry of an earlier use of the same weight in this B, as autograd would sum them
            entry = _WeightGradEntry(param=param, main_grad=main_grad, fusion=fusion, grad_output=grad_output,
                                     input=input, tp_group=tp_group, sequence_parallel=ctx.sequence_parallel,
                                     prepare=prepare_input_tensors_for_wgrad_compute)
            earlier = store.find_open(lambda fn: isinstance(fn, _WeightGradEntry) and fn.folds(param, fusion))
            if earlier is not None:
                earlier.fold(entry)
            else:
                store.put(entry, params=(param,))
            if handle is not None:
                handle.wait()
            grad_input = sub_grad_input if ctx.sequence_parallel else grad_input
            return linear_backward_grads(grad_input, dummy_wgrad(param), grad_bias)

    ZBLinearFunction.__qualname__ = "ZBLinearFunction"
    return ZBLinearFunction
