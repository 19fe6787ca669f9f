#!/usr/bin/env bash
# Set-up and the whole test suite: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
