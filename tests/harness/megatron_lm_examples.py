"""Public launch scripts -- NVIDIA's Megatron-LM examples, the zero-bubble fork's and
VocabularyParallelism's -- scaled to CPU, for runs of Megatron-LM's loop and of ``pretrain_gpt_zb.py`` (tests).

Test code, not the product's run path. Each :class:`ExampleScript` holds the ``pretrain_gpt.py``
arguments of one launch script of Megatron-LM core_v0.16.1 (``examples/...``), flag for flag as the
script passes them, and :meth:`ExampleScript.argv` turns them into a CPU run with a *stated* list
of changes, nothing else:

* **sizes** (layers, hidden size, heads, sequence, vocabulary, batch, samples/iterations, experts
  and the parallel sizes) scaled to a 2-core machine (:attr:`ExampleScript.sizes`);
* **data**: a script's real-data flags (tokenizer model, data path) replaced by the harness's mock
  data (:data:`~harness.megatron_lm.MOCK_DATA_FLAGS`'s dataset and tokenizer);
* **CPU-only**: the flags a CPU build of torch cannot run, each dropped with the reason
  (:attr:`ExampleScript.dropped`), and the harness's :data:`~harness.megatron_lm.CPU_FLAGS`
  added; paths (``--save``, ``--load``, ``--tensorboard-dir``, ``--data-cache-path``) under the
  run's own folder.

Everything else -- optimizer, LR schedule, precision (``--bf16``), distributed optimizer with
overlapped reduce/gather, MoE routing and dispatcher, logging, checkpoint format -- is the script's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.megatron_lm import CPU_FLAGS

__all__ = ["ExampleScript", "GPT3_175B", "LLAMA3_8B", "LLAMA3_8B_FP8", "MIXTRAL_8X7B", "PATH_FLAGS", "VP_GPT",
           "VP_VOCAB_PARALLEL", "ZB_FORK", "ZB_FORK_V_SCHEDULE", "ZB_FORK_ZERO_BUBBLE", "ZB_OFFLOAD", "ZB_OFFLOAD_REFUSED"]

PATH_FLAGS = ("--save", "--load", "--tensorboard-dir", "--data-cache-path")
"""Flags whose value is a path: set under the run's folder."""


@dataclass(frozen=True)
class ExampleScript:
    """One Megatron-LM example launch script's ``pretrain_gpt.py`` arguments and how they are scaled.

    Attributes:
        source: the script, as a path in Megatron-LM at tag core_v0.16.1.
        flags: its arguments in its order: ``(flag, value or None)``, values as the script gives them
            (several values of one flag joined by spaces).
        sizes: flag -> the CPU value (the script's value replaced; a flag absent from the script is
            added; None: a flag without value).
        dropped: flag -> why a CPU run cannot pass it.
        world_size: processes of the CPU run.
        pretrain_sizes, pretrain_dropped: further changes for ``pretrain_gpt_zb.py``'s CPU run, whose
            checks refuse what Megatron-LM's loop accepts and ignores (each with its reason).
    """

    source: str
    flags: tuple[tuple[str, str | None], ...]
    sizes: dict[str, str | None]
    dropped: dict[str, str]
    world_size: int
    pretrain_sizes: dict[str, str | None] = field(default_factory=dict)
    pretrain_dropped: dict[str, str] = field(default_factory=dict)

    def argv(self, folder: str | Path, *, pretrain: bool = False) -> list[str]:
        """The CPU run's ``pretrain_gpt.py`` arguments (``pretrain``: ``pretrain_gpt_zb.py``'s): the
        script's flags with :attr:`sizes` applied, :attr:`dropped` removed, paths under ``folder``,
        then :data:`CPU_FLAGS`."""
        sizes = {**self.sizes, **(self.pretrain_sizes if pretrain else {})}
        dropped = {**self.dropped, **(self.pretrain_dropped if pretrain else {})}
        out: list[str] = []
        seen = set()
        for flag, value in self.flags:
            seen.add(flag)
            if flag in dropped:
                continue
            if flag in PATH_FLAGS:
                value = str(Path(folder) / str(value))
            value = sizes[flag] if flag in sizes else value
            out += [flag] if value is None else [flag, *value.split()]
        for flag, value in sizes.items():
            if flag not in seen:
                out += [flag] if value is None else [flag, *value.split()]
        return [*out, *CPU_FLAGS]


