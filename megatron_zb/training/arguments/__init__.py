"""The command line of ``pretrain_gpt_zb.py``: Megatron's GPT flags plus the zero-bubble ones.

Flag names and meanings follow Megatron-LM's ``pretrain_gpt.py`` so that a user's existing
command keeps working with ``--enable-zero-bubble`` added. Entry points:

* :func:`build_parser` -- the :class:`argparse.ArgumentParser` (groups as in Megatron);
* :func:`parse_args` -- parse ``argv`` (no checks beyond argparse's own);
* :func:`validate_args_and_schedule` -- check every flag combination *before* any process group
  starts, fill in derived values and return them with the schedule built (unit costs) to check
  that it exists and the start-up log lines of adjusted flags (:class:`ValidatedArgs`);
  :func:`validate_args` is the same returning only the args (Megatron-LM's contract). Both are
  idempotent: validating validated args again changes nothing. Everything wrong is reported at
  once: one :class:`ArgumentError` whose ``problems`` each name a flag and the fix (the parser's
  unknown flags, ``parser.parse_known_flags``, first; then every failing check of
  :data:`.validation.CHECKS`, skipping the checks whose inputs a failed check was to provide).

One module per flag group, each holding the group's flags (``add_*_args``), its checks and its
derived values: :mod:`.model` (network size), :mod:`.training` (batch, iterations, optimizer,
learning rate, mixed precision), :mod:`.implementation` (``--transformer-impl``, gradient-accumulation
fusion), :mod:`.kernels` (attention backend, fusions), :mod:`.recompute` (activation recomputation, uneven pipeline split),
:mod:`.mla` (multi-latent attention), :mod:`.parallel`
(distributed), :mod:`.data` (data and
tokenizer), :mod:`.checkpointing_logging`, :mod:`.housekeeping` (profiling, garbage collection, the
CUDA cache), :mod:`.zero_bubble` (schedule, memory limit, profiling,
post-validation) and :mod:`.developer` (``pretrain_gpt_zb.py``'s extra flags). :mod:`.validation`
orders the checks (with what each needs) and holds the numeric ranges of all flags;
:mod:`.flags` turns unknown flags into problems; :mod:`.fork_flags` answers the flags of the zero-bubble
fork and of VocabularyParallelism; :mod:`.support` classes every Megatron-LM flag
(implemented / accepted / refused) for the table of docs/training.md (``scripts/flag_table.py``).

Adding a flag: ``g.add_argument`` in its group's ``add_*_args`` (Megatron's name, default and
help; a new group is a new module whose ``add_*_args`` joins ``_GROUPS`` below); a numeric range
in the tables of :mod:`.validation`; a check across flags, or a derived value, as a function of
the group's module, added to :data:`.validation.CHECKS` with the checks it needs (raise
:class:`ArgumentError` naming the flag to change; a flag adjusted or accepted without effect adds a
start-up line with :func:`.common.notice`); list derived values in the table below, and a
Megatron-LM flag accepted without (full) effect in :data:`.support.ACCEPTED`; then run
``python scripts/flag_table.py``.

Derived values set by :func:`validate_args` (units in brackets):

==================================  ===========================================================
``world_size``                      processes in the job
``data_parallel_size``              ``world_size / (TP * PP)``
``num_microbatches``                micro batches per iteration per DP rank,
                                    ``global_batch_size / (micro_batch_size * DP)``
``schedule``                        resolved schedule name (``1f1b`` when no zero-bubble flag; with
                                    ``--enable-vocab-parallel`` and no ``--schedule``, the family's
                                    ``-vocab-2`` form, ``-vocab-1`` with ``--disable-backward-fusion``);
                                    the ``--schedule`` flag itself is ``schedule_requested``
``schedule_selected_by``            the flag that chose the schedule (for error messages)
``schedule_placement``              ``"plain"``, ``"interleaved"`` or ``"v"``
``split_backward``                  whether the schedule splits backward into B and W
``schedule_cost_aware``             whether the schedule is rebuilt from profiled costs
``num_model_chunks``                model chunks (pipeline stages) per pipeline rank
``virtual_pipeline_model_parallel_size``  ``num_model_chunks`` if > 1 else ``None`` (Megatron)
``num_pipeline_stages``             ``PP * num_model_chunks``
``num_layers_per_stage``            transformer layers per pipeline stage, stage order
``zero_bubble_max_pending_backward``  resolved limit [micro batches of activations per rank]
                                    or ``None`` (the schedule's own default)
``zero_bubble_max_pending_backward_given``  whether that limit came from the flag (not a default)
``schedule_memory_limit``           the same limit in the schedule library's unit (one stage's
                                    activation ``M_B``; ``N * num_model_chunks``) or ``None``
``ffn_hidden_size``                 default ``4 * hidden_size`` (``--swiglu``: ``int(8h / 3 / 64) * 64``)
``max_position_embeddings``         default ``seq_length``
``kv_channels``                     ``--kv-channels``, default ``hidden_size / num_attention_heads``
``params_dtype``                    ``torch.float16`` / ``torch.bfloat16`` / ``torch.float32``
``train_iters``                     ``--train-iters``, or from ``--train-samples`` (Megatron-LM's
                                    ``update_train_iters``, the ramp-up's iterations included)
                                    [iterations]; the flag itself is ``train_iters_requested``
``lr_decay_iters``                  with ``--train-iters``: default ``train_iters`` [iterations]
``lr_decay_samples``                with ``--train-samples``: default ``train_samples`` [samples]
``distributed_backend``             ``"nccl"`` or ``"gloo"`` (``auto`` resolved)
``expert_tensor_parallel_size``     ``--tensor-model-parallel-size`` (the only value accepted, as
                                    Megatron-LM's default)
``post_validation_warmup_iters``    with ``--enable-optimizer-post-validation``: the flag's value,
                                    default 10 [iterations]; ``None`` without post-validation
``post_validation_fallback_clean_iters``  the same for ``--post-validation-fallback-clean-iters``
``data_blend``                      ``(prefixes, weights or None)`` or ``None`` with mock data
``vocab_size``                      ``--vocab-size``, else the tokenizer's [tokens]
``tokenizer_vocab_size``            the tokenizer's vocabulary (NullTokenizer: ``--vocab-size`` + 1, EOD)
``padded_vocab_size``               embedding rows: the larger of the two above, rounded up to
                                    ``make_vocab_size_divisible_by * TP`` (what the model uses)
``transformer_impl``                ``"local"`` or ``"transformer_engine"`` (default resolved);
                                    the flag itself is ``transformer_impl_requested``
``transformer_impl_reason``         why that implementation (one phrase for the start-up log)
``transformer_engine_version``      installed Transformer Engine >= 2.3, or ``None``
``gradient_accumulation_fusion``    resolved (default: apex's fused kernels importable with CUDA);
                                    the flag itself is ``gradient_accumulation_fusion_requested``
``wgrad_kernel``                    which kernel accumulates weight gradients (start-up log)
``validation_notices``              the start-up log lines (also ``ValidatedArgs.notices``)
``sequence_parallel``               off at TP 1 (logged, as Megatron-LM); the flag itself is
                                    ``sequence_parallel_requested``
``check_for_nan_in_loss_and_grad``  off for fp16 with dynamic loss scaling (logged, as Megatron-LM);
                                    the flag itself is ``check_for_nan_in_loss_and_grad_requested``
``overlap_p2p_comm``                -> ``ModelParallelConfig.overlap_p2p_comm``: several model chunks
                                    per rank and no ``--no-overlap-p2p-communication`` (Megatron-LM's
                                    rule); the flag itself is ``overlap_p2p_comm_requested``
``batch_p2p_comm``                  -> ``ModelParallelConfig.batch_p2p_comm``: ``not overlap_p2p_comm``
``barrier_with_L1_time``            -> ``ModelParallelConfig`` / ``OptimizerConfig.barrier_with_L1_time``
                                    with ``--timing-log-level`` >= 1 (:mod:`..timing_log`)
``attention_backend``               -> ``TransformerConfig.attention_backend`` (``AttnBackend``;
                                    checked against the layer spec)
``masked_softmax_fusion``           -> ``TransformerConfig.masked_softmax_fusion``: the flag (default
                                    on, as Megatron-LM) and CUDA with the fused softmax kernels
``bias_activation_fusion``          -> ``TransformerConfig.bias_activation_fusion``: ``--swiglu``:
                                    ``bias_swiglu_fusion``, else ``bias_gelu_fusion`` and linear
                                    biases (Megatron-LM's rules); and CUDA
``bias_dropout_fusion``             -> ``TransformerConfig.bias_dropout_fusion``: the flag and CUDA
``apply_rope_fusion``               -> ``TransformerConfig.apply_rope_fusion``: the flag, RoPE, CUDA and
                                    Transformer Engine
``persist_layer_norm``              -> ``TransformerConfig.persist_layer_norm``: not
                                    ``--no-persist-layer-norm``, CUDA and apex
``cross_entropy_loss_fusion``       -> ``TransformerConfig.cross_entropy_loss_fusion`` (the flag;
                                    ``cross_entropy_fusion_impl`` as parsed, ``te`` needs TE)
                                    (the four fusion flags above are kept as ``<dest>_requested``;
                                    every kernel field reaches ``TransformerConfig`` through
                                    :class:`~megatron_zb.training.run_config.ModelConfig`)
==================================  ===========================================================
"""

