"""What ``scripts/gpu_bundle.sh`` checks: the bundle's wheels' requirements and the size carried to the GPU.

``python -m megatron_zb.testing.gpu_bundle requires WHEEL...`` prints each wheel's unconditional
requirements (``Requires-Dist`` lines without an ``extra ==`` marker): what the GPU machine must
already have, since the bundle installs with ``--no-deps``.

``python -m megatron_zb.testing.gpu_bundle size [--carry PATH]... [--limit-mib 64]`` measures what
travels to the GPU machine: the repository's tracked files and its untracked files that git does not
ignore (``git ls-files -co --exclude-standard``), plus every file under each ``--carry`` path (the
git-ignored bundle); prints the total in MiB and exits 1 above the limit. No torch here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Sequence

__all__ = ["LIMIT_MIB", "carried_bytes", "main", "requirements"]

LIMIT_MIB = 64.0
"""The device tool's limit on the working tree plus carried paths, MiB."""
MIB = 2**20


def requirements(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` entries that hold without any extra."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            out.append(line.split(":", 1)[1].strip())
    return out


def carried_bytes(root: Path, carry: Sequence[Path] = ()) -> tuple[int, int]:
    """(bytes, files) of ``root``'s tracked and untracked-not-ignored files plus every file under ``carry``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                            capture_output=True).stdout.decode().split("\0")
    paths = {root / p for p in listed if p}
    for c in carry:
        c = c if c.is_absolute() else root / c
        paths |= {p for p in c.rglob("*")} if c.is_dir() else {c}
    files = [p for p in paths if p.is_file() and not p.is_symlink()]
    return sum(p.stat().st_size for p in files), len(files)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m megatron_zb.testing.gpu_bundle", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    req = sub.add_parser("requires", help="unconditional requirements of wheels")
    req.add_argument("wheels", nargs="+", type=Path)
    size = sub.add_parser("size", help="bytes carried to the GPU machine")
    size.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    size.add_argument("--carry", type=Path, action="append", default=[], help="a git-ignored path that travels too")
    size.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    args = ap.parse_args(argv)
    if args.what == "requires":
        for wheel in args.wheels:
            print(f"{wheel.name}: requires {', '.join(requirements(wheel)) or 'nothing'}")
        return 0
    total, files = carried_bytes(args.root, args.carry)
    within = total <= args.limit_mib * MIB
    print(f"carried to the GPU machine: {total / MIB:.2f} MiB in {files} files (repository + "
          f"{', '.join(map(str, args.carry)) or 'nothing else'}); limit {args.limit_mib:g} MiB: "
          f"{'fits' if within else 'TOO LARGE'}")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