def _pairs(*args: str) -> tuple[tuple[str, str | None], ...]:
    """``("--a", "1", "--b", "--c", "x")`` -> ``(("--a", "1"), ("--b", None), ("--c", "x"))``."""
    out: list[tuple[str, str | None]] = []
    for a in args:
        if a.startswith("--"):
            out.append((a, None))
        else:  # a flag's value; several values (--rampup-batch-size A B C) joined by spaces
            flag, value = out.pop()
            out.append((flag, a if value is None else f"{value} {a}"))
    return tuple(out)


_LAYER_NORM_1P = ("megatron-core's local layer spec without apex builds torch's LayerNorm, which has no "
                  "zero-centred gamma (TENorm or apex's FusedLayerNorm on GPU)")
_MOCK_DATA = "real data replaced by mock data: --mock-data, NullTokenizer"
_RAMP_BY_ITERATIONS = ("the script ramps the batch with --train-iters, which Megatron-LM core_v0.16.1 refuses "
                       "(arguments.py: 'expected no batch-size rampup for iteration-based training'); the CPU run "
                       "counts samples: --train-samples, --lr-decay-samples")

LLAMA3_8B = ExampleScript(
    source="examples/llama/train_llama3_8b_h100_fp8.sh (its DTYPE=fp8 flags --fp8-format hybrid "
           "--fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather not included: FP8 "
           "needs Transformer Engine on Hopper; the mock-data branch of DATA_ARGS_LIST)",
    flags=_pairs(
        # MODEL_ARGS
        "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
        "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
        "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused",
        "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
        "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015",
        "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
        "--exit-duration-in-mins", "235",
        # MODEL_PARALLEL_ARGS, DDP_ARGS
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        # DATA_ARGS_LIST (mock)
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--data-cache-path", "cache",
        "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files", "--num-workers", "1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
        "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60", "--save", "ckpt", "--load", "ckpt",
        "--tensorboard-dir", "tb"),
    sizes={"--num-layers": "4", "--hidden-size": "64", "--ffn-hidden-size": "224", "--num-attention-heads": "4",
           "--num-query-groups": "1", "--kv-channels": "16", "--seq-length": "32", "--max-position-embeddings": "32",
           "--global-batch-size": "8", "--train-samples": "32", "--lr-decay-samples": "32",
           "--lr-warmup-samples": "8", "--vocab-size": "255", "--eval-iters": "1",
           "--pipeline-model-parallel-size": "2"},
    dropped={"--apply-layernorm-1p": _LAYER_NORM_1P},
    world_size=2,
    pretrain_sizes={"--profile-step-start": "2", "--profile-step-end": "3"},  # inside the 4 iterations
    pretrain_dropped={"--attention-backend": "fused chooses Transformer Engine's attention kernels, which "
                                             "pretrain_gpt_zb.py refuses on megatron-core's local spec"},
)
"""NVIDIA's LLaMA-3 8B script: 4 iterations of 8 samples (4 micro batches of 1), PP=2, world 2."""

MIXTRAL_8X7B = ExampleScript(
    source="examples/mixtral/train_mixtral_8x7b_distributed.sh",
    flags=_pairs(
        # MODEL_ARGS
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096", "--max-position-embeddings", "32768",
        "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
        "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "8",
        "--no-masked-softmax-fusion", "--no-position-embedding", "--rotary-base", "1000000",
        # MOE_ARGS
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather", "--overlap-grad-reduce",
        # DATA_ARGS
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "tokenizer.model", "--data-path", "data",
        "--split", "99990,8,2",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4", "--train-iters", "500000",
        "--lr-decay-iters", "320000", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
        "--lr-warmup-iters", "500", "--clip-grad", "1.0", "--bf16",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
        "--expert-model-parallel-size", "8", "--use-distributed-optimizer", "--sequence-parallel",
        # LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
        "--save", "ckpt", "--load", "ckpt", "--tensorboard-dir", "tb", "--no-load-optim", "--no-load-rng"),
    sizes={"--seq-length": "32", "--max-position-embeddings": "256", "--num-layers": "4", "--hidden-size": "64",
           "--ffn-hidden-size": "224", "--num-attention-heads": "4", "--num-query-groups": "1",
           "--num-experts": "4", "--global-batch-size": "8", "--train-iters": "4", "--lr-decay-iters": "3",
           "--lr-warmup-iters": "1", "--pipeline-model-parallel-size": "2", "--expert-model-parallel-size": "2",
           "--eval-iters": "1", "--tokenizer-type": "NullTokenizer", "--vocab-size": "255", "--mock-data": None},
    dropped={"--moe-grouped-gemm": "Megatron-LM's validate_args asks torch.cuda for the compute capability "
                                   "(grouped GEMM kernels need CUDA sm80+)",
             "--tokenizer-model": _MOCK_DATA, "--data-path": _MOCK_DATA},
    world_size=4,
)
"""NVIDIA's Mixtral 8x7B script: 4 iterations of 8 samples, PP=2 x DP=2 with expert parallelism 2
(4 experts, top-2, all-to-all dispatcher), world 4."""

