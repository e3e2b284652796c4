#!/usr/bin/env bash
# megatron-zb self-test on a GPU node (1 to 8 GPUs, NCCL): one command of at most 9 minutes.
#
#   bash scripts/gpu_selftest.sh --out DIR      # run the plan for every visible GPU (at most 8)
#   bash scripts/gpu_selftest.sh --dry-run      # print the plan, its commands and critical path (works on CPU)
#   bash scripts/gpu_selftest.sh --gpus 4       # plan for 4 GPUs
#   bash scripts/gpu_selftest.sh --steps a,b    # only these jobs (e.g. the ones a 2-GPU plan defers)
#   bash scripts/gpu_selftest.sh --full         # add the opt-in jobs (budget one hour)
#
# The plan (megatron_zb/testing/selftest_jobs.py: the jobs, their timeouts and commands, in one place;
# selftest_plan.py packs them into steps; docs/verification.md "The GPU self-test" has the table).
# Jobs, most informative first, each with its own timeout; jobs of a step run side by side on
# disjoint GPUs (CUDA_VISIBLE_DEVICES); the plan's critical path (sum of the step timeouts) is at
# most 540 s, else the plan is refused (exit 2); what does not fit is listed as DEFERRED:
#   env        (20 s)  nvidia-smi -L; torch / CUDA / NCCL / megatron-core versions; TE and apex presence;
#   hol        (40 s on 1 GPU, 90 s on 2+)  head-of-line probe, under CUDA_DEVICE_MAX_CONNECTIONS=1
#              and unset: does an op that cannot start block later work on other streams (1 GPU), and
#              do two 64 MiB isends issued before the peer's irecvs complete (2 GPUs, NCCL);
#   stress-1conn, stress-default (100 s each; 2+ GPUs)  p2p stress, 64 MiB sends, the at-risk
#              families (1f1b, interleaved-zb, v-half, zbv, zb-2p, 1f1b-v), 12 s per schedule;
#   vocab-zbv-vocab-1 (70 s; 2+ GPUs)  pretrain_gpt_zb.py --enable-vocab-parallel at PP=2;
#   host-bound-before / -workers / -no-mask (60 s each, alone on the node)  pretrain at PP=1,
#              T_F/T_B/T_W side by side: as before, with 2 data workers, without the in-loader mask;
#   mem-pp2    (80 s; 2+ GPUs)  zb-h1 PP=2 peak memory per rank vs megatron-zb plan (FAIL above x 1/0.9);
#   tp2-sp     (60 s; 2+ GPUs)  pretrain zb at TP=2 with sequence parallelism, PP=1;
#   mem-tp2-sp-pp2 (80 s; 4+ GPUs)  the memory check at TP=2 SP x PP=2;
#   vocab-interleaved-zb-vocab-1 (70 s; 2+ GPUs)  a second vocabulary family, where there is room;
#   --full:    numerical suite on CUDA, pretrain zb / zb-2p / zbv PP=2 with --profile-out, TP=2 x PP=2
#              tests, Transformer Engine parity (with TE), benchmark.
# Results: OUT/summary.txt (one line per job as it ends: PASS / FAIL with its last output line) and
# OUT/logs.tar.gz (every log, rewritten after each step); logs and run files in OUT-work. Nothing is
# downloaded. Exit status 0 when no job failed, 1 otherwise, 2 for a bad command line or plan.
# With the bundle of scripts/gpu_bundle.sh (megatron-core as a wheel, for a machine without network):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-bundle/*.whl && \
#     export PYTHONPATH=/tmp/site:$PWD && bash scripts/gpu_selftest.sh --out "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif command -v python3 >/dev/null 2>&1; then
  PY=python3   # the interpreter the bundle's install command uses
else
  PY=python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m megatron_zb.testing.selftest "$@"
