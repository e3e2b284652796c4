"""Layer implementation flags (Megatron's): ``--transformer-impl`` and gradient-accumulation fusion.

* ``--transformer-impl {local,transformer_engine}``: megatron-core's local layer spec, or its
  Transformer Engine spec (TE >= 2.3; under a split-backward schedule the TE modules delay their
  weight gradients to W, :mod:`megatron_zb.runtime.te_route`). Default: ``transformer_engine``
  when Transformer Engine >= 2.3 is installed and CUDA is present, else ``local``.
* ``--gradient-accumulation-fusion`` / ``--no-gradient-accumulation-fusion`` (Megatron's flag;
  dest ``gradient_accumulation_fusion``): the weight-gradient GEMM accumulates straight into
  the fp32 ``main_grad``. Default, as Megatron: on where apex's ``fused_weight_gradient_mlp_cuda``
  is importable (with CUDA), else off. Asked for without apex, megatron-zb's matmul kernels
  with apex's signature run instead (:mod:`megatron_zb.runtime.wgrad_kernels`); the start-up
  log names the kernel either way.

Derived values: ``transformer_impl`` (resolved; the flag itself is kept as
``transformer_impl_requested``), ``transformer_impl_reason`` (one phrase for the log),
``transformer_engine_version`` (or ``None``), ``gradient_accumulation_fusion`` (resolved; the
flag: ``gradient_accumulation_fusion_requested``), ``wgrad_kernel`` (one phrase for the log:
which kernel accumulates weight gradients). Resolving twice gives the same values.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from .common import ArgumentError

__all__ = ["APEX_WGRAD_MODULE", "add_implementation_args", "resolve_gradient_accumulation_fusion",
           "resolve_transformer_impl"]

APEX_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"
"""apex's CUDA extension with ``wgrad_gemm_accum_fp32`` / ``wgrad_gemm_accum_fp16``."""


def add_implementation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("transformer implementation")
    g.add_argument("--enable-experimental", action="store_true",
                   help="Enable megatron-core's experimental features (megatron.core.config's flag), as Megatron-LM.")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                   help="Layer implementation: megatron-core's local spec or its Transformer Engine spec "
                        "(TE >= 2.3; weight gradients delayed to W under split-backward schedules). Default: "
                        "transformer_engine when Transformer Engine >= 2.3 is installed and CUDA is present, "
                        "else local.")
    g.add_argument("--gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_true",
                   default=None,
                   help="Accumulate weight gradients straight into the fp32 main_grad (apex's "
                        "fused_weight_gradient_mlp_cuda; megatron-zb's matmul kernels where apex is absent; "
                        "TE layers: TE's own fused GEMM). Default: on where apex's kernels are importable.")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="Megatron's flag: do not fuse gradient accumulation into the weight-gradient GEMM.")


def resolve_transformer_impl(args: argparse.Namespace) -> None:
    """Fill ``transformer_impl`` (+ reason, TE version); refuse ``transformer_engine`` without
    Transformer Engine >= 2.3 or without CUDA (checked from package metadata: TE is not imported)."""
    from megatron_zb.runtime.te_route import TransformerEngineUnavailable, require_transformer_engine

    try:
        version, missing = require_transformer_engine(), None
    except TransformerEngineUnavailable as e:
        version, missing = None, str(e)
    cuda = torch.cuda.is_available()
    args.transformer_engine_version = version
    if not hasattr(args, "transformer_impl_requested"):
        args.transformer_impl_requested = args.transformer_impl
    requested = args.transformer_impl_requested
    args.transformer_impl = requested
    moe = bool(getattr(args, "num_experts", None))
    mla = bool(getattr(args, "multi_latent_attention", False))
    if requested == "transformer_engine":
        if missing is not None:
            raise ArgumentError("--transformer-impl", f"transformer_engine {missing}; or use --transformer-impl local")
        if not cuda:
            raise ArgumentError("--transformer-impl", "transformer_engine needs CUDA, which is not available here; "
                                                      "use --transformer-impl local")
        if moe:
            raise ArgumentError("--transformer-impl", "transformer_engine with --num-experts (MoE) is not supported by "
                                                      "megatron-zb yet; use --transformer-impl local")
        if mla:
            raise ArgumentError("--transformer-impl", "transformer_engine with --multi-latent-attention is not "
                                                      "supported by megatron-zb yet; use --transformer-impl local")
        args.transformer_impl_reason = f"--transformer-impl (Transformer Engine {version})"
    elif requested == "local":
        args.transformer_impl_reason = "--transformer-impl"
    elif moe:
        args.transformer_impl = "local"
        args.transformer_impl_reason = "default: MoE layers (--num-experts) run on the local spec"
    elif mla:
        args.transformer_impl = "local"
        args.transformer_impl_reason = ("default: multi-latent attention (--multi-latent-attention) runs on the "
                                        "local spec")
    elif missing is None and cuda:
        args.transformer_impl = "transformer_engine"
        args.transformer_impl_reason = f"default: Transformer Engine {version} is installed and CUDA is present"
    else:
        args.transformer_impl = "local"
        why = "CUDA is not available" if missing is None else missing.split("; ", 1)[-1]
        args.transformer_impl_reason = f"default: {why}"


def resolve_gradient_accumulation_fusion(args: argparse.Namespace) -> None:
    """Fill ``gradient_accumulation_fusion`` (default: apex's kernels importable with CUDA) and
    ``wgrad_kernel``, the phrase the start-up log prints (call after :func:`resolve_transformer_impl`)."""
    apex = torch.cuda.is_available() and importlib.util.find_spec(APEX_WGRAD_MODULE) is not None
    if not hasattr(args, "gradient_accumulation_fusion_requested"):
        args.gradient_accumulation_fusion_requested = args.gradient_accumulation_fusion
    requested = args.gradient_accumulation_fusion_requested
    args.gradient_accumulation_fusion = apex if requested is None else requested
    if not args.gradient_accumulation_fusion:
        args.wgrad_kernel = "off: weight gradients go through autograd and megatron-core DDP's hook into main_grad"
        return
    kernel = (f"apex {APEX_WGRAD_MODULE}.wgrad_gemm_accum_fp32/fp16" if apex else
              f"megatron-zb's matmul wgrad_gemm_accum_fp32/fp16 ({APEX_WGRAD_MODULE} not importable)")
    if args.transformer_impl == "transformer_engine":
        kernel = f"Transformer Engine's wgrad GEMM into main_grad (TE layers); output layer: {kernel}"
    args.wgrad_kernel = f"on: {kernel}"
