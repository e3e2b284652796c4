"""``megatron-zb plan``: the subcommand's flags and its run function.

The model flags are Megatron-LM's (same names and defaults as ``pretrain_gpt_zb.py``), the layout
is PP x TP x DP with ``--num-microbatches`` or ``--global-batch-size``, the hardware is ``--gpu
NAME`` from :mod:`megatron_zb.planning.hardware` (any value overridable) or a custom GPU. ``--profile FILE`` plans
from measured costs instead (:mod:`megatron_zb.planning.profile`); the model and layout then come from the file.

Every user error prints one line ``megatron-zb: error: <flag>: <message>`` on stderr and returns
exit status 2 (argparse's own errors go through the main parser, same form).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from megatron_zb.planning.hardware import DEFAULT_HBM_EFFICIENCY, DEFAULT_MFU, HardwareError, gpu_names, resolve_hardware
from megatron_zb.planning.model import (SHARDING_STRATEGIES, TRANSFORMER_IMPLS, PlanError, PlanLayout, PlanModel,
                                        make_model, make_parallel)

PROG = "megatron-zb"
EXIT_USAGE = 2
PROGRESS_AFTER_S = 2.0
PLOT_SUFFIXES = (".png", ".svg", ".pdf")

# Megatron model flags: dest -> (type, default, help). None default = required without --profile.
_MODEL_FLAGS: dict[str, tuple[Any, Any, str]] = {
    "num_layers": (int, None, "transformer layers (required)"),
    "hidden_size": (int, None, "hidden size h (required)"),
    "num_attention_heads": (int, None, "attention heads a (required)"),
    "seq_length": (int, None, "sequence length s, tokens (required)"),
    "micro_batch_size": (int, None, "samples per microbatch b (required)"),
    "vocab_size": (int, None, "vocabulary size before padding (required)"),
    "ffn_hidden_size": (int, None, "MLP width (default 4h; with --swiglu int(8h/3/64)*64)"),
    "num_query_groups": (int, None, "key/value heads with --group-query-attention"),
    "kv_channels": (int, None, "channels per head (default h/a)"),
    "max_position_embeddings": (int, None, "rows of the learned position table (default --seq-length)"),
    "make_vocab_size_divisible_by": (int, 128, "pad the vocabulary to a multiple of this x TP (default 128)"),
    "hidden_dropout": (float, 0.1, "dropout after attention and MLP (default 0.1; 0 keeps no masks)"),
    "attention_dropout": (float, 0.1, "dropout on attention probabilities (default 0.1)"),
}
_MODEL_SWITCHES = {
    "swiglu": "SwiGLU MLP", "group_query_attention": "grouped-query attention (with --num-query-groups)",
    "untie_embeddings_and_output_weights": "separate output-layer weights",
    "disable_bias_linear": "no biases on linear layers", "use_flash_attn": "flash attention (no s x s scores kept)",
    "fp16": "fp16 mixed precision", "bf16": "bf16 mixed precision (neither: fp32, Megatron's default)",
}
_SPLIT_FLAGS = {  # pretrain_gpt_zb.py's uneven-split flags (PlanLayout field names)
    "decoder_first_pipeline_num_layers": "layers of the first stage (plain/interleaved: first rank; V: first stage)",
    "decoder_last_pipeline_num_layers": "layers of the last stage (plain/interleaved: last rank; V: last stage)",
    "account_for_embedding_in_pipeline_split": "count the embedding as a layer of the first stage",
    "account_for_loss_in_pipeline_split": "count the loss as a layer of the last stage",
}
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "vocab_size")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to ``subparsers`` (the main parser's); returns its parser."""
    p = subparsers.add_parser(
        "plan", help="predict every schedule's iteration time and memory for a model, layout and GPU",
        description="Estimate T_F, T_B, T_W, T_comm and activation memory per pipeline stage from the FLOPs "
                    "and bytes of the layers each stage holds (or read measured ones with --profile), simulate "
                    "every schedule family and print predicted iteration time, throughput, bubble rate, peak "
                    "memory per rank, whether it fits, and the recommendation. docs/planning.md explains the "
                    "model and its validation against the zero-bubble paper.")
    g = p.add_argument_group("model (Megatron-LM's flags)")
    for dest, (typ, default, help_) in _MODEL_FLAGS.items():
        g.add_argument(_flag(dest), dest=dest, type=typ, default=default, metavar="N" if typ is int else "X",
                       help=help_)
    for dest, help_ in _MODEL_SWITCHES.items():
        g.add_argument(_flag(dest), dest=dest, action="store_true", help=help_)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                   default="learned_absolute", help="default learned_absolute")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm", help="default LayerNorm")
    g.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="transformer_engine",
                   help="layers the model is built from (default transformer_engine, as Megatron-LM): with "
                        "--sequence-parallel, Transformer Engine's keep their all-gathered inputs until W")
    g = p.add_argument_group("parallel layout")
    g.add_argument("--pipeline-model-parallel-size", dest="pp", type=int, default=None, metavar="P",
                   help="pipeline stages (required)")
    g.add_argument("--tensor-model-parallel-size", dest="tp", type=int, default=None, metavar="T", help="default 1")
    g.add_argument("--data-parallel-size", dest="dp", type=int, default=None, metavar="D", help="default 1")
    g.add_argument("--num-microbatches", type=int, default=None, metavar="M", help="microbatches per iteration")
    g.add_argument("--global-batch-size", type=int, default=None, metavar="G",
                   help="samples per iteration: M = G / (micro batch x DP)")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="optimizer state sharded over DP")
    g.add_argument("--allow-padding-num-layers", action="store_true",
                   help="first/last stage may take fewer layers (as pretrain_gpt_zb.py)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", dest="num_virtual_stages", type=int, default=None,
                   metavar="V", help="chunks per rank for interleaved schedules (default: smallest that splits)")
    g.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES, default="no_shard",
                   help="what the data-parallel ranks shard (default no_shard; optim: the distributed optimizer's "
                        "state; optim_grads: sharded gradients, ZeRO-2, with a table per schedule of the W group "
                        "size k: docs/training.md \"Sharded gradients\")")
    g.add_argument("--zero-bubble-wgrad-group", metavar="K|auto", default=None,
                   help="with optim_grads: plan W groups of K microbatches, or auto (default): every K in 1, 2, 4, "
                        "..., M and recommend one")
    g.add_argument("--ddp-bucket-size", type=int, default=None, metavar="N",
                   help="elements per gradient bucket (default megatron-core's max(40M, 1M x DP))")
    for dest, help_ in _SPLIT_FLAGS.items():
        if dest.startswith("account"):
            g.add_argument(_flag(dest), dest=dest, action="store_true", help=help_)
        else:
            g.add_argument(_flag(dest), dest=dest, type=int, default=None, metavar="N", help=help_)
    g = p.add_argument_group("hardware")
    g.add_argument("--gpu", metavar="NAME", help=f"one of {', '.join(gpu_names())} (docs/planning.md has the table)")
    g.add_argument("--gpu-tflops", type=float, metavar="X", help="dense 16-bit peak, TFLOP/s")
    g.add_argument("--gpu-memory-gib", type=float, metavar="X", help="device memory, GiB")
    g.add_argument("--gpu-hbm-gbs", type=float, metavar="X", help="device memory bandwidth, GB/s")
    g.add_argument("--tp-gbs", type=float, metavar="X", help="a GPU's link bandwidth in a node, per direction, GB/s")
    g.add_argument("--p2p-gbps", type=float, metavar="X", help="stage-to-stage bandwidth, Gbit/s")
    g.add_argument("--p2p-latency-ms", type=float, metavar="X", help="fixed cost of one stage-to-stage transfer, ms")
    g.add_argument("--dp-gbps", type=float, metavar="X",
                   help="a GPU's bandwidth in data-parallel collectives, Gbit/s (default --p2p-gbps)")
    g.add_argument("--mfu", type=float, metavar="X",
                   help=f"fraction of the peak matrix multiplications reach (default {DEFAULT_MFU})")
    g.add_argument("--hbm-efficiency", type=float, metavar="X",
                   help=f"fraction of the HBM bandwidth memory-bound kernels reach (default {DEFAULT_HBM_EFFICIENCY})")
    g.add_argument("--memory-fraction", type=float, default=0.9, metavar="X",
                   help="part of the GPU memory a schedule may use to count as fitting (default 0.9)")
    g = p.add_argument_group("plan")
    g.add_argument("--profile", metavar="FILE", help="measured costs (pretrain_gpt_zb.py --profile-out FILE)")
    g.add_argument("--schedules", metavar="LIST", help="comma-separated families to plan (default: all but the "
                   "exact solvers; large search-based ones are skipped with a note)")
    g.add_argument("--enable-vocab-parallel", action="store_true",
                   help="also plan the vocabulary-parallel schedules (BASE-vocab-1/2: the embedding and the output "
                        "layer split over the pipeline ranks), each beside its base family (docs/vocab_parallel.md)")
    g.add_argument("--json", metavar="FILE", help="write the plan as JSON")
    g.add_argument("--plot", metavar="FILE", help="draw the recommended schedule (.png, .svg or .pdf)")
    g.add_argument("--torch-csv", metavar="FILE", help="write the recommended schedule as the compute-only CSV "
                   "of PyTorch's pipeline runtime (torchtitan not tested; docs/torch_pipelining.md)")
    p.set_defaults(func=run_plan)
    return p


