#!/bin/bash
# Mixtral-8x7B-style MoE GPT with a zero-bubble pipeline schedule, Megatron-LM's flag names
# (after Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh, minus the flags
# megatron-zb does not support: fused-kernel switches, --overlap-*, --moe-grouped-gemm -- grouped-GEMM
# experts have no weight-gradient route into W yet, so experts run as SequentialMLP).
# 4 nodes x 8 GPUs: PP=4 x EP=8 over the data-parallel ranks. Set TOKENIZER (a local HuggingFace
# tokenizer directory) and DATA (a Megatron .bin/.idx prefix). SCHEDULE picks the schedule:
#   --enable-zero-bubble (default), --zero-bubble-v-schedule, or --schedule zb-2p.
# Not run here (no GPU in the test environment); scripts/examples/mixtral_8x7b_zb_cpu.sh runs the
# same flags at tiny sizes on CPU and is exercised by tests/training/test_moe.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${TOKENIZER:?set TOKENIZER to a local HuggingFace tokenizer directory}"
: "${DATA:?set DATA to a Megatron dataset prefix (PATH/name without .bin/.idx)}"
SCHEDULE=${SCHEDULE:---enable-zero-bubble}
NPROC=${NPROC:-8}
NNODES=${NNODES:-4}

MODEL=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8
  --seq-length 4096 --max-position-embeddings 32768
  --normalization RMSNorm --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 1000000
  --untie-embeddings-and-output-weights --init-method-std 0.01
  --hidden-dropout 0 --attention-dropout 0
)
MOE=(
  --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-token-dispatcher-type alltoall
)
PARALLEL=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
  --use-distributed-optimizer
)
TRAINING=(
  --micro-batch-size 1 --global-batch-size 256 --train-iters 500000 --lr-decay-iters 320000
  --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 500 --lr-decay-style cosine
  --weight-decay 0.1 --clip-grad 1.0 --bf16
)
DATA_ARGS=(
  --data-path "$DATA" --split 99990,8,2
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
)
LOGGING=(--log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10)

torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" pretrain_gpt_zb.py \
  "${MODEL[@]}" "${MOE[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA_ARGS[@]}" "${LOGGING[@]}" $SCHEDULE "$@"
