"""The flags of the zero-bubble fork and of VocabularyParallelism: each answered by name, on both routes.

The zero-bubble fork (sail-sg/zero-bubble-pipeline-parallelism: ``megatron/core/zbpp_utils.py``'s
group and the offload flags of its ``megatron/training/arguments.py``) and VocabularyParallelism
(sail-sg/VocabularyParallelism: its ``megatron/training/arguments.py``) add flags of their own to
Megatron-LM's parser. :data:`FORK_FLAGS` is the one table of what megatron-zb answers to each
(the fork's flags megatron-zb has with the same meaning -- ``--enable-zero-bubble``,
``--zero-bubble-v-schedule``, ``--enable-exactly-numeric-match``, ... -- are in
:mod:`.zero_bubble` and not listed here):

* **accepted** (:attr:`ForkFlag.accepted`): in the parser (:func:`add_fork_args`), and when given a
  start-up line says what it does here (:func:`check_fork_flags`);
* **refused**: the answer names the flag, why and what megatron-zb offers instead. In
  ``pretrain_gpt_zb.py`` they are not in the parser, so the unknown-flag report gives the answer
  (:func:`~.flags.unknown_flag_error`, never a did-you-mean hint to an unrelated flag); inside
  Megatron-LM's loop, whose parser would stop at them, :func:`add_fork_args` adds them hidden
  (``refused=True``) and :func:`check_fork_flags` gives the same answers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .common import ArgumentError, Problem, notice

__all__ = ["FORK", "FORK_FLAGS", "VOCABULARY_PARALLELISM", "ForkFlag", "add_fork_args", "check_fork_flags",
           "fork_flag_answer"]

FORK = "the zero-bubble fork"
VOCABULARY_PARALLELISM = "VocabularyParallelism"

_OFFLOAD = ("megatron-zb has no activation offload; to fit activation memory use a V schedule with less of it "
            "(--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup half|min), a lower "
            "--zero-bubble-max-pending-backward, or --recompute-granularity (docs/training.md \"Moving from the "
            "zero-bubble fork\")")


@dataclass(frozen=True)
class ForkFlag:
    """One flag of the fork or of VocabularyParallelism: where it comes from (:data:`FORK` or
    :data:`VOCABULARY_PARALLELISM`), whether ``pretrain_gpt_zb.py`` accepts it, what it takes
    (``action``: ``"store_true"`` / ``"store_false"``, or ``"int"`` / ``"float"`` for a value) and
    the answer: for an accepted flag, what it does here (``no_effect``: nothing, its start-up line a
    WARNING); for a refused one, why and what instead."""

    origin: str
    accepted: bool
    action: str
    answer: str
    dest: str | None = None
    no_effect: bool = False


FORK_FLAGS: dict[str, ForkFlag] = {
    "--enable-zb-runtime": ForkFlag(
        FORK, True, "store_true",
        "megatron-zb's runtime runs every schedule a zero-bubble flag chooses (megatron-core's own 1F1B runs "
        "without one), so the fork's unified runtime is always on; accepted, no effect", no_effect=True),
    "--no-pre-communication-optimization": ForkFlag(
        FORK, True, "store_false",
        "megatron-zb's runtime sends no tiny pre-communication before a transfer (it creates and warms up every "
        "communicator once, before the first iteration), which is what this flag asks of the fork; accepted, "
        "no effect", dest="pre_communication_optimization", no_effect=True),
    "--measure-activation-memory": ForkFlag(
        FORK, True, "store_true",
        "megatron-zb measures the activation bytes of each stage (M_B, M_W) in the profiling window and writes "
        "them with --profile-out FILE; --log-memory-to-tensorboard logs the allocator's memory; accepted, "
        "no effect", no_effect=True),
    "--disable-backward-fusion": ForkFlag(
        VOCABULARY_PARALLELISM, True, "store_true",
        "with --enable-vocab-parallel: the schedule family's Vocab-1 form (two all-reduce barriers) instead "
        "of its Vocab-2 form (one barrier, the output layer's backward fused into its forward pass), as "
        "VocabularyParallelism"),
    "--cpu-offload": ForkFlag(FORK, False, "store_true", _OFFLOAD),
    "--offload-chunk-num": ForkFlag(FORK, False, "int", _OFFLOAD),
    "--offload-time": ForkFlag(FORK, False, "float", _OFFLOAD),
    "--auto-offload-time": ForkFlag(FORK, False, "store_true", _OFFLOAD),
    "--offload-overlap-sr": ForkFlag(FORK, False, "store_true", _OFFLOAD),
    "--offload-continuous-buffers": ForkFlag(FORK, False, "store_true", _OFFLOAD),
    "--no-paired-barrier": ForkFlag(FORK, False, "store_false", _OFFLOAD, dest="paired_barrier"),
    "--recompute-lgd": ForkFlag(
        FORK, False, "store_true",
        "the fork's recomputation of layer norm, GeLU and dropout is not in megatron-zb; megatron-core's "
        "selective recomputation is: --recompute-granularity selective --recompute-modules layernorm (the "
        "layer norms; add mlp to recompute the whole MLP, GeLU included)"),
    "--zero-bubble-adaptive-memory-limit-percentile": ForkFlag(
        FORK, False, "int",
        "megatron-zb has no adaptive memory limit: give the limit with --zero-bubble-max-pending-backward N "
        "(micro batches of activations per rank; `megatron-zb plan` chooses one for a model and a GPU)"),
    "--enable-1f1b-v": ForkFlag(FORK, False, "store_true", "use --schedule 1f1b-v (1F1B on the V placement)"),
    "--interleave-group-size": ForkFlag(
        FORK, False, "int",
        "the fork's grouped interleaving is not in megatron-zb; use --schedule interleaved-1f1b or "
        "interleaved-zb with --num-layers-per-virtual-pipeline-stage"),
    "--profile-memory-iter": ForkFlag(
        FORK, False, "int",
        "use --profile-out FILE (each stage's activation bytes, measured in the profiling window) or "
        "--log-memory-to-tensorboard"),
    "--schedule-timer-start": ForkFlag(
        VOCABULARY_PARALLELISM, False, "int",
        "megatron-zb's profiling window is --zero-bubble-pipeline-timers-start-iter N (first profiled "
        "iteration, 1-based; default 2): use it instead"),
    "--schedule-timer-end": ForkFlag(
        VOCABULARY_PARALLELISM, False, "int",
        "megatron-zb's profiling window is --zero-bubble-pipeline-timers-end-iter N (profiling stops before "
        "it; default 4): use it instead"),
    "--use-interlaced-schedule": ForkFlag(
        VOCABULARY_PARALLELISM, False, "store_true",
        "the interlaced pipeline (Lin et al., OSDI 2024) is not in megatron-zb; --enable-vocab-parallel runs "
        "vocabulary parallelism's own schedules (docs/vocab_parallel.md)"),
    "--enable-layer-redistribution": ForkFlag(
        VOCABULARY_PARALLELISM, False, "store_true",
        "give the last stage's layers with Megatron-LM's --decoder-last-pipeline-num-layers N instead"),
    "--final-stage-num-layers": ForkFlag(
        VOCABULARY_PARALLELISM, False, "int", "use Megatron-LM's --decoder-last-pipeline-num-layers N instead"),
}
"""Flag -> megatron-zb's answer, for every flag the fork and VocabularyParallelism add."""


