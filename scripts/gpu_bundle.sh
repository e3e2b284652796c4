#!/usr/bin/env bash
# Build .gpu-bundle/ (git-ignored, next to the repository): what a GPU machine without network needs
# to run scripts/gpu_selftest.sh -- megatron-core as a wheel for CPython 3.12 x86_64 -- and check that
# the repository's files plus the bundle stay under the device tool's 64 MiB.
#
#   bash scripts/gpu_bundle.sh            # megatron-core 0.19.2 only (the 9-minute plan needs nothing else)
#   bash scripts/gpu_bundle.sh --full     # also hypothesis (+ attrs, sortedcontainers): --full's pytest jobs
#   bash scripts/gpu_bundle.sh --pytest   # also pytest (+ iniconfig, pluggy), for an image without it
#   MCORE_VERSION=0.19.1 bash scripts/gpu_bundle.sh
#
# megatron-core's own requirements without extras (torch, numpy, packaging) are printed: the GPU image
# has them (torch 2.11.0+cu130, Python 3.12.3), so the wheels install with --no-deps. Needs network
# (PyPI) here. Prints the measured size and the one command to run on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.gpu-bundle
MCORE_VERSION="${MCORE_VERSION:-0.19.2}"
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --full) EXTRA+=(hypothesis attrs sortedcontainers) ;;
    --pytest) EXTRA+=(pytest iniconfig pluggy) ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_bundle.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-python3}"
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
download() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$BUNDLE" "$@"
}
download "megatron-core==$MCORE_VERSION"
if [ "${#EXTRA[@]}" -gt 0 ]; then
  download "${EXTRA[@]}"
fi
ls -l "$BUNDLE"
PYTHONPATH="$PWD" "$PY" -m megatron_zb.testing.gpu_bundle requires "$BUNDLE"/*.whl
PYTHONPATH="$PWD" "$PY" -m megatron_zb.testing.gpu_bundle size --carry "$BUNDLE"
echo
echo "# on the GPU machine (carry $BUNDLE with the working tree), from the repository root:"
echo "python3 -m pip install -q --no-index --no-deps --target /tmp/site $BUNDLE/*.whl && export PYTHONPATH=/tmp/site:\$PWD && bash scripts/gpu_selftest.sh --out \"\$OUT\""