def _model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of :func:`make_model` from the flags."""
    if args.fp16 and args.bf16:
        raise PlanError("--fp16", "give --fp16 or --bf16, not both")
    for dest in _REQUIRED:
        if getattr(args, dest) is None:
            raise PlanError(_flag(dest), "required (or plan from measured costs with --profile FILE)")
    kw = {dest: getattr(args, dest) for dest in _MODEL_FLAGS if getattr(args, dest) is not None}
    kw.update({dest: getattr(args, dest) for dest in ("swiglu", "group_query_attention",
                                                      "untie_embeddings_and_output_weights", "use_flash_attn")})
    kw.update(add_bias_linear=not args.disable_bias_linear, position_embedding_type=args.position_embedding_type,
              normalization=args.normalization, precision=_precision(args), transformer_impl=args.transformer_impl)
    return kw


def _precision(args: argparse.Namespace) -> str:
    """``fp16``, ``bf16``, or Megatron's default ``fp32`` when neither flag is given."""
    return "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"


def _given_model_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Model fields the command line sets away from the defaults (field name -> value)."""
    given = {dest: getattr(args, dest) for dest, (_, default, _) in _MODEL_FLAGS.items()
             if getattr(args, dest) is not None and getattr(args, dest) != default}
    given.update({dest: True for dest in ("swiglu", "untie_embeddings_and_output_weights", "use_flash_attn")
                  if getattr(args, dest)})
    if args.disable_bias_linear:
        given["add_bias_linear"] = False
    if args.fp16 or args.bf16:
        given["precision"] = "fp16" if args.fp16 else "bf16"
    for dest, default in (("position_embedding_type", "learned_absolute"), ("normalization", "LayerNorm"),
                          ("transformer_impl", "transformer_engine")):
        if getattr(args, dest) != default:
            given[dest] = getattr(args, dest)
    return given


def _from_profile(args: argparse.Namespace, prof: Any) -> tuple[PlanModel, PlanLayout]:
    """Model and layout of a profile; model flags, PP and TP given must agree with it (the costs
    were measured for them); the microbatches, DP and optimizer may differ."""
    model, par0 = prof.model, prof.parallel
    flags = model.to_flags()
    for dest, value in _given_model_flags(args).items():
        if flags[dest] != value:
            flag = {"add_bias_linear": "--disable-bias-linear", "precision": "--" + str(value)}.get(dest, _flag(dest))
            raise PlanError(flag, f"{value!r} disagrees with the profile's {dest} {flags[dest]!r} "
                                  f"(its costs were measured for that model)")
    for dest, flag in (("pp", "--pipeline-model-parallel-size"), ("tp", "--tensor-model-parallel-size")):
        value = getattr(args, dest)
        if value is not None and value != getattr(par0, dest):
            raise PlanError(flag, f"{value} disagrees with the profile's {getattr(par0, dest)}")
    for dest in _SPLIT_FLAGS:  # the costs were measured with the profile's layers per stage
        value = getattr(args, dest)
        if value not in (None, False) and value != getattr(par0, dest):
            raise PlanError(_flag(dest), f"{value} disagrees with the profile's {getattr(par0, dest)}")
    batch_given = args.num_microbatches is not None or args.global_batch_size is not None
    par = make_parallel(model, pp=par0.pp, tp=par0.tp, dp=args.dp if args.dp is not None else par0.dp,
                        num_microbatches=args.num_microbatches if batch_given else par0.num_microbatches,
                        global_batch_size=args.global_batch_size, sequence_parallel=par0.sequence_parallel,
                        use_distributed_optimizer=args.use_distributed_optimizer or par0.use_distributed_optimizer,
                        allow_padding_num_layers=par0.allow_padding_num_layers,
                        num_virtual_stages=args.num_virtual_stages or par0.num_virtual_stages,
                        **{dest: getattr(par0, dest) for dest in _SPLIT_FLAGS}, **_sharding(args))
    return model, par


def _sharding(args: argparse.Namespace) -> dict[str, Any]:
    """The sharding fields of the layout from the flags (``--zero-bubble-wgrad-group auto``: ``None``)."""
    k = args.zero_bubble_wgrad_group
    if k is not None and k != "auto":
        try:
            k = int(k)
        except ValueError:
            raise PlanError("--zero-bubble-wgrad-group", f"a whole number of microbatches or auto, got {k!r}") from None
    return {"data_parallel_sharding_strategy": args.data_parallel_sharding_strategy,
            "ddp_bucket_size": args.ddp_bucket_size, "wgrad_group": None if k == "auto" else k}


def _inputs(args: argparse.Namespace) -> tuple[PlanModel, PlanLayout, Any]:
    if args.profile is not None:
        from megatron_zb.planning.profile import read_profile
        prof = read_profile(args.profile)
        model, par = _from_profile(args, prof)
        return model, par, prof
    model = make_model(**_model_kwargs(args))
    if args.pp is None:
        raise PlanError("--pipeline-model-parallel-size", "required")
    par = make_parallel(model, pp=args.pp, tp=args.tp or 1, dp=args.dp or 1, num_microbatches=args.num_microbatches,
                        global_batch_size=args.global_batch_size, sequence_parallel=args.sequence_parallel,
                        use_distributed_optimizer=args.use_distributed_optimizer,
                        allow_padding_num_layers=args.allow_padding_num_layers,
                        num_virtual_stages=args.num_virtual_stages,
                        **{dest: getattr(args, dest) for dest in _SPLIT_FLAGS}, **_sharding(args))
    if model.precision == "fp32" and args.gpu is not None and args.gpu_tflops is None:
        raise PlanError("--gpu-tflops", f"the --gpu table holds dense 16-bit peaks; an fp32 model (neither --bf16 "
                                        f"nor --fp16) needs the peak its matrix products reach on {args.gpu} "
                                        f"(fp32 or TF32): give --gpu-tflops, or --bf16/--fp16")
    return model, par, None


def _progress(start: float):
    def report(name: str, i: int, n: int) -> None:
        elapsed = time.perf_counter() - start
        if elapsed > PROGRESS_AFTER_S:
            print(f"{PROG} plan: [{i}/{n}] {name} (elapsed {elapsed:.1f} s)", file=sys.stderr, flush=True)
    return report


def run_plan(args: argparse.Namespace) -> int:
    """Run ``plan`` for parsed ``args``; returns the exit status (2 on a user error)."""
    try:
        return _run(args)
    except (PlanError, HardwareError) as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    from megatron_zb.planning.planner import plan
    from megatron_zb.planning.report import render, to_json
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise PlanError("--plot", f"{args.plot}: the file name must end in {', '.join(PLOT_SUFFIXES)}")
    hw = resolve_hardware(gpu=args.gpu, tflops=args.gpu_tflops, memory_gib=args.gpu_memory_gib,
                          hbm_gbs=args.gpu_hbm_gbs, tp_gbs=args.tp_gbs, p2p_gbps=args.p2p_gbps,
                          p2p_latency_ms=args.p2p_latency_ms, mfu=args.mfu, hbm_efficiency=args.hbm_efficiency,
                          dp_gbps=args.dp_gbps)
    model, par, prof = _inputs(args)
    names = None if args.schedules is None else [n.strip() for n in args.schedules.split(",") if n.strip()]
    if names == []:
        raise PlanError("--schedules", "names no schedule")
    result = plan(model=model, parallel=par, hardware=hw, schedules=names, profile=prof,
                  memory_fraction=args.memory_fraction, progress=_progress(time.perf_counter()),
                  enable_vocab_parallel=args.enable_vocab_parallel)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(to_json(result), indent=1) + "\n")
        except OSError as e:
            raise PlanError("--json", f"cannot write {args.json}: {e.strerror or e}") from None
    print(render(result))
    if args.json:
        print(f"wrote {args.json} (--json)")
    if args.plot:
        _plot(result, args.plot)
    if args.torch_csv:
        _torch_csv(result, args.torch_csv)
    return 0


def _plot(result: Any, path: str) -> None:
    if result.recommended is None:
        print(f"{PROG} plan: --plot {path} not drawn: no schedule is recommended", file=sys.stderr)
        return
    from megatron_zb.schedules.plot import plot_timeline
    fam = next(f for f in result.families if f.name == result.recommended)
    try:
        plot_timeline(fam.result, path)
    except OSError as e:
        raise PlanError("--plot", f"cannot write {path}: {e.strerror or e}") from None
    print(f"wrote {path} (--plot: {fam.name})")


def _torch_csv(result: Any, path: str) -> None:
    """``--torch-csv``: the recommended schedule as PyTorch's compute-only CSV."""
    if result.recommended is None:
        print(f"{PROG} plan: --torch-csv {path} not written: no schedule is recommended", file=sys.stderr)
        return
    from megatron_zb.torch_pipelining import write_csv
    fam = next(f for f in result.families if f.name == result.recommended)
    try:
        note = write_csv(fam.result.schedule, path)
    except ValueError as e:
        raise PlanError("--torch-csv", f"{path}: {' '.join(str(e).split())}") from None
    print(f"wrote {path} (--torch-csv: {fam.name}; {note})")
