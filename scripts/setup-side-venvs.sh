#!/usr/bin/env bash
# Build the vLLM CPU venv and the llm-compressor venv side by side (`make test`), each logging to
# .venv-<name>-setup.log; while they run, a line every PROGRESS_EVERY seconds (default 30) says
# what each is doing, so that a CI log or a `| tee` never sits silent for minutes.
#
#   scripts/setup-side-venvs.sh VLLM_VENV LC_VENV
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
every="${PROGRESS_EVERY:-30}"
names=(vllm lc)
venvs=("$1" "$2")
pids=()
for i in 0 1; do
    bash "$repo_root/scripts/setup-${names[i]}-venv.sh" "${venvs[i]}" >".venv-${names[i]}-setup.log" 2>&1 &
    pids+=($!)
done

start=$(date +%s)
running() { local pid; for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }
while running; do
    for _ in $(seq "$every"); do running && sleep 1; done
    running || break
    for i in 0 1; do
        if kill -0 "${pids[i]}" 2>/dev/null; then
            last="$(tail -n 1 ".venv-${names[i]}-setup.log" 2>/dev/null | tr -d '\r' | cut -c1-100)"
            echo "[$(( $(date +%s) - start )) s] ${venvs[i]}: ${last:-starting}"
        fi
    done
done

status=0
for i in 0 1; do
    if wait "${pids[i]}"; then
        echo "${venvs[i]}: $(tail -n 1 ".venv-${names[i]}-setup.log")"
    else
        echo "${venvs[i]} set-up failed (.venv-${names[i]}-setup.log):"
        tail -n 30 ".venv-${names[i]}-setup.log"
        status=1
    fi
done
exit "$status"
