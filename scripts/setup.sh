#!/usr/bin/env bash
# Creates .venv (once) with the pinned torch first, then torch-sgn with its experiment tooling
# (numpy, tqdm, matplotlib) and its test tools (pytest, ruff, scipy, lightning, DeepXDE, and the
# documentation site's MkDocs, mkdocstrings, build and twine: the `docs` extra).
# torch comes from pip's configured index (TORCH_INDEX_URL replaces it, for instance
# https://download.pytorch.org/whl/cpu for the CPU build; PyPI's Linux wheel is the CUDA build).
# A bare `torch` requirement in a fresh environment would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
# --no-compile: the modules a run imports are compiled then, not torch's thousands of files here
# (35 s of the set-up's 45 s for torch alone).
python -m pip install -q --disable-pip-version-check --no-compile \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
python -m pip install -q --disable-pip-version-check --no-compile -e ".[test,experiments]"
