"""The size and import rules of the whole package (docs/architecture.md, "Rules of the codebase"):
no module over 550 lines, no function over 120 lines, and no import cycle among the modules that
megatron_zb's modules import when they load (imports inside functions and under ``TYPE_CHECKING``
run later or never, so they cannot make a cycle at import time). The installed package stands on its
own: no module imports pytest (or the rest of the test extra) or anything under ``tests/``, at any
nesting, and no module reads a ``TEST_HOOK`` environment variable (fault injection is a callable the
tests install)."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_zb
from harness.import_graph import find_cycle

PKG_DIR = Path(megatron_zb.__file__).parent
TESTS_DIR = Path(__file__).resolve().parent
TEST_EXTRA = frozenset({"pytest", "_pytest", "hypothesis"})
"""Top-level packages only the test extra installs (setup.py ``extras_require["test"]``)."""
MAX_MODULE_LINES = 550
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of megatron_zb (a package is its ``__init__``)."""
    out = {}
    for path in sorted(PKG_DIR.rglob("*.py")):
        parts = ["megatron_zb", *path.relative_to(PKG_DIR).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _load_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module loads: outside functions and outside
    ``if TYPE_CHECKING:`` blocks (inside ``if``/``try``/``with``/class bodies included)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                found.append(stmt)
            elif isinstance(stmt, ast.If):
                if not (isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING"):
                    walk(stmt.body)
                walk(stmt.orelse)
            elif isinstance(stmt, (ast.Try, ast.With, ast.ClassDef)):
                for part in ("body", "orelse", "finalbody"):
                    walk(getattr(stmt, part, []))
                for handler in getattr(stmt, "handlers", []):
                    walk(handler.body)

    walk(tree.body)
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports when it loads. ``from pkg import name`` imports
    ``pkg`` (its ``__init__`` runs first) and also ``pkg.name`` when that is a module; importing
    ``a.b.c`` runs ``a`` and ``a.b`` first."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _load_time_imports(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    prefix = ".".join(parts[:i])
                    # a module's own parent packages are already loading when it loads: not an edge
                    if prefix in mods and prefix != name and not name.startswith(prefix + "."):
                        graph[name].add(prefix)
    return graph


def test_no_module_is_over_550_lines():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_over_120_lines():
    long = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{name}.{node.name} (line {node.lineno})"] = n
    assert long == {}


def test_the_checks_see_the_package():
    """The rules read every module (a long one and a cycle are found when there are some)."""
    mods = _modules()
    assert {"megatron_zb", "megatron_zb.schedules.timing", "megatron_zb.training.run_config",
            "megatron_zb.training.run_config.model"} <= set(mods)
    graph = _import_graph()
    assert "megatron_zb.schedules.timing" in graph["megatron_zb.schedules.simulator"]
    assert "megatron_zb.megatron_lm.v" in graph["megatron_zb.megatron_lm.route"]   # from . import v
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_at_load_time():
    assert find_cycle(_import_graph()) is None


def _test_module_names() -> frozenset[str]:
    """Top-level names under which something of ``tests/`` is importable in a test run: ``tests``
    itself, the packages in it (``harness``) and the modules of the folders pytest puts on
    ``sys.path`` (``conftest``, ``te_double``, the test files, ``pause_before_tracker``, ...)."""
    names = {"tests"}
    for path in TESTS_DIR.rglob("*.py"):
        top = path.parent
        while (top / "__init__.py").is_file():  # inside a package: its outermost package is the name
            path, top = top, top.parent
        names.add(path.stem if path.suffix == ".py" else path.name)
    return frozenset(names)


def _imports_anywhere(tree: ast.Module, name: str) -> list[str]:
    """Every module ``tree`` imports, at any nesting (functions, ``TYPE_CHECKING`` blocks included),
    by statement or by ``importlib.import_module`` / ``__import__`` with a literal name; relative
    imports resolved against ``name`` (a module of megatron_zb)."""
    package = name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                found.append(f"{base}.{node.module}" if node.module else base)
            else:
                found.append(node.module or "")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("import_module", "__import__"):
                found.append(node.args[0].value)
    return found


def test_no_module_imports_the_test_extra_or_tests():
    """What pip installs runs without pytest and without the checkout's ``tests/``."""
    forbidden = TEST_EXTRA | _test_module_names()
    assert {"tests", "conftest", "te_double", "pytest"} <= forbidden
    bad = {}
    for name, path in _modules().items():
        own = f"{name}.__init__" if path.name == "__init__.py" else name  # a package resolves "." to itself
        hits = sorted({m for m in _imports_anywhere(ast.parse(path.read_text()), own)
                       if m.split(".")[0] in forbidden})
        if hits:
            bad[name] = hits
    assert bad == {}, f"modules of megatron_zb importing test-only code: {bad}"


def test_no_module_reads_a_test_hook_variable():
    """Fault injection is a typed callable the tests install (``grad_sync.set_before_reduce_hook``,
    ``checkpointing.set_before_tracker_hook``), never an environment variable the product reads."""
    bad = [name for name, path in _modules().items() if "TEST_HOOK" in path.read_text()]
    assert bad == []


def test_the_boundary_checks_see_what_they_look_for():
    """The import check finds an import of pytest or of a tests/ module at any nesting."""
    src = ("def f():\n    import pytest\n    from harness.dp_overlap import run\n"
           "    importlib.import_module('tests.data')\n    from . import x\n")
    got = _imports_anywhere(ast.parse(src), "megatron_zb.runtime.p2p")
    assert sorted(got) == ["harness.dp_overlap", "megatron_zb.runtime", "pytest", "tests.data"]
