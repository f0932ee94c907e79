#!/usr/bin/env bash
# One call on the GPU machine (torch/triton preinstalled, no nox): the engine TTFT benchmark, the
# GPU accuracy report and the whole test suite, each under a time cap, results packed into one file.
# Usage: bash reports/gpu_check.sh OUT_DIR   (writes OUT_DIR/gpu.tgz and OUT_DIR/summary.txt)
set -u
out=${1:?usage: gpu_check.sh OUT_DIR}
work=$(mktemp -d)/gpu
mkdir -p "$work"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$work/device.txt"

timeout 230 python3 -m reports.bench --only engine --out "$work" > "$work/bench-engine.log" 2>&1
echo "engine bench exit $?" | tee -a "$work/summary.txt"
timeout 200 python3 -m reports.accuracy --device cuda --out "$work" > "$work/accuracy.log" 2>&1
echo "accuracy report exit $?" | tee -a "$work/summary.txt"
timeout 200 python3 -m pytest tests -q -p no:cacheprovider -n 8 > "$work/tests.log" 2>&1
echo "pytest exit $?" | tee -a "$work/summary.txt"
tail -n 15 "$work/tests.log" >> "$work/summary.txt"

tar czf "$out/gpu.tgz" -C "$(dirname "$work")" gpu
cp "$work/summary.txt" "$out/summary.txt"
cat "$work/summary.txt"
