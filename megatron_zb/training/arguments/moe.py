"""Mixture-of-experts flags (Megatron's "moe" group plus ``--expert-model-parallel-size``): names,
defaults and value forms as Megatron-LM's; their checks and derived values.

Experts are megatron-core's ``SequentialMLP`` of the local layer spec (one
``ColumnParallelLinear``/``RowParallelLinear`` pair per expert), so their weight gradients go
through the runtime's ``linear`` route into W like every dense linear layer; the router's weight
gradient is computed in B (megatron-core's own ``RouterGatingLinearFunction``). Expert parallelism
(``--expert-model-parallel-size``) spreads the experts over the data-parallel ranks of a pipeline
stage, as megatron-core's ``parallel_state`` does.

DeepSeek's MoE, with Megatron-LM's meanings and defaults (megatron-core's ``TransformerConfig`` fields of the
same names): shared experts (``--moe-shared-expert-intermediate-size``, ``--moe-shared-expert-gate``; megatron-core's
``SharedExpertMLP``, built from the same linear layers, so their weight gradients go to W too; the gate's weight,
like the router's, gets its gradient in B) and the router's options (``--moe-router-score-function``, group-limited
top-k ``--moe-router-num-groups`` / ``--moe-router-group-topk``, ``--moe-router-pre-softmax``,
``--moe-router-topk-scaling-factor``, the aux-loss-free expert bias ``--moe-router-enable-expert-bias`` /
``--moe-router-bias-update-rate``: megatron-core's ``finalize_model_grads`` updates the bias once per iteration,
which megatron-zb's runtime calls after the iteration's last W). ``--moe-shared-expert-overlap`` and
``--moe-router-force-load-balancing`` are refused with their reasons (``flags.WHY_NOT``).

Derived values: ``moe_ffn_hidden_size`` (default ``--ffn-hidden-size``), ``moe_layer_pattern``
(one 0/1 per transformer layer, 1 = MoE layer; ``None`` without ``--num-experts``);
``moe_router_load_balancing_type`` and ``moe_aux_loss_coeff`` collapse one-element lists to the
element (as Megatron-LM's ``validate_args``).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch

from .common import ArgumentError

__all__ = ["LOAD_BALANCING_TYPES", "TOKEN_DISPATCHERS", "add_moe_args", "check_moe", "moe_freq_type"]

LOAD_BALANCING_TYPES: tuple[str, ...] = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""``--moe-router-load-balancing-type`` choices (Megatron-LM's)."""

TOKEN_DISPATCHERS: tuple[str, ...] = ("allgather", "alltoall")
"""``--moe-token-dispatcher-type`` choices; Megatron-LM's third, ``flex`` (DeepEP / HybridEP
kernels, GPU only), is not supported."""


SCORE_FUNCTIONS: tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus")
"""``--moe-router-score-function`` choices: every release's (``megatron_compat.ROUTER_SCORE_FUNCTIONS``;
one the installed megatron-core lacks is refused by validation, naming the release)."""


