"""The training loop behind ``pretrain_gpt_zb.py``: Megatron's GPT pretraining with zero-bubble schedules.

One call, :func:`main`, does what Megatron-LM's ``pretrain_gpt.py`` does, with megatron-zb's
``forward_backward_func`` in place of megatron-core's:

1. parse and validate the command line (:mod:`megatron_zb.training.arguments`) *before* any
   process group exists; a bad flag prints one ``pretrain_gpt_zb.py: error: --flag: ...`` line
   (on local rank 0) and exits with status 2;
2. ``torch.distributed`` (``--distributed-backend``: gloo on CPU, nccl on GPU) and megatron-core's
   ``parallel_state`` (TP, PP); Megatron's seeds (``--seed + 100 * pipeline rank``);
3. this rank's GPT chunks for the schedule's placement (plain / V / interleaved,
   :func:`megatron_zb.model.build_gpt_chunks`), wrapped as Megatron does (``Float16Module`` for
   fp16/bf16, megatron-core ``DistributedDataParallel``), with the config hooks
   (``no_sync_func``, ``finalize_model_grads_func``, ``grad_scale_func``);
4. ``get_megatron_optimizer(OptimizerConfig(...))`` (optionally wrapped for optimizer
   post-validation) and megatron-core's ``OptimizerParamScheduler`` (warm-up, decay; steps counted
   in samples, as Megatron counts them);
5. ``--load``: resume from a ``dist_checkpointing`` checkpoint (:mod:`.checkpointing`);
6. train/valid/test iterators (:mod:`megatron_zb.training.data`);
7. the loop: one ``forward_backward_func`` call and one optimizer step per iteration; profile
   and re-plan cost-aware schedules (:mod:`.profiling`); Megatron's log line every
   ``--log-interval``; evaluation every ``--eval-interval``; checkpoints every
   ``--save-interval``; ``--exit-interval``.

Developer flags added here (:func:`add_developer_args`): ``--use-megatron-core-schedule``
(megatron-core's own 1F1B, the numerical reference), ``--loss-log-json`` (exact per-iteration
values), ``--exit-interval`` and Megatron's ``--override-opt_param-scheduler`` /
``--use-checkpoint-opt_param-scheduler``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator, Sequence

__all__ = ["add_developer_args", "main", "validate_developer_args"]

PROG = "pretrain_gpt_zb.py"


# ---------------------------------------------------------------------------- command line
def add_developer_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pretrain_gpt_zb.py`` beyond :func:`~megatron_zb.training.arguments.build_parser`'s."""
    g = parser.add_argument_group("megatron-zb developer")
    g.add_argument("--use-megatron-core-schedule", action="store_true",
                   help="Reference run: megatron-core's own forward_backward_func (its 1F1B; plain placement "
                        "only, so not together with a zero-bubble schedule flag). For comparing loss curves.")
    g.add_argument("--loss-log-json", type=str, default=None, metavar="PATH",
                   help="Write every iteration's exact lm loss, learning rate, grad norm and loss scale, and "
                        "every validation loss, to this JSON file (written by the last rank at each log line "
                        "and at the end).")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Exit after the iteration that is divisible by this value, saving a checkpoint first "
                        "when --save is set (as Megatron).")
    g.add_argument("--override-opt_param-scheduler", dest="override_opt_param_scheduler", action="store_true",
                   help="On --load, take the learning-rate schedule from the command line, ignoring the "
                        "checkpoint's (as Megatron).")
    g.add_argument("--use-checkpoint-opt_param-scheduler", dest="use_checkpoint_opt_param_scheduler",
                   action="store_true",
                   help="On --load, take the learning-rate schedule from the checkpoint (as Megatron).")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Accepted for compatibility: megatron-zb always unties the input embedding and the "
                        "output layer (Megatron ties them unless this flag is given).")


def validate_developer_args(args: argparse.Namespace) -> None:
    """Check the flags of :func:`add_developer_args` (after ``validate_args``); raise ``ArgumentError``."""
    from megatron_zb.training.arguments import ArgumentError

    if args.use_megatron_core_schedule:
        if args.schedule != "1f1b":
            raise ArgumentError("--use-megatron-core-schedule",
                                f"runs megatron-core's own 1F1B, but {args.schedule_selected_by} selected schedule "
                                f"{args.schedule!r}; drop one of the two")
        if args.enable_optimizer_post_validation:
            raise ArgumentError("--use-megatron-core-schedule", "cannot be combined with "
                                "--enable-optimizer-post-validation")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ArgumentError("--exit-interval", f"must be a positive integer, got {args.exit_interval}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler",
                            "and --use-checkpoint-opt_param-scheduler contradict each other; keep one")
    if args.loss_log_json:
        parent = os.path.dirname(os.path.abspath(args.loss_log_json))
        if not os.path.isdir(parent):
            raise ArgumentError("--loss-log-json", f"directory {parent!r} does not exist")
    if args.load and not os.path.isdir(args.load):
        raise ArgumentError("--load", f"{args.load!r} is not a directory")


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def _usage_error(message: str) -> int:
    """Print one error line on local rank 0; other ranks wait briefly so the launcher shows it."""
    if _local_rank() == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(5)  # let local rank 0 print before the launcher tears the job down
    return 2


