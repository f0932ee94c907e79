#!/usr/bin/env bash
# Writes the kernels of a commit as the package `kernels_prev` under DIR, so that the benchmark can
# time them against the working tree's kernels in one process (an A/B). DIR travels to the GPU
# machine through the device tool's `carry` (it is git-ignored).
# Usage: bash reports/previous_kernels.sh [COMMIT] [DIR]   (defaults: 19c0473, the kernels before the
# tile lists of issue 16, and .ab)
set -eu
commit=${1:-19c0473}
dir=${2:-.ab}
rm -rf "$dir/kernels_prev"
mkdir -p "$dir"
git archive "$commit" kernels | tar -x -C "$dir"
mv "$dir/kernels" "$dir/kernels_prev"
sed -i -E 's/\bfrom kernels([. ])/from kernels_prev\1/; s/^import kernels$/import kernels_prev/' "$dir"/kernels_prev/*.py
echo "$commit" > "$dir/kernels_prev/COMMIT"