def fork_flag_answer(name: str) -> str:
    """The line answering refused fork flag ``name`` (the unknown-flag report's and the route's)."""
    f = FORK_FLAGS[name]
    return f"{name} is a flag of {f.origin}, not of megatron-zb: {f.answer}; remove it"


def _dest(name: str) -> str:
    return FORK_FLAGS[name].dest or name[2:].replace("-", "_")


def add_fork_args(parser: argparse.ArgumentParser, *, refused: bool = False) -> None:
    """The accepted fork flags (``refused``: also the refused ones, hidden: for Megatron-LM's parser,
    which would stop at them). A flag the parser already has is left alone."""
    g = parser.add_argument_group("flags of the zero-bubble fork and VocabularyParallelism")
    known = {o for a in parser._actions for o in a.option_strings}
    for name, f in FORK_FLAGS.items():
        if name in known or not (f.accepted or refused):
            continue
        shown = f"{f.origin}'s flag: {f.answer}." if f.accepted else argparse.SUPPRESS
        if f.action in ("int", "float"):
            g.add_argument(name, dest=_dest(name), type=int if f.action == "int" else float, default=None,
                           help=shown)
        else:
            g.add_argument(name, dest=_dest(name), action=f.action, help=shown)


def _given(args: argparse.Namespace, name: str) -> bool:
    """Whether fork flag ``name`` was on the command line (its value is not its default)."""
    value = getattr(args, _dest(name), None)
    return {"store_true": value is True, "store_false": value is False}.get(FORK_FLAGS[name].action,
                                                                          value is not None)


def _refusal(name: str) -> ArgumentError:
    """The error answering refused fork flag ``name`` (its line starts with the flag)."""
    error = ArgumentError(name, "")
    error._set((Problem(name, fork_flag_answer(name)),))
    return error


def check_fork_flags(args: argparse.Namespace) -> None:
    """A start-up line for each accepted fork flag given; one :class:`ArgumentError` naming every
    refused fork flag given (present in ``args`` only where :func:`add_fork_args` added them hidden)."""
    refused = [_refusal(name)
               for name, f in FORK_FLAGS.items() if not f.accepted and _given(args, name)]
    if refused:
        raise ArgumentError.combine(refused)
    for name, f in FORK_FLAGS.items():
        if f.accepted and _given(args, name):
            notice(args, ("WARNING: " if f.no_effect else "") + f"{name} ({f.origin}'s flag): {f.answer}")
