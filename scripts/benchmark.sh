#!/usr/bin/env bash
# megatron-zb benchmarks on this machine (CPU, gloo, real processes): the default full run.
#
#   bash scripts/benchmark.sh                 # full run, about 5-6 min on 2 cores, results in out/bench/
#   bash scripts/benchmark.sh --quick         # 1-2 min smoke run
#   bash scripts/benchmark.sh --wait-quiet 40 # first wait up to 40 min for load average < 2.5
#   bash scripts/benchmark.sh --out DIR ...   # any option of scripts/benchmark.py (see --help)
#
# Sections: real tiny-GPT PP=2 timings against megatron-core's own 1F1B (m = 4, 8, 16), activation
# memory at PP=2 and PP=4, an emulated 4- and 8-rank cluster (sleep-for-compute, real runtime and
# p2p) against the simulator, optimizer post-validation on/off. Writes results.md, results.csv and
# PNG plots to the output directory; progress on stderr. Run it on a quiet machine: the results
# record the load average, and other processes on the cores distort every timing.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "load average before the run: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
exec python scripts/benchmark.py "$@"