from __future__ import annotations

import argparse
from typing import Callable, Sequence

from megatron_zb.model.gpt_chunks import split_layers

from .checkpointing_logging import add_checkpointing_args, add_validation_and_logging_args
from .common import ArgumentError, Problem
from .flags import MegatronZBArgumentParser
from .fork_flags import add_fork_args
from .housekeeping import add_housekeeping_args
from .data import TOKENIZER_TYPES, add_data_args, parse_data_blend
from .implementation import add_implementation_args
from .fp8 import add_fp8_args
from .kernels import add_kernel_args
from .logging_flags import add_logging_extra_args
from .model import add_network_args
from .mla import add_mla_args
from .moe import add_moe_args
from .mtp import add_mtp_args
from .parallel import add_distributed_args
from .recompute import add_pipeline_split_args, add_recompute_args
from .sharding import add_sharding_args
from .training import add_learning_rate_args, add_mixed_precision_args, add_training_args
from .validation import ValidatedArgs, validate_args, validate_args_and_schedule
from .zero_bubble import (POST_VALIDATION_FALLBACK_CLEAN_ITERS, POST_VALIDATION_WARMUP_ITERS,
                          V_MEM_SETUP_TO_SCHEDULE, add_zero_bubble_args, initial_schedule)

__all__ = [
    "ArgumentError",
    "Problem",
    "POST_VALIDATION_FALLBACK_CLEAN_ITERS",
    "POST_VALIDATION_WARMUP_ITERS",
    "TOKENIZER_TYPES",
    "V_MEM_SETUP_TO_SCHEDULE",
    "ValidatedArgs",
    "build_parser",
    "initial_schedule",
    "parse_args",
    "parse_data_blend",
    "split_layers",
    "validate_args",
    "validate_args_and_schedule",
]

