"""The one rebind rule (megatron_zb/megatron_lm/rebind.py) and the route package's lazy names."""

from __future__ import annotations

import sys
import types


def test_rebinds_replace_everywhere_and_restore_last_first():
    """Every loaded module holding the original under its name gets the replacement; ``restore`` puts the
    originals back, including a name set twice (the first original wins)."""
    from megatron_zb.megatron_lm.rebind import Rebinds

    def original() -> str:
        return "original"

    def replacement() -> str:
        return "replacement"

    holders = [types.ModuleType(f"_rebind_probe_{i}") for i in range(2)]
    other = types.ModuleType("_rebind_probe_other")
    for m in holders:
        m.original = original
    other.original = lambda: "someone else's"
    for m in (*holders, other):
        sys.modules[m.__name__] = m
    try:
        rebinds = Rebinds()
        assert not rebinds and rebinds.everywhere(original, replacement) == 2
        assert [m.original() for m in (*holders, other)] == ["replacement", "replacement", "someone else's"]
        rebinds.set(holders[0], "original", lambda: "third")
        assert rebinds and holders[0].original() == "third"
        rebinds.restore()
        assert not rebinds and [m.original for m in holders] == [original, original]
    finally:
        for m in (*holders, other):
            del sys.modules[m.__name__]


def test_the_route_package_exports_the_route_names_lazily():
    """``megatron_zb.megatron_lm``'s names are ``route.py``'s ``__all__``, imported on first use."""
    import megatron_zb.megatron_lm as package
    from megatron_zb.megatron_lm import route

    assert sorted(package.ROUTE_NAMES) == sorted(route.__all__)
    assert all(getattr(package, name) is getattr(route, name) for name in route.__all__)
