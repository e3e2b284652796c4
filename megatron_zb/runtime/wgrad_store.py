"""The weight-gradient store: B now, W later, for every Megatron linear layer.

During a ``B`` action the runtime opens :meth:`WeightGradStore.deferring` for the (chunk,
microbatch) being back-propagated. Inside it, megatron-core's
``LinearWithGradAccumulationAndAsyncCommunication`` (the autograd function behind
``ColumnParallelLinear`` and ``RowParallelLinear``, replaced by :class:`ZBLinearFunction` via
:func:`install`) computes the input gradient at once -- with its tensor-parallel all-reduce or,
under sequence parallelism, reduce-scatter -- and queues the weight-gradient GEMM. The matching
``W`` action calls :meth:`WeightGradStore.run` which executes the queue:

* with ``gradient_accumulation_fusion``: the fused ``wgrad_gemm_accum_fp32/fp16`` kernel
  accumulates into ``weight.main_grad`` (apex's ``fused_weight_gradient_mlp_cuda`` on GPU; on a
  CPU-only machine :mod:`megatron_zb.runtime.wgrad_kernels` provides a matmul fallback with the
  same signature, so the same code path runs and is tested here);
* otherwise a matmul, added into ``weight.main_grad`` (megatron-core DDP, exactly what DDP's
  grad-accumulation hook would add) or into ``weight.grad``.

Under sequence parallelism the ``W`` pass re-gathers the sequence-sharded input over the tensor
parallel group (every TP rank runs the same schedule, so the collectives line up), trading one
all-gather for not keeping the gathered input alive between B and W.

Outside a deferring window (``BW`` actions, forward-only, megatron-core's own schedules) the
layer behaves exactly as megatron-core's. Parameters outside linear layers (norms, linear biases,
embeddings, position embeddings) get their gradients during ``B``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


class WeightGradStoreError(RuntimeError):
    """Misuse of the store: W without its B, a W run twice, or W left pending at iteration end."""


class WeightGradStore:
    """Queues of deferred weight-gradient computations, one per (model chunk, microbatch)."""

    def __init__(self) -> None:
        self._queues: dict[tuple[int, int], list[Callable[[], None]]] = {}
        self._active: tuple[int, int] | None = None
        self.executed = 0  # weight-gradient computations run by W since creation (for tests, stats)

    @contextlib.contextmanager
    def deferring(self, chunk: int, microbatch: int) -> Iterator[None]:
        """Queue the weight-gradient work of linear layers run inside this block for ``(chunk, mb)``."""
        key = (chunk, microbatch)
        if self._active is not None:
            raise WeightGradStoreError(f"B of chunk {chunk} microbatch {microbatch} started while "
                                       f"B of chunk {self._active[0]} microbatch {self._active[1]} is open")
        if key in self._queues:
            raise WeightGradStoreError(f"B of chunk {chunk} microbatch {microbatch} ran twice before its W")
        self._queues[key] = []
        self._active = key
        try:
            yield
        finally:
            self._active = None

    @property
    def is_deferring(self) -> bool:
        return self._active is not None

    def put(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` for the W of the open (chunk, microbatch)."""
        if self._active is None:
            raise WeightGradStoreError("weight-gradient work queued outside a B pass")
        self._queues[self._active].append(fn)

    def run(self, chunk: int, microbatch: int) -> int:
        """Run (and drop) the queued weight-gradient work of ``(chunk, microbatch)``; return its size."""
        try:
            queue = self._queues.pop((chunk, microbatch))
        except KeyError:
            raise WeightGradStoreError(
                f"W of chunk {chunk} microbatch {microbatch} has nothing to run: its B has not run "
                f"(or this W already ran)") from None
        with torch.no_grad():  # as inside autograd's backward: no graph for gradient math
            for fn in queue:
                fn()
        self.executed += len(queue)
        return len(queue)

    def pending(self) -> list[tuple[int, int]]:
        """(chunk, microbatch) pairs whose W has not run yet."""
        return sorted(self._queues)

    def assert_empty(self) -> None:
        """Raise when an iteration ends with W still pending (a schedule that lost a W)."""
        if self._queues:
            pend = ", ".join(f"(chunk {c}, microbatch {m})" for c, m in self.pending())
            raise WeightGradStoreError(f"iteration ended with weight gradients still pending for {pend}")

    def clear(self) -> None:
        self._queues.clear()
        self._active = None


_STORE = WeightGradStore()


