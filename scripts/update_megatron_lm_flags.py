"""Regenerate the flag list of megatron_zb/training/arguments/megatron_flags.py from Megatron-LM.

Usage (a Megatron-LM checkout at the tag matching the installed megatron-core, e.g.
``git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM``)::

    python scripts/update_megatron_lm_flags.py /path/to/Megatron-LM > flags.json

Builds Megatron-LM's own parser (``megatron.training.arguments.add_megatron_arguments``) against
the installed megatron-core and prints every long option string as a JSON list. Optional
dependencies Megatron-LM imports at module level but the parser does not use (wandb, triton
kernels, ...) are replaced by empty stand-in modules; nothing is run.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
from unittest import mock

_STUB_PACKAGES = {"tensorstore", "zarr", "wandb", "nvidia_resiliency_ext", "one_logger_utils", "modelopt",
                  "flask_restful", "flask"}
_STUB_MODULES = {"megatron.core.transformer.custom_layers.batch_invariant_kernels"}  # needs triton


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):  # noqa: D102
        if name.split(".")[0] in _STUB_PACKAGES or name in _STUB_MODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: D102
        module = mock.MagicMock()
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module):  # noqa: D102
        pass


def main() -> None:
    megatron_lm = sys.argv[1]
    sys.meta_path.insert(0, _Stubs())
    sys.path.insert(0, megatron_lm)
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    flags = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
    print(json.dumps(flags))


if __name__ == "__main__":
    main()
