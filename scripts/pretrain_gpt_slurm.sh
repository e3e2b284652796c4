#!/usr/bin/env bash
#SBATCH --job-name=gpt-zb
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=gpt-zb-%j.out
#
# Multi-node GPT pretraining with a zero-bubble pipeline schedule under SLURM.
#
# Usage:
#   cd megatron-zb && sbatch --nodes=4 scripts/pretrain_gpt_slurm.sh [extra pretrain_gpt_zb.py flags...]
#   (or, inside an allocation: bash scripts/pretrain_gpt_slurm.sh [flags...])
# Submit from the repository root (sbatch runs a spooled copy of this file), or set REPO_DIR.
# Extra arguments are appended last, so they override the flags built here.
#
# One SLURM task per node runs torchrun, which starts GPUS_PER_NODE processes:
#   MASTER_ADDR  first host of SLURM_JOB_NODELIST (scontrol show hostnames), unless set
#   NODE_RANK    SLURM_NODEID of each task (evaluated inside the task)
#   NNODES       SLURM_JOB_NUM_NODES (SLURM_NNODES)
# The world size is NNODES * GPUS_PER_NODE; it must be a multiple of TP * PP.
#
# Variables (environment, with defaults):
#   REPO_DIR        repository root holding pretrain_gpt_zb.py, on every node (default: see above)
#   GPUS_PER_NODE   GPUs (= processes) per node (default 8)
#   MASTER_PORT     rendezvous port on MASTER_ADDR (default 6000)
#   NUM_LAYERS HIDDEN_SIZE NUM_HEADS SEQ_LENGTH    model size (default 32 / 4096 / 32 / 4096)
#   MICRO_BATCH GLOBAL_BATCH                         batch sizes in samples (default 1 / 256)
#   TP PP                                            tensor / pipeline parallel sizes (default 4 / 8)
#   SCHEDULE   zb (default) | zbv | v-half | v-min | 1f1b | NAME (any --schedule name of the library)
#   MAX_PENDING_BACKWARD  memory limit of zero-bubble schedules in micro batches per rank (empty: default)
#   POST_VALIDATION       1 adds --enable-optimizer-post-validation (zero-bubble schedules only)
#   PRECISION             bf16 (default) | fp16 | fp32
#   TRAIN_ITERS LR MIN_LR WARMUP_ITERS               (default 500000 / 1.5e-4 / 1.5e-5 / 2000)
#   DATA_PATH        dataset prefix(es) from tools/preprocess_data.py, or a blend "W1 P1 W2 P2";
#                    must be on a filesystem every node sees
#   MOCK_DATA        1 trains on synthetic data instead
#   DATA_CACHE_PATH  dataset index cache, shared by all nodes (default CHECKPOINT_PATH/data_cache)
#   TOKENIZER_TYPE TOKENIZER_MODEL  ByteLevel (default; no download) or HuggingFaceTokenizer + local dir
#   CHECKPOINT_PATH  --save directory on shared storage (default ./checkpoints/gpt_zb_slurm);
#                    also --load when it exists (resume)
#   TENSORBOARD_DIR  TensorBoard directory (empty: none)
#
# What this script has been checked for: `bash -n`, and the argument list it builds (srun,
# scontrol and torchrun stubbed; tests/test_arguments.py validates it with
# megatron_zb.training.arguments). It was not run on a cluster (none in the development environment).
set -euo pipefail

if [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then
    echo "error: not inside a SLURM allocation (SLURM_JOB_NODELIST unset); submit with sbatch" >&2
    exit 1
fi

# sbatch runs a copy of this script from a spool directory, so fall back to the submit directory.
SCRIPT_REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${REPO_DIR:-}" ]]; then
    if [[ -f "${SCRIPT_REPO_DIR}/pretrain_gpt_zb.py" ]]; then
        REPO_DIR="${SCRIPT_REPO_DIR}"
    else
        REPO_DIR="${SLURM_SUBMIT_DIR:-$(pwd)}"
    fi
fi
if [[ ! -f "${REPO_DIR}/pretrain_gpt_zb.py" ]]; then
    echo "error: ${REPO_DIR}/pretrain_gpt_zb.py not found; submit from the repository root or set REPO_DIR" >&2
    exit 1
fi

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
# awk reads all of scontrol's output (`head -n 1` could kill scontrol with SIGPIPE under pipefail)
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | awk 'NR == 1')}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))

NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN_SIZE=${HIDDEN_SIZE:-4096}
NUM_HEADS=${NUM_HEADS:-32}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-256}
TP=${TP:-4}
PP=${PP:-8}

SCHEDULE=${SCHEDULE:-zb}
MAX_PENDING_BACKWARD=${MAX_PENDING_BACKWARD:-}
POST_VALIDATION=${POST_VALIDATION:-0}
PRECISION=${PRECISION:-bf16}

TRAIN_ITERS=${TRAIN_ITERS:-500000}
LR=${LR:-1.5e-4}
MIN_LR=${MIN_LR:-1.5e-5}
WARMUP_ITERS=${WARMUP_ITERS:-2000}

DATA_PATH=${DATA_PATH:-}
MOCK_DATA=${MOCK_DATA:-0}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-ByteLevel}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-./checkpoints/gpt_zb_slurm}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-${CHECKPOINT_PATH}/data_cache}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-}

if (( WORLD_SIZE % (TP * PP) != 0 )); then
    echo "error: world size ${WORLD_SIZE} (${NNODES} nodes x ${GPUS_PER_NODE}) is not a multiple of TP*PP=$((TP * PP))" >&2
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

DATA_ARGS=(--tokenizer-type "${TOKENIZER_TYPE}" --split 949,50,1 --data-cache-path "${DATA_CACHE_PATH}")
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

# ${ARR[@]+"${ARR[@]}"}: expands an empty array without tripping `set -u` on bash < 4.4
TRAIN_ARGS=("${MODEL_ARGS[@]}" ${PRECISION_ARGS[@]+"${PRECISION_ARGS[@]}"} ${SCHEDULE_ARGS[@]+"${SCHEDULE_ARGS[@]}"}
            "${DATA_ARGS[@]}" "${LOG_ARGS[@]}" --distributed-backend nccl "$@")

echo "gpt-zb: ${NNODES} nodes x ${GPUS_PER_NODE} GPUs, master ${MASTER_ADDR}:${MASTER_PORT}, TP=${TP} PP=${PP}, schedule ${SCHEDULE}"

export MASTER_ADDR MASTER_PORT
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

# The single quotes matter: SLURM_NODEID must expand inside each task (one per node), not here.
# The training arguments are passed as positional parameters, so no quoting is lost on the way.
srun --nodes="${NNODES}" --ntasks="${NNODES}" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash -c 'exec torchrun \
        --nnodes "$1" --nproc_per_node "$2" --node_rank "${SLURM_NODEID}" \
        --master_addr "$3" --master_port "$4" \
        "$5/pretrain_gpt_zb.py" "${@:6}"' \
    gpt-zb "${NNODES}" "${GPUS_PER_NODE}" "${MASTER_ADDR}" "${MASTER_PORT}" "${REPO_DIR}" "${TRAIN_ARGS[@]}"
