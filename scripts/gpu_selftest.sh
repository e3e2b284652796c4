#!/usr/bin/env bash
# megatron-zb self-test on a GPU node (1 to 8 GPUs, NCCL): everything the CPU machines cannot run.
#
#   bash scripts/gpu_selftest.sh              # run what fits this node, print a summary
#   bash scripts/gpu_selftest.sh --dry-run    # print the commands it would run, run nothing (works on CPU)
#   bash scripts/gpu_selftest.sh --gpus 4     # use 4 GPUs (default: every visible GPU, at most 8)
#   bash scripts/gpu_selftest.sh --skip-bench # everything but the benchmark
#   bash scripts/gpu_selftest.sh --out DIR    # logs and summary.txt in DIR (default /tmp/megatron_zb_gpu_selftest-DATE)
#
# Steps (docs/verification.md says what each one checks and where each piece has been verified):
#   1. environment: GPUs, torch / CUDA / NCCL versions, Transformer Engine and apex presence;
#   2. the numerical test suite on CUDA: the tests that build models take their device and backend
#      from MEGATRON_ZB_TEST_DEVICE / MEGATRON_ZB_TEST_BACKEND, so the CPU suite's equality tests
#      (every schedule against megatron-core's 1F1B, TP/SP, DDP and its overlapped reduce, model
#      flags, fused accumulation, the Transformer Engine contract) run here on GPUs with NCCL;
#      tests that need more GPUs than the node has are reported as skipped;
#   3. p2p stress (2+ GPUs): every registered schedule, PP = number of GPUs, a GPT with one layer per
#      stage and 64 MiB activations (seq 4096 x hidden 8192, bf16) -- large enough that NCCL does not
#      buffer a send, so an issue order that deadlocks fails here, naming the schedule
#      (megatron_zb/testing/p2p_stress.py);
#   4. pretrain_gpt_zb.py on CUDA with NCCL (2+ GPUs): zb, zb-2p and zbv at PP = 2, mock data, with the
#      profile-then-replan window and --profile-out (the CUDA timing path); on one GPU the pipeline
#      runs are skipped and zb runs at PP = 1 instead (megatron_zb/testing/pretrain_run.py);
#   5. TP = 2 with sequence parallelism (2+ GPUs): pretrain_gpt_zb.py at TP = 2, PP = 1; with 4+ GPUs
#      the numerical suite's TP/SP cases (bitwise against megatron-core 1F1B) and pretrain at TP = 2, PP = 2;
#   6. memory (2+ GPUs): pretrain_gpt_zb.py with zb-h1 at PP = 2 (local layers), each rank's
#      torch.cuda.max_memory_allocated next to `megatron-zb plan`'s prediction; FAIL above the
#      prediction x 1/0.9, the plan's own headroom (megatron_zb/testing/memory_check.py); with 4+
#      GPUs the same at TP = 2 with sequence parallelism x PP = 2, with Transformer Engine's layers
#      when TE is installed (else local), where each W keeps all-gathered tensors (M_W > M_B per
#      layer at large TP: the plan lets B allocate);
#   7. with Transformer Engine >= 2.3 installed: the real-TE parity tests (delayed weight gradients
#      under zb-h1 / zb-2p / zbv equal the non-delayed path of megatron-core's 1F1B; FP8 with linear
#      biases and MoE grouped GEMM with and without fused accumulation, main_grad under
#      megatron-core DDP; each run's store ran microbatches x (TE modules + 1) W's and left every
#      TE queue empty);
#   8. with 2 or more GPUs: a short benchmark, megatron-core's 1F1B against zb, zb-2p and zbv at
#      PP = number of GPUs on a GPT sized for the GPUs, printed as one table.
# The summary at the end lists every step as PASS, FAIL or SKIPPED with the reason (a step's last
# output line); it is also written to OUT/summary.txt, each step's output to OUT/<step>.log.
# Nothing is downloaded: it uses the installed packages and random / mock data. Exit status: 0 when
# every step that ran passed.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
GPUS=""
BENCH=1
OUT=""
STEP_TIMEOUT="${GPU_SELFTEST_STEP_TIMEOUT:-5400}"
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --gpus) GPUS="${2:?--gpus needs a number}"; shift ;;
    --skip-bench) BENCH=0 ;;
    --out) OUT="${2:?--out needs a directory}"; shift ;;
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
[ -z "$OUT" ] && OUT="${TMPDIR:-/tmp}/megatron_zb_gpu_selftest-$(date +%Y%m%d-%H%M%S)"

HAVE_TE=0
if "$PY" -c 'from megatron_zb.runtime.te_route import require_transformer_engine as r; r()' >/dev/null 2>&1; then
  HAVE_TE=1
fi

CUDA_ENV="env MEGATRON_ZB_TEST_DEVICE=cuda MEGATRON_ZB_TEST_BACKEND=nccl CUBLAS_WORKSPACE_CONFIG=:4096:8"
PYTEST="$PY -m pytest -q -p no:cacheprovider -rs"
NUMERIC_TESTS="tests/runtime/test_runtime.py tests/runtime/test_routes.py tests/runtime/test_te_contract.py tests/runtime/test_dp_overlap.py tests/training/test_model_flags.py"

