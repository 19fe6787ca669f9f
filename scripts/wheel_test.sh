#!/usr/bin/env bash
# The package as a user installs it: `python -m build` makes the sdist and, from it, the wheel;
# `twine check --strict` passes on both; the wheel installs into a fresh virtual environment
# beside the pinned torch (no -e, no test tools), and an example runs there from a folder
# outside the repository, importing torch_sgn from that environment alone.
#   bash scripts/wheel_test.sh        # after scripts/setup.sh (it uses .venv's build and twine)
# TORCH_VERSION and TORCH_INDEX_URL as in scripts/setup.sh. CI runs it after the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
. .venv/bin/activate
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || {
    cat "$work/build.log"
    exit 1
}
python -m twine check --strict "$work"/dist/*
wheel=("$work"/dist/torch_sgn-*.whl)
[ -f "${wheel[0]}" ] || { echo "no wheel built" >&2; exit 1; }

# A fresh environment (not the project's .venv): torch first, then the wheel (its only
# requirement, torch, is then met and not fetched again).
python -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile)
"${pip[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
"${pip[@]}" "${wheel[0]}"

mkdir "$work/user"
cp examples/pinn_poisson.py "$work/user/"
cd "$work/user"
py="$work/venv/bin/python"
# torch_sgn comes from the fresh environment, with its marker file, and the version the
# changelog's newest entry names.
"$py" - "$root" <<'EOF'
import re
import sys
from pathlib import Path

import torch_sgn

root = Path(sys.argv[1])
where = Path(torch_sgn.__file__).resolve()
assert root not in where.parents, f"torch_sgn imported from the repository: {where}"
assert (where.parent / "py.typed").is_file(), "py.typed is not installed"
newest = re.search(r"^## (\d+\.\d+\.\d+)", (root / "CHANGELOG.md").read_text(), re.M)
assert newest and newest.group(1) == torch_sgn.__version__, (newest, torch_sgn.__version__)
print(f"torch_sgn {torch_sgn.__version__} from {where.parent}")
EOF
# The experiment tooling is in the wheel, its dependencies an extra: without them its command
# says what to install.
if out="$("$work/venv/bin/torch-sgn" --help 2>&1)"; then
    echo "torch-sgn ran without the experiments extra: $out" >&2
    exit 1
fi
grep -q 'torch-sgn\[experiments\]' <<<"$out" || { echo "$out" >&2; exit 1; }
"$py" pinn_poisson.py --quick
echo "wheel test: passed"
