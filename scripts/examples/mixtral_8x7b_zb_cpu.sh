#!/bin/bash
# scripts/examples/mixtral_8x7b_zb.sh scaled down for a CPU (gloo, fp32, 4 processes, mock data):
# the same architecture, MoE, parallel and loss flags at tiny sizes (PP=2 x EP=2). Extra arguments
# are appended (e.g. --loss-log-json FILE). SCHEDULE picks the schedule as in the GPU script;
# SCHEDULE=--use-megatron-core-schedule runs megatron-core's own 1F1B on the same flags.
set -euo pipefail
cd "$(dirname "$0")/../.."
SCHEDULE=${SCHEDULE:---enable-zero-bubble}
ITERS=${ITERS:-3}

MODEL=(
  --num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4
  --group-query-attention --num-query-groups 2
  --seq-length 32 --max-position-embeddings 64
  --normalization RMSNorm --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 1000000
  --untie-embeddings-and-output-weights --init-method-std 0.01
  --hidden-dropout 0 --attention-dropout 0
)
MOE=(
  --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-token-dispatcher-type alltoall
)
PARALLEL=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2
  --use-distributed-optimizer
)
TRAINING=(
  --micro-batch-size 2 --global-batch-size 16 --train-iters "$ITERS" --lr-decay-iters "$ITERS"
  --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 --lr-decay-style cosine
  --weight-decay 0.1 --clip-grad 1.0
)
DATA_ARGS=(--mock-data --num-workers 0)
LOGGING=(--log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 0)
SYSTEM=(--distributed-backend gloo --pipeline-timeout-seconds 60 --distributed-timeout-minutes 2)

OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python -m torch.distributed.run --standalone --nproc_per_node 4 \
  pretrain_gpt_zb.py "${MODEL[@]}" "${MOE[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA_ARGS[@]}" \
  "${LOGGING[@]}" "${SYSTEM[@]}" $SCHEDULE "$@"
