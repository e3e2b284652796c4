#!/usr/bin/env bash
# megatron-zb self-test on a GPU node (1 to 8 GPUs, NCCL): everything the CPU machines cannot run.
#
#   bash scripts/gpu_selftest.sh              # run what fits this node, print a summary
#   bash scripts/gpu_selftest.sh --dry-run    # print the commands it would run, run nothing (works on CPU)
#   bash scripts/gpu_selftest.sh --gpus 4     # use 4 GPUs (default: every visible GPU, at most 8)
#   bash scripts/gpu_selftest.sh --skip-bench # only the tests
#
# Steps:
#   1. environment: GPUs, torch / CUDA / NCCL versions, Transformer Engine and apex presence;
#   2. the numerical test suite on CUDA: the tests that build models take their device and backend
#      from MEGATRON_ZB_TEST_DEVICE / MEGATRON_ZB_TEST_BACKEND, so the CPU suite's equality tests
#      (every schedule against megatron-core's 1F1B, TP/SP, DDP and its overlapped reduce, model
#      flags, fused accumulation, the Transformer Engine contract) run here on GPUs with NCCL;
#      tests that need more GPUs than the node has are reported as skipped;
#   3. with Transformer Engine >= 2.3 installed: the real-TE parity tests (delayed weight gradients
#      under zb-h1 / zb-2p / zbv equal the non-delayed path of megatron-core's 1F1B);
#   4. with 2 or more GPUs: a short benchmark, megatron-core's 1F1B against zb, zb-2p and zbv at
#      PP = number of GPUs on a GPT sized for the GPUs, printed as one table.
# Nothing is downloaded: it uses the installed packages and random data. Exit status: 0 when
# every step that ran passed.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
GPUS=""
BENCH=1
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --gpus) GPUS="${2:?--gpus needs a number}"; shift ;;
    --skip-bench) BENCH=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_selftest.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
NOTE=""
if [ -z "$GPUS" ]; then
  GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
  if [ "$GPUS" -eq 0 ] && [ "$DRY" -eq 1 ]; then
    GPUS=8
    NOTE="no GPU visible here: showing the commands for an 8-GPU node (--gpus N for another count)"
  fi
fi
case "$GPUS" in ''|*[!0-9]*) echo "gpu_selftest.sh: --gpus must be a number, got '$GPUS'" >&2; exit 2 ;; esac
if [ "$GPUS" -lt 1 ]; then
  echo "gpu_selftest.sh: no CUDA device visible (torch.cuda.device_count() == 0); use --dry-run to see the commands" >&2
  exit 2
fi
[ "$GPUS" -gt 8 ] && GPUS=8

HAVE_TE=0
if "$PY" -c 'from megatron_zb.runtime.te_route import require_transformer_engine as r; r()' >/dev/null 2>&1; then
  HAVE_TE=1
fi

CUDA_ENV="env MEGATRON_ZB_TEST_DEVICE=cuda MEGATRON_ZB_TEST_BACKEND=nccl CUBLAS_WORKSPACE_CONFIG=:4096:8"
PYTEST="$PY -m pytest -q -p no:cacheprovider -rs"
NUMERIC_TESTS="tests/test_runtime.py tests/test_routes.py tests/test_te_contract.py tests/test_dp_overlap.py tests/test_model_flags.py"

declare -a SUMMARY=()
FAILED=0
step() {  # step NAME COMMAND...: print the command; run it unless --dry-run; record the outcome
  local name="$1"; shift
  echo "+ $*"
  if [ "$DRY" -eq 1 ]; then
    return 0
  fi
  if bash -c "$*"; then
    SUMMARY+=("PASS     $name")
  else
    SUMMARY+=("FAIL     $name")
    FAILED=1
  fi
}
skip() {  # skip NAME REASON
  echo "# skipped: $1 -- $2"
  SUMMARY+=("SKIPPED  $1 ($2)")
}

echo "# megatron-zb GPU self-test: $GPUS GPU(s)$([ "$DRY" -eq 1 ] && echo ', dry run (nothing is executed)')"
[ -n "$NOTE" ] && echo "# $NOTE"

step "environment" "nvidia-smi -L"
step "versions" "$PY -c 'import torch, torch.distributed as d; print(\"torch\", torch.__version__, \"CUDA\", torch.version.cuda, \"NCCL\", torch.cuda.nccl.version() if torch.cuda.is_available() else None, \"GPUs\", torch.cuda.device_count())'"
step "transformer engine / apex" "$PY -c 'from megatron_zb.runtime.te_route import transformer_engine_version as v; import importlib.util as u; print(\"transformer_engine\", v(), \"apex fused_weight_gradient_mlp_cuda\", u.find_spec(\"fused_weight_gradient_mlp_cuda\") is not None)'"

if [ "$GPUS" -lt 2 ]; then
  echo "# one GPU: every test that needs 2 or more ranks (one GPU per rank) is reported as skipped"
fi
step "numerical test suite on CUDA" "$CUDA_ENV $PYTEST $NUMERIC_TESTS"

if [ "$HAVE_TE" -eq 1 ] || [ "$DRY" -eq 1 ]; then
  [ "$HAVE_TE" -eq 0 ] && echo "# runs only where Transformer Engine >= 2.3 is installed (not here)"
  if [ "$GPUS" -ge 2 ]; then
    step "Transformer Engine parity" "$CUDA_ENV $PYTEST tests/test_te_contract.py -k real_transformer_engine"
  else
    skip "Transformer Engine parity" "needs 2 GPUs"
  fi
else
  skip "Transformer Engine parity" "Transformer Engine >= 2.3 is not installed"
fi

if [ "$BENCH" -eq 0 ]; then
  skip "benchmark" "--skip-bench"
elif [ "$GPUS" -ge 2 ]; then
  step "benchmark (PP=$GPUS)" "$CUDA_ENV $PY -m megatron_zb.testing.gpu_bench --pp $GPUS"
else
  skip "benchmark" "a pipeline needs 2 or more GPUs"
fi

if [ "$DRY" -eq 1 ]; then
  exit 0
fi
echo
echo "== gpu_selftest summary ($GPUS GPU(s))"
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit "$FAILED"