def moe_freq_type(value: str | int) -> int | list[int]:
    """``--moe-layer-freq``: an integer N (every N-th layer is MoE, starting with layer 0) or a Python
    list expression of 0/1 such as ``"([1]*3+[0]*1)*3"`` (1 = MoE layer), as Megatron-LM's."""
    if isinstance(value, int):
        return value
    if "[" not in value:
        return int(value)
    if re.search(r"[^,\d\[\]\(\)\+\*\s]", value):
        raise argparse.ArgumentTypeError(f"invalid pattern {value!r}: only digits, ',', '[', ']', '(', ')', "
                                         f"'+' and '*' are allowed")
    pattern = eval(value, {"__builtins__": {}}, {})  # noqa: S307 -- characters checked above, as Megatron-LM
    if not isinstance(pattern, list):
        raise argparse.ArgumentTypeError(f"pattern {value!r} does not evaluate to a list")
    return pattern


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("moe")
    g.add_argument("--num-experts", type=int, default=None,
                   help="Number of experts per MoE layer (default: none, a dense model).")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts each token is routed to (default 2).")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="Hidden size of each expert's MLP. Default: --ffn-hidden-size.")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                   help="Scaling coefficient of the load-balancing loss (one per load-balancing type; "
                        "default 0.0; 1e-2 is a common start).")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", type=str, choices=LOAD_BALANCING_TYPES,
                   default="aux_loss", help="Load-balancing strategy of the router (default aux_loss).")
    g.add_argument("--moe-token-dispatcher-type", type=str, choices=TOKEN_DISPATCHERS, default="allgather",
                   help="How tokens reach their experts: allgather (default) or alltoall.")
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                   help="Data type of the router's scores and of the weighted sum of the experts' outputs "
                        "(megatron-core's TransformerConfig.moe_router_dtype); default: the model's.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="Tensor-parallel size of the experts; megatron-zb splits them like the dense layers: "
                        "--tensor-model-parallel-size only (Megatron-LM's default).")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Expert-parallel size: the experts of a layer are split over this many data-parallel "
                        "ranks of a pipeline stage (must divide the data-parallel size and --num-experts; "
                        "default 1).")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="Which layers are MoE layers: an integer N (one MoE layer every N layers, starting with "
                        "the first) or a list expression of 0/1 per layer, e.g. \"([1]*3+[0]*1)*2\" (default 1: "
                        "every layer).")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="Grouped-GEMM experts (GPU only; not available on CPU, where experts are SequentialMLP).")
    _add_deepseek_args(g)


def _add_deepseek_args(g: argparse._ArgumentGroup) -> None:
    """Shared experts and DeepSeek's router options (megatron-core's ``TransformerConfig`` defaults)."""
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Total FFN hidden size of the shared experts (shared experts x each one's size); they see "
                        "every token, beside the routed experts (default: no shared expert).")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="A sigmoid gate on the shared experts' output (with --moe-shared-expert-intermediate-size).")
    g.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default="softmax",
                   help="Score function of the router: softmax (default) or sigmoid (DeepSeek-V3); sqrtsoftplus "
                        "with megatron-core 0.19.")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="Expert groups for group-limited routing (with --moe-router-group-topk; must divide "
                        "--num-experts).")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="Groups each token may be routed to (group-limited top-k; default: plain top-k).")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free load balancing: a per-expert bias on the routing scores, updated once per "
                        "iteration from the tokens each expert got (needs a score function other than softmax).")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="Step of the expert bias per iteration (default 1e-3, DeepSeek-V3's).")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Apply the score function before the top-k selection (default: after).")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Factor on the selected experts' routing weights (default: none).")


def check_moe(args: argparse.Namespace) -> None:
    """Check the MoE flags against each other and the parallel layout; fill the derived values.

    Needs ``data_parallel_size`` and ``ffn_hidden_size`` (run after the parallel sizes and
    :func:`~.model.fill_model_sizes`).
    """
    ep = args.expert_model_parallel_size
    if ep < 1:
        raise ArgumentError("--expert-model-parallel-size", f"must be a positive integer, got {ep}")
    if args.num_experts is None:
        if ep > 1:
            raise ArgumentError("--expert-model-parallel-size", f"{ep} needs --num-experts (a MoE model); "
                                                                "drop it for a dense model")
        given = _moe_only_flags_given(args)
        if given:
            raise ArgumentError(given[0], "only applies to a MoE model; add --num-experts N or drop it")
        args.moe_layer_pattern = None
        return
    n = args.num_experts
    if n < 1:
        raise ArgumentError("--num-experts", f"must be a positive integer, got {n}")
    if not 1 <= args.moe_router_topk <= n:
        raise ArgumentError("--moe-router-topk", f"must be in [1, --num-experts {n}], got {args.moe_router_topk}")
    if n % ep:
        raise ArgumentError("--expert-model-parallel-size", f"{ep} does not divide --num-experts {n}; pick a "
                                                            f"divisor of the expert count")
    if args.data_parallel_size % ep:
        raise ArgumentError("--expert-model-parallel-size",
                            f"{ep} does not divide the data-parallel size {args.data_parallel_size} (experts are "
                            f"spread over the data-parallel ranks of a stage); launch a multiple of "
                            f"{ep * args.tensor_model_parallel_size * args.pipeline_model_parallel_size} processes")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ArgumentError("--sequence-parallel", "MoE with --tensor-model-parallel-size > 1 needs sequence "
                                                   "parallelism (as Megatron-LM); add --sequence-parallel")
    if getattr(args, "add_bias_linear", True) and ep * args.tensor_model_parallel_size == 1:
        raise ArgumentError("--disable-bias-linear",
                            "experts with linear biases fail in megatron-core 0.16.1 at expert-parallel x "
                            "tensor-parallel size 1 (in-place bias add on a view in MLP.forward); add "
                            "--disable-bias-linear (as MoE recipes do)")
    if args.moe_grouped_gemm:
        _check_grouped_gemm(args)
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    elif args.moe_ffn_hidden_size < 1:
        raise ArgumentError("--moe-ffn-hidden-size", f"must be a positive integer, got {args.moe_ffn_hidden_size}")
    args.moe_router_load_balancing_type = _single(args.moe_router_load_balancing_type)
    args.moe_aux_loss_coeff = _single(args.moe_aux_loss_coeff)
    _check_load_balancing(args)
    _check_shared_experts(args)
    _check_router(args)
    args.moe_layer_pattern = _layer_pattern(args.moe_layer_freq, args.num_layers)


