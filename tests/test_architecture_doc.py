"""docs/architecture.md's "writing a generator" example is real: it registers, builds, simulates,
lowers, and runs on a real PP=2 megatron-core pipeline with loss and gradients bitwise equal to
megatron-core's own 1F1B (GPipe runs the same forward and backward steps in another interleaving;
each stage's backwards run in microbatch order in both, so every gradient is summed in the same
order)."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _example_source() -> str:
    text = DOC.read_text()
    m = re.search(r"<!-- example: writing a generator -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/architecture.md lost its generator example block"
    return m.group(1)


@pytest.fixture()
def gpipe():
    """Execute the doc's block; unregister its name afterwards so other tests see the stock catalogue."""
    from megatron_zb.schedules.catalog import SCHEDULES

    namespace: dict = {}
    exec(compile(_example_source(), str(DOC), "exec"), namespace)
    try:
        yield namespace["gpipe"]
    finally:
        SCHEDULES.pop("gpipe-example", None)


def test_example_registers_and_the_library_accepts_it(gpipe):
    from megatron_zb.schedules import CostModel, lower, simulate
    from megatron_zb.schedules.registry import build_schedule, schedule_names

    assert "gpipe-example" in schedule_names()
    sched = build_schedule("gpipe-example", num_ranks=4, num_microbatches=8)
    res = simulate(sched, CostModel(t_f=1.0, t_b=1.0, t_w=1.0))
    # GPipe by hand (unit F, BW = 2): fill 8 + 3 forwards, 8 backwards of 2 on the last rank, then
    # the gradient walks back 3 stages: 8 + 3 + 16 + 3*2 = 33; rank 0 holds all 8 microbatches.
    assert res.makespan == pytest.approx(33.0, rel=1e-12)
    assert res.peak_memory[0] == pytest.approx(8.0, rel=1e-12)
    assert sum(1 for _, _, a in lower(sched).actions() if not a.is_compute) == 2 * 2 * 3 * 8


def test_example_runs_on_a_real_pipeline_bitwise_equal_to_megatron(gpipe):
    from megatron_zb.testing import run_distributed
    from megatron_zb.testing.tiny_gpt import TinyGPT, run_step

    cfg = TinyGPT(pp=2)
    sched = gpipe(num_ranks=2, num_microbatches=cfg.num_microbatches)
    ref = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=None), world_size=2, timeout=120))
    got = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=sched), world_size=2, timeout=120))
    assert len(got["losses"]) == len(ref["losses"]) == cfg.num_microbatches
    assert all(torch.equal(a, b) for a, b in zip(got["losses"], ref["losses"]))
    assert got["grads"].keys() == ref["grads"].keys() and ref["grads"]
    for name, g in ref["grads"].items():
        assert torch.equal(got["grads"][name], g), name


def test_no_test_imports_a_private_name():
    """The page's claim "No test imports a private function": every ``from megatron_zb... import``
    in tests/ names public names only (no leading underscore)."""
    import ast

    tests = Path(__file__).resolve().parent
    private = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_zb"):
                private += [f"{path.relative_to(tests)}:{node.lineno} {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")]
    assert private == []


FLOORS = ("schedules", "model", "runtime", "training")
"""The page's layers, lowest first: a module of one never imports one of a higher floor (``model/`` builds
the chunks the runtime runs; ``planning/`` and the modules beside the floors are not ordered here)."""


def _imported_packages(path: Path, module: str) -> set[str]:
    """The ``megatron_zb`` sub-packages ``path`` (module ``module``) imports, at load time or inside functions."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against the module's package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [name]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n.split(".")[1] for n in names if n.startswith("megatron_zb.") and n.count(".") >= 1}
    return out


def test_no_floor_imports_a_higher_one():
    """schedules/ < model/ < runtime/ < training/: no import goes up (before issue 40 ``model/`` imported
    ``runtime/`` for the weight-gradient rule, now ``model/grad_accumulation.py``)."""
    package = Path(__file__).resolve().parents[1] / "megatron_zb"
    upward = []
    for low, floor in enumerate(FLOORS):
        for path in sorted((package / floor).rglob("*.py")):
            parts = path.relative_to(package).with_suffix("").parts
            module = ".".join(("megatron_zb",) + (parts[:-1] if parts[-1] == "__init__" else parts))
            higher = _imported_packages(path, module) & set(FLOORS[low + 1:])
            upward += [f"{path.relative_to(package)} -> {h}/" for h in sorted(higher)]
    assert upward == []
