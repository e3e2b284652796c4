"""Checkpoints across schedules inside NVIDIA Megatron-LM's own training loop (core_v0.16.1), on CPU.

Saved with zero bubble (the flags route, ``--enable-zero-bubble --save``), resumed with megatron-core's
1F1B (``--load``; the flags route installed, no zero-bubble flag), and the reverse: each resumed
iteration equals the uninterrupted run's bit for bit (lm loss, grad norm on every rank) and so do
every rank's parameters after the last iteration. One chain of three runs, tiny GPT, PP=2, the
distributed optimizer (torch's Adam, as on any install without apex / Transformer Engine):

1. ``zb``: 4 iterations with ``--enable-zero-bubble``, saving at iteration 2 (and 4): the uninterrupted run;
2. ``mcore``: megatron-core's 1F1B resumes from ``zb``'s iteration 2, runs 3-4, saves at 3 (and 4);
3. ``zb_again``: ``--enable-zero-bubble`` resumes from ``mcore``'s iteration 3 and runs 4.

The distributed optimizer cannot resume in Megatron-LM's loop at this tag without apex / TE (measured
once by hand, not in this file: ``assert len(steps) == 1`` in megatron-core's
``DistributedOptimizer.state_dict``; with that alone repaired, iteration 3 is exact and 4 is not, the
Adam step being wrong): ``megatron_zb.megatron_lm.install()`` applies megatron-zb's repairs around
Megatron-LM's ``load_checkpoint`` (``checkpointing.repaired_distributed_adam_load``), which these
runs need.

Dropout is off (``--hidden-dropout 0 --attention-dropout 0``) because Megatron-LM's own resume is
not exact with dropout on this CPU build (measured, megatron-core's 1F1B saving and resuming: the
first resumed iteration differs): on CPU, megatron's "CUDA" random generator is the CPU one (the CPU
shim, docs/cpu_support.md), and after ``load_checkpoint`` restores it Megatron-LM builds its three
data-loader iterators, each of which draws its base seed from that generator -- on a GPU they draw
from the CPU generator and dropout from the CUDA one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from harness.megatron_lm import (CPU_FLAGS, MOCK_DATA_FLAGS, TINY_GPT_FLAGS, MegatronLMRun,
                                             bitwise_differences, run_megatron_lm)
import test_megatron_lm_loop
from test_megatron_lm_loop import FLAGS_PLUGIN, ITERS, MCORE_1F1B, REPLAN_FUNC, TIMEOUT_S, assert_trains

pytestmark = test_megatron_lm_loop.pytestmark  # skips without Megatron-LM or its imports

PP2_DISTOPT = (*CPU_FLAGS, *MOCK_DATA_FLAGS, *TINY_GPT_FLAGS, "--pipeline-model-parallel-size", "2",
               "--global-batch-size", "8", "--train-iters", str(ITERS), "--use-distributed-optimizer",
               "--hidden-dropout", "0", "--attention-dropout", "0")
"""Tiny GPT, PP=2 (world 2), the distributed optimizer, 4 micro batches of 2, dropout off (module docstring)."""


def _run(extra: tuple[str, ...]) -> MegatronLMRun:
    return run_megatron_lm([*PP2_DISTOPT, *extra], world_size=2, timeout=TIMEOUT_S, plugin=FLAGS_PLUGIN,
                           params=True)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MegatronLMRun]:
    """The three runs of the module docstring, in order (each loads the previous one's checkpoint)."""
    zb_dir, mcore_dir = tmp_path_factory.mktemp("zb-ckpt"), tmp_path_factory.mktemp("mcore-ckpt")
    zb = _run(("--enable-zero-bubble", "--save", str(zb_dir), "--save-interval", "2"))
    mcore = _run(("--load", str(zb_dir), "--ckpt-step", "2", "--save", str(mcore_dir), "--save-interval", "3"))
    zb_again = _run(("--enable-zero-bubble", "--load", str(mcore_dir), "--ckpt-step", "3"))
    assert _saved(zb_dir) == [2, 4] and _saved(mcore_dir) == [3, 4]
    return {"zb": zb, "mcore": mcore, "zb_again": zb_again}


def _saved(folder: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("iter_")) for p in folder.glob("iter_*") if (p / ".metadata").is_file())


def _from(run: MegatronLMRun, first: int) -> MegatronLMRun:
    """``run`` as if it had logged iterations ``first``.. only (the resumed run's view of it), without
    the printed lm loss: Megatron-LM prints the mean since the run's first logged iteration (at this
    tag iteration 2 prints the mean of 1 and 2), so a resumed run prints other means. The exact
    per-iteration loss (``training_log``'s argument) is compared, and the printed grad norm."""
    skip = first - run.iterations[0].iteration
    return replace(run, iterations=[replace(it, lm_loss=None) for it in run.iterations[skip:]],
                   grad_norms_by_rank=[r[skip:] for r in run.grad_norms_by_rank])


def _assert_resumed(run: MegatronLMRun, first: int, forward_backward: str, ref: MegatronLMRun) -> None:
    assert [it.iteration for it in run.iterations] == list(range(first, ITERS + 1)), run.logs[-1][-2000:]
    assert {it.forward_backward for it in run.iterations} == {forward_backward}
    assert run.iterations[0].lm_loss == float(f"{run.iterations[0].exact['lm loss']:.6E}")  # its own first mean
    assert bitwise_differences(_from(run, first), _from(ref, first)) == []


def test_the_uninterrupted_zero_bubble_run_trains(chain: dict[str, MegatronLMRun]) -> None:
    assert_trains(chain["zb"], 2, REPLAN_FUNC)


def test_saved_with_zero_bubble_resumed_by_megatron_core_is_bitwise_uninterrupted(
        chain: dict[str, MegatronLMRun]) -> None:
    _assert_resumed(chain["mcore"], 3, MCORE_1F1B, chain["zb"])


def test_saved_by_megatron_core_resumed_with_zero_bubble_is_bitwise_uninterrupted(
        chain: dict[str, MegatronLMRun]) -> None:
    _assert_resumed(chain["zb_again"], 4, REPLAN_FUNC, chain["zb"])
