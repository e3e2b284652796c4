"""Fused weight-gradient accumulation kernels, with a CPU fallback sharing the same path.

On GPU, megatron-core's ``gradient_accumulation_fusion`` uses apex's
``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/fp16(input, grad_output, main_grad)``,
which computes ``main_grad += grad_output^T @ input`` in one GEMM. On a machine without it (every
CPU-only machine) :class:`MatmulWgradKernels` provides the same two functions as a matmul followed
by an in-place add -- bit-identical to megatron-core's unfused path -- so the fused code path of
megatron-core and of megatron-zb's weight-gradient store runs, and is tested, on CPU.
Only the fallback is exercised on this project's CPU CI; the apex kernels are used unchanged when
present.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch


class MatmulWgradKernels:
    """Drop-in for apex's ``fused_weight_gradient_mlp_cuda`` built from plain matmuls."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        main_grad.add_(grad_output.t().matmul(total_input))

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        main_grad.add_(grad_output.t().matmul(total_input))


@functools.lru_cache(maxsize=None)
def fused_kernels() -> ModuleType | MatmulWgradKernels:
    """apex's fused kernels when importable, otherwise the matmul fallback (decided once per process: a
    failing import costs milliseconds, and every W of a CUDA run asks)."""
    try:
        import fused_weight_gradient_mlp_cuda  # type: ignore[import-not-found]
        return fused_weight_gradient_mlp_cuda
    except ImportError:
        return MatmulWgradKernels()


def wgrad_gemm_accum(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` with the best available kernel (2-D inputs)."""
    kernels = fused_kernels() if total_input.is_cuda else MatmulWgradKernels()
    if main_grad.dtype == torch.float32:
        kernels.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernels.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise RuntimeError(f"gradient_accumulation_fusion: unsupported main_grad dtype {main_grad.dtype}")


def install_megatron_fallback() -> bool:
    """Let megatron-core use ``gradient_accumulation_fusion`` without apex (the matmul fallback).

    Only acts when apex's extension is missing; returns True when the fallback was installed.
    """
    from ..megatron_compat import grad_accum_fusion_available, set_grad_accum_fusion_kernels

    if grad_accum_fusion_available():
        return False
    set_grad_accum_fusion_kernels(MatmulWgradKernels())
    return True
