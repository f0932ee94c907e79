#!/usr/bin/env bash
# The named kernel cases under compute-sanitizer (GPU machine; no nox there): memcheck on the vLLM
# regressions, the page/block pairs, empty rows, the named decode and prefill cases and the edge-case
# table (every case's block-table padding holds out-of-range page ids and its unused pages and slots
# hold NaN: harness/cases.py), then racecheck on a few. Writes OUT_DIR/sanitizer.md and the logs.
# Usage: bash reports/gpu_sanitizer.sh OUT_DIR
set -u
out=${1:?usage: gpu_sanitizer.sh OUT_DIR}
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=smoke
memcheck_k="vllm or page_block or empty or named or non_finite or non_contiguous or residues"
racecheck_k="(vllm-ctx16 and float16) or (P5-S64 and local_strided) or empty-splits"
tools=${SANITIZER_TOOLS:-memcheck racecheck}
cap=${SANITIZER_CAP:-240}
run() {  # tool, -k expression, log name
  timeout "$cap" compute-sanitizer --tool "$1" --error-exitcode 1 --print-limit 20 \
    python3 -m pytest tests/kernels -q -p no:cacheprovider -k "$2" > "$out/$3.log" 2>&1
  echo $?
}
mem=-; race=-
[[ $tools == *memcheck* ]] && mem=$(run memcheck "$memcheck_k" sanitizer-memcheck)
[[ $tools == *racecheck* ]] && race=$(run racecheck "$racecheck_k" sanitizer-racecheck)
{
  echo "# compute-sanitizer on the kernel tests"
  echo
  echo "Device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); $(compute-sanitizer --version | tail -1)."
  echo "Command: \`bash reports/gpu_sanitizer.sh OUT_DIR\` (HYPOTHESIS_PROFILE=smoke). Every case's block-table padding"
  echo "holds out-of-range page ids (-1, 2^31-1) and its unused pages and slots hold NaN (harness/cases.py)."
  echo
  echo "| tool | tests (-k) | pytest | sanitizer summary | exit |"
  echo "| --- | --- | --- | --- | --- |"
  for tool in $tools; do
    log="$out/sanitizer-$tool.log"
    k=$([ $tool = memcheck ] && echo "$memcheck_k" || echo "$racecheck_k")
    code=$([ $tool = memcheck ] && echo "$mem" || echo "$race")
    echo "| $tool | \`$k\` | $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1) | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sort | uniq -c | tr '\n' ';') | $code |"
  done
} > "$out/sanitizer.md"
cat "$out/sanitizer.md"