# pretrain_gpt_zb.py on CUDA: a GPT of 8 layers, hidden 2048, 16 heads, sequence 2048, bf16, 8 micro
# batches of 1, megatron-core's mock data (tokenizer ByteLevel: vocabulary 258, nothing to download);
# 10 iterations, the profiling window 3-6, then the re-plan from the measured costs.
PT_MODEL="--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 --bf16"
PT_TRAIN="--train-iters 10 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2 --lr-decay-style cosine --mock-data --num-workers 0 --log-interval 1 --eval-interval 10 --eval-iters 1 --distributed-backend nccl --zero-bubble-pipeline-timers-start-iter 3 --zero-bubble-pipeline-timers-end-iter 7"
PT_ENV="env CUDA_DEVICE_MAX_CONNECTIONS=1"
pretrain() {  # pretrain NAME NPROC FLAGS...: the command of one pretrain_gpt_zb.py run (output in $OUT/pretrain-NAME)
  local name="$1" nproc="$2"; shift 2
  local dir="$OUT/pretrain-$name"
  echo "$PT_ENV $PY -m megatron_zb.testing.pretrain_run --nproc $nproc --label $name --out $dir -- $PT_MODEL $PT_TRAIN $* --loss-log-json $dir/loss.json"
}

declare -a SUMMARY=()
FAILED=0
slug() { echo "$1" | tr -c 'A-Za-z0-9.=+-' '_' | tr -s '_' | sed 's/_*$//'; }
step() {  # step NAME COMMAND...: print the command; run it unless --dry-run; record the outcome
  local name="$1"; shift
  local cmd="$*"
  echo "+ $cmd"
  if [ "$DRY" -eq 1 ]; then
    SUMMARY+=("WOULD RUN  $name")
    return 0
  fi
  local log; log="$OUT/$(slug "$name").log"
  local t0=$SECONDS status=PASS
  if ! timeout -k 60 "$STEP_TIMEOUT" bash -c "set -o pipefail; { $cmd ; } 2>&1 | tee '$log'"; then
    status=FAIL
    FAILED=1
  fi
  local last; last="$(grep -v '^[[:space:]]*$' "$log" 2>/dev/null | tail -n 1 | cut -c1-400 || true)"
  SUMMARY+=("$(printf '%-8s %s (%ss): %s' "$status" "$name" "$((SECONDS - t0))" "$last")")
}
skip() {  # skip NAME REASON
  echo "# skipped: $1 -- $2"
  SUMMARY+=("$(printf '%-8s %s (%s)' SKIPPED "$1" "$2")")
}

echo "# megatron-zb GPU self-test: $GPUS GPU(s)$([ "$DRY" -eq 1 ] && echo ', dry run (nothing is executed)')"
[ -n "$NOTE" ] && echo "# $NOTE"
if [ "$DRY" -eq 1 ]; then
  echo "# results would go to $OUT"
else
  mkdir -p "$OUT"
  echo "# results go to $OUT (summary.txt, one log per step)"
fi

# 1. environment
step "environment" "nvidia-smi -L"
step "versions" "$PY -c 'import torch, torch.distributed as d; print(\"torch\", torch.__version__, \"CUDA\", torch.version.cuda, \"NCCL\", torch.cuda.nccl.version() if torch.cuda.is_available() else None, \"GPUs\", torch.cuda.device_count())'"
step "transformer engine / apex" "$PY -c 'from megatron_zb.runtime.te_route import transformer_engine_version as v; import importlib.util as u; print(\"transformer_engine\", v(), \"apex fused_weight_gradient_mlp_cuda\", u.find_spec(\"fused_weight_gradient_mlp_cuda\") is not None)'"

# 2. the numerical suite on CUDA
if [ "$GPUS" -lt 2 ]; then
  echo "# one GPU: every test that needs 2 or more ranks (one GPU per rank) is reported as skipped"
fi
step "numerical test suite on CUDA" "$CUDA_ENV $PYTEST $NUMERIC_TESTS"

# 3. p2p at production activation sizes, every schedule
if [ "$GPUS" -ge 2 ]; then
  step "p2p stress, 64 MiB sends, every schedule (PP=$GPUS)" "$CUDA_ENV $PY -m megatron_zb.testing.p2p_stress --pp $GPUS"
else
  skip "p2p stress" "needs 2 GPUs"
fi

# 4. pretrain_gpt_zb.py on CUDA, profile then re-plan
if [ "$GPUS" -ge 2 ]; then
  step "pretrain zb PP=2 on CUDA" "$(pretrain zb 2 --pipeline-model-parallel-size 2 --enable-zero-bubble --profile-out "$OUT/pretrain-zb/profile.json")"
  step "pretrain zb-2p PP=2 on CUDA" "$(pretrain zb-2p 2 --pipeline-model-parallel-size 2 --schedule zb-2p --profile-out "$OUT/pretrain-zb-2p/profile.json")"
  step "pretrain zbv PP=2 on CUDA" "$(pretrain zbv 2 --pipeline-model-parallel-size 2 --zero-bubble-v-schedule --profile-out "$OUT/pretrain-zbv/profile.json")"
