#!/usr/bin/env bash
# Run megatron-zb's tests on Python 3.12 with the newest megatron-core 0.19.x (docs/compatibility.md).
#
# Usage: bash scripts/test_py312.sh [pytest args; default: the whole tests/ directory]
#        bash scripts/test_py312.sh --find-python   (prints how Python 3.12 is started; exit 1: none)
#
# 1. creates a Python 3.12 virtual environment at $PY312_VENV (default .venv-py312 in the
#    repository) unless one is there: `python3.12 -m venv` (through pyenv: PYENV_VERSION=3.12.1
#    when pyenv's global version is another one);
# 2. installs torch 2.13.0 (on 3.12 the registry's manylinux build: about 530 MB plus its CUDA
#    library packages; it runs on the CPU) and megatron-zb with its test extras, editable, which
#    pulls the newest megatron-core < 0.20 (setup.py);
# 3. runs pytest there on the working tree, with the megatron-core version printed first.
# MEGATRON_ZB_SKIP_INSTALL=1 skips steps 1-2 and runs an existing $PY312_VENV with the working tree on
# PYTHONPATH (for a shared venv that already holds torch, megatron-core 0.19.x and the test extras).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PY312_VENV:-.venv-py312}"
python312() {  # Python 3.12: pyenv's newest 3.12.x when pyenv has one, else python3.12 on PATH
    local v=""  # (no `grep -q` on pyenv's output: under pipefail its SIGPIPE would fail the pipeline)
    if command -v pyenv >/dev/null; then v="$(pyenv versions --bare | grep -x '3\.12\.[0-9]*' | tail -1 || true)"; fi
    if [[ -n "$v" ]]; then
        PYENV_VERSION="$v" python3.12 "$@"
    else
        python3.12 "$@"
    fi
}
if [[ "${1:-}" == --find-python ]]; then
    python312 -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)'
    exit
fi
if [[ "${MEGATRON_ZB_SKIP_INSTALL:-0}" != 1 ]]; then
    if [[ ! -x "$VENV/bin/python" ]]; then
        python312 -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    "$VENV/bin/python" -m pip install -q -e ".[test]"
fi
PY="$VENV/bin/python"
"$PY" - <<'EOF'
import sys
from importlib.metadata import version
assert sys.version_info[:2] >= (3, 12), f"{sys.executable} is Python {sys.version.split()[0]}, not 3.12"
print(f"Python {sys.version.split()[0]}, torch {version('torch')}, megatron-core {version('megatron-core')}")
EOF
if [[ $# -eq 0 ]]; then set -- tests; fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider --durations=40 "$@"
