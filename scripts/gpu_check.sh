#!/usr/bin/env bash
# Every notebook once on a GPU with a short, gpu-sized run (< 8 minutes in all on one H100/H200).
# Uses each notebook's `gpu` profile (hub models: the machine must reach the hub, or set MODEL to a local
# directory or to the embedded "smollm2-135m") with grids cut down by -p overrides: each notebook's
# `gpu_check` record in decodelab.suite.registry, listed by `decodelab list --gpu-check`.
#   scripts/gpu_check.sh                 # hub models from the gpu profiles
#   MODEL=smollm2-135m scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device; run 'make setup' on a machine with an NVIDIA GPU" >&2
  exit 1
fi
model_override=()
[ -n "${MODEL:-}" ] && model_override=(-p "model=${MODEL}")

run() {  # run NOTEBOOK [-p key=value ...]
  local nb=$1; shift
  echo "=== $nb"
  "$PY" -m decodelab run "$nb" --profile gpu "${model_override[@]}" "$@"
}

# One line per registered notebook: NAME -p key=value ... (its `gpu_check` record in decodelab.suite.registry).
lines=$("$PY" -m decodelab list --gpu-check)
while IFS= read -r line; do
  eval "args=($line)"  # the line is shell-quoted by `decodelab list --gpu-check` (shlex.join)
  run "${args[@]}"
done <<< "$lines"
echo "gpu_check: all notebooks ran; results under results/<notebook>/"
