# fp4forge: the two set-up commands are `make demo` (main job on the built-in testbed) and
# `make test` (installs everything the tests need, then runs them). Both work on a fresh machine
# that reaches PyPI and PyTorch's CPU wheel index (README.md#set-up-two-commands):
#   make test PIP_INDEX_URL=https://mirror/simple PYTORCH_CPU_INDEX=https://mirror/whl/cpu
# points them at mirrors (scripts/pip-index.sh says how each index is used).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
LC_VENV ?= .venv-lc
DEMO ?= demo
PYTEST_ARGS ?=
PYTORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
export PYTHON PYTORCH_CPU_INDEX

.PHONY: install demo vllm test test-fast clean

# pyproject.toml states version ranges; constraints.txt pins the versions the tests run on.
$(BIN)/.fp4forge-ready: pyproject.toml constraints.txt
	bash scripts/setup-venv.sh $(VENV)

install: $(BIN)/.fp4forge-ready

# The main job on the trained tiny Laguna testbed fp4forge ships (`fp4forge testbed shipped`: the
# same bytes on every machine, verified by sha256; no training), as one resumable `fp4forge pipeline`: calibrate
# it layer by layer, export NVFP4 W4A4 experts + FP8 attention/shared expert + calibrated FP8 KV
# scales, check the KV scales, audit, byte table, fidelity against the BF16 teacher (calibration and
# fidelity on the text the testbed ships: its own training and held-out documents; fidelity on about
# 32k held-out tokens, 40 documents, so its bootstrap intervals rest on more than a handful), the serve line,
# and (when the vLLM venv exists: `make vllm`, or after `make test`) serve it with vLLM CPU + the
# fp4forge-vllm plugin, bench perf and quality; then write the model card
# $(DEMO)/trained-laguna-nvfp4/README.md. Re-running skips every step whose inputs did not change.
COMMA := ,
DEMO_SERVE := $(if $(wildcard $(VLLM_VENV)/bin/vllm),--serve --vllm-venv $(VLLM_VENV) --bench perf$(COMMA)quality --quality-teacher,)
# BASE_MODEL=NAME/trained-laguna: a Hub repository the testbed was published to, for the card's
# base_model (README.md); without it the card states the shipped testbed's name, version and sha256.
BASE_MODEL ?=
DEMO_BASE := $(if $(BASE_MODEL),--base-model $(BASE_MODEL),)
demo: install
	@if [ ! -d $(DEMO)/trained-laguna ]; then $(BIN)/fp4forge testbed shipped $(DEMO)/trained-laguna; fi
	$(BIN)/fp4forge pipeline $(DEMO)/trained-laguna $(DEMO)/trained-laguna-nvfp4 --recipe nvfp4-experts-fp8-attn \
	  --calib-samples 16 --calib-seq-len 256 --calib-portable --calib-text $(DEMO)/trained-laguna/fp4forge-calibration.jsonl --fidelity-text $(DEMO)/trained-laguna/fp4forge-heldout.jsonl --fidelity-samples 64 --fidelity-seq-len 512 $(DEMO_SERVE) $(DEMO_BASE)

# The vLLM CPU venv with the fp4forge-vllm plugin (about 3 min and 3.4 GB, once).
vllm:
	bash scripts/setup-vllm-venv.sh $(VLLM_VENV)

# The whole suite, integration tests included: the vLLM CPU and llm-compressor venvs are
# created side by side (each a few minutes, once) and the tests use them.
test: install
	bash scripts/setup-side-venvs.sh $(VLLM_VENV) $(LC_VENV)
	FP4FORGE_VLLM_VENV=$(abspath $(VLLM_VENV)) FP4FORGE_LC_VENV=$(abspath $(LC_VENV)) $(BIN)/python -m pytest $(PYTEST_ARGS)

# Unit tests only (no servers, no other venvs): seconds, for the edit-test loop.
test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(DEMO) .pytest_cache
