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
#   VOCAB_FILE MERGE_FILE           with TOKENIZER_TYPE=GPT2BPETokenizer: local vocab.json / merges.txt
#   CHECKPOINT_PATH  --save directory (default ./checkpoints/gpt_zb); also --load when it exists (resume)
#   TENSORBOARD_DIR  TensorBoard directory (empty: none; needs the tensorboard package)
#
# What this script has been checked for: `bash -n`, and the argument list it builds (torchrun
# stubbed; tests/training/test_arguments.py validates it with megatron_zb.training.arguments). It was not
# run on GPUs (none in the development environment).
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# This launcher's own defaults; scripts/lib/pretrain_gpt_common.sh sets the others and builds the flags.
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-2048}
NUM_HEADS=${NUM_HEADS:-16}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
GLOBAL_BATCH=${GLOBAL_BATCH:-64}
TP=${TP:-1}
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-./checkpoints/gpt_zb}
# shellcheck source=lib/pretrain_gpt_common.sh
source "${REPO_DIR}/scripts/lib/pretrain_gpt_common.sh"

if (( GPUS_PER_NODE % (TP * PP) != 0 )); then
    echo "error: GPUS_PER_NODE=${GPUS_PER_NODE} is not a multiple of TP*PP=$((TP * PP))" >&2
    exit 1
fi

pretrain_gpt_build_args  # sets TRAIN_ARGS (and MODEL_ARGS, SCHEDULE_ARGS, ...)

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

set -x
exec torchrun --standalone --nproc_per_node "${GPUS_PER_NODE}" \
    "${REPO_DIR}/pretrain_gpt_zb.py" "${TRAIN_ARGS[@]}" "$@"