def get_weight_grad_store() -> WeightGradStore:
    """The process-wide store that :class:`ZBLinearFunction` feeds."""
    return _STORE


def _accumulate_wgrad(weight: torch.Tensor, main_grad: torch.Tensor | None, fusion: bool,
                      grad_output: torch.Tensor, total_input: torch.Tensor) -> None:
    """Add ``grad_output^T @ total_input`` to the weight's gradient, as megatron-core would."""
    from .wgrad_kernels import wgrad_gemm_accum

    if fusion:
        assert main_grad is not None, "gradient_accumulation_fusion needs weight.main_grad"
        wgrad_gemm_accum(total_input, grad_output, main_grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        return
    grad_weight = grad_output.t().matmul(total_input)
    if hasattr(weight, "main_grad") and weight.main_grad is not None:
        weight.main_grad.add_(grad_weight)  # what megatron-core DDP's grad hook adds
    elif weight.grad is None:
        weight.grad = grad_weight
    else:
        weight.grad += grad_weight


def _make_zb_function():
    from megatron.core.tensor_parallel import layers
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute
    get_global_memory_buffer = layers.get_global_memory_buffer

    base = layers.LinearWithGradAccumulationAndAsyncCommunication
    custom_bwd = layers.custom_bwd

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
            store = get_weight_grad_store()
            if not store.is_deferring or ctx.grad_output_buffer is not None:
                return base.backward(ctx, grad_output)
            input, weight = ctx.saved_tensors
            param = ctx.zb_weight
            tp_group = ctx.tp_group
            main_grad = ctx.main_grad
            fusion = ctx.gradient_accumulation_fusion
            if fusion:
                param.main_grad = main_grad
            # 1. the input gradient, now: it is on the critical path
            grad_input = grad_output.matmul(weight)
            handle = None
            if ctx.allreduce_dgrad:
                handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
            if ctx.sequence_parallel:
                assert not ctx.allreduce_dgrad
                sub_grad_input = torch.empty(list(input.size()), dtype=input.dtype, device=input.device)
                handle = torch.distributed.reduce_scatter_tensor(sub_grad_input, grad_input, group=tp_group,
                                                                 async_op=True)
            if ctx.use_bias:  # as megatron-core: sum over the flattened [s*b, h] gradient
                flat = grad_output.contiguous()
                flat = flat.view(-1, flat.shape[-1]) if flat.dim() == 3 else flat
                grad_bias = flat.sum(dim=0)
            else:
                grad_bias = None

            # 2. the weight gradient, later: queued for this (chunk, microbatch)'s W
            sequence_parallel = ctx.sequence_parallel

            def weight_grad() -> None:
                total_input = input
                if sequence_parallel:
                    size = list(input.size())
                    size[0] *= tp_group.size()
                    total_input = get_global_memory_buffer().get_tensor(size, input.dtype, "mpu")
                    torch.distributed.all_gather_into_tensor(total_input, input.contiguous(), group=tp_group)
                g, x = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
                _accumulate_wgrad(param, main_grad, fusion, g, x)

            store.put(weight_grad)
            if handle is not None:
                handle.wait()
            grad_input = sub_grad_input if ctx.sequence_parallel else grad_input
            return grad_input, None, grad_bias, None, None, None, None, None, None

    ZBLinearFunction.__name__ = "ZBLinearFunction"
    return base, ZBLinearFunction


_ORIGINAL: type | None = None


def install() -> None:
    """Route megatron-core's linear layers through :class:`ZBLinearFunction` (idempotent).

    Outside :meth:`WeightGradStore.deferring` the replacement behaves exactly like megatron-core's
    function, so installing it never changes a run that does not use a split-backward schedule.
    """
    global _ORIGINAL, ZBLinearFunction
    from megatron.core.tensor_parallel import layers

    if _ORIGINAL is not None:
        return
    base, fn = _make_zb_function()
    _ORIGINAL = base
    ZBLinearFunction = fn
    layers.LinearWithGradAccumulationAndAsyncCommunication = fn


def uninstall() -> None:
    """Restore megatron-core's own linear autograd function."""
    global _ORIGINAL
    from megatron.core.tensor_parallel import layers

    if _ORIGINAL is not None:
        layers.LinearWithGradAccumulationAndAsyncCommunication = _ORIGINAL
        _ORIGINAL = None


ZBLinearFunction: type | None = None
"""The installed replacement class (``None`` until :func:`install`)."""