_MOE_ONLY: tuple[tuple[str, str, object], ...] = (
    ("--moe-ffn-hidden-size", "moe_ffn_hidden_size", None), ("--moe-grouped-gemm", "moe_grouped_gemm", False),
    ("--moe-shared-expert-intermediate-size", "moe_shared_expert_intermediate_size", None),
    ("--moe-shared-expert-gate", "moe_shared_expert_gate", False),
    ("--moe-router-score-function", "moe_router_score_function", "softmax"),
    ("--moe-router-num-groups", "moe_router_num_groups", None),
    ("--moe-router-group-topk", "moe_router_group_topk", None),
    ("--moe-router-enable-expert-bias", "moe_router_enable_expert_bias", False),
    ("--moe-router-bias-update-rate", "moe_router_bias_update_rate", 1e-3),
    ("--moe-router-pre-softmax", "moe_router_pre_softmax", False),
    ("--moe-router-topk-scaling-factor", "moe_router_topk_scaling_factor", None))
"""(flag, dest, default) of the flags that only mean something with ``--num-experts``."""


def _moe_only_flags_given(args: argparse.Namespace) -> list[str]:
    """The MoE-only flags given a value other than their default (a dense model refuses them)."""
    return [flag for flag, dest, default in _MOE_ONLY if getattr(args, dest, default) != default]


def _check_shared_experts(args: argparse.Namespace) -> None:
    size = args.moe_shared_expert_intermediate_size
    if size is not None and size < 1:
        raise ArgumentError("--moe-shared-expert-intermediate-size", f"must be a positive integer, got {size}")
    if size is None and args.moe_shared_expert_gate:
        raise ArgumentError("--moe-shared-expert-gate", "gates the shared experts: add "
                                                        "--moe-shared-expert-intermediate-size N or drop it")


def _check_router(args: argparse.Namespace) -> None:
    """DeepSeek's router options, as megatron-core's ``TransformerConfig`` checks them (here before any
    process group starts, each naming its flag)."""
    from megatron_zb.megatron_compat import megatron_core_version, router_score_functions

    score = args.moe_router_score_function
    if score not in router_score_functions():
        raise ArgumentError("--moe-router-score-function", f"{score!r} needs megatron-core 0.19 (installed: "
                                                           f"{megatron_core_version()}); pick one of "
                                                           f"{', '.join(router_score_functions())}")
    if args.moe_router_enable_expert_bias and score == "softmax":
        raise ArgumentError("--moe-router-enable-expert-bias", "the expert bias needs a score function other than "
                                                               "softmax (megatron-core's rule); add "
                                                               "--moe-router-score-function sigmoid")
    if (args.moe_router_topk == 1 and score == "softmax" and not args.moe_router_pre_softmax
            and args.moe_router_load_balancing_type != "sinkhorn"):
        raise ArgumentError("--moe-router-pre-softmax", "top-1 routing with softmax after the top-k has a zero "
                                                        "gradient (megatron-core's rule); add --moe-router-pre-softmax")
    if args.moe_router_group_topk is not None:
        _check_group_topk(args)


