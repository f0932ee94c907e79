#!/usr/bin/env bash
# One device call: kernel smoke tests (bf16 and the 8k Phi-3 cases included) and the probe (A/B with
# the previous commit's kernels in .ab/, register caps, host-path profile).
# Usage: bash reports/gpu_probe.sh OUT_DIR   (run reports/previous_kernels.sh first; carry .ab)
set -u
out=${1:?usage: gpu_probe.sh OUT_DIR}
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-smoke}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 -m pytest tests/kernels -q -p no:cacheprovider -n 8 2>&1 | tail -25 > "$out/tests.txt"
tail -4 "$out/tests.txt"
timeout 300 python3 -m reports.kernel_probe --out "$out" --previous .ab > "$out/probe.log" 2>&1; echo "probe exit $?"
tail -3 "$out/probe.log"
