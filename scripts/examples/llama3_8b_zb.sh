#!/bin/bash
# LLaMA-3-8B-style dense GPT with a zero-bubble pipeline schedule, Megatron-LM's flag names.
# 8 GPUs per node: TP=2 x PP=4. Set TOKENIZER (a local HuggingFace tokenizer directory) and DATA
# (a Megatron .bin/.idx prefix). SCHEDULE picks the zero-bubble schedule:
#   --enable-zero-bubble (default: greedy ZB under 1F1B's activation memory),
#   --zero-bubble-v-schedule, or --schedule zb-2p.
# Not run here (no GPU in the test environment); scripts/examples/llama3_8b_zb_cpu.sh runs the same
# flags at tiny sizes on CPU and is exercised by tests/training/test_model_flags.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${TOKENIZER:?set TOKENIZER to a local HuggingFace tokenizer directory}"
: "${DATA:?set DATA to a Megatron dataset prefix (PATH/name without .bin/.idx)}"
SCHEDULE=${SCHEDULE:---enable-zero-bubble}
NPROC=${NPROC:-8}

MODEL=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --kv-channels 128
  --seq-length 8192 --max-position-embeddings 8192
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0
  --untie-embeddings-and-output-weights --init-method-std 0.02 --attention-softmax-in-fp32
  --hidden-dropout 0 --attention-dropout 0
)
PARALLEL=(
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --sequence-parallel
  --decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7
  --recompute-granularity selective --recompute-modules core_attn
)
TRAINING=(
  --micro-batch-size 1 --global-batch-size 128 --train-iters 1000
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16
  --calculate-per-token-loss
)
DATA_ARGS=(
  --data-path "$DATA" --split 99,1,0
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
)
LOGGING=(--log-interval 1 --eval-interval 200 --eval-iters 10)

torchrun --nproc_per_node "$NPROC" pretrain_gpt_zb.py \
  "${MODEL[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA_ARGS[@]}" "${LOGGING[@]}" $SCHEDULE "$@"
