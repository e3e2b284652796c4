"""Checkpoints that say when they are wrong (issue 44): the manifest's checksums verified on load, a
``--save`` that cannot hold checkpoints refused up front, a save that does not fit or fails mid-write.

One run (:func:`saved`: PP=2, greedy zero bubble, dropout 0.1, 8 iterations, checkpoints at 4 and 8)
is made once for this module and test_checkpoint_failures.py (tests/training/conftest.py); each test
copies its checkpoint folder and damages the copy. The refused loads stop before any training (a few
seconds each); one resume from the checkpoint the refusals name (``--ckpt-step 4``) is compared bit for bit with the uninterrupted run, and one after a
refused save.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from megatron_zb.megatron_compat import common_state_in_file, release
from harness.pretrain_harness import (CHECKPOINT_ARGV, assert_resumes_at, main_in_ranks, assert_curve, in_process, losses,
                                     torchrun_exit)  # the end-to-end harness

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ARGV = CHECKPOINT_ARGV
"""8 iterations, --save-interval 4, dropout 0.1; PP=2, greedy zero bubble (test_checkpoint_failures' run)."""
TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"


OVERWRITING = "Overwriting old incomplete / corrupted checkpoint..."
"""megatron-core's own log line when a save's directory is not empty (here: the test's trap in it)."""
MCORE_ASYNC_DEPRECATION = "MCore's async save is deprecated"
"""megatron-core 0.19's own warning at a process's first save (its ``execute_sync`` path, which a synchronous
save takes too): not an error line of ours."""


def _one_error_line(ranks: list[dict[str, Any]], rc: int = 1) -> str:
    """Assert exit ``rc`` on every rank, one error line (rank 0), no traceback; return the line."""
    assert [r["rc"] for r in ranks] == [rc] * len(ranks), ranks
    errors = [ln for r in ranks for ln in r["err"].splitlines() if ln.strip() and ln != OVERWRITING
              and not ln.startswith(MCORE_ASYNC_DEPRECATION)]
    everything = "".join(r["out"] + r["err"] for r in ranks)
    assert len(errors) == 1 and errors[0].startswith("pretrain_gpt_zb.py: error: "), "\n".join(errors)
    assert "Traceback" not in everything, everything[-3000:]
    print(errors[0])  # pytest -s shows the lines docs/training.md quotes
    return errors[0]


def _copy(saved: tuple[dict, Path], dst: Path) -> Path:
    shutil.copytree(saved[1], dst)
    return dst


def _flip(file: Path, offset: int) -> None:
    """Invert every bit of the byte at ``offset`` of ``file`` (same length)."""
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


def _item(path: Path, prefix: str) -> tuple[Path, int]:
    """(shard file, offset of the middle byte) of the first stored item whose key starts with ``prefix``,
    from torch's ``.metadata`` storage index."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(path)).read_metadata().storage_data
    index, info = min(((k, v) for k, v in storage.items() if k.fqn.startswith(prefix)), key=lambda kv: kv[0].fqn)
    return path / info.relative_path, info.offset + info.length // 2


# ---------------------------------------------------------------------------- the manifest
def test_every_checkpoint_has_a_manifest_of_all_its_files(saved):
    from megatron_zb.training.checkpoint_manifest import file_checksum

    for it in ("iter_0000004", "iter_0000008"):
        path = saved[1] / it
        files = json.loads((path / MANIFEST).read_text())["files"]
        on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)
        assert sorted(files) == on_disk and ".metadata" in files, (files, on_disk)
        assert ("common.pt" in files) == common_state_in_file(), files  # 0.19: inside the torch_dist files
        for name, entry in files.items():
            size, crc = file_checksum(str(path / name))
            assert (entry["bytes"], entry["crc32"]) == (size, f"{crc:08x}"), name


DAMAGE = {
    "a model tensor in a shard": lambda p: _item(p, "decoder.layers"),
    "the common state": lambda p: ((p / "common.pt", (p / "common.pt").stat().st_size // 2) if common_state_in_file()
                                   else _item(p, "common_state")),
    "an optimizer tensor": lambda p: _item(p, "optimizer.state.exp_avg"),
}


@pytest.mark.parametrize("where", list(DAMAGE))
def test_a_flipped_byte_is_refused_naming_file_iteration_and_previous_checkpoint(tmp_path, saved, where):
    """One byte changed in place (same length: :func:`damage` cannot see it): one line naming the file,
    the checkpoint (iteration 8) and ``--ckpt-step 4``; nothing written."""
    root = _copy(saved, tmp_path / "ckpt")
    file, offset = DAMAGE[where](root / "iter_0000008")
    _flip(file, offset)
    line = _one_error_line(main_in_ranks(ARGV + ["--load", str(root)]))
    assert f"cannot load checkpoint {root / 'iter_0000008'} ({root / TRACKER} names iteration 8): {file} does not " \
           f"match its checksum in {MANIFEST}" in line, line
    assert f"the previous intact checkpoint is iteration 4 ({root / 'iter_0000004'}): add --ckpt-step 4" in line, line


def test_ckpt_step_named_by_the_refusal_resumes_bitwise(tmp_path, saved):
    """All three bytes flipped in iteration 8: ``--ckpt-step 4`` loads the intact checkpoint and
    iterations 5-8 are the uninterrupted run's bit for bit."""
    full, _ = saved
    root = _copy(saved, tmp_path / "ckpt")
    for where in DAMAGE:
        _flip(*DAMAGE[where](root / "iter_0000008"))
    assert_resumes_at(tmp_path, root, full, step=4, argv=ARGV)


def test_no_ckpt_verify_loads_a_flipped_checkpoint_silently(tmp_path, saved):
    """``--no-ckpt-verify``: the old behaviour -- a changed byte of a weight loads without complaint."""
    root = _copy(saved, tmp_path / "ckpt")
    _flip(*_item(root / "iter_0000008", "decoder.layers"))
    ranks = main_in_ranks(ARGV + ["--load", str(root), "--no-ckpt-verify"])
    assert [r["rc"] for r in ranks] == [0, 0], ranks
    assert "successfully loaded checkpoint" in ranks[0]["out"] and "WARNING: checkpoint" not in ranks[0]["out"]
    assert not any(r["err"].strip() for r in ranks), ranks


def test_checkpoint_without_manifest_loads_with_one_warning(tmp_path, saved):
    root = _copy(saved, tmp_path / "ckpt")
    (root / "iter_0000008" / MANIFEST).unlink()
    ranks = main_in_ranks(ARGV + ["--load", str(root)])
    assert [r["rc"] for r in ranks] == [0, 0], ranks
    warnings = [ln for r in ranks for ln in r["out"].splitlines() if MANIFEST in ln]
    assert warnings == [f"WARNING: checkpoint {root / 'iter_0000008'} has no {MANIFEST} (saved before megatron-zb "
                        f"wrote manifests, or by Megatron-LM's own loop): its files are loaded unverified"], warnings
    assert "successfully loaded checkpoint" in ranks[0]["out"]


# ---------------------------------------------------------------------------- the save directory
def _validate(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """``main`` as global rank 0 of 2 with ``argv``: validation's exit status and stderr (no process group)."""
    import torch.distributed as dist

    from megatron_zb.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    rc = main(argv)
    assert not dist.is_initialized()
    return rc, capsys.readouterr().err


def test_save_at_a_file_is_refused_before_any_process_group(tmp_path, monkeypatch, capsys):
    file = tmp_path / "not_a_dir"
    file.write_text("x")
    for save, says in ((file, f"--save: {file} is a file, not a directory"),
                       (file / "ckpt", f"--save: {file / 'ckpt'} cannot be created: {file} is a file")):
        rc, err = _validate(ARGV + ["--save", str(save)], monkeypatch, capsys)
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("usage")]
        assert rc == 2 and len(lines) == 1 and says in lines[0], err


def test_save_in_a_read_only_directory_is_refused(tmp_path, monkeypatch, capsys):
    """Not root: a 0o555 directory. Root (whom permission bits do not stop): a read-only tmpfs mount."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True)
        if done.returncode != 0:
            pytest.skip("running as root, whom a 0o555 directory does not stop, and a read-only tmpfs cannot be "
                        f"mounted here ({done.stderr.decode().strip()})")
    else:
        ro.chmod(0o555)
    try:
        rc, err = _validate(ARGV + ["--save", str(ro / "ckpt")], monkeypatch, capsys)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=False, capture_output=True)
        else:
            ro.chmod(0o755)
    assert rc == 2 and f"--save: the directory {ro} (to create {ro / 'ckpt'} in) is not writable" in err, err


# ---------------------------------------------------------------------------- a save that does not fit
@pytest.fixture
def small_fs(tmp_path) -> Path:
    """An empty mount point for a tmpfs the test sizes (root only); unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False, capture_output=True)


