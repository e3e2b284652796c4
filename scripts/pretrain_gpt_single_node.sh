#!/usr/bin/env bash
# Pretrain a GPT model with a zero-bubble pipeline schedule on one node (default 8 GPUs).
#
# Usage:
#   bash scripts/pretrain_gpt_single_node.sh [extra pretrain_gpt_zb.py flags...]
#
# Everything below is a variable with a default; override from the environment, e.g.
#   PP=4 TP=2 SCHEDULE=zbv DATA_PATH=/data/corpus_text_document bash scripts/pretrain_gpt_single_node.sh
#   SCHEDULE=1f1b bash scripts/pretrain_gpt_single_node.sh            # Megatron's 1F1B baseline
#   MOCK_DATA=1 bash scripts/pretrain_gpt_single_node.sh --train-iters 20
# Extra arguments are appended last, so they override the flags built here.
#
# Variables:
#   GPUS_PER_NODE   processes to start (default 8)
#   NUM_LAYERS HIDDEN_SIZE NUM_HEADS SEQ_LENGTH    model size (default 24 / 2048 / 16 / 2048)
#   MICRO_BATCH GLOBAL_BATCH                         batch sizes in samples (default 1 / 64)
#   TP PP                                            tensor / pipeline parallel sizes (default 1 / 8)
#   SCHEDULE   zb (default) | zbv | v-half | v-min | 1f1b | NAME (any --schedule name of the library)
#   MAX_PENDING_BACKWARD  memory limit of zero-bubble schedules in micro batches per rank
#                         (empty: the schedule's default, PP for zb)
#   POST_VALIDATION       1 adds --enable-optimizer-post-validation (zero-bubble schedules only)
#   PRECISION             bf16 (default) | fp16 | fp32
#   TRAIN_ITERS LR MIN_LR WARMUP_ITERS               schedule of the run (default 500000 / 3e-4 / 3e-5 / 2000)
#   DATA_PATH        dataset prefix(es) from tools/preprocess_data.py, or a blend "W1 P1 W2 P2"
#   MOCK_DATA        1 trains on synthetic data instead (no DATA_PATH needed)
#   TOKENIZER_TYPE TOKENIZER_MODEL  ByteLevel (default; no download) or HuggingFaceTokenizer + local dir
#   CHECKPOINT_PATH  --save directory (default ./checkpoints/gpt_zb); also --load when it exists (resume)
#   TENSORBOARD_DIR  TensorBoard directory (empty: none; needs the tensorboard package)
#
# What this script has been checked for: `bash -n`, and the argument list it builds (torchrun
# stubbed; tests/test_arguments.py validates it with megatron_zb.training.arguments). It was not
# run on GPUs (none in the development environment).
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}

NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-2048}
NUM_HEADS=${NUM_HEADS:-16}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-64}
TP=${TP:-1}
PP=${PP:-8}

SCHEDULE=${SCHEDULE:-zb}
MAX_PENDING_BACKWARD=${MAX_PENDING_BACKWARD:-}
POST_VALIDATION=${POST_VALIDATION:-0}
PRECISION=${PRECISION:-bf16}

TRAIN_ITERS=${TRAIN_ITERS:-500000}
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
WARMUP_ITERS=${WARMUP_ITERS:-2000}

DATA_PATH=${DATA_PATH:-}
MOCK_DATA=${MOCK_DATA:-0}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-ByteLevel}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-./checkpoints/gpt_zb}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-}

if (( GPUS_PER_NODE % (TP * PP) != 0 )); then
    echo "error: GPUS_PER_NODE=${GPUS_PER_NODE} is not a multiple of TP*PP=$((TP * PP))" >&2
    exit 1
fi

SCHEDULE_ARGS=()
case "${SCHEDULE}" in
    zb)     SCHEDULE_ARGS+=(--enable-zero-bubble) ;;
    zbv)    SCHEDULE_ARGS+=(--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup zb) ;;
    v-half) SCHEDULE_ARGS+=(--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup half) ;;
    v-min)  SCHEDULE_ARGS+=(--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup min) ;;
    1f1b)   ;;
    *)      SCHEDULE_ARGS+=(--schedule "${SCHEDULE}") ;;
esac
if [[ -n "${MAX_PENDING_BACKWARD}" ]]; then
    SCHEDULE_ARGS+=(--zero-bubble-max-pending-backward "${MAX_PENDING_BACKWARD}")
fi
if [[ "${POST_VALIDATION}" == 1 ]]; then
    SCHEDULE_ARGS+=(--enable-optimizer-post-validation)
fi

PRECISION_ARGS=()
case "${PRECISION}" in
    bf16) PRECISION_ARGS+=(--bf16) ;;
    fp16) PRECISION_ARGS+=(--fp16) ;;
    fp32) ;;
    *) echo "error: PRECISION must be bf16, fp16 or fp32, got ${PRECISION}" >&2; exit 1 ;;
esac

DATA_ARGS=(--tokenizer-type "${TOKENIZER_TYPE}" --split 949,50,1)
if [[ -n "${TOKENIZER_MODEL}" ]]; then
    DATA_ARGS+=(--tokenizer-model "${TOKENIZER_MODEL}")
fi
if [[ "${MOCK_DATA}" == 1 ]]; then
    DATA_ARGS+=(--mock-data)
elif [[ -n "${DATA_PATH}" ]]; then
    read -r -a DATA_PATH_WORDS <<< "${DATA_PATH}"
    DATA_ARGS+=(--data-path "${DATA_PATH_WORDS[@]}")
else
    echo "error: set DATA_PATH (prefix from tools/preprocess_data.py) or MOCK_DATA=1" >&2
    exit 1
fi

LOG_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 10 --save "${CHECKPOINT_PATH}" --save-interval 1000)
if [[ -d "${CHECKPOINT_PATH}" ]]; then
    LOG_ARGS+=(--load "${CHECKPOINT_PATH}")
fi
if [[ -n "${TENSORBOARD_DIR}" ]]; then
    LOG_ARGS+=(--tensorboard-dir "${TENSORBOARD_DIR}")
fi

MODEL_ARGS=(
    --num-layers "${NUM_LAYERS}" --hidden-size "${HIDDEN_SIZE}" --num-attention-heads "${NUM_HEADS}"
    --seq-length "${SEQ_LENGTH}" --max-position-embeddings "${SEQ_LENGTH}"
    --micro-batch-size "${MICRO_BATCH}" --global-batch-size "${GLOBAL_BATCH}"
    --train-iters "${TRAIN_ITERS}" --lr "${LR}" --min-lr "${MIN_LR}" --lr-warmup-iters "${WARMUP_ITERS}"
    --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --tensor-model-parallel-size "${TP}" --pipeline-model-parallel-size "${PP}"
)

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

set -x
# ${ARR[@]+"${ARR[@]}"}: expands an empty array without tripping `set -u` on bash < 4.4
exec torchrun --standalone --nproc_per_node "${GPUS_PER_NODE}" \
    "${REPO_DIR}/pretrain_gpt_zb.py" \
    "${MODEL_ARGS[@]}" ${PRECISION_ARGS[@]+"${PRECISION_ARGS[@]}"} ${SCHEDULE_ARGS[@]+"${SCHEDULE_ARGS[@]}"} \
    "${DATA_ARGS[@]}" "${LOG_ARGS[@]}" \
    --distributed-backend nccl \
    "$@"
