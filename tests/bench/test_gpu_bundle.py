"""``scripts/gpu_bundle.sh``'s checks (:mod:`megatron_zb.testing.gpu_bundle`) without network: a wheel's
unconditional requirements, and the bytes carried to the GPU machine (tracked + untracked-not-ignored
files + the git-ignored bundle) on a throw-away repository. The download itself is not tested here."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

from megatron_zb.testing import gpu_bundle

ROOT = Path(__file__).resolve().parents[2]


def test_bundle_script_parses_and_its_folder_is_ignored():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_bundle.sh")]).returncode == 0
    assert ".gpu-bundle/" in (ROOT / ".gitignore").read_text().splitlines()


def test_requirements_are_those_without_an_extra(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nRequires-Dist: torch>=2.6.0\nRequires-Dist: numpy\n"
                                                  "Requires-Dist: wandb; extra == \"training\"\n")
    assert gpu_bundle.requirements(wheel) == ["torch>=2.6.0", "numpy"]


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_carried_bytes_count_what_travels_and_the_limit_refuses(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text(".gpu-bundle/\nbuild/\n")   # 20 bytes, untracked, not ignored
    (repo / "tracked.py").write_bytes(b"x" * 1000)
    _git(repo, "add", "tracked.py")
    (repo / "new.py").write_bytes(b"y" * 500)                       # untracked, not ignored: travels
    (repo / "build").mkdir()
    (repo / "build" / "big.bin").write_bytes(b"z" * 10_000)         # ignored: stays
    (repo / ".gpu-bundle").mkdir()
    (repo / ".gpu-bundle" / "a.whl").write_bytes(b"w" * 3000)       # ignored, but carried
    assert gpu_bundle.carried_bytes(repo) == (1520, 3)
    assert gpu_bundle.carried_bytes(repo, [Path(".gpu-bundle")]) == (4520, 4)
    assert gpu_bundle.main(["size", "--root", str(repo), "--carry", ".gpu-bundle", "--limit-mib", "0.001"]) == 1
    assert "TOO LARGE" in capsys.readouterr().out
    assert gpu_bundle.main(["size", "--root", str(repo), "--carry", ".gpu-bundle"]) == 0
    assert "carried to the GPU machine: 0.00 MiB in 4 files" in capsys.readouterr().out
