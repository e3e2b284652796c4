#!/usr/bin/env bash
# The README's main job. Installs megatron-zb (CPU torch 2.13.0 first), then builds the greedy
# zero-bubble schedule for 4 pipeline ranks x 8 microbatches (unit costs, memory limit 2p*M_B),
# prints its predicted bubble rate, peak activation memory and timeline beside 1F1B's, and draws
# both to out/demo/*.png.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e .
mkdir -p out/demo
for s in 1f1b zb-h1 zb-2p; do
  megatron-zb schedule --schedule "$s" --pp 4 --microbatches 8 --plot "out/demo/$s.png"
done