LLAMA3_8B_FP8 = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
                 "--fp8-param-gather")
"""The FP8 variant's extra flags of NVIDIA's LLaMA-3 8B script (``DTYPE=fp8``): refused on CPU."""

GPT3_175B = ExampleScript(
    source="examples/gpt3/train_gpt3_175b_distributed.sh",
    flags=_pairs(
        # GPT_MODEL_ARGS
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
        "--max-position-embeddings", "2048", "--attention-backend", "auto",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size", "16", "16", "5859375",
        "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
        "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        # DATA_ARGS
        "--data-path", "data", "--vocab-file", "gpt2-vocab.json", "--merge-file", "gpt2-merges.txt",
        "--split", "949,50,1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "ckpt",
        "--load", "ckpt", "--eval-iters", "10", "--tensorboard-dir", "tb"),
    sizes={"--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
           "--max-position-embeddings": "32", "--global-batch-size": "8", "--rampup-batch-size": "4 4 16",
           "--train-samples": "48", "--lr-decay-samples": "40", "--tensor-model-parallel-size": "1",
           "--pipeline-model-parallel-size": "2", "--log-interval": "1", "--eval-iters": "1",
           "--mock-data": None, "--tokenizer-type": "NullTokenizer", "--vocab-size": "255"},
    dropped={"--data-path": _MOCK_DATA, "--vocab-file": _MOCK_DATA, "--merge-file": _MOCK_DATA,
             "--train-iters": _RAMP_BY_ITERATIONS, "--lr-decay-iters": _RAMP_BY_ITERATIONS},
    world_size=2,
)
"""NVIDIA's GPT-3 175B script: 48 samples with the batch ramping 4 -> 8 (m = 4 -> 8 micro batches
of 1), PP=2, world 2. Counted in samples: the script as published passes ``--rampup-batch-size``
with ``--train-iters``, which Megatron-LM core_v0.16.1 itself refuses."""

ZB_FORK = ExampleScript(
    source="sail-sg/zero-bubble-pipeline-parallelism examples/pretrain_zero_bubble.sh (its defaults: TP_SIZE=2, "
           "PIPELINE_SIZE=2, LAYERS=8, HIDDEN_SIZE=8192, ATTENTION_HEADS=64, FP32 unset -> --fp16; its "
           "schedule flags are ZB_FORK_ZERO_BUBBLE)",
    flags=_pairs(
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "8",
        "--hidden-size", "8192", "--num-attention-heads", "64", "--exit-interval", "1000", "--seq-length", "4096",
        "--max-position-embeddings", "8192", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-samples", "146484375", "--lr-decay-samples", "126953125", "--lr-warmup-samples", "183105",
        "--lr", "6.0e-5", "--min-lr", "6.0e-6", "--lr-decay-style", "cosine", "--log-interval", "10",
        "--eval-iters", "40", "--eval-interval", "10000", "--data-path", "data",
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "tokenizer.model", "--split", "98,2,0",
        "--clip-grad", "8.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--no-barrier-with-level-1-timing", "--profile-step-start", "150",
        "--profile-step-end", "170", "--untie-embeddings-and-output-weights", "--use-legacy-models",
        "--sequence-parallel", "--use-flash-attn", "--transformer-impl", "local", "--use-distributed-optimizer",
        "--no-overlap-p2p-communication", "--profile-ranks", "0", "--fp16"),
    sizes={"--tensor-model-parallel-size": "1", "--num-layers": "4", "--hidden-size": "64",
           "--num-attention-heads": "4", "--seq-length": "32", "--max-position-embeddings": "64",
           "--train-samples": "48", "--lr-decay-samples": "40", "--lr-warmup-samples": "8", "--log-interval": "1",
           "--eval-iters": "1", "--profile-step-start": "2", "--profile-step-end": "3",
           "--tokenizer-type": "NullTokenizer", "--vocab-size": "255", "--mock-data": None},
    dropped={"--data-path": _MOCK_DATA, "--tokenizer-model": _MOCK_DATA},
    world_size=2,
)
"""The zero-bubble fork's own script: 6 iterations of 8 samples, PP=2 (TP 2 -> 1 for 2 cores, so its
``--sequence-parallel`` is turned off with Megatron-LM's warning), world 2. ``--profile-ranks`` is
the script's list for world 2."""

