"""Layout of megatron_zb.schedules: no import cycle, and every generator registers the same way."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import megatron_zb.schedules as schedules_pkg
from megatron_zb.schedules import CostModel, Placement, Schedule, ScheduleError, simulate
from megatron_zb.schedules.catalog import SCHEDULES, register
from megatron_zb.schedules.ir import BW, F, make_schedule, plain_placement
from megatron_zb.schedules.registry import build_schedule, get_spec, schedule_names
from harness.import_graph import find_cycle

PKG_DIR = Path(schedules_pkg.__file__).parent
PKG = schedules_pkg.__name__


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its ``__init__``)."""
    out = {}
    for path in PKG_DIR.rglob("*.py"):
        parts = list(path.relative_to(PKG_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PKG, *parts])] = path
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file, lazy imports included)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                # `from pkg import name` imports the module pkg.name when there is one, else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def test_import_graph_is_read_correctly():
    graph = _import_graph()
    assert f"{PKG}.generators" in graph[f"{PKG}.registry"]
    assert f"{PKG}.catalog" in graph[f"{PKG}.generators.greedy"]
    assert f"{PKG}.timing" in graph[f"{PKG}.simulator"]
    assert f"{PKG}.limits" in graph[f"{PKG}.generators.vshape"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_schedules_package_has_no_import_cycle():
    assert find_cycle(_import_graph()) is None


def test_registration_order_is_the_documented_list_order():
    assert schedule_names() == ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb", "zb-1p", "zb-2p", "zbv", "v-half",
                                "v-min", "1f1b-v", "interleaved-zb", "zb-optimal", "zbv-optimal", "1f1b-vocab-1",
                                "1f1b-vocab-2", "zb-h1-vocab-1", "zb-h1-vocab-2", "zbv-vocab-1", "zbv-vocab-2",
                                "interleaved-1f1b-vocab-1", "interleaved-1f1b-vocab-2", "interleaved-zb-vocab-1",
                                "interleaved-zb-vocab-2",
                                "zb-vocab-1", "zb-vocab-2", "zb-1p-vocab-1", "zb-1p-vocab-2", "zb-2p-vocab-1",
                                "zb-2p-vocab-2", "v-half-vocab-1", "v-half-vocab-2", "v-min-vocab-1", "v-min-vocab-2"]


def test_every_builder_takes_the_same_keyword_arguments():
    want = ["num_ranks", "num_microbatches", "costs", "memory_limit", "num_chunks"]
    for name in schedule_names():
        spec = get_spec(name)
        params = inspect.signature(spec.build).parameters.values()
        assert [p.name for p in params] == want, name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), name
        assert isinstance(spec.placement, Placement), name


def test_a_new_module_registers_a_schedule_by_decorator():
    """The documented way to add a schedule: a builder decorated with ``register``."""

    @register("test-gpipe", "all forwards, then all backwards", placement=Placement.PLAIN,
              split_backward=False, cost_aware=False)
    def gpipe(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
              num_chunks: int) -> Schedule:
        ranks = [[F(i, r) for i in range(num_microbatches)] + [BW(i, r) for i in range(num_microbatches)]
                 for r in range(num_ranks)]
        return make_schedule(num_microbatches=num_microbatches, stage_to_rank=plain_placement(num_ranks),
                             ranks=ranks)

    try:
        assert schedule_names()[-1] == "test-gpipe"
        sched = build_schedule("test-gpipe", num_ranks=3, num_microbatches=4)
        assert sched.name == "test-gpipe"
        res = simulate(sched, CostModel())
        # unit costs, p=3, m=4: the forwards end at 4 + 2 = 6 on the last rank, the backwards (2 each)
        # take 8 per rank and the last one reaches rank 0 after 2 * 2 more: 6 + 8 + 4 = 18
        assert res.total_time == 18.0
        assert res.peak_memory == [4.0, 4.0, 4.0]
        try:
            register("test-gpipe", "again", placement=Placement.PLAIN, split_backward=False,
                     cost_aware=False)(gpipe)
        except ScheduleError as e:
            assert "registered twice" in str(e)
        else:
            raise AssertionError("a second registration of one name must fail")
    finally:
        SCHEDULES.pop("test-gpipe", None)


