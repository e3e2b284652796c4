#!/bin/bash
# scripts/examples/llama3_8b_zb.sh scaled down for a CPU (gloo, fp32, 2 processes, mock data):
# the same architecture, recomputation, split and loss flags at tiny sizes. Extra arguments are
# appended (e.g. --loss-log-json FILE). SCHEDULE picks the schedule as in the GPU script;
# SCHEDULE=--use-megatron-core-schedule runs megatron-core's own 1F1B on the same flags.
set -euo pipefail
cd "$(dirname "$0")/../.."
SCHEDULE=${SCHEDULE:---enable-zero-bubble}
ITERS=${ITERS:-4}

MODEL=(
  --num-layers 5 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
  --group-query-attention --num-query-groups 2 --kv-channels 16
  --seq-length 32 --max-position-embeddings 32
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0
  --untie-embeddings-and-output-weights --init-method-std 0.02 --attention-softmax-in-fp32
  --hidden-dropout 0 --attention-dropout 0
)
PARALLEL=(
  --pipeline-model-parallel-size 2
  --decoder-last-pipeline-num-layers 2
  --recompute-granularity selective --recompute-modules core_attn mlp layernorm
)
TRAINING=(
  --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS"
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 1 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --calculate-per-token-loss
)
DATA_ARGS=(--mock-data --num-workers 0)
LOGGING=(--log-interval 1 --eval-interval 1000 --eval-iters 0)
SYSTEM=(--distributed-backend gloo --pipeline-timeout-seconds 60 --distributed-timeout-minutes 2)

OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python -m torch.distributed.run --standalone --nproc_per_node 2 \
  pretrain_gpt_zb.py "${MODEL[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA_ARGS[@]}" "${LOGGING[@]}" \
  "${SYSTEM[@]}" $SCHEDULE "$@"