def _mount_tmpfs(mnt: Path, size: int) -> None:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or done.returncode}; needs root or "
                    f"CAP_SYS_ADMIN): the free-space check is not exercised on a real full file system")


def test_save_that_does_not_fit_stops_before_writing_and_resume_is_bitwise(tmp_path, saved, small_fs):
    """A tmpfs holding iteration 4's checkpoint with about half of it free: resuming at 4 and saving
    iteration 5 (``--exit-interval 5``) is refused in one line naming the bytes needed and free and
    the latest intact checkpoint (4); nothing is written; resuming from it is bit for bit."""
    full, ckpt = saved
    used = sum(p.stat().st_size for p in (ckpt / "iter_0000004").rglob("*") if p.is_file())
    _mount_tmpfs(small_fs, (used + used // 2 + 65536 + 4095) // 4096 * 4096)
    shutil.copytree(ckpt / "iter_0000004", small_fs / "iter_0000004")
    (small_fs / TRACKER).write_text("4")
    before = sorted(str(p) for p in small_fs.rglob("*"))
    line = _one_error_line(main_in_ranks(ARGV + ["--load", str(small_fs), "--save", str(small_fs), "--exit-interval", "5"]))
    assert f"cannot save checkpoint {small_fs / 'iter_0000005'}: it needs about " in line, line
    assert "bytes free" in line and "nothing was written" in line, line
    assert f"the latest intact checkpoint is iteration 4 ({small_fs / 'iter_0000004'}), which --load {small_fs} " \
           f"resumes" in line, line
    assert sorted(str(p) for p in small_fs.rglob("*")) == before and (small_fs / TRACKER).read_text() == "4"
    resumed = in_process(tmp_path, "resumed", 2, ARGV + ["--load", str(small_fs)])
    assert sorted(losses(resumed)) == list(range(5, 9))
    assert_curve(losses(resumed), losses(full), what="resumed after a refused save", exact=True)


def test_save_failing_mid_write_is_one_line_and_keeps_the_tracker(tmp_path, saved):
    """A writer's OSError (rank 1's shard path is a directory): one line naming the rank, the error and
    the latest intact checkpoint; the tracker still names 8."""
    root = _copy(saved, tmp_path / "ckpt")
    (root / "iter_0000005" / "__1_0.distcp").mkdir(parents=True)
    line = _one_error_line(main_in_ranks(ARGV + ["--load", str(root), "--ckpt-step", "4", "--save", str(root),
                                         "--exit-interval", "5"]))
    # megatron-core 0.16 passes the OSError's text on; 0.19 only its class (filesystem_async.py: "An error is
    # caught while starting worker {i}, error: {e}" with the exception of the worker's result)
    said = (f"[Errno 21] Is a directory: '{root / 'iter_0000005' / '__1_0.distcp'}'" if release() == "0.16"
            else "An error is caught while starting worker 0, error: <class 'IsADirectoryError'>")
    assert f"cannot save checkpoint {root / 'iter_0000005'}: rank 1: RuntimeError: Worker failure: {said}" in line, line
    assert f"the tracker is not advanced: the latest intact checkpoint is iteration 8 ({root / 'iter_0000008'})" \
           in line, line
    assert (root / TRACKER).read_text().strip() == "8" and not (root / "iter_0000005" / MANIFEST).exists()


def test_a_write_of_rank_0_alone_failing_ends_the_run_at_once_naming_it(tmp_path, saved):
    """``metadata.json``, which megatron-core's save has rank 0 alone write after every rank's shards (then a
    barrier), is a directory. Under torchrun: rank 0 prints one line naming itself, the error and the latest
    intact checkpoint and exits 1 without a collective; the launcher ends rank 1, which waits in the save's
    barrier -- the run ends in seconds, not after ``--distributed-timeout-minutes`` (a collective agreement
    there deadlocked: rank 0 in it, rank 1 in the save's barrier). The tracker still names 8."""
    root = _copy(saved, tmp_path / "ckpt")
    (root / "iter_0000005" / "metadata.json").mkdir(parents=True)
    argv = ARGV + ["--load", str(root), "--ckpt-step", "4", "--save", str(root), "--exit-interval", "5",
                   "--distributed-timeout-minutes", "5"]
    rc, log = torchrun_exit(2, argv, cwd=tmp_path, timeout=150)  # a deadlock would wait 5 minutes
    assert rc != 0, log[-3000:]
    said = [ln for ln in log.splitlines() if "pretrain_gpt_zb.py: error: " in ln]
    assert len(said) == 1, log[-4000:]
    assert f"rank 0: cannot save checkpoint {root / 'iter_0000005'}: " in said[0], said[0]
    assert "Is a directory" in said[0] and "metadata.json" in said[0], said[0]
    assert f"the latest intact checkpoint is iteration 8 ({root / 'iter_0000008'})" in said[0], said[0]
    assert (root / TRACKER).read_text().strip() == "8"
