# Sourced by the scripts/setup-*.sh scripts: the one place that says where pip looks for packages.
#
# PyTorch publishes its CPU-only builds (torch 2.13.0+cpu, no nvidia-* libraries) on its own wheel
# index; PyPI's torch of the same version is the CUDA build with about twenty nvidia-* packages
# (several GB). As PyTorch's install selector says for "CPU" and vLLM's CPU install guide says for
# vLLM, the CPU index is added as an *extra* index next to PyPI (or the PIP_INDEX_URL mirror).
#
#   PYTORCH_CPU_INDEX      the CPU wheel index (default https://download.pytorch.org/whl/cpu);
#                          a mirror's URL, or empty to add none (a pip configuration or mirror
#                          that already offers torch+cpu)
#   PYTORCH_INDEX_TIMEOUT  seconds to wait for it before going on without it (default 5)
#   FP4FORGE_PIP_PLAN      a path: resolve only (pip install --dry-run --report PATH), install
#                          nothing; tests/test_install_plan.py runs the scripts this way
PYTORCH_CPU_INDEX="${PYTORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"
PYTORCH_INDEX_TIMEOUT="${PYTORCH_INDEX_TIMEOUT:-5}"

# Prints "--extra-index-url URL" when the CPU index answers, else nothing and a note on stderr:
# pip would otherwise ask the unreachable index for every package, retrying each time.
torch_index_options() {
    local python="$1"
    [[ -n "$PYTORCH_CPU_INDEX" ]] || return 0
    if "$python" - "$PYTORCH_CPU_INDEX" "$PYTORCH_INDEX_TIMEOUT" >&2 <<'PY'
import os, sys, urllib.parse, urllib.request
index, timeout = sys.argv[1].rstrip("/"), float(sys.argv[2])
parts = urllib.parse.urlsplit(index)
try:
    if parts.scheme == "file":
        if not os.path.isdir(urllib.request.url2pathname(parts.path)):
            raise OSError("no such directory")
    else:
        urllib.request.urlopen(f"{index}/torch/", timeout=timeout).close()
except Exception as exc:
    print(f"note: PyTorch's CPU wheel index {index} did not answer within {timeout:g} s ({exc}).\n"
          "      Going on without it: the indexes of your pip configuration must then offer the CPU\n"
          "      build of torch, or pip fails to resolve it (torch==2.13.0+cpu is not on PyPI).\n"
          "      Set PYTORCH_CPU_INDEX to a mirror of it, or to nothing to silence this note.")
    sys.exit(1)
PY
    then
        printf -- '--extra-index-url %s\n' "$PYTORCH_CPU_INDEX"
    fi
}

# pip install "$@" with "$1"'s pip, the CPU index added; pip's own progress is shown (the large
# wheels take minutes). With FP4FORGE_PIP_PLAN set it resolves only and writes pip's report there.
pip_install() {
    local python="$1"
    shift
    local -a index_options
    read -r -a index_options <<<"$(torch_index_options "$python")"
    if [[ -n "${FP4FORGE_PIP_PLAN:-}" ]]; then
        "$python" -m pip install --dry-run --ignore-installed --quiet --report "$FP4FORGE_PIP_PLAN" \
            "${index_options[@]}" "$@"
    else
        "$python" -m pip install "${index_options[@]}" "$@"
    fi
}

# The venv at $1 (made with the Python $2 when it does not exist yet), its pip brought up to date.
ensure_venv() {
    [[ -x "$1/bin/python" ]] || "$2" -m venv "$1"
    "$1/bin/python" -m pip install --quiet --upgrade pip
}
