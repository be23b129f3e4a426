#!/usr/bin/env bash
# Create the project venv (`make install`, and so `make demo` and `make test`): fp4forge editable
# with its test extra, at the versions of constraints.txt (torch 2.13.0+cpu: the CPU build).
#
#   scripts/setup-venv.sh [VENV]        (default: <repo>/.venv)
#
# Indexes (scripts/pip-index.sh): PyPI, or the mirror PIP_INDEX_URL names, plus PyTorch's CPU
# wheel index (PYTORCH_CPU_INDEX). The stamp $VENV/bin/.fp4forge-ready is written last.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo_root/.venv}"
python_bin="${PYTHON:-python3}"
# shellcheck source=pip-index.sh
source "$repo_root/scripts/pip-index.sh"

requirements=(-e "$repo_root[test]" -c "$repo_root/constraints.txt")
if [[ -n "${FP4FORGE_PIP_PLAN:-}" ]]; then
    # resolve with the caller's Python; its setuptools builds the project's metadata
    pip_install "$python_bin" --no-build-isolation "${requirements[@]}"
    exit 0
fi

start=$(date +%s)
ensure_venv "$venv" "$python_bin"
echo "setup-venv: installing fp4forge and its test dependencies into $venv (the first time a few minutes)"
pip_install "$venv/bin/python" "${requirements[@]}"
touch "$venv/bin/.fp4forge-ready"
echo "setup-venv: $venv ready in $(( $(date +%s) - start )) s"