def parse_and_validate(argv: Sequence[str] | None, world_size: int) -> argparse.Namespace:
    """Parse and validate ``argv``; raises ``ArgumentError`` or ``SystemExit(2)`` (argparse)."""
    from megatron_zb.training.arguments import build_parser, validate_args

    parser = build_parser(extra_args_provider=add_developer_args)

    def error(message: str) -> None:
        if _local_rank() == 0:
            parser.print_usage(sys.stderr)
        raise SystemExit(_usage_error(message))

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    validate_args(args, world_size=world_size)
    validate_developer_args(args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pretrain_gpt_zb.py``; returns the exit status."""
    from megatron_zb.training.arguments import ArgumentError

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = parse_and_validate(argv, world_size)
    except ArgumentError as e:
        return _usage_error(str(e))
    trainer = Trainer(args)
    try:
        return trainer.run()
    finally:
        trainer.close()


# ---------------------------------------------------------------------------- data helpers
class _SharedSource:
    """One micro-batch iterator read by several chunks of this rank, each in micro-batch order.

    With the V placement, pipeline rank 0 holds the first stage (needs tokens) and the last stage
    (needs labels): both read the same micro batches. Items are kept until every view has read them.
    """

    def __init__(self, source: Iterator[Any], num_views: int) -> None:
        self.source = source
        self.buffer: collections.deque = collections.deque()
        self.base = 0
        self.pos = [0] * num_views

    def get(self, view: int) -> Any:
        idx = self.pos[view]
        while self.base + len(self.buffer) <= idx:
            self.buffer.append(next(self.source))
        item = self.buffer[idx - self.base]
        self.pos[view] += 1
        while self.buffer and min(self.pos) > self.base:
            self.buffer.popleft()
            self.base += 1
        return item


class _View:
    def __init__(self, shared: _SharedSource, index: int) -> None:
        self.shared, self.index = shared, index

    def __iter__(self) -> "_View":
        return self

    def __next__(self) -> Any:
        return self.shared.get(self.index)


def chunk_iterators(source: Iterator[Any] | None, needs_data: Sequence[bool]) -> list[Any]:
    """One iterator per chunk: views of ``source`` for the chunks that read data, ``None`` for the others."""
    n = sum(needs_data)
    if source is None or n == 0:
        return [None] * len(needs_data)
    if n == 1:
        return [source if need else None for need in needs_data]
    shared = _SharedSource(source, n)
    out, k = [], 0
    for need in needs_data:
        if need:
            out.append(_View(shared, k))
            k += 1
        else:
            out.append(None)
    return out


# ---------------------------------------------------------------------------- loss
def loss_func(loss_mask: Any, output_tensor: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Megatron's GPT loss: masked sum of the per-token losses, the token count, and for reporting
    ``[masked sum, tokens]`` (megatron-core divides by the tokens and the micro batches)."""
    import torch

    losses = output_tensor.view(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum()
    report = torch.stack([loss.detach(), tokens.detach()])
    return loss, tokens.detach().to(torch.int), {"lm loss": report}


def forward_step(data_iterator: Iterator[Any] | None, model: Any, *, device: Any = None) -> tuple[Any, Any]:
    """megatron-core forward step: the chunk's micro batch (``None`` on middle stages), output, loss."""
    from megatron_zb.training.data import get_batch

    batch = get_batch(data_iterator, device=device)
    if batch is None:
        return model(None, None, None), partial(loss_func, None)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


# ---------------------------------------------------------------------------- the trainer
@dataclass
class _IterRecord:
    iteration: int
    loss: tuple[float, float] | None  # (masked sum, tokens) on ranks holding the last stage
    skipped: bool
    grad_norm: float | None
    lr: float
    loss_scale: float


@dataclass
class _Interval:
    records: list[_IterRecord] = field(default_factory=list)
    start: float = 0.0
    excluded: float = 0.0  # seconds of evaluation / checkpointing / re-planning inside the interval


def _print_rank_0(msg: str) -> None:
    from megatron_zb.training.logging_utils import print_rank_0
    print_rank_0(msg)


def _print_rank_last(msg: str) -> None:
    from megatron_zb.training.logging_utils import print_rank_last
    print_rank_last(msg)


class Trainer:
    """State of one ``pretrain_gpt_zb.py`` run (see the module docstring for the steps)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started_pg = False
        self.tb: Any = None
        self.iteration_of_step: dict[int, int] = {}  # post-validation: step index -> iteration

    # ------------------------------------------------------------------ setup
    def run(self) -> int:
        args = self.args
        self.t_start = time.perf_counter()
        self._init_distributed()
        self._build_model()
        self._build_optimizer()
        self._build_forward_backward()
        self.iteration = 0
        self.consumed_train_samples = 0
        self.consumed_valid_samples = 0
        self.restored_costs: Any = None
        self.saved_costs: Any = None
        if args.load:
            self._load()
        self._build_data()
        self._schedule_report_initial()
        from megatron_zb.training.logging_utils import tensorboard_writer
        self.tb = tensorboard_writer(args.tensorboard_dir)
        exited = self._train()
        if not exited:
            self._finish()
        return 0

    def close(self) -> None:
        import torch.distributed as dist

        if self.tb is not None:
            self.tb.close()
        if self.started_pg and dist.is_initialized():
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()

    def _init_distributed(self) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel

        args = self.args
        if int(os.environ.get("RANK", "0")) == 0:  # no process group yet
            print(f"> initializing torch distributed with {args.world_size} process(es), backend "
                  f"{args.distributed_backend} ...", flush=True)
        if args.distributed_backend == "nccl":
            torch.cuda.set_device(_local_rank())
        if not dist.is_initialized():
            if args.world_size == 1:
                os.environ.setdefault("RANK", "0")
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                if "MASTER_PORT" not in os.environ:
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
            dist.init_process_group(backend=args.distributed_backend, world_size=args.world_size,
                                    rank=int(os.environ.get("RANK", "0")),
                                    timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
            self.started_pg = True
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes)
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.device = torch.device("cuda", torch.cuda.current_device()) if args.distributed_backend == "nccl" \
            else torch.device("cpu")
        # Megatron's seeds: a different stream per pipeline rank; tensor-parallel streams forked by megatron.
        seed = args.seed + 100 * self.pp_rank
        random.seed(seed)
        import numpy as np
        np.random.seed(seed)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    def _build_model(self) -> None:
        import torch
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        from megatron_zb.model import build_gpt_chunks, cpu_gpt_config
        from megatron_zb.training.arguments import initial_schedule

        args = self.args
        t0 = time.perf_counter()
        _print_rank_0(f"> building model: GPT, {args.num_layers} layers, hidden {args.hidden_size}, "
                      f"{args.num_attention_heads} heads, sequence {args.seq_length}, vocabulary "
                      f"{args.padded_vocab_size} (padded); schedule {args.schedule} "
                      f"({args.schedule_placement} placement, {args.num_pipeline_stages} stages, layers per "
                      f"stage {args.num_layers_per_stage}) ...")
        self.schedule0 = initial_schedule(args)
        self.stage_to_rank = list(self.schedule0.stage_to_rank)
        config = cpu_gpt_config(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            sequence_parallel=args.sequence_parallel, params_dtype=args.params_dtype,
            pipeline_dtype=args.params_dtype, fp16=args.fp16, bf16=args.bf16, init_method_std=0.02)
        self.chunks = build_gpt_chunks(config=config, vocab_size=args.padded_vocab_size,
                                       max_sequence_length=args.max_position_embeddings,
                                       stage_to_rank=self.stage_to_rank, seed=args.seed,
                                       layers_per_stage=args.num_layers_per_stage)
        modules = []
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.bf16, overlap_grad_reduce=False,
            use_distributed_optimizer=args.use_distributed_optimizer)
        for i, chunk in enumerate(self.chunks):
            module: Any = chunk.module
            if self.device.type == "cuda":
                module.cuda(self.device)
            if args.fp16 or args.bf16:
                module = _chunk_float16_module(module.config, module, first=chunk.plan.pre_process,
                                               last=chunk.plan.post_process)
            modules.append(DistributedDataParallel(config=chunk.module.config, ddp_config=ddp_config,
                                                   module=module, disable_bucketing=i > 0))
        self.model = modules
        no_sync = [m.no_sync for m in modules] if len(modules) > 1 else modules[0].no_sync
        for chunk in self.chunks:
            chunk.module.config.no_sync_func = no_sync
            chunk.module.config.finalize_model_grads_func = finalize_model_grads
        n = sum(p.numel() for c in self.chunks for p in c.module.parameters())
        if self.dp_rank == 0:
            stages = [c.plan.stage for c in self.chunks]
            print(f" > model built: {n} parameters on this rank (tensor rank {self.tp_rank}, pipeline rank "
                  f"{self.pp_rank}, stages {stages}) in {time.perf_counter() - t0:.1f} s", flush=True)
        torch.distributed.barrier()

    def _build_optimizer(self) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        args = self.args
        cfg = OptimizerConfig(
            optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, fp16=args.fp16, bf16=args.bf16, params_dtype=args.params_dtype,
            loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
            use_distributed_optimizer=args.use_distributed_optimizer)
        inner = get_megatron_optimizer(cfg, self.model, use_gloo_process_groups=args.distributed_backend != "gloo")
        self.inner_optimizer = inner
        self.post_validation = args.enable_optimizer_post_validation
        if self.post_validation:
            from megatron_zb.optimizer import PostValidationOptimizer
            self.optimizer = PostValidationOptimizer(
                inner, exact=args.enable_exactly_numeric_match, warmup_iters=args.post_validation_warmup_iters,
                clean_iters_required=args.post_validation_fallback_clean_iters,
                timeout=60.0 * args.distributed_timeout_minutes)
            clean = args.post_validation_fallback_clean_iters
            mode = "exact" if args.enable_exactly_numeric_match else "in-place"
            _print_rank_0(f"> optimizer post-validation ({mode} rollback): synchronous steps in the first "
                          f"{args.post_validation_warmup_iters} iteration(s) (--post-validation-warmup-iters) and "
                          + (f"after a clipped or inf/nan step until {clean} consecutive clean one(s)" if clean else
                             "never after a clipped or inf/nan step")
                          + " (--post-validation-fallback-clean-iters)")
            # Every validation (begin_iteration, validate, or a method that validates first)
            # reports here: it fixes the LR schedule and that iteration's logged values.
            self.optimizer.register_validation_hook(self._handle_report)
        else:
            self.optimizer = inner
        for chunk in self.chunks:
            chunk.module.config.grad_scale_func = self.optimizer.scale_loss
        gbs = args.global_batch_size
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
            wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=args.override_opt_param_scheduler)

    def _build_forward_backward(self) -> None:
        args = self.args
        if args.use_megatron_core_schedule:
            from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func
            self.fb: Any = megatron_func()
            self.zb = None
            return
        from megatron_zb.runtime import get_forward_backward_func

        self.zb = get_forward_backward_func(args.schedule, memory_limit=args.schedule_memory_limit,
                                            num_chunks=args.num_model_chunks, timeout=args.pipeline_timeout_seconds)
        # Every rank built the initial schedule in validate_args; run global rank 0's everywhere, so that
        # a generator that is not deterministic across processes (e.g. a time-limited solver) cannot
        # give ranks different action lists.
        self.schedule0 = self._rank0_schedule(self.schedule0)
        self.zb.install_schedule(self.schedule0)
        self.fb = self.zb

    def _replan_on_rank0(self, costs: Any) -> tuple[str, Any, float]:
        """Rebuild the schedule from ``costs`` on global rank 0 and install it on every rank.

        Returns ``("ok", schedule, seconds)`` or ``("error", message, seconds)`` (then nothing changes).
        Collective.
        """
        import torch.distributed as dist

        from megatron_zb.schedules import ScheduleError

        args = self.args
        key = (args.pipeline_model_parallel_size, args.num_microbatches)
        old = self.zb.schedule_for(*key)
        outcome: list[Any] = [None]
        if dist.get_rank() == 0:
            t0 = time.perf_counter()
            try:
                self.zb.replan(costs, memory_limit=args.schedule_memory_limit)
                sched = self.zb.schedule_for(*key)
                outcome = [("ok", sched, time.perf_counter() - t0)]
            except ScheduleError as e:
                outcome = [("error", str(e), time.perf_counter() - t0)]
        dist.broadcast_object_list(outcome, src=0)
        status, payload, seconds = outcome[0]
        if status == "ok":
            self.zb.replan(costs, memory_limit=args.schedule_memory_limit)
            self.zb.install_schedule(self._rank0_schedule(payload))
        else:
            self.zb.install_schedule(old)
        return status, payload, seconds

    def _rank0_schedule(self, mine: Any) -> Any:
        """Global rank 0's schedule (broadcast); the placement must be the one the model was built for."""
        import torch.distributed as dist

        holder = [mine]
        dist.broadcast_object_list(holder, src=0)
        sched = holder[0]
        if list(sched.stage_to_rank) != self.stage_to_rank:
            raise RuntimeError(f"rank 0's schedule places stages as {sched.stage_to_rank}, this rank built "
                               f"{self.stage_to_rank}")
        return sched

    def _build_data(self) -> None:
        import torch.distributed as dist

        from megatron_zb.training.data import build_data_iterators, train_valid_test_num_samples

        args = self.args
        t0 = time.perf_counter()
        _print_rank_0("> building train, validation and test datasets ...")
        if args.mock_data:  # mock datasets are never cached; megatron-core warns about it once per split
            import logging
            logging.getLogger("megatron.core.datasets.gpt_dataset").addFilter(
                lambda r: "because path_to_cache is None" not in r.getMessage())
        train, valid, test = build_data_iterators(args, consumed_train_samples=self.consumed_train_samples,
                                                  consumed_valid_samples=self.consumed_valid_samples)
        needs = [c.plan.pre_process or c.plan.post_process for c in self.chunks]
        self.train_iters = chunk_iterators(train, needs)
        self.valid_iters = chunk_iterators(valid, needs)
        self.test_iters = chunk_iterators(test, needs)
        # Every rank must agree whether there is validation / test data (decided on data ranks).
        flags = [valid is not None, test is not None]
        holder = [flags]
        dist.broadcast_object_list(holder, src=0)
        self.has_valid, self.has_test = holder[0]
        n_train, n_valid, n_test = train_valid_test_num_samples(args)
        _print_rank_0(f"> data ready: {'mock' if args.mock_data else 'indexed'} data, {n_train} training, "
                      f"{n_valid} validation, {n_test} test samples requested; starting at sample "
                      f"{self.consumed_train_samples} ({time.perf_counter() - t0:.1f} s)")

    def _iterator_arg(self, iters: list[Any]) -> Any:
        return iters if len(iters) > 1 else iters[0]

    # ------------------------------------------------------------------ schedule report
    def _schedule_report_initial(self) -> None:
        from megatron_zb.schedules import simulate
        from megatron_zb.schedules.costs import CostModel
        from megatron_zb.training.logging_utils import format_schedule_report
        from megatron_zb.training.profiling import mem_w_ratio

        args = self.args
        ratio = mem_w_ratio(hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                            seq_length=args.seq_length)
        sched = self.zb.schedule_for(args.pipeline_model_parallel_size, args.num_microbatches) if self.zb \
            else self.schedule0
        sim = simulate(sched, CostModel(mem_w=ratio), enforce_memory=False)
        name = args.schedule + (" (megatron-core's own forward_backward_func)" if args.use_megatron_core_schedule
                                else "")
        title = "schedule report (unit costs T_F = T_B = T_W = 1, before profiling)"
        measured = None
        if self.restored_costs is not None:
            title = "schedule report (rebuilt from the profiled costs stored in the checkpoint)"
            sim = simulate(sched, self.restored_costs, enforce_memory=False)
            sc = self.restored_costs.resolve(args.num_pipeline_stages)
            measured = {"T_F": sum(sc.t_f) / len(sc.t_f), "T_B": sum(sc.t_b) / len(sc.t_b),
                        "T_W": sum(sc.t_w) / len(sc.t_w), "T_comm": sc.t_comm}
        _print_rank_0(format_schedule_report(
            schedule=name, num_ranks=args.pipeline_model_parallel_size, num_microbatches=args.num_microbatches,
            predicted_bubble_rate=sim.bubble_rate, peak_activation_memory=sim.peak_memory,
            memory_limit=args.schedule_memory_limit, measured_costs=measured, title=title))

    # ------------------------------------------------------------------ checkpoints
    def _load(self) -> None:
        from megatron_zb.training.checkpointing import load_checkpoint

        args = self.args
        t0 = time.perf_counter()
        _print_rank_0(f"> loading checkpoint from {args.load} ...")
        state = load_checkpoint(args.load, chunks=[c.module for c in self.chunks], optimizer=self.optimizer,
                                scheduler=self.scheduler, args=args)
        if state is None:
            _print_rank_0(f"WARNING: no checkpoint in {args.load} (no latest_checkpointed_iteration.txt); "
                          f"training from scratch")
            return
        self.iteration = state["iteration"]
        self.consumed_train_samples = int(state.get("consumed_train_samples", 0))
        self.consumed_valid_samples = int(state.get("consumed_valid_samples", 0))
        if not state["rng_restored"]:
            _print_rank_0("WARNING: the checkpoint was saved with another (pipeline, tensor, data)-parallel layout; "
                          "random states are not restored (dropout streams start afresh)")
        zb = state.get("zero_bubble") or {}
        same = zb.get("schedule") == args.schedule and zb.get("num_stages") == args.num_pipeline_stages
        costs = zb.get("costs") if same else None
        self.saved_costs = costs  # carried into this run's checkpoints unless profiled again
        if (costs is not None and self.zb is not None and args.schedule_cost_aware
                and self.iteration >= args.zero_bubble_pipeline_timers_end_iter - 1):
            from megatron_zb.schedules.costs import CostModel
            cm = CostModel(**costs)
            status, payload, _ = self._replan_on_rank0(cm)
            if status == "ok":
                self.restored_costs = cm
            else:
                _print_rank_0(f"WARNING: cannot rebuild the schedule from the checkpoint's profiled costs "
                              f"({payload}); using the unit-cost schedule")
        _print_rank_0(f"  successfully loaded checkpoint from {state['path']} at iteration {self.iteration} "
                      f"({time.perf_counter() - t0:.1f} s)")

    def _save(self) -> None:
        from megatron_zb.training.checkpointing import save_checkpoint

        args = self.args
        t0 = time.perf_counter()
        extra = {"zero_bubble": {"schedule": args.schedule, "num_stages": args.num_pipeline_stages,
                                 "costs": self.saved_costs}}
        path = save_checkpoint(args.save, iteration=self.iteration, chunks=[c.module for c in self.chunks],
                               optimizer=self.optimizer, scheduler=self.scheduler,
                               consumed_train_samples=self.consumed_train_samples,
                               consumed_valid_samples=self.consumed_valid_samples, args=args, extra=extra)
        self.last_saved = self.iteration
        _print_rank_0(f"  successfully saved checkpoint from iteration {self.iteration:7d} to {path} "
                      f"({time.perf_counter() - t0:.1f} s)")

    # ------------------------------------------------------------------ training
    def _train(self) -> bool:
        """The loop; returns True when it stopped at ``--exit-interval``."""
        import torch

        args = self.args
        for m in self.model:
            m.train()
        self.last_saved = self.iteration if args.load else None
        self.interval = _Interval(start=time.perf_counter())
        self.total_skipped = 0
        self.history: list[dict[str, Any]] = []  # exact per-iteration values (for --loss-log-json)
        self.valid_history: list[dict[str, Any]] = []
        from megatron_zb.training.profiling import ActionProfile
        self.profile = ActionProfile()
        self.profiled_iterations: list[int] = []
        start, end = args.zero_bubble_pipeline_timers_start_iter, args.zero_bubble_pipeline_timers_end_iter
        _print_rank_0(f"> training: iterations {self.iteration + 1} to {args.train_iters}, {args.num_microbatches} "
                      f"micro batches of {args.micro_batch_size} per iteration per data-parallel rank"
                      + (f"; profiling iterations {start}-{end - 1}, then re-planning" if self.zb is not None
                         and self.iteration < end - 1 else ""))
        while self.iteration < args.train_iters:
            it = self.iteration + 1
            profiling = self.zb is not None and start <= it < end
            if self.zb is not None:
                self.zb.options.time_actions = profiling
            record = self._train_step(it, profiling)
            self.iteration = it
            self.consumed_train_samples += args.global_batch_size
            self.interval.records.append(record)
            if profiling and it == min(end - 1, args.train_iters) and self.profiled_iterations:
                t0 = time.perf_counter()
                self._replan()
                self.interval.excluded += time.perf_counter() - t0
            if it % args.log_interval == 0:
                self._log_interval()
            if args.eval_iters > 0 and self.has_valid and it % args.eval_interval == 0:
                t0 = time.perf_counter()
                self._evaluate(f"iteration {it}", self.valid_iters, valid=True)
                self.interval.excluded += time.perf_counter() - t0
            if args.save and args.save_interval and it % args.save_interval == 0:
                t0 = time.perf_counter()
                self._finalize_optimizer()
                self._save()
                self.interval.excluded += time.perf_counter() - t0
            if args.exit_interval and it % args.exit_interval == 0:
                if self.interval.records:
                    self._log_interval(print_line=False)
                self._finalize_optimizer()
                if args.save and self.last_saved != it:
                    self._save()
                torch.distributed.barrier()
                _print_rank_0(f"> exiting program at iteration {it} (--exit-interval {args.exit_interval})")
                self._write_loss_json()
                return True
        return False

    def _finalize_optimizer(self) -> None:
        if self.post_validation:
            self.optimizer.finalize()  # reports through _handle_report

    def _handle_report(self, report: Any) -> None:
        """A post-validation report of an earlier step: fix the LR schedule and that iteration's record."""
        it = self.iteration_of_step.pop(report.iteration, None)
        if it is None:
            return
        if report.changed and not report.result.update_successful:
            self.scheduler.step(increment=-self.args.global_batch_size)
        if report.changed and report.result.update_successful:
            self.scheduler.step(increment=self.args.global_batch_size)
        for r in self.interval.records:
            if r.iteration == it:
                r.skipped = not report.result.update_successful
                r.grad_norm = report.result.grad_norm
                r.lr = self._lr()
                r.loss_scale = self._loss_scale()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _loss_scale(self) -> float:
        # The wrapped optimizer's: the post-validation wrapper's get_loss_scale would validate first.
        return float(self.inner_optimizer.get_loss_scale().item())

    def _train_step(self, it: int, profiling: bool) -> _IterRecord:
        import torch

        args = self.args
        if self.post_validation:
            self.optimizer.begin_iteration()  # validates the previous step (reports to _handle_report)
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        t0 = time.perf_counter()
        out = self.fb(forward_step_func=partial(forward_step, device=self.device),
                      data_iterator=self._iterator_arg(self.train_iters), model=self.model,
                      num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                      forward_only=False)
        fb_time = time.perf_counter() - t0
        if profiling and self.zb.last_timing is not None:
            self.profile.add(self.zb.last_timing, fb_time)
            self.profiled_iterations.append(it)
        if self.post_validation:
            self.iteration_of_step[self.optimizer.iteration] = it
        update_successful, grad_norm, _ = self.optimizer.step()
        if self.post_validation and not self.optimizer.pending:
            self.iteration_of_step.pop(self.optimizer.iteration - 1, None)  # final already (synchronous step)
        if update_successful:
            self.scheduler.step(increment=args.global_batch_size)
        loss = None
        if out:
            total = torch.zeros(2, dtype=torch.float64)
            for d in out:
                total += d["lm loss"].detach().to("cpu", torch.float64)
            loss = (float(total[0]), float(total[1]))
        return _IterRecord(iteration=it, loss=loss, skipped=not update_successful,
                           grad_norm=None if grad_norm is None else float(grad_norm), lr=self._lr(),
                           loss_scale=self._loss_scale())

    # ------------------------------------------------------------------ profiling and re-planning
    def _replan(self) -> None:
        import torch

        from megatron_zb.schedules import simulate
        from megatron_zb.training.logging_utils import format_schedule_report
        from megatron_zb.training.profiling import agree_on_profile, cost_model, measure_t_comm

        args = self.args
        self.zb.options.time_actions = False
        tp = args.tensor_model_parallel_size
        seq = args.seq_length // tp if args.sequence_parallel else args.seq_length
        t_comm = measure_t_comm(shape=(seq, args.micro_batch_size, args.hidden_size), dtype=args.params_dtype,
                                device=self.device, group=self.pp_group)
        agreed = agree_on_profile(self.profile, t_comm, pp_group=self.pp_group)
        stages = args.num_pipeline_stages
        pp, m = args.pipeline_model_parallel_size, args.num_microbatches
        try:
            costs = cost_model(agreed, num_stages=stages, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                               memory_limit=args.schedule_memory_limit)
        except ValueError as e:
            _print_rank_0(f"WARNING: profiling gave no usable costs ({e}); keeping the schedule")
            return
        before = simulate(self.zb.schedule_for(pp, m), costs, enforce_memory=False)
        note = ""
        if args.schedule_cost_aware:
            status, payload, seconds = self._replan_on_rank0(costs)
            if status == "ok":
                note = (f"    re-planned {args.schedule!r} from the measured costs in {seconds:.2f} s; the "
                        f"unit-cost schedule would have a predicted bubble rate of {100 * before.bubble_rate:.1f}% "
                        f"under them")
                self.saved_costs = dataclasses.asdict(costs)
            else:  # the unit-cost schedule stays
                note = f"    WARNING: re-planning failed ({payload}); keeping the unit-cost schedule"
        else:
            note = f"    schedule {args.schedule!r} is not cost-aware: kept as is"
        sched = self.zb.schedule_for(pp, m)
        sim = simulate(sched, costs, enforce_memory=False)
        first, last = self.profiled_iterations[0], self.profiled_iterations[-1]
        report = format_schedule_report(
            schedule=args.schedule, num_ranks=pp, num_microbatches=m, predicted_bubble_rate=sim.bubble_rate,
            peak_activation_memory=sim.peak_memory, memory_limit=args.schedule_memory_limit,
            measured_idle_fraction=agreed.idle_fraction, measured_costs=agreed.report_costs(stages),
            title=f"schedule report after profiling iterations {first}-{last} "
                  f"(costs: mean over stages, ms; idle: 1 - busy/elapsed per pipeline rank)")
        per_stage = "    measured per stage (ms): " + "; ".join(
            f"{name}=[{', '.join(f'{v:.3f}' for v in vals)}]"
            for name, op in (("T_F", "F"), ("T_B", "B"), ("T_W", "W"), ("T_BW", "BW"))
            if (vals := agreed.per_stage(op, stages)) is not None)
        _print_rank_0(report + "\n" + per_stage + "\n" + note)
        torch.distributed.barrier()

    # ------------------------------------------------------------------ logging
    def _gather_losses(self, values: list[tuple[float, float] | None], count: int) -> list[tuple[float, float]]:
        """``count`` (masked sum, tokens) pairs from the last stage, summed over DP, on every rank."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        holder_pp = self.stage_to_rank[-1]
        buf = torch.zeros(2 * count, dtype=torch.float64, device=self.device)
        if self.pp_rank == holder_pp:
            buf.copy_(torch.tensor([x for v in values for x in (v if v is not None else (0.0, 0.0))],
                                   dtype=torch.float64))
            if parallel_state.get_data_parallel_world_size() > 1:
                dist.all_reduce(buf, group=parallel_state.get_data_parallel_group())
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(buf, src=dist.get_global_rank(self.pp_group, holder_pp), group=self.pp_group)
        vals = buf.cpu().tolist()
        return [(vals[2 * i], vals[2 * i + 1]) for i in range(count)]

    def _log_interval(self, print_line: bool = True) -> None:
        import torch.distributed as dist

        from megatron_zb.training.logging_utils import format_iteration_line

        args = self.args
        if self.post_validation:
            self.optimizer.validate()  # the line reports validated values (reports to _handle_report)
        now = time.perf_counter()
        interval = self.interval
        records = interval.records
        losses = self._gather_losses([r.loss for r in records], len(records))
        rollbacks = None
        if self.post_validation:
            import torch
            c = torch.tensor([self.optimizer.reset_interval_counters().rollbacks], dtype=torch.float64,
                             device=self.device)
            dist.all_reduce(c, op=dist.ReduceOp.MAX)
            rollbacks = int(c.item())
        per_iter = []
        for r, (num, den) in zip(records, losses):
            value = num / den if den > 0 else float("nan")
            per_iter.append(value)
            self.history.append({"iteration": r.iteration, "lm loss": value, "skipped": r.skipped,
                                 "learning rate": r.lr, "grad norm": r.grad_norm, "loss scale": r.loss_scale})
        # As Megatron: skipped iterations do not enter the average; a skipped iteration whose loss
        # is inf/nan counts as a nan iteration; the loss field is left out when nothing is averaged.
        kept = [v for r, v in zip(records, per_iter) if not r.skipped]
        nan_iters = sum(1 for r, v in zip(records, per_iter) if r.skipped and not math.isfinite(v))
        finite = kept
        skipped = sum(1 for r in records if r.skipped)
        self.total_skipped += skipped
        n = len(records)
        elapsed = max(0.0, now - interval.start - interval.excluded) / max(1, n)
        last = records[-1]
        if print_line:
            line = format_iteration_line(
                iteration=last.iteration, train_iters=args.train_iters, consumed_samples=self.consumed_train_samples,
                elapsed_ms=1e3 * elapsed, throughput=args.global_batch_size / elapsed if elapsed > 0 else None,
                learning_rate=last.lr, global_batch_size=args.global_batch_size,
                losses={"lm loss": sum(finite) / len(finite)} if finite else {},
                loss_scale=last.loss_scale, grad_norm=last.grad_norm, skipped_iterations=skipped,
                nan_iterations=nan_iters, rollbacks=rollbacks)
            _print_rank_last(line)
            if self.tb is not None and self.tb.enabled:
                scalars = {"learning-rate": last.lr, "loss-scale": last.loss_scale,
                           "iteration-time": elapsed}
                if finite:
                    scalars["lm loss"] = sum(finite) / len(finite)
                if last.grad_norm is not None:
                    scalars["grad-norm"] = last.grad_norm
                self.tb.add_scalars(scalars, last.iteration)
                self.tb.flush()
        self._write_loss_json()
        self.interval = _Interval(start=time.perf_counter())

    def _write_loss_json(self) -> None:
        from megatron_zb.training.logging_utils import is_last_rank

        path = self.args.loss_log_json
        if not path or not is_last_rank():
            return
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"schedule": self.args.schedule, "megatron_core_schedule": self.args.use_megatron_core_schedule,
                       "train": self.history, "valid": self.valid_history}, f, indent=1)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, prefix: str, iters: list[Any], *, valid: bool) -> float:
        import torch

        args = self.args
        if self.post_validation:
            self.optimizer.validate()  # evaluate the validated parameters
        for m in self.model:
            m.eval()
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for _ in range(args.eval_iters):
                out = self.fb(forward_step_func=partial(forward_step, device=self.device),
                              data_iterator=self._iterator_arg(iters), model=self.model,
                              num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                              micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                              forward_only=True)
                for d in out or []:
                    total += d["lm loss"].detach().to("cpu", torch.float64)
        for m in self.model:
            m.train()
        if valid:
            self.consumed_valid_samples += args.eval_iters * args.global_batch_size
        [(num, den)] = self._gather_losses([(float(total[0]), float(total[1]))], 1)
        loss = num / den if den > 0 else float("nan")
        ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
        string = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        bar = "-" * (len(string) + 1)
        _print_rank_last(bar + "\n" + string + "\n" + bar)
        self.valid_history.append({"prefix": prefix, "iteration": self.iteration, "lm loss": loss, "ppl": ppl})
        if self.tb is not None and self.tb.enabled and valid:
            self.tb.add_scalars({"lm loss validation": loss, "lm loss validation ppl": ppl}, self.iteration)
        return loss

    def _finish(self) -> None:
        import torch

        args = self.args
        if self.interval.records:
            self._log_interval(print_line=False)  # the last iterations' exact values (no log line: as Megatron)
        self._finalize_optimizer()
        if args.save and self.last_saved != self.iteration:
            self._save()
        if args.eval_iters > 0:
            if self.has_valid:
                self._evaluate(f"iteration {self.iteration} on validation set", self.valid_iters, valid=True)
            if self.has_test:
                self._evaluate(f"iteration {self.iteration} on test set", self.test_iters, valid=False)
        self._write_loss_json()
        if self.post_validation:
            c = self.optimizer.counters()
            _print_rank_0(f"> optimizer post-validation (rank 0): {c.eager_steps} eager steps, {c.sync_steps} "
                          f"synchronous steps, {c.rollbacks} rollbacks, {c.clipped_iterations} clipped, "
                          f"{c.skipped_iterations} skipped iterations")
        torch.distributed.barrier()
        _print_rank_0(f"> training done: {self.iteration} iterations, {self.total_skipped} skipped, "
                      f"{time.perf_counter() - self.t_start:.1f} s in all")


def _chunk_float16_module(config: Any, module: Any, *, first: bool, last: bool) -> Any:
    """megatron-core's ``Float16Module`` deciding first/last by the chunk's stage, not the pipeline rank.

    megatron-core's own asks ``parallel_state`` (pipeline rank, virtual stage), which is wrong for
    V / interleaved chunks built with ``vp_stage=None``: e.g. on a V's rank 0 the last stage's
    loss would stay in half precision, on the last rank a middle chunk's output would become fp32.
    """
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

    class ChunkFloat16Module(Float16Module):
        def forward(self, *inputs: Any, fp32_output: bool = True, **kwargs: Any) -> Any:
            if first:
                inputs = fp32_to_float16(inputs, self.float16_convertor)
            outputs = self.module(*inputs, **kwargs)
            if last and fp32_output is True:
                outputs = float16_to_fp32(outputs)
            return outputs

    return ChunkFloat16Module(config, module)
