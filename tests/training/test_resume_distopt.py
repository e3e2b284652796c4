"""Resume identity with the distributed optimizer: PP=2 x DP=2, ``--use-distributed-optimizer``,
exact optimizer post-validation, greedy zero-bubble schedule.

The trainer (what ``pretrain_gpt_zb.py`` runs) runs in-process on 4 ranks of ``run_distributed``
(not under torchrun: the test reads each rank's Adam state from the live optimizer). Each run
takes ~15 s on an idle 2-core machine.

Clipping at 1.3 (grad norms here are 1.1-1.4) with ``--post-validation-fallback-clean-iters 0``
makes eager steps clip and be rolled back and redone, also after the resume; a warm-up of 1 makes
every run's first step synchronous (the warm-up counts from the start of each run).

Before the fix in ``megatron_zb.training.checkpointing`` (``give_each_param_its_step``), the
resumed run's Adam ``step`` restarted at 0 and was shared by all parameters: iteration k+1 was
still equal, iteration k+2 was not.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

N, K = 6, 3  # iterations of the uninterrupted run; the checkpoint's iteration
ARGV = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "2e-3", "--mock-data", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
        "--distributed-backend", "gloo", "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2",
        "--pipeline-model-parallel-size", "2", "--train-iters", str(N), "--enable-zero-bubble",
        "--use-distributed-optimizer", "--clip-grad", "1.3",
        "--enable-optimizer-post-validation", "--enable-exactly-numeric-match",
        "--post-validation-warmup-iters", "1", "--post-validation-fallback-clean-iters", "0"]
WORLD = 4  # PP=2 x DP=2


def _adam_state(inner: Any) -> list[dict[str, Any]]:
    """Every Adam state of this rank (its shard of the distributed optimizer), in param-group
    order: ``step``, ``exp_avg``, ``exp_avg_sq`` and the fp32 main param, copied."""
    out = []
    for part in inner.chained_optimizers:
        opt = part.optimizer
        for group in opt.param_groups:
            for p in group["params"]:
                entry = {k: v.detach().clone() for k, v in opt.state[p].items()}
                entry["main_param"] = p.detach().clone()
                out.append(entry)
    return out


def _run(argv: list[str], json_path: str) -> dict:
    """One rank: the trainer on ``argv``; its Adam state right after construction (i.e. after
    ``--load``) and after the run, rank 0's log, the last rank's per-iteration values."""
    import torch.distributed as dist

    from megatron_zb.training.pretrain import parse_and_validate
    from megatron_zb.training.trainer import Trainer

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        trainer = Trainer(parse_and_validate(argv + ["--loss-log-json", json_path], dist.get_world_size()))
        try:
            loaded = _adam_state(trainer.optim.inner)
            assert trainer.run() == 0
            end = _adam_state(trainer.optim.inner)
        finally:
            trainer.close()
    values = json.loads(Path(json_path).read_text()) if Path(json_path).exists() else None
    return {"log": log.getvalue(), "values": values, "loaded": loaded, "end": end}


def _launch(tmp_path: Path, name: str, argv: list[str]) -> list[dict]:
    from megatron_zb.testing import run_distributed

    d = tmp_path / name
    d.mkdir()
    return run_distributed(_run, world_size=WORLD, args=(argv, str(d / "values.json")), timeout=400)


def _values(ranks: list[dict]) -> list[tuple]:
    """Per iteration: (iteration, lm loss, learning rate, grad norm, loss scale, skipped), exact."""
    values = next(r["values"] for r in ranks if r["values"] is not None)
    return [(r["iteration"], r["lm loss"], r["learning rate"], r["grad norm"], r["loss scale"], r["skipped"])
            for r in values["train"]]


def _assert_same_adam_state(got: list[dict], want: list[dict], what: str) -> None:
    """Bitwise equality of two ranks' Adam states (same keys, same tensors)."""
    import torch

    assert len(got) == len(want) and got, what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys() and {"step", "exp_avg", "exp_avg_sq"} <= a.keys(), (what, i, a.keys())
        for key in a:
            assert torch.equal(a[key], b[key]), f"{what}: state {i} {key} differs, max |diff| " \
                                                f"{(a[key].double() - b[key].double()).abs().max().item()}"


def _rollbacks(ranks: list[dict]) -> int:
    """Rank 0's post-validation rollbacks, from the run's last line about them."""
    m = re.search(r"> optimizer post-validation \(rank 0\): .* (\d+) rollbacks", ranks[0]["log"])
    assert m, ranks[0]["log"][-2000:]
    return int(m.group(1))


