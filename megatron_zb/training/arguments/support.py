"""How far each Megatron-LM flag is supported by ``pretrain_gpt_zb.py``: the data of the flag table.

Every flag of Megatron-LM's parser (:data:`~.megatron_flags.MEGATRON_LM_FLAGS`) is in exactly one
class:

* **implemented**: in ``pretrain_gpt_zb.py``'s parser and in effect, with Megatron-LM's meaning;
* **accepted**: in the parser, but without effect or only partly (:data:`ACCEPTED`), with why;
* **refused**: not in the parser; the error says why and how to do without
  (:func:`~.flags.unknown_flag_error`: a reason of its own, or "not supported yet").

:func:`flag_table_markdown` renders the table that ``scripts/flag_table.py`` writes into
``docs/training.md`` (a test keeps the checked-in copy current).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass

from .flags import WHY_NOT, unknown_flag_error
from .fork_flags import FORK_FLAGS
from .megatron_flags import MEGATRON_LM_FLAGS, MEGATRON_LM_VERSION

__all__ = ["ACCEPTED", "FlagSupport", "flag_support", "flag_table_markdown", "parser_flags"]

ACCEPTED: dict[str, str] = {
    "--use-mcore-models": "no-op, as in Megatron-LM (deprecated there: megatron-core models are the default; here "
                          "the only ones)",
    "--use-legacy-models": "megatron-core has no legacy models: megatron-core's GPTModel (the same architecture) is "
                           "built, with megatron-core's checkpoints; a start-up WARNING says so; a legacy-format "
                           "checkpoint given to `--load` is refused in one line naming it and the conversion",
    "--use-flash-attn": "no effect on megatron-core's GPT, as in Megatron-LM (read by its legacy model only); a "
                        "start-up WARNING points to `--attention-backend flash`",
    "--no-overlap-p2p-communication": "megatron-zb's runtime never batches its p2p (one isend/irecv per transfer, "
                                      "receives posted ahead), so its schedules run the same; sets megatron-core's "
                                      "`overlap_p2p_comm`/`batch_p2p_comm` as Megatron-LM; a start-up WARNING says so",
    "--context-parallel-size": "1 only (no context parallelism); a larger value is refused with the reason",
    "--ckpt-format": "torch_dist only (Megatron-LM's default, what megatron-zb writes and reads); the other "
                     "formats are refused with the reason",
    "--use-cpu-initialization": "always on in megatron-zb (every placement of the layers gets the same weights, "
                                "initialised on the CPU), so the flag changes nothing",
    "--expert-tensor-parallel-size": "`--tensor-model-parallel-size`'s value only (Megatron-LM's default: experts "
                                     "split like the dense layers); another value is refused with the reason",
    "--dist-ckpt-strictness": "megatron-core's StrictHandling at load, as Megatron-LM, but for `return_unexpected` / "
                              "`return_all` (they return the keys instead of acting on them; refused)",
    "--auto-detect-ckpt-format": "no effect: the format of `--load` is always detected (torch_dist read, Megatron-LM's "
                                 "torch format refused naming the conversion); a start-up WARNING says so",
    "--log-validation-ppl-to-tensorboard": "always on in megatron-zb (`lm loss validation ppl` is written with "
                                           "every validation loss), so the flag changes nothing",
    "--no-position-embedding": "no-op with `--position-embedding-type rope` (no learned position table); refused "
                               "otherwise, as Megatron-LM (deprecated there)",
}
"""Megatron-LM flags the parser accepts without (full) effect -> why."""


@dataclass(frozen=True)
class FlagSupport:
    """One flag's class (``"implemented"``, ``"accepted"``, ``"refused"``) and the why (empty when implemented)."""

    status: str
    why: str = ""


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long option strings of ``parser``."""
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


def flag_support(name: str, supported: set[str]) -> FlagSupport:
    """The class of Megatron-LM flag ``name`` given the parser's flags ``supported``."""
    if name not in supported:
        # named against the table's release (core_v0.16.1's list), whichever megatron-core is installed
        error = unknown_flag_error(name, sorted(supported), (MEGATRON_LM_VERSION, MEGATRON_LM_FLAGS))
        return FlagSupport("refused", error.problems[0].text)
    if name in ACCEPTED:
        return FlagSupport("accepted", ACCEPTED[name])
    return FlagSupport("implemented")


def flag_table_markdown(parser: argparse.ArgumentParser) -> str:
    """The flag table of ``docs/training.md`` for ``pretrain_gpt_zb.py``'s ``parser`` (Markdown)."""
    supported = parser_flags(parser)
    support = {name: flag_support(name, supported) for name in sorted(MEGATRON_LM_FLAGS)}
    counts = Counter(s.status for s in support.values())
    refused_own = sorted(n for n, s in support.items() if s.status == "refused" and n in WHY_NOT)
    not_yet = sorted(n for n, s in support.items() if s.status == "refused" and n not in WHY_NOT)
    lines = [
        f"Megatron-LM {MEGATRON_LM_VERSION.split()[0]}'s parser has {len(support)} flags: "
        f"**{counts['implemented']} implemented**, **{counts['accepted']} accepted** without (full) effect, "
        f"**{counts['refused']} refused** ({len(refused_own)} for a reason of their own, {len(not_yet)} not "
        f"supported yet). Generated from the parser by `scripts/flag_table.py`.",
        "",
        "| Megatron-LM flag | status |",
        "|---|---|",
    ]
    for name, s in support.items():
        if s.status == "implemented":
            lines.append(f"| `{name}` | implemented |")
        elif s.status == "accepted":
            lines.append(f"| `{name}` | accepted: {s.why} |")
    for name in refused_own:
        lines.append(f"| `{name}` | refused: {WHY_NOT[name]} |")
    fixes = [n for n in not_yet if "remove it" not in support[n].why]
    lines += ["", f"Refused, not supported yet ({len(not_yet)}; the error says \"remove it\""
                  + (", or how to do without: " + ", ".join(f"`{n}`" for n in fixes) if fixes else "") + "): "
              + ", ".join(f"`{n}`" for n in not_yet) + ".",
              "", "megatron-zb's own flags (not Megatron-LM's): "
              + ", ".join(f"`{n}`" for n in sorted(supported - MEGATRON_LM_FLAGS - set(FORK_FLAGS))) + ".",
              "", "Flags of the zero-bubble fork and of VocabularyParallelism: each answered by name (\"Moving from "
              "the zero-bubble fork\" below)."]
    return "\n".join(lines) + "\n"