ZB_FORK_ZERO_BUBBLE = ("--enable-zero-bubble", "--zero-bubble-pipeline-timers-start-iter", "2",
                       "--zero-bubble-pipeline-timers-end-iter", "4", "--zero-bubble-max-pending-backward", "4",
                       "--enable-optimizer-post-validation")
"""What the fork's script adds with ``ENABLE_ZERO_BUBBLE=1`` (timers 100/110 -> 2/4 for 6 iterations;
memory limit ``2 * PIPELINE_SIZE``; post-validation because it runs fp16)."""

ZB_FORK_V_SCHEDULE = ("--zero-bubble-v-schedule", *ZB_FORK_ZERO_BUBBLE)
"""What the fork's script adds with ``ZERO_BUBBLE_V_SCHEDULE=1``: ``--zero-bubble-v-schedule``, then (the
script sets ``ENABLE_ZERO_BUBBLE=1``) :data:`ZB_FORK_ZERO_BUBBLE`, in the script's order."""

_OFFLOAD_ANSWERED = ("refused by name by pretrain_gpt_zb.py (training/arguments/fork_flags.py; "
                     "tests/training/test_launch_scripts.py::test_offload_script_is_refused_naming_its_offload_flags)")

ZB_OFFLOAD = ExampleScript(
    source="sail-sg/zero-bubble-pipeline-parallelism examples/pretrain_offload.sh at 39f2c186 (its defaults on one "
           "node of 2 GPUs: PIPELINE_SIZE=2, LAYERS=3*2-2=4, GLOBAL_BATCH_SIZE=2*2*1=4, HIDDEN_SIZE=4096, "
           "FFN_HIDDEN_SIZE=16384, ATTENTION_HEADS=32, GQA=8, TP_SIZE=1, SEQ_LENGTH=8192, TRAIN_SAMPLES and "
           "LR_DECAY_SAMPLES as its arithmetic gives; FP32 unset -> --fp16; INTERLEAVED_1F1B unset -> "
           "--no-pre-communication-optimization; OFFLOAD=1 -> --cpu-offload; its zero-bubble flags with "
           "ENABLE_ZERO_BUBBLE=1 are ZB_FORK_ZERO_BUBBLE's, scaled alike)",
    flags=_pairs(
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
        "--hidden-size", "4096", "--ffn-hidden-size", "16384", "--num-attention-heads", "32",
        "--group-query-attention", "--num-query-groups", "8", "--exit-interval", "20", "--seq-length", "8192",
        "--max-position-embeddings", "8192", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-samples", "18310546", "--lr-decay-samples", "15869140", "--lr-warmup-samples", "183105",
        "--lr", "6.0e-5", "--min-lr", "6.0e-6", "--lr-decay-style", "cosine", "--log-interval", "10",
        "--eval-iters", "40", "--eval-interval", "10000", "--data-path", "data",
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "tokenizer.model", "--split", "98,2,0",
        "--clip-grad", "8.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--no-barrier-with-level-1-timing", "--profile-step-start", "3",
        "--profile-step-end", "6", "--transformer-impl", "local", "--use-legacy-models", "--use-flash-attn",
        "--no-bias-dropout-fusion", "--no-create-attention-mask-in-dataloader", "--untie-embeddings-and-output-weights",
        "--allow-padding-num-layers", "--initial-loss-scale", "65536", "--sequence-parallel", "--recompute-lgd",
        "--measure-activation-memory", "--use-tp-pp-dp-mapping", "--offload-continuous-buffers",
        "--profile-ranks", "0 1", "--fp16", "--no-pre-communication-optimization", "--cpu-offload"),
    sizes={"--hidden-size": "64", "--ffn-hidden-size": "256", "--num-attention-heads": "4",
           "--num-query-groups": "2", "--seq-length": "32", "--max-position-embeddings": "32",
           "--train-samples": "24", "--lr-decay-samples": "20", "--lr-warmup-samples": "4", "--log-interval": "1",
           "--eval-iters": "1", "--profile-step-start": "2", "--profile-step-end": "3",
           "--tokenizer-type": "NullTokenizer", "--vocab-size": "255", "--mock-data": None},
    dropped={"--data-path": _MOCK_DATA, "--tokenizer-model": _MOCK_DATA},
    world_size=2,
    pretrain_dropped={"--recompute-lgd": _OFFLOAD_ANSWERED, "--use-tp-pp-dp-mapping": _OFFLOAD_ANSWERED,
                      "--offload-continuous-buffers": _OFFLOAD_ANSWERED, "--cpu-offload": _OFFLOAD_ANSWERED},
)
"""The fork's PipeOffload script (``OFFLOAD=1``): 6 iterations of 4 samples, PP=2 (4 layers, as its
defaults), world 2. Its flags pretrain_gpt_zb.py refuses -- PipeOffload's ``--cpu-offload``,
``--offload-continuous-buffers`` and ``--recompute-lgd``, and the rank order ``--use-tp-pp-dp-mapping`` it
runs with -- are :data:`ZB_OFFLOAD_REFUSED`, dropped for pretrain_gpt_zb.py's run."""

