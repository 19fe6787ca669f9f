#!/usr/bin/env bash
# Set-up and the main job: bash scripts/benchmark.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/sine_sgn_vs_sgd.py "$@"