def _check_group_topk(args: argparse.Namespace) -> None:
    """Group-limited top-k: ``topk // group_topk`` best scores per group rank the groups, then the top-k
    experts come from the ``group_topk`` chosen groups."""
    n, k, groups, gk = args.num_experts, args.moe_router_topk, args.moe_router_num_groups, args.moe_router_group_topk
    if groups is None:
        raise ArgumentError("--moe-router-num-groups", "group-limited routing (--moe-router-group-topk) needs the "
                                                       "number of expert groups; add --moe-router-num-groups N")
    if groups < 1 or n % groups:
        raise ArgumentError("--moe-router-num-groups", f"must be a positive divisor of --num-experts {n}, got {groups}")
    if not 1 <= gk <= min(groups, k):
        raise ArgumentError("--moe-router-group-topk", f"must be in [1, min(--moe-router-num-groups {groups}, "
                                                       f"--moe-router-topk {k})], got {gk}")
    if k > gk * (n // groups):
        raise ArgumentError("--moe-router-topk", f"{k} experts cannot come from {gk} group(s) of {n // groups}; "
                                                 f"raise --moe-router-group-topk or lower --moe-router-topk")


def _single(value: Any) -> Any:
    """A one-element list becomes its element (Megatron-LM's ``validate_args`` does the same)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _check_load_balancing(args: argparse.Namespace) -> None:
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    if isinstance(types, list) != isinstance(coeffs, list) or (isinstance(types, list) and len(types) != len(coeffs)):
        raise ArgumentError("--moe-aux-loss-coeff", f"give one coefficient per --moe-router-load-balancing-type "
                                                    f"({types}), got {coeffs}")
    for c in coeffs if isinstance(coeffs, list) else [coeffs]:
        if c < 0:
            raise ArgumentError("--moe-aux-loss-coeff", f"must be >= 0, got {c}")


def _check_grouped_gemm(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise ArgumentError("--moe-grouped-gemm", "grouped-GEMM experts need CUDA, which is not available here; "
                                                  "drop --moe-grouped-gemm (experts then run as SequentialMLP)")
    if getattr(args, "split_backward", False):
        raise ArgumentError("--moe-grouped-gemm", f"grouped-GEMM experts have no route deferring their weight "
                                                  f"gradient to W, which schedule {args.schedule!r} needs; drop "
                                                  f"--moe-grouped-gemm (SequentialMLP experts defer it)")


def _layer_pattern(freq: int | list[int], num_layers: int) -> list[int]:
    """One 0/1 per layer (1 = MoE) from ``--moe-layer-freq`` (megatron-core's rule for an integer)."""
    if isinstance(freq, int):
        if freq < 1:
            raise ArgumentError("--moe-layer-freq", f"must be a positive integer or a 0/1 list, got {freq}")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if len(freq) != num_layers or any(v not in (0, 1) for v in freq):
        raise ArgumentError("--moe-layer-freq", f"a pattern needs one 0 or 1 per layer ({num_layers} layers), "
                                                f"got {freq}")
    if not any(freq):
        raise ArgumentError("--moe-layer-freq", "the pattern has no MoE layer; drop --num-experts for a dense model")
    return list(freq)


def check_expert_tensor_parallel(args: argparse.Namespace) -> None:
    """``--expert-tensor-parallel-size``: the experts are split over the tensor-parallel ranks like the
    dense layers, so only ``--tensor-model-parallel-size`` itself; defaults to it (as Megatron-LM)."""
    tp, etp = args.tensor_model_parallel_size, args.expert_tensor_parallel_size
    if etp is not None and etp != tp:
        raise ArgumentError("--expert-tensor-parallel-size",
                            f"{etp} is not supported: megatron-zb splits the experts over the tensor-parallel "
                            f"ranks like the dense layers; give --tensor-model-parallel-size's {tp} or drop the flag")
    args.expert_tensor_parallel_size = tp
