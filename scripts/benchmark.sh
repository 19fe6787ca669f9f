#!/usr/bin/env bash
# Set-up and the main job: bash scripts/benchmark.sh [extra `torch-sgn grid` options]
# A quick grid on Boston housing (data ships with the package): SGN(2, 3, 5, 10), SGD(0.01, 0.1)
# and Adam(0.001), 3 seeds, 4 s of training each, 1 thread: 2-3 minutes on 2 CPU cores
# (3 min 10 s measured on a 2-core AMD EPYC shared with other jobs).
# Prints the table and writes plots to runs/boston/report/. Finished runs are skipped on rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
torch-sgn grid boston-quick --out runs --threads 1 "$@"
