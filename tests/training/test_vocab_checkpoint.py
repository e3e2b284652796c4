"""Checkpoints and the distributed optimizer with ``pretrain_gpt_zb.py --enable-vocab-parallel``.

The vocabulary slices (``VocabParallelSlices``, each rank's ``[V_pad/2, h]`` rows) are saved by
megatron-core's dist-checkpointing as shards of the whole ``[V_pad, h]`` matrix under megatron-core
``GPTModel``'s key (``embedding.word_embeddings.weight``; untied also ``output_layer.weight``), with
their Adam state. The trainer runs in-process on real gloo ranks (``harness.trainer_run``),
PP=2 x DP=2, tied embeddings (Megatron-LM's default), ``--schedule zb-h1-vocab-1``, Adam, clipping,
LR warm-up and decay, no dropout (as tests/runtime/test_vocab_runtime.py's pretrain runs).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

N, K = 4, 2  # iterations of the uninterrupted runs; the checkpoint's iteration
WORLD = 4  # PP=2 x DP=2
ARGV = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "100", "--make-vocab-size-divisible-by", "64",
        "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(N), "--lr", "2e-3",
        "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--mock-data", "--num-workers", "0", "--log-interval", "1",
        "--eval-iters", "0", "--distributed-backend", "gloo", "--pipeline-model-parallel-size", "2",
        "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2"]
"""The padded vocabulary (101 ids -> 128) is the same with and without the flag (64 x TP x PP = 128 and
64 x TP = 64 both give 128), so the checkpoint's matrices fit a run without it."""
VOCAB = ["--enable-vocab-parallel", "--schedule", "zb-h1-vocab-1"]
DISTOPT = ["--use-distributed-optimizer"]


def _train(run: dict) -> list[tuple[int, float, float, float]]:
    """(iteration, lm loss, grad norm, learning rate) of every logged training iteration."""
    return [(r["iteration"], r["lm loss"], r["grad norm"], r["learning rate"]) for r in run["values"]["train"]]


def _at(root: Path, iteration: int, dst: Path) -> Path:
    """A copy of ``root``'s checkpoint of ``iteration`` whose tracker names it (as if the run stopped there)."""
    shutil.copytree(root / f"iter_{iteration:07d}", dst / f"iter_{iteration:07d}")
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def _close(got: list[tuple], want: list[tuple], *, rel: float, what: str) -> None:
    assert [g[0] for g in got] == [w[0] for w in want], what
    for g, w in zip(got, want):
        assert g[1:] == pytest.approx(w[1:], rel=rel), (what, g, w)


def test_vocab_parallel_checkpoints_and_distributed_optimizer(tmp_path):
    """Four runs (PP=2 x DP=2 but the last):

    * ``--enable-vocab-parallel --use-distributed-optimizer``, saving at iteration K, and the same
      resumed from that checkpoint: iterations K+1..N **bitwise** those of the uninterrupted run
      (loss, grad norm, learning rate) -- the slices, their distributed Adam state and the RNG restored;
    * the same without ``--use-distributed-optimizer`` (saving at K too): every iteration within a
      relative 1e-6 of the distributed optimizer's run (the reduce-scatter / all-gather and the sharded
      grad norm round differently from an all-reduce; measured: losses equal, grad norm 6.3e-8);
    * a run **without** the flag (``--schedule zb-h1``, PP=2 x DP=1: also another data-parallel size)
      loading that run's checkpoint of K: the word embedding (tied: the first stage's weight and the
      last stage's copy) gathered from the two slices, with their Adam state; iterations K+1..N within
      a relative 1e-5 of the flag's run (what tests/runtime/test_vocab_runtime.py allows between the
      two arithmetics; measured: losses equal, grad norm 4.7e-8).

    Measured (one 2-core machine shared with other jobs, load average 8-18): the four runs 16, 6, 11
    and 4 s, the first with the process start-up; 21-48 s for the test.
    """
    from harness.trainer_run import in_process

    ckpt, plain_ckpt = tmp_path / "ckpt", tmp_path / "plain_ckpt"
    save = ["--save-interval", str(K)]
    distopt = in_process(tmp_path, "distopt", WORLD, ARGV + VOCAB + DISTOPT + save + ["--save", str(ckpt)])
    resumed = in_process(tmp_path, "resumed", WORLD, ARGV + VOCAB + DISTOPT + ["--load", str(_at(ckpt, K, tmp_path / "k"))])
    assert f"successfully loaded checkpoint from {tmp_path / 'k'}/iter_{K:07d} at iteration {K}" in resumed["log"]
    assert "random states are not restored" not in resumed["log"]
    assert [t[0] for t in _train(distopt)] == list(range(1, N + 1))
    assert _train(resumed) == _train(distopt)[K:]

    plain = in_process(tmp_path, "plain", WORLD, ARGV + VOCAB + save + ["--save", str(plain_ckpt)])
    _close(_train(plain), _train(distopt), rel=1e-6, what="without --use-distributed-optimizer")

    unflagged = in_process(tmp_path, "unflagged", 2, ARGV + ["--schedule", "zb-h1",  # PP=2 x DP=1
                                                            "--load", str(_at(plain_ckpt, K, tmp_path / "pk"))])
    assert "vocabulary parallelism" not in unflagged["log"]
    assert f"at iteration {K}" in unflagged["log"]
    _close(_train(unflagged), _train(plain)[K:], rel=1e-5, what="loaded without --enable-vocab-parallel")


def test_distributed_optimizer_state_across_the_flag_is_refused():
    """The distributed optimizer's state follows the gradient buckets, and the slices have buffers of
    their own: loading it across ``--enable-vocab-parallel`` is refused with one message naming the fix;
    without the distributed optimizer (per-parameter state under the model's keys) it is allowed, and
    checkpoints that do not record the flag count as saved without it."""
    from megatron_zb.training.checkpointing import CheckpointError, check_optimizer_format

    def common(vocab: bool | None) -> dict:
        args = {"use_distributed_optimizer": True} if vocab is None else {"use_distributed_optimizer": True,
                                                                           "enable_vocab_parallel": vocab}
        return {"args": args, "parallel_layout": (2, 1, 2)}

    check_optimizer_format(common(True), distributed=True, layout=(2, 1, 2), path="c", vocab_parallel=True)
    check_optimizer_format(common(None), distributed=True, layout=(2, 1, 2), path="c", vocab_parallel=False)
    no_distopt = {"args": {"use_distributed_optimizer": False, "enable_vocab_parallel": True}, "parallel_layout": (2, 1, 2)}
    check_optimizer_format(no_distopt, distributed=False, layout=(2, 1, 2), path="c", vocab_parallel=False)
    with pytest.raises(CheckpointError, match="a run with --enable-vocab-parallel: .*resume with --enable-vocab-parallel"):
        check_optimizer_format(common(True), distributed=True, layout=(2, 1, 2), path="c", vocab_parallel=False)
    with pytest.raises(CheckpointError, match="a run without --enable-vocab-parallel"):
        check_optimizer_format(common(None), distributed=True, layout=(2, 1, 2), path="c", vocab_parallel=True)
