"""Flags the parser does not know: a Megatron-LM flag not supported yet, or a typo.

:class:`MegatronZBArgumentParser` is ``pretrain_gpt_zb.py``'s parser. Where ``argparse`` would
print "unrecognized arguments", it raises :class:`UnsupportedFlagError` (an
:class:`~.common.ArgumentError`, so ``pretrain_gpt_zb.py`` prints one line and exits 2 before
any process group starts) naming the first unknown flag:

* a Megatron-LM flag refused for a reason of its own (:data:`WHY_NOT`):
  "--delay-wgrad-compute is refused: <why>; remove it";
* a flag of Megatron-LM's parser (:func:`~.megatron_flags.megatron_lm_flags`: the list of the
  Megatron-LM release that goes with the installed megatron-core):
  "--context-parallel-size is a Megatron-LM flag megatron-zb does not support yet; ...";
* anything else: "--flag is not a flag of pretrain_gpt_zb.py; did you mean --closest?" (the
  closest supported flag by ``difflib`` similarity, when one is similar enough).

Every unknown flag of a command line is reported, in the order given, in one error (one
:class:`~.common.Problem` each), and so is every value outside a flag's choices ("--flag: invalid
choice 'x'; choose from a, b", the flag then left at its default so that validation goes on);
:meth:`MegatronZBArgumentParser.parse_known_flags` returns them instead of raising, so that
validation can add its own problems to the same report.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Sequence

from .common import ArgumentError, Problem
from .fork_flags import FORK_FLAGS, fork_flag_answer
from .megatron_flags import megatron_lm_flags

__all__ = ["MegatronZBArgumentParser", "UnsupportedFlagError", "unknown_flag_error"]


class UnsupportedFlagError(ArgumentError):
    """An unknown flag on the command line; the message starts with the flag itself."""

    def __init__(self, flag: str, message: str) -> None:
        self._set((Problem(flag, message),))


WHY_NOT: dict[str, str] = {
    "--use-megatron-fsdp": "megatron-core's Megatron FSDP reduce-scatters the gradients from a hook that fires when "
                           "the fused backward ends, before a deferred W has added its weight gradients (megatron-"
                           "core's DDP, with or without --use-distributed-optimizer, runs every schedule)",
    "--delay-wgrad-compute": "megatron-zb defers Transformer Engine's weight gradients itself whenever the "
                             "schedule splits the backward, and Megatron-LM's flag would also move megatron-core "
                             "DDP's gradient hook into TE's backward_dw (DistributedDataParallelConfig."
                             "delay_wgrad_compute), where it would drop the gradients megatron-zb settles",
    "--use-tp-pp-dp-mapping": "megatron-zb builds megatron-core's default rank order (tp-cp-ep-dp-pp), the only "
                              "one its pipeline runtime is tested on; without the flag ranks are placed as in "
                              "Megatron-LM by default (the zero-bubble fork's pretrain_offload.sh passes it to keep "
                              "pipeline neighbours on one node)",
    "--moe-shared-expert-overlap": "megatron-core runs the shared experts on a second CUDA stream inside the alltoall "
                                   "dispatcher's steps, ordering their backward against the dispatcher's with "
                                   "autograd sequence numbers; CPU has no streams and megatron-zb has not verified "
                                   "that order with the split backward (W deferred out of that stream); without the "
                                   "flag the shared experts run before the router, as Megatron-LM's default",
    "--moe-router-force-load-balancing": "Megatron-LM's benchmark-only routing on random logits, drawn from the "
                                         "expert-parallel RNG stream in the order the rank runs its forwards, which "
                                         "the V and interleaved placements change; megatron-zb has not verified it",
}
"""Megatron-LM flags refused for a reason of their own (flag -> why), not as "not supported yet"."""

def unknown_flag_error(flag: str, supported: Sequence[str],
                       megatron_lm: tuple[str, frozenset[str]] | None = None) -> UnsupportedFlagError:
    """The error for ``flag`` (``--name``, no value), which is not among ``supported``. ``megatron_lm``:
    (version, flags) of the Megatron-LM release it is named against; default: the one that goes with
    the installed megatron-core (``megatron_flags.megatron_lm_flags()``)."""
    if flag in FORK_FLAGS:
        return UnsupportedFlagError(flag, fork_flag_answer(flag))
    if flag in WHY_NOT:
        return UnsupportedFlagError(flag, f"{flag} is refused: {WHY_NOT[flag]}; remove it")
    version, flags = megatron_lm if megatron_lm is not None else megatron_lm_flags()
    if flag in flags:
        return UnsupportedFlagError(flag, f"{flag} is a Megatron-LM flag megatron-zb does not support yet "
                                          f"(Megatron-LM {version.split()[0]}); remove it "
                                          f"(docs/training.md lists the supported flags)")
    close = difflib.get_close_matches(flag, list(supported), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "see pretrain_gpt_zb.py --help for the supported flags"
    return UnsupportedFlagError(flag, f"{flag} is not a flag of pretrain_gpt_zb.py; {hint}")


class MegatronZBArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose unknown flags raise :class:`UnsupportedFlagError` (all of them
    in one :class:`~.common.ArgumentError`)."""

    _bad_choices: list[tuple[argparse.Action, object]] | None = None

    def _check_value(self, action: argparse.Action, value: object) -> None:
        """argparse's check of ``value`` against ``action.choices``; inside :meth:`parse_known_flags`
        a value outside them is collected for the report instead of stopping the parse."""
        if self._bad_choices is not None and action.choices is not None and value not in action.choices:
            self._bad_choices.append((action, value))
            return
        super()._check_value(action, value)

    def parse_known_flags(self, args: Sequence[str] | None = None,
                          namespace: argparse.Namespace | None = None
                          ) -> tuple[argparse.Namespace, ArgumentError | None]:
        """Parse ``args``; return the namespace of the known flags and the error naming every unknown
        flag and every value outside its flag's choices (``None`` when there is none; such a flag is
        left at its default). Other bad values of known flags are argparse's errors, as ever."""
        self._bad_choices = []
        try:
            parsed, extras = self.parse_known_args(args, namespace)
            bad, self._bad_choices = self._bad_choices, None
        finally:
            self._bad_choices = None
        flags = list(dict.fromkeys(e.split("=", 1)[0] for e in extras if e.startswith("--")))
        if extras and not flags:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        supported = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        errors = [unknown_flag_error(f, supported) for f in flags] + [_invalid_choice(parsed, a, v) for a, v in bad]
        return parsed, ArgumentError.combine(errors) if errors else None

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_flags(args, namespace)
        if unknown is not None:
            raise unknown
        return parsed


def _invalid_choice(parsed: argparse.Namespace, action: argparse.Action, value: object) -> ArgumentError:
    """The problem of ``value`` outside ``action.choices``; the flag goes back to its default in ``parsed``."""
    setattr(parsed, action.dest, action.default)
    name = max(action.option_strings, key=len)
    choices = ", ".join(str(c) for c in action.choices)  # type: ignore[union-attr]
    return ArgumentError(name, f"invalid choice {value!r}; choose from {choices}")