else
  skip "pretrain zb, zb-2p, zbv PP=2 on CUDA" "needs 2 GPUs: PP=1 cannot test the pipeline"
  # no pipeline, but the trainer, the executor's F/B/W and the profiling window (CUDA timing, re-plan)
  # run on CUDA; --profile-out needs PP >= 2 (the planner models pipelines)
  step "pretrain zb PP=1 on CUDA (no pipeline)" "$(pretrain zb-pp1 1 --pipeline-model-parallel-size 1 --enable-zero-bubble)"
fi

# 5. tensor parallelism 2 with sequence parallelism
if [ "$GPUS" -ge 2 ]; then
  step "pretrain zb TP=2 SP PP=1 on CUDA" "$(pretrain zb-tp2-sp 2 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --enable-zero-bubble)"
else
  skip "TP=2 with sequence parallelism" "needs 2 GPUs"
fi
if [ "$GPUS" -ge 4 ]; then
  step "TP=2 (+SP) x PP=2 numerical tests on CUDA" "$CUDA_ENV $PYTEST tests/runtime/test_runtime.py -k tp2_pp2"
  step "pretrain zb TP=2 SP PP=2 on CUDA" "$(pretrain zb-tp2-sp-pp2 4 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --enable-zero-bubble --profile-out "$OUT/pretrain-zb-tp2-sp-pp2/profile.json")"
elif [ "$GPUS" -ge 2 ]; then
  skip "TP=2 with sequence parallelism x PP=2" "needs 4 GPUs"
fi

# 6. measured memory against the plan
if [ "$GPUS" -ge 2 ]; then
  step "pretrain zb-h1 PP=2 on CUDA (memory run)" "$(pretrain zb-h1-memory 2 --pipeline-model-parallel-size 2 --schedule zb-h1 --transformer-impl local)"
  step "memory vs megatron-zb plan (zb-h1 PP=2)" "$PY -m megatron_zb.testing.memory_check --run $OUT/pretrain-zb-h1-memory --schedule zb-h1 -- $PT_MODEL --pipeline-model-parallel-size 2 --vocab-size 258"
else
  skip "memory vs megatron-zb plan" "needs 2 GPUs: megatron-zb plan models pipelines of PP >= 2"
fi
if [ "$GPUS" -ge 4 ]; then
  IMPL=local
  [ "$HAVE_TE" -eq 1 ] && IMPL=transformer_engine
  step "pretrain zb-h1 TP=2 SP PP=2 on CUDA (memory run, $IMPL)" "$(pretrain zb-h1-tp2-sp-memory 4 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --schedule zb-h1 --transformer-impl $IMPL)"
  step "memory vs megatron-zb plan (zb-h1 TP=2 SP PP=2, $IMPL)" "$PY -m megatron_zb.testing.memory_check --run $OUT/pretrain-zb-h1-tp2-sp-memory --schedule zb-h1 -- $PT_MODEL --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --transformer-impl $IMPL --vocab-size 258"
else
  skip "memory vs megatron-zb plan, TP=2 with sequence parallelism" "needs 4 GPUs (TP=2 x PP=2)"
fi

# 7. Transformer Engine
if [ "$HAVE_TE" -eq 1 ] || [ "$DRY" -eq 1 ]; then
  [ "$HAVE_TE" -eq 0 ] && echo "# runs only where Transformer Engine >= 2.3 is installed (not here)"
  if [ "$GPUS" -ge 2 ]; then
    step "Transformer Engine parity" "$CUDA_ENV $PYTEST tests/runtime/test_te_real.py"
  else
    skip "Transformer Engine parity" "needs 2 GPUs"
  fi
else
  skip "Transformer Engine parity" "Transformer Engine >= 2.3 is not installed"
fi

# 8. benchmark
if [ "$BENCH" -eq 0 ]; then
  skip "benchmark" "--skip-bench"
elif [ "$GPUS" -ge 2 ]; then
  step "benchmark (PP=$GPUS)" "$CUDA_ENV $PY -m megatron_zb.testing.gpu_bench --pp $GPUS"
else
  skip "benchmark" "a pipeline needs 2 or more GPUs"
fi

report() {
  echo "== gpu_selftest summary ($GPUS GPU(s)$([ "$DRY" -eq 1 ] && echo ', dry run: nothing was run'))"
  if [ "$DRY" -eq 0 ]; then
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
    nvidia-smi -L 2>/dev/null | sed 's/^/gpu: /' || true
    grep -h '^torch ' "$OUT/versions.log" 2>/dev/null | sed 's/^/versions: /' || true
    echo "logs: $OUT"
  fi
  for line in "${SUMMARY[@]}"; do echo "$line"; done
}
echo
if [ "$DRY" -eq 1 ]; then
  report
  exit 0
fi
report | tee "$OUT/summary.txt"
exit "$FAILED"
