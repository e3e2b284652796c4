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
#   VOCAB_FILE MERGE_FILE           with TOKENIZER_TYPE=GPT2BPETokenizer: local vocab.json / merges.txt
#   CHECKPOINT_PATH  --save directory on shared storage (default ./checkpoints/gpt_zb_slurm);
#                    also --load when it exists (resume)
#   TENSORBOARD_DIR  TensorBoard directory (empty: none)
#
# What this script has been checked for: `bash -n`, and the argument list it builds (srun,
# scontrol and torchrun stubbed; tests/training/test_arguments.py validates it with
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

# This launcher's own defaults; scripts/lib/pretrain_gpt_common.sh sets the others and builds the flags.
NUM_LAYERS=${NUM_LAYERS:-32}
HIDDEN_SIZE=${HIDDEN_SIZE:-4096}
NUM_HEADS=${NUM_HEADS:-32}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
GLOBAL_BATCH=${GLOBAL_BATCH:-256}
TP=${TP:-4}
LR=${LR:-1.5e-4}
MIN_LR=${MIN_LR:-1.5e-5}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-./checkpoints/gpt_zb_slurm}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-${CHECKPOINT_PATH}/data_cache}
# The common file next to this script, or, for sbatch's spooled copy, the one under REPO_DIR.
COMMON_SH="${SCRIPT_REPO_DIR}/scripts/lib/pretrain_gpt_common.sh"
if [[ ! -f "${COMMON_SH}" ]]; then
    COMMON_SH="${REPO_DIR}/scripts/lib/pretrain_gpt_common.sh"
fi
if [[ ! -f "${COMMON_SH}" ]]; then
    echo "error: ${COMMON_SH} not found; REPO_DIR must be a full megatron-zb checkout" >&2
    exit 1
fi
# shellcheck source=lib/pretrain_gpt_common.sh
source "${COMMON_SH}"

if (( WORLD_SIZE % (TP * PP) != 0 )); then
    echo "error: world size ${WORLD_SIZE} (${NNODES} nodes x ${GPUS_PER_NODE}) is not a multiple of TP*PP=$((TP * PP))" >&2
    exit 1
fi

pretrain_gpt_build_args --data-cache-path "${DATA_CACHE_PATH}"  # sets TRAIN_ARGS (and MODEL_ARGS, ...)

echo "gpt-zb: ${NNODES} nodes x ${GPUS_PER_NODE} GPUs, master ${MASTER_ADDR}:${MASTER_PORT}, TP=${TP} PP=${PP}, schedule ${SCHEDULE}"

export MASTER_ADDR MASTER_PORT
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

# The single quotes matter: SLURM_NODEID must expand inside each task (one per node), not here.
# The training arguments (then the user's extra arguments) are passed as positional parameters, so
# no quoting is lost on the way.
srun --nodes="${NNODES}" --ntasks="${NNODES}" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash -c 'exec torchrun \
        --nnodes "$1" --nproc_per_node "$2" --node_rank "${SLURM_NODEID}" \
        --master_addr "$3" --master_port "$4" \
        "$5/pretrain_gpt_zb.py" "${@:6}"' \
    gpt-zb "${NNODES}" "${GPUS_PER_NODE}" "${MASTER_ADDR}" "${MASTER_PORT}" "${REPO_DIR}" "${TRAIN_ARGS[@]}" "$@"
