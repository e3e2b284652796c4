"""Kernel flags (Megatron-LM's names, defaults and meanings): the attention backend and the fusions.

Parsed exactly as Megatron-LM core_v0.16.1's ``megatron/training/arguments.py`` parses them (line
numbers of that file): ``--attention-backend`` (megatron-core's ``AttnBackend``, default ``auto``;
generated there from ``TransformerConfig.attention_backend``), ``--no-masked-softmax-fusion``
(2030), ``--no-bias-gelu-fusion`` (2035), ``--no-bias-swiglu-fusion`` (2038),
``--no-bias-dropout-fusion`` (2042), ``--no-rope-fusion`` (2045), ``--use-flash-attn`` (2053),
``--no-persist-layer-norm`` (2078), ``--cross-entropy-loss-fusion`` and
``--cross-entropy-fusion-impl`` (generated from ``ModelParallelConfig``).

:func:`resolve_kernels` derives the values meant for megatron-core's ``TransformerConfig`` fields of
the same names (listed in :mod:`megatron_zb.training.arguments`):

* Megatron-LM's own rules first: ``bias_activation_fusion`` is ``bias_swiglu_fusion`` with
  ``--swiglu``, else ``bias_gelu_fusion`` and off without linear biases (arguments.py 965, 1333-1337);
  ``apply_rope_fusion`` only with RoPE (994); ``persist_layer_norm = not no_persist_layer_norm`` (1323).
* The fusions Megatron-LM turns on by default run here only where their kernels do (CUDA, and apex
  or Transformer Engine where named in :data:`FUSION_NEEDS`); elsewhere (on CPU) they are off and the
  start-up log says which and why, as ``--gradient-accumulation-fusion``'s default is resolved.
* What the user asks for explicitly is honoured or refused naming what is missing:
  ``--attention-backend flash|fused|unfused`` (Transformer Engine's attention: needs the
  Transformer Engine layer spec), ``local`` (megatron-core's own attention: needs the local spec,
  as Megatron-LM asks for ``--spec local``), ``--cross-entropy-fusion-impl te`` (Transformer Engine).
* ``--use-flash-attn`` is read by Megatron-LM's legacy model only; megatron-core's GPT ignores it,
  as in Megatron-LM (a log line points to ``--attention-backend flash``).

The flag values themselves are kept as ``<dest>_requested`` where the resolved value replaces them,
so that validating again gives the same result.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
from megatron.core.transformer.enums import AttnBackend

from .common import ArgumentError, notice

__all__ = ["FLAG_FIELDS", "FUSION_NEEDS", "TE_ATTENTION_BACKENDS", "add_kernel_args", "check_attention_backend", "resolve_kernels"]

TE_ATTENTION_BACKENDS: tuple[AttnBackend, ...] = (AttnBackend.flash, AttnBackend.fused, AttnBackend.unfused)
"""Backends that choose among Transformer Engine's attention kernels (megatron-core sets TE's
``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` / ``NVTE_UNFUSED_ATTN`` from them)."""

FUSION_NEEDS: dict[str, tuple[str, str | None]] = {
    "masked_softmax_fusion": ("the fused softmax kernels", "scaled_masked_softmax_cuda"),
    "bias_activation_fusion": ("megatron-core's fused bias-activation functions (jit_fuser)", None),
    "bias_dropout_fusion": ("megatron-core's fused bias-dropout-add (jit_fuser)", None),
    "apply_rope_fusion": ("Transformer Engine's fused RoPE", "transformer_engine"),
    "persist_layer_norm": ("apex's persistent LayerNorm", "apex"),
}
"""Megatron-LM's default-on fusions -> (what runs them, the module that must be importable besides
CUDA, or ``None``). Without CUDA each is off: the fused functions target the GPU (on CPU
torch.compile of each costs ~10 s at first use, measured in Megatron-LM's loop; the GeLU fusion
also uses the tanh approximation of GeLU)."""

FLAG_FIELDS: dict[str, str] = {
    "--attention-backend": "attention_backend", "--no-masked-softmax-fusion": "masked_softmax_fusion",
    "--no-bias-gelu-fusion": "bias_activation_fusion", "--no-bias-swiglu-fusion": "bias_activation_fusion",
    "--no-bias-dropout-fusion": "bias_dropout_fusion", "--no-rope-fusion": "apply_rope_fusion",
    "--no-persist-layer-norm": "persist_layer_norm", "--cross-entropy-loss-fusion": "cross_entropy_loss_fusion",
    "--cross-entropy-fusion-impl": "cross_entropy_fusion_impl",
}
"""Each flag of this group -> the ``TransformerConfig`` field (and ``args`` attribute) it decides."""

_REQUESTED = ("masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion")
"""Flags whose resolved value replaces the parsed one (kept as ``<dest>_requested``)."""


def _attn_backend(name: str) -> AttnBackend:
    """``--attention-backend`` value -> ``AttnBackend`` member (Megatron-LM: ``AttnBackend[name]``)."""
    try:
        return AttnBackend[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(b.name for b in AttnBackend)}") from None


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("attention backend and fusions (Megatron-LM's)")
    g.add_argument("--attention-backend", type=_attn_backend, choices=list(AttnBackend), default=AttnBackend.auto,
                   metavar="{" + ",".join(b.name for b in AttnBackend) + "}",
                   help="Attention implementation (megatron-core's AttnBackend, default auto): flash, fused and "
                        "unfused choose Transformer Engine's kernels (--transformer-impl transformer_engine); local "
                        "is megatron-core's own attention (--transformer-impl local); auto lets the layer spec "
                        "decide.")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="Megatron-LM's legacy-model flag: no effect on megatron-core's GPT (as in Megatron-LM); "
                        "use --attention-backend flash.")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                   help="Disable the fused scale-mask-softmax kernel (on where it runs: CUDA with its kernels).")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                   help="Disable the fused bias-GeLU (on with CUDA).")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                   help="Disable the fused bias-SwiGLU (on with CUDA).")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                   help="Disable the fused bias-dropout-add (on with CUDA).")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                   help="Disable Transformer Engine's fused RoPE (on with RoPE, CUDA and Transformer Engine).")
    g.add_argument("--no-persist-layer-norm", action="store_true",
                   help="Disable apex's persistent LayerNorm kernel (on with CUDA and apex).")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="Use megatron-core's fused cross entropy (--cross-entropy-fusion-impl).")
    g.add_argument("--cross-entropy-fusion-impl", choices=("native", "te"), default="native",
                   help="Fused cross entropy: native (megatron-core's, default) or te (Transformer Engine's).")


def _keep_requested(args: argparse.Namespace) -> None:
    for dest in _REQUESTED:
        if not hasattr(args, dest + "_requested"):
            setattr(args, dest + "_requested", getattr(args, dest))


def _missing(needs_module: str | None) -> str | None:
    """What is missing to run a kernel here (``None``: nothing)."""
    missing = [] if torch.cuda.is_available() else ["CUDA"]
    if needs_module is not None and importlib.util.find_spec(needs_module) is None:
        missing.append(needs_module)
    return " and ".join(missing) or None


def check_attention_backend(args: argparse.Namespace) -> None:
    """The backend the layer spec can run (call after ``resolve_transformer_impl``)."""
    backend, impl = args.attention_backend, args.transformer_impl
    if backend in TE_ATTENTION_BACKENDS and impl != "transformer_engine":
        raise ArgumentError("--attention-backend", f"{backend.name} chooses Transformer Engine's attention, but the "
                                                   f"layers are megatron-core's local spec ({args.transformer_impl_reason}"
                                                   f"); use --attention-backend auto or local, or run with --transformer-"
                                                   f"impl transformer_engine (Transformer Engine >= 2.3 and CUDA)")
    if backend == AttnBackend.local and impl == "transformer_engine":
        raise ArgumentError("--attention-backend", "local is megatron-core's own attention, which the Transformer "
                                                   "Engine layer spec does not use (Megatron-LM asks for --spec local); "
                                                   "add --transformer-impl local or use --attention-backend auto")
    if args.cross_entropy_loss_fusion_requested and args.cross_entropy_fusion_impl == "te" and \
            args.transformer_engine_version is None:
        raise ArgumentError("--cross-entropy-fusion-impl", "te needs Transformer Engine, which is not installed; use "
                                                           "--cross-entropy-fusion-impl native")


def resolve_kernels(args: argparse.Namespace) -> None:
    """Fill the fusion fields (module docstring), check the attention backend, log what changed."""
    _keep_requested(args)
    args.cross_entropy_loss_fusion = args.cross_entropy_loss_fusion_requested
    check_attention_backend(args)
    wanted = {
        "masked_softmax_fusion": args.masked_softmax_fusion_requested,
        "bias_activation_fusion": args.bias_swiglu_fusion if args.swiglu else (
            args.bias_gelu_fusion and args.add_bias_linear),
        "bias_dropout_fusion": args.bias_dropout_fusion_requested,
        "apply_rope_fusion": args.apply_rope_fusion_requested and args.position_embedding_type == "rope",
        "persist_layer_norm": not args.no_persist_layer_norm,
    }
    off = []
    for field, on in wanted.items():
        what, module = FUSION_NEEDS[field]
        missing = _missing(module) if on else None
        setattr(args, field, on and missing is None)
        if missing is not None:
            off.append(f"{field} ({what}: needs {missing})")
    if off:
        notice(args, "> fusions Megatron-LM turns on that cannot run here, off: " + "; ".join(off))
    if args.use_flash_attn:
        notice(args, "WARNING: --use-flash-attn has no effect on megatron-core's GPT (Megatron-LM reads it only in "
                     "its legacy model); --attention-backend flash chooses flash attention (Transformer Engine)")
