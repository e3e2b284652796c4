"""Every benchmark runs from the installed package: ``python -m megatron_zb.bench NAME`` resolves each
NAME to a module inside ``megatron_zb`` and never runs a file of the checkout's ``scripts/`` (which an
installed wheel does not have); the scripts only call those modules."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import megatron_zb
from megatron_zb.bench.__main__ import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]
PKG_DIR = Path(megatron_zb.__file__).resolve().parent


def test_every_benchmark_is_a_module_of_the_package():
    for name, bench in BENCHMARKS.items():
        spec = importlib.util.find_spec(bench.module)
        assert spec is not None and spec.origin, (name, bench.module)
        assert Path(spec.origin).resolve().is_relative_to(PKG_DIR), (name, spec.origin)


def test_the_dispatcher_never_runs_a_path():
    """No ``runpy.run_path`` and no ``scripts`` folder in the entry point (it used to run five
    benchmarks from ``scripts/`` with ``runpy.run_path``)."""
    tree = ast.parse((PKG_DIR / "bench" / "__main__.py").read_text())
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "run_path" not in called and "run_module" in called
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    strings = [n.value for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]
    assert not [s for s in strings if re.search(r"scripts/\w+\.py|\.py$", s)], strings
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {"SCRIPTS", "run_path", "__file__"} & names


def test_list_and_a_benchmark_run_from_a_copy_of_the_package_alone(tmp_path):
    """The package copied to a folder without ``scripts/`` or ``tests/`` (what a wheel installs):
    ``--list`` names every benchmark, and one short one runs, from that copy."""
    shutil.copytree(PKG_DIR, tmp_path / "site" / "megatron_zb", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), OMP_NUM_THREADS="1")
    listed = subprocess.run([sys.executable, "-m", "megatron_zb.bench", "--list"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert all(f"  {name} " in listed.stdout for name in BENCHMARKS), listed.stdout
    run = subprocess.run([sys.executable, "-m", "megatron_zb.bench", "greedy-speed", "--pp", "4", "--repeats", "1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "command: python -m megatron_zb.bench.greedy_speed --pp 4 --repeats 1" in run.stdout, run.stdout
    assert "| 4 | 32 | 2p |" in run.stdout, run.stdout
    assert str(tmp_path / "site" / "megatron_zb") in subprocess.run(
        [sys.executable, "-c", "import megatron_zb; print(megatron_zb.__file__)"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60).stdout  # the copy ran, not the checkout


def test_the_benchmark_scripts_only_call_the_package():
    """Each ``scripts/`` file of a benchmark is a thin caller of its module's ``main``."""
    scripts = {"cpu": "benchmark.py", "schedules": "bench_schedules.py", "vshape": "bench_vshape.py",
               "greedy-speed": "bench_greedy_speed.py", "torch-pipelining": "bench_torch_pipelining.py"}
    for name, script in scripts.items():
        tree = ast.parse((ROOT / "scripts" / script).read_text())
        defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not defs, (script, [d.name for d in defs])
        assert any(n.module == BENCHMARKS[name].module and [a.name for a in n.names] == ["main"] for n in imports), script
