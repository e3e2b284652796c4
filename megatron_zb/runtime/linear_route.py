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

Under sequence parallelism the ``W`` pass re-gathers the sequence-sharded input over the tensor
parallel group (every TP rank runs the same schedule, so the collectives line up), trading one
all-gather for not keeping the gathered input alive between B and W.

Outside a B window, and for megatron-core's own deferral (``grad_output_buffer``, the embedding
wgrad deferral), the backward is megatron-core's.
"""

from __future__ import annotations

from typing import Any

import torch

from .wgrad_store import current_store


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


def _dummy_wgrad(weight: torch.Tensor) -> torch.Tensor | None:
    """What B returns as the weight gradient of a megatron-core DDP parameter: a dummy, with
    ``grad_added_to_main_grad`` set, exactly as megatron-core's fused-accumulation backward does.

    DDP's gradient-accumulator hook then adds nothing (W adds the real gradient later) and, with
    ``overlap_grad_reduce``, finds the ``param.grad`` it asserts on. Parameters outside DDP get
    ``None`` (their ``.grad`` is written by W).
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device, requires_grad=False)
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device, requires_grad=False)


def build_zb_linear_function(base: Any) -> Any:
    """A subclass of megatron-core's linear autograd function ``base`` whose weight gradient is
    deferred to W inside a B window (see the module docstring). Reads the ``ctx`` fields listed
    in :data:`megatron_zb.megatron_compat.LINEAR_CTX_FIELDS`."""
    from megatron.core.parallel_state import get_global_memory_buffer

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
            if store is None or ctx.grad_output_buffer is not None:
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

            store.put(weight_grad, params=(param,))
            if handle is not None:
                handle.wait()
            grad_input = sub_grad_input if ctx.sequence_parallel else grad_input
            return linear_backward_grads(grad_input, _dummy_wgrad(param), grad_bias)

    ZBLinearFunction.__qualname__ = "ZBLinearFunction"
    return ZBLinearFunction