ZB_OFFLOAD_REFUSED = ("--recompute-lgd", "--use-tp-pp-dp-mapping", "--offload-continuous-buffers", "--cpu-offload")
""":data:`ZB_OFFLOAD`'s flags that pretrain_gpt_zb.py refuses, in the script's order."""

VP_GPT = ExampleScript(
    source="sail-sg/VocabularyParallelism pretrain_gpt.sh at 6191c3bf (its defaults on one node of 2 GPUs: "
           "VOCAB_SIZE=256k, PIPELINE_SIZE=2, LAYERS=4*2=8, GLOBAL_BATCH_SIZE=2*3*1=6, HIDDEN_SIZE=4096, "
           "ATTENTION_HEADS=32, TP_SIZE=1, SEQ_LENGTH=2048, IMM_SIZE=4*4096; FP32 unset -> --fp16; its "
           "VOCAB_PARALLEL=1 flag is VP_VOCAB_PARALLEL)",
    flags=_pairs(
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "8",
        "--hidden-size", "4096", "--ffn-hidden-size", "16384", "--num-attention-heads", "32",
        "--exit-interval", "30", "--seq-length", "2048", "--max-position-embeddings", "2048",
        "--micro-batch-size", "1", "--global-batch-size", "6", "--train-samples", "146484375",
        "--lr-decay-samples", "126953125", "--lr-warmup-samples", "183105", "--lr", "6.0e-5", "--min-lr", "6.0e-6",
        "--lr-decay-style", "cosine", "--log-interval", "10", "--eval-iters", "40", "--eval-interval", "10000",
        "--data-path", "data", "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
        "tokenizer.model", "--split", "98,2,0", "--clip-grad", "8.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--init-method-std", "0.006", "--no-barrier-with-level-1-timing",
        "--profile-step-start", "7", "--profile-step-end", "8", "--profile-ranks", "0 1",
        "--schedule-timer-start", "10", "--schedule-timer-end", "20", "--use-flash-attn", "--sequence-parallel",
        "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--use-cpu-initialization", "--use-distributed-optimizer", "--initial-loss-scale", "65536",
        "--no-create-attention-mask-in-dataloader", "--fp16"),
    sizes={"--num-layers": "4", "--hidden-size": "64", "--ffn-hidden-size": "256", "--num-attention-heads": "4",
           "--seq-length": "32", "--max-position-embeddings": "32", "--train-samples": "24",
           "--lr-decay-samples": "20", "--lr-warmup-samples": "6", "--log-interval": "1", "--eval-iters": "1",
           "--profile-step-start": "2", "--profile-step-end": "3", "--tokenizer-type": "NullTokenizer",
           "--vocab-size": "255", "--mock-data": None},
    dropped={"--data-path": _MOCK_DATA, "--tokenizer-model": _MOCK_DATA},
    world_size=2,
    pretrain_dropped={
        "--schedule-timer-start": "VocabularyParallelism's profiling window, refused by name by pretrain_gpt_zb.py "
                                  "(its window is --zero-bubble-pipeline-timers-start-iter, default 2)",
        "--schedule-timer-end": "VocabularyParallelism's profiling window, refused by name by pretrain_gpt_zb.py "
                                "(its window is --zero-bubble-pipeline-timers-end-iter, default 4)"},
)
"""VocabularyParallelism's script: 4 iterations of 6 samples (3 micro batches of 1), PP=2, world 2,
fp16, untied, no dropout, the distributed optimizer; 256 ids (255 and the NullTokenizer's EOD), 256 rows."""

VP_VOCAB_PARALLEL = ("--enable-vocab-parallel",)
"""What VocabularyParallelism's script adds with ``VOCAB_PARALLEL=1`` (``INTERLACED_SCHEDULE`` and ``FB_SPLIT``
unset): on pretrain_gpt_zb.py, 1F1B's Vocab-2 form ``1f1b-vocab-2`` (one barrier, as the script's default)."""
