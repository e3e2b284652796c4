"""``scripts/gpu_selftest.sh`` on a CPU machine: its dry run prints commands that exist and parse.

No GPU here, so the script itself is only dry-run: every printed command must parse as bash,
name a Python module or script that exists, and -- for pytest -- select at least one test.
The benchmark it runs (:mod:`megatron_zb.testing.gpu_bench`) runs here on CPU at tiny sizes.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zb.testing import gpu_bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_selftest.sh"


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _commands(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def _python_argv(command: str) -> tuple[dict[str, str], list[str]] | None:
    """(environment, argv from ``python`` on) of a printed command, None if it does not run Python."""
    words = shlex.split(command)
    env: dict[str, str] = {}
    if words[0] == "env":
        words = words[1:]
        while words and "=" in words[0]:
            k, v = words.pop(0).split("=", 1)
            env[k] = v
    if not words or Path(words[0]).name not in ("python", "python3", Path(sys.executable).name):
        return None
    return env, words[1:]


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_dry_run_prints_commands_that_exist_and_parse():
    res = _dry_run("--gpus", "8")
    assert res.returncode == 0, res.stderr
    commands = _commands(res.stdout)
    assert len(commands) >= 6, res.stdout
    assert any("MEGATRON_ZB_TEST_DEVICE=cuda" in c and "tests/test_runtime.py" in c for c in commands)
    assert any("-k real_transformer_engine" in c for c in commands)
    assert any("megatron_zb.testing.gpu_bench --pp 8" in c for c in commands)
    for command in commands:
        assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0, command
        parsed = _python_argv(command)
        if parsed is None:
            assert shlex.split(command)[0] == "nvidia-smi", f"unexpected command {command!r}"
            continue
        env, argv = parsed
        assert env.get("MEGATRON_ZB_TEST_DEVICE", "cuda") == "cuda"
        if argv[0] == "-c":
            compile(argv[1], "<gpu_selftest -c>", "exec")
        elif argv[:2] == ["-m", "pytest"]:
            paths = [a for a in argv[2:] if a.startswith("tests/")]
            assert paths and all((ROOT / p).is_file() for p in paths), command
            keep = [a for a in argv[2:] if a not in ("-q", "-rs")]
            collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *keep], cwd=ROOT,
                                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                                       timeout=300)
            assert collected.returncode == 0, collected.stdout[-2000:]
            assert "::test_" in collected.stdout, f"{command!r} selects no test"
        elif argv[0] == "-m":
            assert importlib.util.find_spec(argv[1]) is not None, command
            helped = subprocess.run([sys.executable, "-m", argv[1], "--help"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            assert helped.returncode == 0 and "--pp" in helped.stdout
            assert all(o in helped.stdout for o in argv[2:] if o.startswith("--")), command
        else:
            assert (ROOT / argv[0]).is_file(), command


def test_one_gpu_node_runs_what_fits_and_says_what_it_skips():
    res = _dry_run("--gpus", "1")
    assert res.returncode == 0, res.stderr
    assert "skipped: benchmark -- a pipeline needs 2 or more GPUs" in res.stdout
    assert "skipped: Transformer Engine parity -- needs 2 GPUs" in res.stdout
    assert "every test that needs 2 or more ranks" in res.stdout
    assert not any("gpu_bench" in c for c in _commands(res.stdout))
    assert any("tests/test_runtime.py" in c for c in _commands(res.stdout))


def test_without_gpu_and_without_dry_run_it_refuses():
    res = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 2 and "no CUDA device visible" in res.stderr


def test_benchmark_runs_on_cpu_at_tiny_sizes(capsys):
    assert gpu_bench.main(["--pp", "2", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "schedule" not in line]
    assert [r.split("|")[1].strip() for r in rows] == list(gpu_bench.VARIANTS)
    assert all(float(r.split("|")[2]) > 0 for r in rows)


@pytest.mark.parametrize("pp,gib,hidden", [(8, 80.0, 2048), (4, 24.0, 1024)])
def test_model_is_sized_for_the_gpus(pp, gib, hidden):
    sizes = gpu_bench.model_for(pp=pp, gpu_memory_gib=gib)
    assert sizes["hidden"] == hidden and sizes["layers"] == 4 * pp and sizes["layers"] % (2 * pp) == 0
