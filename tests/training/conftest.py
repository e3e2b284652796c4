"""Fixtures shared by the checkpoint tests of this folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.pretrain_harness import CHECKPOINT_ARGV, in_process, losses


@pytest.fixture(scope="session")
def saved(tmp_path_factory) -> tuple[dict, Path]:
    """The uninterrupted run of ``CHECKPOINT_ARGV`` (its values) and its checkpoint folder (iterations 4 and
    8, tracker 8): made once for test_checkpoint_failures.py and test_checkpoint_integrity.py, which copy
    the folder before damaging it or resuming from it."""
    tmp = tmp_path_factory.mktemp("saved")
    run = in_process(tmp, "full", 2, CHECKPOINT_ARGV + ["--save", str(tmp / "ckpt")])
    assert sorted(losses(run)) == list(range(1, 9))
    return run, tmp / "ckpt"
