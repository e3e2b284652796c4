"""Transformer Engine's released source read against what the TE route relies on.

:mod:`megatron_zb.testing.te_source` parses -- never imports -- the ``transformer-engine``
wheel of each release in ``TE_SOURCE_VERSIONS`` (the list docs/transformer_engine.md names) and
checks the lines the route and ``tests/te_double.py`` rely on: the queue type, ``pop``'s return,
the bias guard in ``backward_dw``, FP8's ``bias=None`` to the delayed GEMM, GroupedLinear's
returned buffers, the weight names, ``LayerNormMLP``'s two pops.

The wheels are not part of the project: they come from the cache directory
(``$MEGATRON_ZB_TE_WHEELS``, default ``~/.cache/megatron-zb/te-wheels``), downloaded there on
first use (``pip download --no-deps``, 0.5-1 MB each). Where the package index cannot be
reached and the cache is empty, each release's test is skipped, saying so; the last full result
is recorded in docs/transformer_engine.md (``scripts/check_te_source.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_zb.testing.te_source import TE_SOURCE_VERSIONS, WheelUnavailable, check_release, wheel_path

DOC = Path(__file__).resolve().parents[2] / "docs" / "transformer_engine.md"


def _wheel(version: str) -> Path:
    try:
        return wheel_path(version)
    except WheelUnavailable as err:
        pytest.skip(f"Transformer Engine {version}'s source is not available here ({err}); run "
                    f"scripts/check_te_source.py where the package index can be reached")


@pytest.mark.parametrize("version", TE_SOURCE_VERSIONS)
def test_te_release_source_has_what_the_route_relies_on(version):
    facts = check_release(version, _wheel(version))
    failed = [f"{f.where}: {f.name} ({f.detail})" for f in facts if not f.holds]
    assert not failed, f"Transformer Engine {version}: " + "; ".join(failed)
    assert len(facts) >= 20


def test_the_checker_can_fail():
    """Version-dependent facts read from the wrong release fail: TE 2.8's source read as 2.3's
    has the hooks API and a GroupedLinear that returns its B-time buffer."""
    facts = {f.name: f for f in check_release("2.3.0", _wheel("2.8.0"))}
    assert not facts["a delayed backward returns None for the weights (TE < 2.8)"].holds
    assert not facts["no hooks API before TE 2.7 (the route settles directly)"].holds
    assert sum(not f.holds for f in facts.values()) == 2


def test_the_docs_name_the_releases_checked():
    line = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("TE releases whose source is checked:"))
    assert tuple(re.findall(r"\d+\.\d+\.\d+", line)) == TE_SOURCE_VERSIONS
