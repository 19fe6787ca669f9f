#!/usr/bin/env bash
# Set-up, the linter and the test suite, the long tests (marked slow) left out, on pytest-xdist
# workers (one per core):
#   bash scripts/test.sh [pytest options]          # e.g. -k ggn, or -m slow: the slow ones alone
#   bash scripts/test.sh --all [pytest options]    # every test, the slow ones too
set -euo pipefail
cd "$(dirname "$0")/.."
select=(-m "not slow")
if [ "${1:-}" = "--all" ]; then
    select=()
    shift
fi
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests benchmarks examples
ruff format --check src tests benchmarks examples
# loadgroup keeps an xdist_group's tests on one worker where pytest-xdist can (not with pytest 9.2);
# the distributed tests' ranks are launched once per session whichever worker asks first.
python -m pytest -q -n auto --dist loadgroup ${select[@]+"${select[@]}"} "$@"
