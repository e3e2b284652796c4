# shellcheck shell=bash
# Shared part of scripts/pretrain_gpt_single_node.sh and scripts/pretrain_gpt_slurm.sh: the defaults
# both launchers agree on and the Megatron-style flags they build for pretrain_gpt_zb.py.
# Source it (do not run it) after `set -euo pipefail`; sourcing only sets variables and defines a
# function, and prints nothing.
#
# The caller must set beforehand (its own defaults, each overridable from the environment):
#   NUM_LAYERS HIDDEN_SIZE NUM_HEADS SEQ_LENGTH GLOBAL_BATCH TP LR MIN_LR CHECKPOINT_PATH
# Sourcing sets these defaults, for each variable that is unset or empty (the caller may set any of
# them first, the environment normally does):
#   MICRO_BATCH=1 PP=8 SCHEDULE=zb MAX_PENDING_BACKWARD= POST_VALIDATION=0 PRECISION=bf16
#   TRAIN_ITERS=500000 WARMUP_ITERS=2000 DATA_PATH= MOCK_DATA=0 TOKENIZER_TYPE=ByteLevel
#   TOKENIZER_MODEL= VOCAB_FILE= MERGE_FILE= TENSORBOARD_DIR=
# (the launchers' header comments document what each variable means).
#
# pretrain_gpt_build_args [DATA_FLAG...]
#   Call it after the caller's own checks (e.g. world size a multiple of TP*PP). It sets the arrays
#   SCHEDULE_ARGS   SCHEDULE as zero-bubble flags (zb, zbv, v-half, v-min, 1f1b or --schedule NAME),
#                   plus MAX_PENDING_BACKWARD and POST_VALIDATION
#   PRECISION_ARGS  --bf16, --fp16 or nothing (fp32); another PRECISION exits 1
#   DATA_ARGS       tokenizer, --split 949,50,1, the DATA_FLAGs given to the function (e.g.
#                   --data-cache-path DIR), then --mock-data or --data-path; exits 1 without either
#   LOG_ARGS        log/eval intervals, --save CHECKPOINT_PATH (also --load when it exists), TensorBoard
#   MODEL_ARGS      model size, batch sizes, LR schedule, AdamW settings, TP and PP sizes
#   TRAIN_ARGS      MODEL_ARGS PRECISION_ARGS SCHEDULE_ARGS DATA_ARGS LOG_ARGS --distributed-backend nccl;
#                   the caller passes these to pretrain_gpt_zb.py and appends its own "$@" last, so
#                   that the user's extra arguments override them.

for _pretrain_gpt_var in NUM_LAYERS HIDDEN_SIZE NUM_HEADS SEQ_LENGTH GLOBAL_BATCH TP LR MIN_LR CHECKPOINT_PATH; do
    if [[ -z "${!_pretrain_gpt_var:-}" ]]; then
        echo "error: ${_pretrain_gpt_var} must be set before sourcing ${BASH_SOURCE[0]}" >&2
        exit 1
    fi
done
unset _pretrain_gpt_var

MICRO_BATCH=${MICRO_BATCH:-1}
PP=${PP:-8}

SCHEDULE=${SCHEDULE:-zb}
MAX_PENDING_BACKWARD=${MAX_PENDING_BACKWARD:-}
POST_VALIDATION=${POST_VALIDATION:-0}
PRECISION=${PRECISION:-bf16}

TRAIN_ITERS=${TRAIN_ITERS:-500000}
WARMUP_ITERS=${WARMUP_ITERS:-2000}

DATA_PATH=${DATA_PATH:-}
MOCK_DATA=${MOCK_DATA:-0}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-ByteLevel}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
VOCAB_FILE=${VOCAB_FILE:-}
MERGE_FILE=${MERGE_FILE:-}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-}

pretrain_gpt_build_args() {
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

    DATA_ARGS=(--tokenizer-type "${TOKENIZER_TYPE}" --split 949,50,1 "$@")
    if [[ -n "${TOKENIZER_MODEL}" ]]; then
        DATA_ARGS+=(--tokenizer-model "${TOKENIZER_MODEL}")
    fi
    if [[ -n "${VOCAB_FILE}" ]]; then
        DATA_ARGS+=(--vocab-file "${VOCAB_FILE}")
    fi
    if [[ -n "${MERGE_FILE}" ]]; then
        DATA_ARGS+=(--merge-file "${MERGE_FILE}")
    fi
    if [[ "${MOCK_DATA}" == 1 ]]; then
        DATA_ARGS+=(--mock-data)
    elif [[ -n "${DATA_PATH}" ]]; then
        local -a data_path_words
        read -r -a data_path_words <<< "${DATA_PATH}"
        DATA_ARGS+=(--data-path "${data_path_words[@]}")
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
                "${DATA_ARGS[@]}" "${LOG_ARGS[@]}" --distributed-backend nccl)
}
