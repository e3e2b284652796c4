#!/usr/bin/env bash
# The README's test command (CI runs exactly this): the whole test suite on both supported
# platforms (docs/megatron_core_versions.md), the two suites side by side:
#   py311  -- this Python (3.11 on these machines) with megatron-core 0.16.1: installs CPU torch
#             2.13.0 first (an unpinned torch would pull a multi-GB CUDA build), then megatron-zb
#             editable with its test extras;
#   py312  -- Python 3.12 with the newest megatron-core 0.19.x, in the virtual environment
#             scripts/test_py312.sh makes ($PY312_VENV, default .venv-py312), installed while the
#             first suite already runs.
# Run once when both suites run (unless test paths are given), the work split between them so both end
# about together: tests/schedules, tests/cli and tests/bench by the first suite -- schedules/ and the
# planner import neither torch nor megatron-core (asserted by tests/schedules/test_schedules_layout.py);
# the CLI's --torch-csv needs torch 2.13, the same release in both environments; tests/bench holds the
# benchmark scripts' smoke tests (no number asserted; the training path they drive is tested on both
# releases by tests/training) -- and tests/torch_pipelining (torch 2.13 only, no megatron-core) and
# tests/runtime/test_nccl_semantics.py (the NCCL model's certificate of every family, pure Python, about
# 4 minutes) by the 3.12 suite, which starts later (its install). With one suite (MEGATRON_ZB_PY312=skip, or this Python
# is 3.12) it runs everything.
# Each suite writes its own log (test-logs/<platform>.log) and pytest folder; a progress line every
# 10 s (tests done, failed, percentage); at the end each suite's summary (its whole log if it failed), the wall time, and exit 1 if
# either failed. MEGATRON_ZB_PY312=skip runs the first suite only and says so on the last line;
# without a Python 3.12 and without that setting the script stops before installing, naming both fixes.
# Usage: bash scripts/run_tests.sh [extra pytest args, given to both suites]
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
LOGS=test-logs
mkdir -p "$LOGS"
BASETEMP="${TMPDIR:-/tmp}/megatron-zb-tests-$$"
PYTEST_ARGS=(-q -p no:cacheprovider --durations=40)
ONCE_FIRST=()   # left out of the first suite when both run: run by the 3.12 suite
ONCE=()         # left out of the 3.12 suite: run by the first
if [[ $# -eq 0 ]]; then
    set -- tests
    ONCE_FIRST=(--ignore=tests/torch_pipelining --ignore=tests/runtime/test_nccl_semantics.py)
    ONCE=(--ignore=tests/schedules --ignore=tests/cli --ignore=tests/bench)
fi

# 1. Python 3.12 present, or explicitly skipped (checked before anything is installed).
first=$(python -c 'import sys; print("py%d%d" % sys.version_info[:2])')
py312=run
if [[ "${MEGATRON_ZB_PY312:-}" == skip ]]; then
    py312=skip
elif [[ $first == py312 ]]; then  # this Python is 3.12 itself: its suite is the megatron-core 0.19.x one
    py312=self
elif ! bash scripts/test_py312.sh --find-python >/dev/null 2>&1; then
    echo "run_tests.sh: no Python 3.12 found for the megatron-core 0.19.x suite; install Python 3.12" \
         "(e.g. pyenv install 3.12) or set MEGATRON_ZB_PY312=skip to test megatron-core 0.16.1 only" >&2
    exit 2
fi

# 2. This Python's install (needed by everything after it).
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"

# 3. Both suites, side by side (the 3.12 environment is installed inside its job).
start=$SECONDS
mkdir -p "$BASETEMP"
python -c 'import sys; from importlib.metadata import version as v
print(f"{sys.argv[1]} suite: Python", sys.version.split()[0], "torch", v("torch"), "megatron-core", v("megatron-core"))' "$first"
[[ $py312 == run ]] || ONCE_FIRST=()
[[ ${#ONCE_FIRST[@]} -gt 0 ]] && echo "$first suite: tests/torch_pipelining and tests/runtime/test_nccl_semantics.py run by the py312 suite only (release-independent)"
python -m pytest "${PYTEST_ARGS[@]}" --basetemp "$BASETEMP/$first" "${ONCE_FIRST[@]}" "$@" >"$LOGS/$first.log" 2>&1 &
pids=($!)
names=("$first")
if [[ $py312 == run ]]; then
    [[ ${#ONCE[@]} -gt 0 ]] && echo "py312 suite: tests/schedules, tests/cli and tests/bench run by the $first suite only (release-independent)"
    bash scripts/test_py312.sh --basetemp "$BASETEMP/py312" "${ONCE[@]}" "$@" >"$LOGS/py312.log" 2>&1 &  # its own pytest options: those above
    pids+=($!)
    names+=(py312)
fi

progress() {  # one line: per suite, the tests done so far (pytest's result characters), failures, percentage
    local line="[$(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s]" name results pct
    for name in "${names[@]}"; do
        results=$(grep -E '^[.sxXFE]+( +\[ *[0-9]+%\])?$' "$LOGS/$name.log" 2>/dev/null | tr -cd '.sxXFE' || true)
        pct=$(grep -o '\[ *[0-9]*%\]' "$LOGS/$name.log" 2>/dev/null | tail -1 | tr -d '[] ' || true)
        if [[ -z "$results" ]]; then line+="  $name: installing/collecting"; continue; fi
        line+="  $name: ${#results} tests done${pct:+ ($pct at the last pytest mark)}, $(tr -cd 'FE' <<<"$results" | wc -c) failed"
    done
    echo "$line"
}
while kill -0 "${pids[@]}" 2>/dev/null; do
    for _ in $(seq 10); do
        sleep 1
        running=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
        [[ $running == 1 ]] || break
    done
    progress
done

# 4. Each suite's result.
status=0
for i in "${!pids[@]}"; do
    name=${names[$i]}
    if wait "${pids[$i]}"; then
        echo "=== $name: passed ($LOGS/$name.log) ==="
        sed -n '/slowest .* durations/,$p' "$LOGS/$name.log"
    else
        status=1
        echo "=== $name: FAILED ($LOGS/$name.log) ==="
        cat "$LOGS/$name.log"
    fi
done
rm -rf "$BASETEMP"
echo "run_tests.sh: $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s for the suites;" \
     "$(case $py312 in run) echo "both platforms tested";; self) echo "this Python is 3.12: megatron-core 0.16.1 NOT tested";;
        *) echo "megatron-core 0.19.x NOT tested (MEGATRON_ZB_PY312=skip)";; esac)"
exit $status
