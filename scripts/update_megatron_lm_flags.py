"""Regenerate a Megatron-LM flag list of megatron_zb/training/arguments/ from Megatron-LM.

One list per supported Megatron-LM release, the one that goes with the installed megatron-core
(``megatron_compat.megatron_lm_tag()``), in the module ``megatron_flags.FLAG_MODULES`` names:
core_v0.16.1 -> ``megatron_flags.py`` (megatron-core 0.16.1, Python 3.11; its selection function
below the list is kept), core_v0.19.0 -> ``megatron_flags_0_19.py`` (megatron-core 0.19.x, Python
>= 3.12). Usage, with a Megatron-LM checkout at that tag (e.g.
``git clone -b core_v0.19.0 https://github.com/NVIDIA/Megatron-LM``)::

    python scripts/update_megatron_lm_flags.py /path/to/Megatron-LM            # JSON list
    python scripts/update_megatron_lm_flags.py /path/to/Megatron-LM --write    # rewrite the module

Builds Megatron-LM's own parser (``megatron.training.arguments.add_megatron_arguments``) against
the installed megatron-core and collects every long option string. Optional dependencies
Megatron-LM imports at module level but the parser does not use (wandb, one-logger,
triton kernels, ...) are replaced by empty stand-in modules; nothing is run. ``--write`` refuses a
checkout whose tag (from git, or the ``SOURCE.md`` of a ``../shared`` copy) is not the installed
megatron-core's.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
KEEP_MARKER = "# ---------------------------------------------------------------------- not generated:"
"""A module's text from this line on is kept when the list above it is rewritten (megatron_flags.py's
selection function)."""

_STUB_PACKAGES = {"tensorstore", "zarr", "wandb", "one_logger_utils", "modelopt",
                  "flask_restful", "flask"}
_STUB_MODULES = {"megatron.core.transformer.custom_layers.batch_invariant_kernels"}  # needs triton at 0.16.1


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):  # noqa: D102
        if name.split(".")[0] in _STUB_PACKAGES or name in _STUB_MODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: D102
        module = mock.MagicMock()
        module.__path__, module.__spec__, module.__version__ = [], spec, "0.0.0"
        return module

    def exec_module(self, module):  # noqa: D102
        pass


def megatron_lm_flags(megatron_lm: str) -> list[str]:
    """Every ``--flag`` of Megatron-LM's parser built from the checkout ``megatron_lm``, sorted."""
    sys.meta_path.insert(0, _Stubs())
    sys.path.insert(0, megatron_lm)
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})


def checkout_release(megatron_lm: str) -> tuple[str | None, str | None]:
    """(tag, commit) of the checkout: from git, else from a ``SOURCE.md`` beside its files."""
    folder = Path(megatron_lm)
    if (folder / ".git").exists():
        def git(*cmd: str) -> str | None:
            out = subprocess.run(["git", "-C", str(folder), *cmd], capture_output=True, text=True)
            return out.stdout.strip() or None if out.returncode == 0 else None
        return git("describe", "--tags", "--exact-match"), git("rev-parse", "HEAD")
    source = folder / "SOURCE.md"
    text = source.read_text() if source.is_file() else ""
    tag, commit = re.search(r"tag `(core_v[\d.]+)`", text), re.search(r"commit ([0-9a-f]{40})", text)
    return (tag.group(1) if tag else None), (commit.group(1) if commit else None)


def module_text(tag: str, commit: str, flags: list[str], megatron_core: str) -> str:
    """The Python module holding ``flags`` of Megatron-LM ``tag``."""
    body = textwrap.fill(", ".join(json.dumps(f) for f in flags) + ",", width=116, initial_indent="    ",
                         subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)
    return f'''"""Every command-line flag of Megatron-LM's ``pretrain_gpt.py`` parser at {tag}, as data.

Source: Megatron-LM tag ``{tag}`` (commit {commit}),
the release that goes with megatron-core {megatron_core}: ``megatron/training/arguments.py``'s
``add_megatron_arguments(parser)`` -- including the flags it generates from megatron-core's config
dataclasses -- collected from the built parser's option strings by
``scripts/update_megatron_lm_flags.py --write`` (generated: do not edit the list). {len(flags)} flags.

Used by :mod:`.flags` (through :func:`.megatron_flags.megatron_lm_flags`, which picks the list of the
installed megatron-core's release) to tell a Megatron-LM flag megatron-zb does not support yet from a
typo.
"""

from __future__ import annotations

__all__ = ["MEGATRON_LM_FLAGS", "MEGATRON_LM_VERSION"]

MEGATRON_LM_VERSION = "{tag} ({commit})"
"""The Megatron-LM release the list was taken from."""

MEGATRON_LM_FLAGS: frozenset[str] = frozenset((
{body}
))
"""Every ``--flag`` Megatron-LM's GPT pretraining parser accepts (long option strings only)."""
'''


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("megatron_lm", help="a Megatron-LM checkout at the tag that goes with the installed megatron-core")
    cli.add_argument("--write", action="store_true", help="rewrite that release's flag module instead of printing JSON")
    opts = cli.parse_args()
    sys.path.insert(0, str(ROOT))
    from megatron_zb.megatron_compat import megatron_core_version, megatron_lm_tag
    from megatron_zb.training.arguments.megatron_flags import FLAG_MODULES

    if not opts.write:
        print(json.dumps(megatron_lm_flags(opts.megatron_lm)))
        return
    tag, commit = checkout_release(opts.megatron_lm)
    if tag != megatron_lm_tag():
        sys.exit(f"update_megatron_lm_flags.py: error: {opts.megatron_lm} is Megatron-LM {tag or 'of unknown tag'}, "
                 f"not {megatron_lm_tag()} (the release that goes with the installed megatron-core "
                 f"{megatron_core_version()})")
    flags = megatron_lm_flags(opts.megatron_lm)
    path = ROOT / "megatron_zb" / "training" / "arguments" / f"{FLAG_MODULES[tag]}.py"
    kept = path.read_text() if path.is_file() else ""
    kept = "\n\n" + kept[kept.index(KEEP_MARKER):] if KEEP_MARKER in kept else ""
    path.write_text(module_text(tag, commit or "unknown", flags, megatron_core_version()) + kept)
    print(f"{path.relative_to(ROOT)}: {len(flags)} flags of Megatron-LM {tag}")


if __name__ == "__main__":
    main()
