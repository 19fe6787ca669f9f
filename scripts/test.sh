#!/usr/bin/env bash
# Set-up, the linter and the whole test suite: bash scripts/test.sh [pytest options]
# (e.g. `bash scripts/test.sh -m "not slow"` skips the long tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests benchmarks examples
ruff format --check src tests benchmarks examples
python -m pytest -q "$@"
