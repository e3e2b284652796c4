"""The Megatron-LM CPU harness itself (tests/harness/megatron_lm*.py), without running Megatron-LM:
finding the folder, parsing its log lines, comparing runs bit for bit, the entry script's top level,
and that every Megatron-LM / megatron-core line a workaround answers still says what it did."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_zb.megatron_compat import megatron_lm_tag
from harness import megatron_lm as mlm
from harness.megatron_lm import (IterationLog, MegatronLMRun, bitwise_differences, find_megatron_lm,
                                             parse_iteration_lines, run_megatron_lm)
from harness.megatron_lm_workarounds import RELEASES, check_sites
from harness.megatron_lm_zygote import MAIN_SCRIPT

ROOT = Path(__file__).resolve().parents[2]
LOG = """\
 [2026-11-25 13:27:33.481207] iteration        1/       4 | consumed samples:            8 | elapsed time per \
iteration (ms): 382.4 | learning rate: 7.750000E-04 | global batch size:     8 | lm loss: 4.846199E+00 | loss \
scale: 1.0 | grad norm: 1.507 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 0.00
 [2026-11-25 13:27:33.652230] iteration        2/       4 | consumed samples:           16 | learning rate: \
5.500000E-04 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""


def test_parse_iteration_lines_reads_loss_and_grad_norm() -> None:
    rows = parse_iteration_lines(LOG)
    assert [(n, loss, norm) for n, loss, norm, _ in rows] == [(1, 4.846199, 1.507), (2, None, None)]
    assert rows[0][3].startswith("[2026-11-25 13:27:33.481207] iteration        1/")


def test_find_megatron_lm_prefers_the_env_var_then_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project, mine = tmp_path / "project", tmp_path / "mine"
    shared = tmp_path / "shared" / f"megatron-lm-{megatron_lm_tag()}"  # the release going with megatron-core
    for folder in (project, mine, shared):
        folder.mkdir(parents=True)
    monkeypatch.delenv(mlm.MEGATRON_LM_ENV, raising=False)
    assert find_megatron_lm(project) is None
    (shared / "pretrain_gpt.py").write_text("")
    assert find_megatron_lm(project) == shared.resolve()
    monkeypatch.setenv(mlm.MEGATRON_LM_ENV, str(mine))  # no pretrain_gpt.py there: the shared folder
    assert find_megatron_lm(project) == shared.resolve()
    (mine / "pretrain_gpt.py").write_text("")
    assert find_megatron_lm(project) == mine.resolve()


def test_run_without_megatron_lm_names_the_skip_reason(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="MEGATRON_LM_DIR"):
        run_megatron_lm([], world_size=1, timeout=1, megatron_lm_dir=tmp_path)


def _module_level_plugin() -> None:
    """A plugin step given as a function."""


def test_plugin_steps_are_code_or_importable_functions() -> None:
    assert mlm.plugin_spec(None) == ""
    assert mlm.plugin_spec("import megatron_zb") == "import megatron_zb"
    assert mlm.plugin_spec(_module_level_plugin) == f"{__name__}:_module_level_plugin"
    with pytest.raises(ValueError, match="importable"):
        mlm.plugin_spec(lambda: None)


def test_a_failing_rank_is_reported_by_its_exception_line() -> None:
    log = "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n" \
          "[rank0]: AssertionError: output should be pseudo-'freed' in schedule, to optimize memory\nbye\n"
    assert mlm.exception_line(log) == "AssertionError: output should be pseudo-'freed' in schedule, to optimize memory"
    assert mlm.exception_line("all good\n") == "(no exception in its output)"


def _run(losses: list[float], norms: list[float], weight: torch.Tensor) -> MegatronLMRun:
    its = [IterationLog(i + 1, float(f"{x:.6E}"), round(g, 3), "", {"lm loss": x, "grad norm": g})
           for i, (x, g) in enumerate(zip(losses, norms))]
    return MegatronLMRun(its, [list(norms), list(norms)], [{"chunk0.w": weight}, {"chunk0.w": weight + 1}], ["", ""],
                         1.0)


def test_bitwise_differences_sees_one_ulp_and_signed_zero() -> None:
    w = torch.tensor([0.0, 1.5, -2.0])
    ref = _run([4.5, 4.25], [1.0, 0.5], w)
    assert bitwise_differences(_run([4.5, 4.25], [1.0, 0.5], w.clone()), ref) == []
    ulp = math.nextafter(4.25, 5.0)
    assert bitwise_differences(_run([4.5, ulp], [1.0, 0.5], w), ref) == [
        f"iteration 2: lm loss {ulp!r} != 4.25"]
    signed = torch.tensor([-0.0, 1.5, -2.0])
    assert bitwise_differences(_run([4.5, 4.25], [1.0, 0.5], signed), ref) == ["rank 0: chunk0.w differs"]
    assert "iterations [1] != [1, 2]" in bitwise_differences(_run([4.5], [1.0], w), ref)[0]


def test_entry_script_top_level_is_light() -> None:
    """dist-checkpointing's spawned results process re-imports the rank's __main__ (this script) as
    __mp_main__: it must not import torch or start anything there."""
    code = ("import runpy, sys\n"
            f"runpy.run_path({str(MAIN_SCRIPT)!r}, run_name='__mp_main__')\n"
            "heavy = [m for m in ('torch', 'megatron', 'megatron_zb') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


@pytest.mark.skipif(find_megatron_lm() is None, reason=mlm.SKIP_REASON)
def test_every_answered_line_still_says_what_the_workaround_expects() -> None:
    assert check_sites(find_megatron_lm()) == []


def test_the_other_releases_training_files_do_not_pass_the_site_check() -> None:
    """A rank refuses Megatron-LM files of another release than the one going with the installed
    megatron-core (``apply_workarounds`` runs :func:`check_sites` first): the other supported
    release's files, where present beside the project, differ at some site."""
    others = [ROOT.parent / "shared" / f"megatron-lm-{tag}" for tag in RELEASES if tag != megatron_lm_tag()]
    present = [folder for folder in others if (folder / "pretrain_gpt.py").is_file()]
    if not present:
        pytest.skip(f"no other release's training files beside the project ({[str(f) for f in others]})")
    for folder in present:
        assert check_sites(folder), folder


def test_the_rendezvous_port_is_held_before_any_rank_starts() -> None:
    """The ranks' MASTER_PORT is bound by the harness's own store before they start (a port found free
    and released for rank 0 to bind later was taken in between once in CI: EADDRINUSE); a rank connects
    as a client, as under torchrun's agent store."""
    import socket

    import torch.distributed as dist

    store = mlm._rendezvous_store()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("rank0", "up")
    assert store.get("rank0") == b"up"
