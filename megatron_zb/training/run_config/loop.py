"""The training loop's sections of the run configuration: checkpoint saving, loading and early
exit, the iteration log (TensorBoard, W&B, ``--loss-log-json``), Megatron-LM's ``--profile`` window,
host and CUDA memory housekeeping."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Union

from .fields import read_section

__all__ = ["CheckpointConfig", "LoggingConfig", "MemoryConfig", "ProfilingConfig"]


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints are saved and loaded, what ``--load`` restores and when a run saves and
    exits early (Megatron-LM's meanings)."""

    save: str | None = None
    """``--save``: the directory checkpoints are written to; ``None``: none written."""
    load: str | None = None
    """``--load``: the directory a checkpoint is loaded from at start-up; ``None``: start from scratch."""
    dist_ckpt_strictness: str = "assume_ok_unexpected"
    """``--dist-ckpt-strictness``: megatron-core's ``StrictHandling`` of missing / unexpected keys at load."""
    save_interval: int | None = None
    """``--save-interval``: with ``--save``, a checkpoint after every this many iterations
    (``None`` or 0: only at the end and on an early exit) [iterations]."""
    ckpt_step: int | None = None
    """``--ckpt-step``: with ``--load``, the iteration whose checkpoint is loaded; ``None``: the one
    ``latest_checkpointed_iteration.txt`` names [iterations]."""
    ckpt_verify: bool = True
    """``--no-ckpt-verify`` sets it ``False``: the checkpoint ``--load`` reads is not verified against its
    manifest's checksums (reading it once more, about 0.45 s per GB per rank on a 2-core CPU)."""
    no_load_optim: bool = False
    """``--no-load-optim``: keep this run's fresh optimizer state and LR scheduler; the fp32 main
    parameters are refreshed from the loaded model (megatron-core's ``reload_model_params``)."""
    no_load_rng: bool = False
    """``--no-load-rng``: keep this run's random states (seeded by ``--seed``)."""
    finetune: bool = False
    """``--finetune``: load the model only: iteration 0, no consumed samples, no optimizer / LR
    scheduler / random states / profiled costs from the checkpoint."""
    exit_interval: int | None = None
    """``--exit-interval``: save (``--save``) and exit 0 after the first iteration divisible by it;
    ``None`` or 0: never [iterations]."""
    exit_signal_handler: bool = False
    """``--exit-signal-handler``: on :attr:`exit_signal`, finish the iteration, save (``--save``) and
    exit 0; every rank checks after every iteration."""
    exit_signal: signal.Signals = signal.SIGTERM
    """``--exit-signal``: the signal :attr:`exit_signal_handler` handles."""
    exit_duration_in_mins: float | None = None
    """``--exit-duration-in-mins``: after the first iteration that ends this long after the run
    started, save (``--save``) and exit 0; checked on every rank after every iteration [minutes]."""

    @classmethod
    def from_args(cls, args: Any) -> "CheckpointConfig":
        """The section of validated ``args`` (Megatron-LM's ``--no-load-*`` default to ``None``: off).
        The LR-schedule flags of ``--load`` are :class:`~.optim.OptimConfig`'s."""
        return read_section(cls, args, no_load_optim=bool(args.no_load_optim), no_load_rng=bool(args.no_load_rng),
                            exit_duration_in_mins=args.exit_duration_in_mins or None)