ExtraArgsProvider = Callable[[argparse.ArgumentParser], object]

_GROUPS: tuple[Callable[[argparse.ArgumentParser], None], ...] = (
    add_network_args, add_implementation_args, add_kernel_args, add_training_args, add_learning_rate_args,
    add_mixed_precision_args, add_fp8_args, add_recompute_args, add_distributed_args, add_sharding_args,
    add_pipeline_split_args, add_data_args, add_moe_args,
    add_mtp_args,
    add_mla_args,
    add_checkpointing_args, add_validation_and_logging_args, add_logging_extra_args, add_housekeeping_args,
    add_zero_bubble_args, add_fork_args)
"""The flag groups in ``--help`` order (Megatron's order, then the zero-bubble flags, then the accepted flags
of the zero-bubble fork and VocabularyParallelism)."""


def build_parser(*, extra_args_provider: ExtraArgsProvider | None = None) -> argparse.ArgumentParser:
    """The ``pretrain_gpt_zb.py`` parser; ``extra_args_provider(parser)`` may add more flags."""
    parser = MegatronZBArgumentParser(
        prog="pretrain_gpt_zb.py",
        description="Megatron GPT pretraining with zero-bubble pipeline schedules. Accepts Megatron's "
                    "GPT flags; add --enable-zero-bubble (or --zero-bubble-v-schedule) to switch schedule.",
        allow_abbrev=False,
    )
    for add_group in _GROUPS:
        add_group(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None, *, extra_args_provider: ExtraArgsProvider | None = None
               ) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``). Call :func:`validate_args` on the result."""
    return build_parser(extra_args_provider=extra_args_provider).parse_args(argv)
