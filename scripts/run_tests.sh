#!/usr/bin/env bash
# The README's test command: install megatron-zb with its test extras (CPU torch first: an
# unpinned torch would pull a multi-GB CUDA build), then run the whole test suite.
# Usage: bash scripts/run_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
