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
"""The padded vocabulary (101 ids -> 128) is the same with and without the flag (64 x TP = 64, which
TP x PP = 2 divides), so the checkpoint's matrices fit a run without it."""
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


ACROSS = list(ARGV)
ACROSS[ACROSS.index("--make-vocab-size-divisible-by") + 1] = "5"
ACROSS[ACROSS.index("--vocab-size") + 1] = "1004"
"""PP=2 x DP=1 (2 processes), 1005 ids (1004 and the NullTokenizer's EOD), ``--make-vocab-size-divisible-by 5``:
1005 rows with and without the flag (Megatron-LM's 5 x TP), which neither 5 x TP x PP = 10 nor 128 x TP x PP
divides -- the flag's two slices hold 503 and 502 rows (before issue 41 it padded to 1010 rows: another model)."""


def test_checkpoint_continues_across_the_flag_with_a_vocabulary_not_dividing_tp_pp(tmp_path):
    """Three runs at PP=2, tied, of the model above (and one refused):

    * ``plain``: without the flag (``--schedule zb-h1``), 4 iterations uninterrupted, checkpoint at 2;
    * the flag with the old rule's padding (``--make-vocab-size-divisible-by 10``: 1010 rows) is refused at
      the load, the line naming the conversion (``--make-vocab-size-divisible-by 1005``);
    * ``flagged``: ``--enable-vocab-parallel --schedule zb-h1-vocab-1`` continuing ``plain``'s checkpoint of
      iteration 2 (slices of 503 and 502 rows, saved as megatron-core's uneven shards of the 1005-row
      matrix): iterations 3-4 within a relative 1e-5 of ``plain``'s;
    * ``back``: without the flag again, continuing ``flagged``'s checkpoint of iteration 3: iteration 4
      within a relative 1e-5 of ``plain``'s (and of ``flagged``'s).

    1e-5 is docs/vocab_parallel.md's tolerance between the flag's run and megatron-core's schedule: the
    vocabulary-parallel softmax sums its slices in another order (loss, grad norm; the learning rate equal).
    Every run logs the 1005 padded rows. No row beyond them exists, so none needs masking. Measured (0.16.1):
    losses within 1.7e-8, grad norms and learning rates equal.
    """
    from harness.trainer_run import in_process

    plain = in_process(tmp_path, "plain", 2, ACROSS + ["--schedule", "zb-h1", "--save", str(tmp_path / "p"),
                                                     "--save-interval", "2"])
    with pytest.raises(Exception, match=r"--padded-vocab-size: checkpoint 1005, this run 1010 \(pass "
                                        r"--make-vocab-size-divisible-by 1005 to pad this run to the checkpoint's "
                                        r"1005 rows\)"):
        in_process(tmp_path, "old_rule", 2, ACROSS + VOCAB + ["--make-vocab-size-divisible-by", "10",
                                                             "--load", str(_at(tmp_path / "p", 2, tmp_path / "p2o"))])
    flagged = in_process(tmp_path, "flagged", 2, ACROSS + VOCAB + [
        "--load", str(_at(tmp_path / "p", 2, tmp_path / "p2")), "--save", str(tmp_path / "f"), "--save-interval", "3"])
    back = in_process(tmp_path, "back", 2, ACROSS + ["--schedule", "zb-h1",
                                                    "--load", str(_at(tmp_path / "f", 3, tmp_path / "f3"))])
    for run in (plain, flagged, back):
        assert "vocabulary 1005 (padded)" in run["log"], run["log"][:2000]
    assert "vocabulary parallelism: 2 slices of 503 or 502 rows (padded vocabulary 1005)" in flagged["log"]
    assert "vocabulary parallelism" not in back["log"]
    assert "at iteration 2" in flagged["log"] and "at iteration 3" in back["log"]
    assert [t[0] for t in _train(plain)] == list(range(1, N + 1))
    _close(_train(flagged), _train(plain)[2:], rel=1e-5, what="continued with --enable-vocab-parallel")
    _close(_train(back), _train(plain)[3:], rel=1e-5, what="continued without it again")
    _close(_train(back), _train(flagged)[1:], rel=1e-5, what="against the flag's own iteration")


def test_a_checkpoint_of_other_padding_is_refused_naming_the_conversion():
    """The refusal's clause (``--padded-vocab-size: checkpoint P, this run Q (...)``): the
    ``--make-vocab-size-divisible-by`` that pads this run to the checkpoint's rows, or, where this run's
    TP does not divide them, the tensor-parallel size to use."""
    from megatron_zb.planning.model import padded_vocab_fix

    # a flagged checkpoint padded by the old rule (128 x TP x PP = 256): 8448 rows for 8200 ids
    assert padded_vocab_fix(8448, tp=1) == \
        "pass --make-vocab-size-divisible-by 8448 to pad this run to the checkpoint's 8448 rows"
    assert padded_vocab_fix(8448, tp=2) == \
        "pass --make-vocab-size-divisible-by 4224 to pad this run to the checkpoint's 8448 rows"
    assert padded_vocab_fix(1005, tp=2) == ("the checkpoint's 1005 rows do not split over this run's 2 "
                                            "tensor-parallel ranks: load it at a --tensor-model-parallel-size "
                                            "that divides 1005")
