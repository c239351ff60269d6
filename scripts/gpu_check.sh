#!/usr/bin/env bash
# Every notebook once on a GPU with a short, gpu-sized run (< 8 minutes in all on one H100/H200).
# Uses each notebook's `gpu` profile (hub models: the machine must reach the hub, or set MODEL to a local
# directory or to the embedded "smollm2-135m") with grids cut down by -p overrides.
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

run quickstart -p max_new_tokens=64 -p "batch_sizes=[1,16,128]"
run speculation -p "batch_sizes=[1,16,128]" -p "ks=[2,4]" -p max_new_tokens=64 -p calibration_repeats=2
run sampling -p n_problems=32 -p "temperatures=[0.7,1.5]" -p n_writing_prompts=8 -p writing_samples=4 -p confidence_steps=512 -p n_boot=200
run mtp -p "n_heads=[1,4]" -p "mtp_style=[gloeckle]" -p train_tokens=1048576 -p "seeds=[0]" -p retrofit_tokens=131072 -p retrofit_steps=50 -p "spec_batch_sizes=[1,8]"
run masking -p n_samples=8 -p max_new_tokens=64
run consistency -p n_problems=16 -p "n_values=[1,4,16]" -p "prompt_lengths=[512,2048]" -p "cost_n_values=[1,16]"
echo "gpu_check: all notebooks ran; results under results/<notebook>/"
