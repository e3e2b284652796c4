#!/usr/bin/env python
"""Read Transformer Engine's released source against what megatron-zb's TE route relies on.

For each release in ``megatron_zb.testing.te_source.TE_SOURCE_VERSIONS`` (or those given), the
``transformer-engine`` wheel -- pure Python, parsed, never imported -- from the cache directory
(``$MEGATRON_ZB_TE_WHEELS``, default ``~/.cache/megatron-zb/te-wheels``; downloaded there with
``pip download --no-deps`` when missing) is checked fact by fact; prints one line per fact and
a summary. Exit status 0: every fact holds; 1: one does not; 2: a wheel could not be had.

    python scripts/check_te_source.py [VERSION ...] [--no-download]
"""

from __future__ import annotations

import argparse
import sys

from megatron_zb.testing.te_source import TE_SOURCE_VERSIONS, WheelUnavailable, check_release, wheel_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=list(TE_SOURCE_VERSIONS), help="TE releases (default: all)")
    parser.add_argument("--no-download", action="store_true", help="use the cache directory only")
    args = parser.parse_args(argv)
    status = 0
    for version in args.versions:
        try:
            wheel = wheel_path(version, download=not args.no_download)
        except WheelUnavailable as err:
            print(f"transformer-engine {version}: UNAVAILABLE: {err}")
            status = max(status, 2)
            continue
        facts = check_release(version, wheel)
        failed = [f for f in facts if not f.holds]
        for f in facts:
            detail = f" ({f.detail})" if f.detail else ""
            print(f"transformer-engine {version}: {'ok  ' if f.holds else 'FAIL'} {f.where}: {f.name}{detail}")
        print(f"transformer-engine {version}: {len(facts) - len(failed)}/{len(facts)} facts hold")
        if failed:
            status = max(status, 1) if status != 2 else 2
    return status


if __name__ == "__main__":
    sys.exit(main())