def test_resume_with_distributed_optimizer_and_post_validation_equals_uninterrupted(tmp_path):
    """fp32: N iterations == K iterations, save, exit, --load, K+1..N: every iteration's lm loss,
    learning rate, grad norm (bitwise); each rank's Adam state right after the load equals the
    one saved, and after iteration N the uninterrupted run's (step, moments, main params)."""
    whole = _launch(tmp_path, "whole", ARGV)
    ckpt = tmp_path / "ckpt"
    first = _launch(tmp_path, "first", ARGV + ["--save", str(ckpt), "--save-interval", str(K),
                                               "--exit-interval", str(K)])
    second = _launch(tmp_path, "second", ARGV + ["--load", str(ckpt)])
    assert [v[0] for v in _values(first)] == list(range(1, K + 1))
    assert [v[0] for v in _values(second)] == list(range(K + 1, N + 1))
    assert _values(first) + _values(second) == _values(whole)
    for rank in range(WORLD):
        steps = {float(s["step"]) for s in first[rank]["end"]}
        assert steps == {float(K)}, steps  # K successful Adam steps, every param its own count
        _assert_same_adam_state(second[rank]["loaded"], first[rank]["end"], f"rank {rank} after --load")
        _assert_same_adam_state(second[rank]["end"], whole[rank]["end"], f"rank {rank} at iteration {N}")
    # The resumed run post-validated eagerly and rolled a clipped step back (not only synchronous steps).
    assert _rollbacks(second) >= 1 and "rebuilt from the profiled costs stored in the checkpoint" in second[0]["log"]


def test_fp16_resume_with_distributed_optimizer_restores_the_loss_scaler(tmp_path):
    """fp16 with dynamic loss scaling from 2^19: the first iterations overflow (skipped; the scale
    is halved from the second, after the hysteresis of 2), so the checkpoint at K holds a lowered
    scale and a spent hysteresis. Resuming from it gives the uninterrupted run's values from K+1 to
    N bitwise, loss scale and skipped iterations included, and its Adam state at N. The
    uninterrupted run is the one that saved (at K and N): 2 runs instead of 3."""
    argv = ARGV + ["--fp16", "--initial-loss-scale", str(2.0 ** 19)]
    ckpt = tmp_path / "ckpt"
    whole = _launch(tmp_path, "whole", argv + ["--save", str(ckpt), "--save-interval", str(K)])
    values = _values(whole)
    scales = [v[4] for v in values]
    assert values[0][5] and scales[K - 1] < scales[0], values  # the checkpoint's loss scale is not the initial one
    assert not all(v[5] for v in values[:K]) and not all(v[5] for v in values[K:]), values  # Adam stepped
    at_k = tmp_path / "ckpt_k"
    shutil.copytree(ckpt / f"iter_{K:07d}", at_k / f"iter_{K:07d}")
    (at_k / "latest_checkpointed_iteration.txt").write_text(str(K))
    second = _launch(tmp_path, "second", argv + ["--load", str(at_k)])
    assert _values(second) == values[K:], (_values(second), values)
    for rank in range(WORLD):
        _assert_same_adam_state(second[rank]["end"], whole[rank]["end"], f"rank {rank} at iteration {N}")


def test_optimizer_format_mismatch_is_refused():
    """Loading the distributed optimizer's state into a run without it (or the reverse), or at
    another (PP, TP) layout, is refused with one message; DP may differ; old checkpoints (no
    flag recorded) are not checked."""
    from megatron_zb.training.checkpointing import CheckpointError, check_optimizer_format

    def common(distopt: bool | None, layout: tuple[int, int, int]) -> dict:
        args = {} if distopt is None else {"use_distributed_optimizer": distopt}
        return {"args": args, "parallel_layout": layout}

    check_optimizer_format(common(True, (2, 1, 2)), distributed=True, layout=(2, 1, 2), path="c")
    check_optimizer_format(common(True, (2, 1, 2)), distributed=True, layout=(2, 1, 1), path="c")
    check_optimizer_format(common(False, (2, 1, 2)), distributed=False, layout=(4, 1, 1), path="c")
    check_optimizer_format(common(None, (2, 1, 2)), distributed=True, layout=(4, 1, 1), path="c")
    with pytest.raises(CheckpointError, match="saved with --use-distributed-optimizer and this run is without it"):
        check_optimizer_format(common(True, (2, 1, 2)), distributed=False, layout=(2, 1, 2), path="c")
    with pytest.raises(CheckpointError, match="saved without --use-distributed-optimizer and this run is with it"):
        check_optimizer_format(common(False, (2, 1, 2)), distributed=True, layout=(2, 1, 2), path="c")
    with pytest.raises(CheckpointError, match=r"\(PP, TP\) = \(2, 1\); this run has \(4, 1\)"):
        check_optimizer_format(common(True, (2, 1, 2)), distributed=True, layout=(4, 1, 1), path="c")
