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
# --no-compile: pip's own byte-compiling is left out (35 s of the set-up's 45 s for torch alone);
# the environment is byte-compiled once below instead, in parallel.
python -m pip install -q --disable-pip-version-check --no-compile \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
python -m pip install -q --disable-pip-version-check --no-compile -e ".[test,experiments]"
# Byte-compile the environment once (a stamp file marks it done). Where PYTHONDONTWRITEBYTECODE
# is set, an import never writes its .pyc: every process (each test worker, each subprocess a
# test launches) would compile torch, DeepXDE and Lightning from source again (collecting the
# tests: 27 s, 11 s once compiled).
if [ ! -f .venv/.byte-compiled ]; then
    python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        > /dev/null || true
    touch .venv/.byte-compiled
fi