def test_family_attributes_are_set_at_registration():
    """The family-specific lists of the planner, the PyTorch export's ``auto`` and the V flag are
    attributes of the registry entries, set at each family's ``register`` call."""
    specs = [get_spec(n) for n in schedule_names()]
    assert {s.name: s.excluded_from_plan for s in specs if s.excluded_from_plan} == {
        "zb-optimal": "exact CP-SAT solver: minutes beyond small p and m",
        "zbv-optimal": "exact CP-SAT solver: minutes beyond small p and m"}
    assert [s.name for s in specs if s.torch_auto_candidate] == ["1f1b", "interleaved-1f1b", "zb-h1", "zb-1p", "zbv",
                                                                 "1f1b-v", "interleaved-zb"]
    assert {s.v_mem_setup: s.name for s in specs if s.v_mem_setup} == {"zb": "zbv", "half": "v-half", "min": "v-min"}


def test_register_refuses_a_v_mem_setup_off_the_v_or_taken():
    build = get_spec("zbv").build
    for placement, setup, msg in ((Placement.PLAIN, "new", "needs the V placement"),
                                  (Placement.V, "half", "is 'v-half''s already")):
        try:
            register("test-v", "x", placement=placement, split_backward=True, cost_aware=True,
                     v_mem_setup=setup)(build)
        except ScheduleError as e:
            assert msg in str(e)
        else:
            raise AssertionError(f"v_mem_setup={setup!r} on {placement} must be refused")
        finally:
            SCHEDULES.pop("test-v", None)


# ---------------------------------------------------------------------------- no torch
NO_TORCH = textwrap.dedent("""
    import importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is made unimportable here ({name})")
            return None

    sys.meta_path.insert(0, NoTorch())
""")


def test_schedules_and_the_planner_import_and_run_without_torch():
    """``megatron_zb.schedules`` (every generator, the simulator) and ``megatron-zb plan`` need no torch:
    run in a subprocess where importing torch raises ImportError (where ``--torch-csv`` is refused)."""
    code = NO_TORCH + textwrap.dedent("""
        from megatron_zb.schedules import CostModel, simulate
        from megatron_zb.schedules.registry import build_schedule, get_spec, schedule_names
        from megatron_zb.cli import main

        costs = CostModel(t_f=1.0, t_b=1.2, t_w=0.8, t_comm=0.1, mem_w=0.4)
        for name in schedule_names():
            if name.endswith("-optimal"):
                continue   # CP-SAT (OR-Tools) is not torch either, but slow; its warm starts are built here
            simulate(build_schedule(name, num_ranks=2, num_microbatches=4, costs=costs), costs)
        rc = main(["plan", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
                   "--micro-batch-size", "1", "--vocab-size", "1000", "--pipeline-model-parallel-size", "2",
                   "--num-microbatches", "4", "--gpu", "A100", "--bf16", "--schedules", "1f1b,zb,zbv"])
        assert rc == 0, rc
        import contextlib, io
        err = io.StringIO()
        with contextlib.redirect_stderr(err):  # --torch-csv needs torch: one line, exit 2
            rc = main(["schedule", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "4", "--no-timeline",
                       "--torch-csv", "never-written.csv"])
        assert rc == 2 and "--torch-csv never-written.csv: needs PyTorch" in err.getvalue(), err.getvalue()
        assert "torch" not in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _generator_files() -> list[Path]:
    return sorted((PKG_DIR / "generators").glob("*.py"))


def test_no_generator_depends_on_the_installed_torch():
    """A generator's result may not depend on which torch is installed: none imports torch or the
    PyTorch importer (:mod:`megatron_zb.schedules.torch_import`), lazily or not."""
    graph = _import_graph()
    for name in graph:
        if ".generators" in name:
            assert f"{PKG}.torch_import" not in graph[name], name
    for path in _generator_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), (path.name, names)


def test_no_generator_swallows_an_exception():
    """No ``except Exception`` (or bare ``except``, or ``BaseException``) in a generator: what it
    cannot do is an error, never a silently skipped candidate."""
    for path in _generator_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler):
                caught = ast.unparse(node.type) if node.type is not None else ""
                assert caught not in ("", "Exception", "BaseException"), f"{path.name}:{node.lineno}: except {caught}"