@dataclass(frozen=True)
class LoggingConfig:
    """When and where a run reports: the iteration line, TensorBoard, W&B, ``--loss-log-json``
    (Megatron-LM's "logging" flags)."""

    log_interval: int = 100
    """``--log-interval``: an iteration line (and Megatron-LM's timers) after every this many
    iterations [iterations]."""
    logging_level: int | None = None
    """``--logging-level``: the root logger's level (``logging.INFO`` = 20); ``None``: ``$MEGATRON_LOGGING_LEVEL``,
    else unchanged (:func:`~megatron_zb.training.logging_utils.set_logging_level`)."""
    tensorboard_dir: str | None = None
    """``--tensorboard-dir``: where TensorBoard scalars are written; ``None``: nowhere."""
    log_throughput: bool = False
    """``--log-throughput``: the model's TFLOP/s per GPU in the iteration line [TFLOP/s]."""
    log_timers_to_tensorboard: bool = False
    """``--log-timers-to-tensorboard``: the timers in TensorBoard [s per iteration]."""
    loss_log_json: str | None = None
    """``--loss-log-json`` (developer flag): the file the last rank writes every iteration's exact
    values to; ``None``: not written."""
    wandb_project: str | None = None
    """``--wandb-project``: the W&B project the scalars go to (last rank); ``None``: no W&B."""
    wandb_exp_name: str | None = None
    """``--wandb-exp-name``: the W&B run name."""
    wandb_save_dir: str | None = None
    """``--wandb-save-dir``: W&B's files; ``None``: ``SAVE/wandb`` with ``--save``, else ``./wandb``."""
    wandb_config: tuple[tuple[str, Union[int, float, str, bool]], ...] = field(default=(), compare=False, repr=False)
    """W&B's run config with ``--wandb-project``: every flag of the validated command line whose value
    is a number, a string or a boolean, as ``(dest, value)`` pairs (Megatron-LM gives W&B ``vars(args)``).
    Read by nothing else; not compared, not in ``repr``."""

    log_params_norm: bool = False
    """``--log-params-norm``: ``params norm`` in the iteration line and ``params-norm`` in TensorBoard:
    the L2 norm of the model's parameters after the step, over all ranks (Megatron-LM's
    ``calc_params_l2_norm``) [parameter units]."""
    log_memory_to_tensorboard: bool = False
    """``--log-memory-to-tensorboard``: CUDA caching-allocator statistics in TensorBoard
    (``mem-reserved-bytes``, ``mem-allocated-bytes``, ``mem-max-allocated-bytes`` [bytes],
    ``mem-allocated-count``); nothing on CPU."""
    timing_log_level: int = 0
    """``--timing-log-level``: Megatron-LM's timers, 0 (none), 1 or 2 (:mod:`~megatron_zb.training.timing_log`)."""
    timing_log_option: str = "minmax"
    """``--timing-log-option``: ``"max"``, ``"minmax"`` or ``"all"`` (over ranks)."""
    barrier_with_L1_time: bool = True
    """Cleared by ``--no-barrier-with-level-1-timing``: level-1 timers start after a barrier."""

    @classmethod
    def from_args(cls, args: Any) -> "LoggingConfig":
        """The section of validated ``args``."""
        wandb_config = tuple((k, v) for k, v in vars(args).items() if isinstance(v, (int, float, str, bool)))
        return read_section(cls, args, wandb_config=wandb_config)


@dataclass(frozen=True)
class ProfilingConfig:
    """Megatron-LM's ``--profile`` window (its ``ProfilingConfig``); iterations are global, 1-based."""

    profile: bool = False
    """``--profile``: profile the window below on the ranks of :attr:`profile_ranks`."""
    profile_step_start: int = 10
    """``--profile-step-start`` [iterations completed when the window opens]."""
    profile_step_end: int = 12
    """``--profile-step-end`` [iteration after which the window closes]."""
    profile_ranks: tuple[int, ...] = (0,)
    """``--profile-ranks``: global ranks that profile."""
    use_pytorch_profiler: bool = False
    """``--use-pytorch-profiler``: PyTorch's profiler (always on CPU); else CUDA's capture range
    (``cudaProfilerStart/Stop`` with NVTX ranges, for ``nsys --capture-range=cudaProfilerApi``)."""
    trace_dir: str | None = None
    """Where the PyTorch profiler writes one Chrome trace per profiled rank: ``--tensorboard-dir``."""

    @classmethod
    def from_args(cls, args: Any) -> "ProfilingConfig":
        """The section of validated ``args``."""
        return read_section(cls, args, profile_ranks=tuple(args.profile_ranks), trace_dir=args.tensorboard_dir)


@dataclass(frozen=True)
class MemoryConfig:
    """Host garbage collection and the CUDA caching allocator (Megatron-LM's training flags)."""

    manual_gc: bool = False
    """``--manual-gc``: Python's automatic garbage collector off for the run; collections at
    :attr:`manual_gc_interval` and around evaluation instead, at the same point on every rank."""
    manual_gc_interval: int = 0
    """``--manual-gc-interval``: a full collection after every this many iterations (0: none) [iterations]."""
    manual_gc_eval: bool = True
    """Cleared by ``--no-manual-gc-eval``: with ``--manual-gc``, collect before and after each
    evaluation during training."""
    empty_unused_memory_level: int = 0
    """``--empty-unused-memory-level``: ``torch.cuda.empty_cache()`` after forward-backward and each
    evaluation step (1), and also after the optimizer step (2); 0: never. No-op on CPU."""

    @classmethod
    def from_args(cls, args: Any) -> "MemoryConfig":
        """The section of validated ``args``."""
        return read_section(cls, args)
