"""FP8 and tensor-parallel communication-overlap flags: Megatron-LM's names, defaults and meanings,
mapped onto megatron-core's ``TransformerConfig`` (fields of the same names in
:class:`~megatron_zb.training.run_config.ModelConfig`), refused where Transformer Engine cannot run.

Megatron-LM core_v0.16.1 generates ``--fp8-format`` (dest ``fp8``), ``--fp8-recipe``, ``--fp8-margin``,
``--fp8-interval``, ``--fp8-amax-history-len`` and ``--fp8-amax-compute-algo`` from
``TransformerConfig``'s fields and ``--tp-comm-overlap`` from ``ModelParallelConfig``'s; it declares
``--fp8-param-gather`` itself (arguments.py 1398) and passes it as ``TransformerConfig.fp8_param``
(1331), only with the distributed optimizer (655). All of them need Transformer Engine's layers
(``--transformer-impl transformer_engine``) on CUDA: :func:`check_fp8` refuses them otherwise, in
one problem that names every FP8 flag given. Not run here (no GPU, no Transformer Engine).
"""

from __future__ import annotations

import argparse

from .common import ArgumentError

__all__ = ["FP8_DEFAULTS", "add_fp8_args", "check_fp8", "fp8_flags_given"]

FP8_DEFAULTS: dict[str, object] = {
    "--fp8-format": None, "--fp8-recipe": "delayed", "--fp8-margin": 0, "--fp8-interval": 1,
    "--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": "most_recent", "--fp8-param-gather": False,
}
"""Each FP8 flag -> megatron-core's default (``TransformerConfig``; the flag's dest is its name
without ``--``, ``--fp8-format``'s is ``fp8``)."""


def _dest(flag: str) -> str:
    return "fp8" if flag == "--fp8-format" else flag[2:].replace("-", "_")


def add_fp8_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("FP8 and tensor-parallel overlap (Transformer Engine; Megatron-LM's)")
    g.add_argument("--fp8-format", dest="fp8", choices=("e4m3", "hybrid"), default=None,
                   help="FP8 through Transformer Engine: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 "
                        "gradients). Needs --transformer-impl transformer_engine on CUDA.")
    g.add_argument("--fp8-recipe", choices=("tensorwise", "delayed", "mxfp8", "blockwise"), default="delayed",
                   help="FP8 scaling recipe (default delayed).")
    g.add_argument("--fp8-margin", type=int, default=0, help="Margin of the FP8 scaling factor (default 0).")
    g.add_argument("--fp8-interval", type=int, default=1,
                   help="Deprecated in Transformer Engine 1.8 and ignored there (default 1).")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="Length of the amax history window of the scaling factor (default 1).")
    g.add_argument("--fp8-amax-compute-algo", choices=("most_recent", "max"), default="most_recent",
                   help="Which amax of the history the scaling factor uses (default most_recent).")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="Keep the compute parameters in FP8 and all-gather them in FP8 (with "
                        "--use-distributed-optimizer).")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="Overlap tensor-parallel communication with GEMMs (Transformer Engine's userbuffers; "
                        "needs --sequence-parallel and TP > 1).")


def fp8_flags_given(args: argparse.Namespace) -> list[str]:
    """The FP8 flags whose value is not megatron-core's default, in :data:`FP8_DEFAULTS`' order."""
    return [f for f, default in FP8_DEFAULTS.items() if getattr(args, _dest(f)) != default]


def check_fp8(args: argparse.Namespace) -> None:
    """FP8 and ``--tp-comm-overlap`` only on Transformer Engine's layers (call after
    ``resolve_transformer_impl``); ``--fp8-param-gather`` with FP8 and the distributed optimizer."""
    given = fp8_flags_given(args)
    if given and args.transformer_impl != "transformer_engine":
        raise ArgumentError(given[0], f"{', '.join(given)}: FP8 needs Transformer Engine's layers on an FP8-capable "
                                      f"GPU, and the layers here are megatron-core's local spec "
                                      f"({args.transformer_impl_reason}); drop the FP8 flags, or run with "
                                      f"--transformer-impl transformer_engine (Transformer Engine >= 2.3 and CUDA)")
    if args.fp8_param_gather and args.fp8 is None:
        raise ArgumentError("--fp8-param-gather", "keeps parameters in FP8, which needs --fp8-format; add it or "
                                                  "drop --fp8-param-gather")
    if args.fp8_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--fp8-param-gather", "needs --use-distributed-optimizer (as Megatron-LM); add it")
    if args.tp_comm_overlap and args.transformer_impl != "transformer_engine":
        raise ArgumentError("--tp-comm-overlap", f"overlaps through Transformer Engine's userbuffers, and the layers "
                                                 f"here are megatron-core's local spec ({args.transformer_impl_reason})"
                                                 f"; drop it, or run with --transformer-impl transformer_engine")
    if args.tp_comm_overlap and not (args.sequence_parallel and args.tensor_model_parallel_size > 1):
        raise ArgumentError("--tp-comm-overlap", "needs --sequence-parallel and --tensor-model-parallel-size > 1 "
                                                 "(as megatron-core); add them or drop --tp-comm-overlap")
