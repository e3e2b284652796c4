#!/usr/bin/env bash
# Train a tiny GPT on 4 CPU processes with a zero-bubble pipeline schedule -- the README's main job.
#
# Usage:
#   bash scripts/pretrain_gpt_cpu_demo.sh [extra pretrain_gpt_zb.py flags...]
#
# What it does, from scratch:
#   1. installs CPU torch 2.13.0, then megatron-zb (pip install -e .; pulls megatron-core 0.16.1);
#   2. torchrun: 4 processes on this machine (gloo), pipeline-parallel size 4, a GPT of 8 layers,
#      hidden 64, 4 heads, sequence 64, on megatron-core's synthetic data (--mock-data);
#      8 micro batches of 2 per iteration, 40 iterations, --enable-zero-bubble (the greedy
#      zero-bubble schedule under 1F1B's activation memory);
#   3. profiles iterations 3-7 (T_F, T_B, T_W per stage, T_comm by ping-pong), rebuilds the schedule
#      from the measured costs and prints the measured costs, the predicted bubble rate and each
#      rank's measured idle fraction; logs Megatron's iteration line every 5 iterations, validates
#      every 20, and saves a checkpoint at the end to out/pretrain_gpt_cpu_demo/checkpoints
#      (the whole log also goes to out/pretrain_gpt_cpu_demo/train.log);
#   4. --profile on iteration 30: megatron-zb's timeline of it in out/pretrain_gpt_cpu_demo/profile --
#      megatron_zb_timeline.json (each rank's measured F/B/W and p2p waits, a Chrome trace: open it
#      in https://ui.perfetto.dev) and megatron_zb_timeline.png (the iteration as measured above the
#      simulator's prediction: where the bubble went; with 4 processes on fewer cores, mostly
#      time-slicing, which the log says) -- beside PyTorch's profiler trace of rank 0 (--profile on
#      CPU: no Python stacks, a few MB).
# Takes about a minute on 2 cores (install check, imports and start-up included).
#
# Extra arguments are appended last and override the flags below. `--schedule NAME` or
# `--zero-bubble-v-schedule` replaces --enable-zero-bubble, e.g.
#   bash scripts/pretrain_gpt_cpu_demo.sh --schedule 1f1b          # the 1F1B baseline
#   bash scripts/pretrain_gpt_cpu_demo.sh --zero-bubble-v-schedule  # ZB-V
# (`python pretrain_gpt_zb.py --help` lists every flag; docs/training.md explains the output.)
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e .

OUT=out/pretrain_gpt_cpu_demo
rm -rf "${OUT}"
mkdir -p "${OUT}/checkpoints"
export OMP_NUM_THREADS=1

SCHEDULE_ARGS=(--enable-zero-bubble)
for a in "$@"; do  # --schedule / --zero-bubble-v-schedule given: let it choose instead
    if [[ "$a" == "--schedule" || "$a" == "--zero-bubble-v-schedule" ]]; then SCHEDULE_ARGS=(); fi
done

torchrun --standalone --nproc_per_node 4 pretrain_gpt_zb.py \
    --pipeline-model-parallel-size 4 \
    --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --micro-batch-size 2 --global-batch-size 16 \
    --train-iters 40 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 4 --lr-decay-style cosine \
    --mock-data --num-workers 0 \
    ${SCHEDULE_ARGS[@]+"${SCHEDULE_ARGS[@]}"} \
    --zero-bubble-pipeline-timers-start-iter 3 --zero-bubble-pipeline-timers-end-iter 8 \
    --log-interval 5 --eval-interval 20 --eval-iters 2 \
    --save "${OUT}/checkpoints" --save-interval 40 \
    --profile --profile-step-start 30 --profile-step-end 31 --tensorboard-dir "${OUT}/profile" \
    --distributed-backend gloo \
    "$@" 2>&1 | tee "${OUT}/train.log"
