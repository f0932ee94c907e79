#!/usr/bin/env bash
# The GPU machine's checks in two calls that fit the device tool's 10-minute limit (torch/triton are
# preinstalled there, no nox). Each step runs under a time cap and writes into OUT_DIR as it goes;
# OUT_DIR.tgz beside it holds the lot (on the device tool: OUT_DIR=$OUT/suite, say).
#   bash reports/gpu_check.sh OUT_DIR suite   the whole test suite (tabulated: kernels-tests.md;
#                                             SUITE_PATHS: a part of it, SUITE_CAP: its seconds),
#                                             compute-sanitizer memcheck on the named kernel cases
#   bash reports/gpu_check.sh OUT_DIR bench   the kernel benchmark (A/B against .ab/, made by
#                                             reports/previous_kernels.sh; carry .ab), the engine TTFT,
#                                             the accuracy report
#   bash reports/gpu_check.sh OUT_DIR verdicts-tests   the operator tests of the triton kernels with
#                                             contract §5's allowances, every dtype (kernels-tests.md)
#   bash reports/gpu_check.sh OUT_DIR campaign  campaign speed, cold and warm kernel cache, and the time
#                                             to a planted bug's first failure (campaign-speed.md)
#   bash reports/gpu_check.sh OUT_DIR layouts  the operator and layout tests on the GPU (a short
#                                             profile), then the config sweep and A/B against .ab/ of
#                                             reports/kernel_probe.py (carry .ab)
#   bash reports/gpu_check.sh OUT_DIR kernels  the kernel benchmark alone, A/B against .ab/
#   bash reports/gpu_check.sh OUT_DIR probe    reports/kernel_probe.py (A/B against .ab/, carry .ab),
#                                             the planned-path and decode tests, and the direct launch
#                                             deliberately broken (keyed without pointer alignment):
#                                             its test must fail
#   bash reports/gpu_check.sh OUT_DIR hopper   the Hopper path's tests (tests/kernels/test_hopper_prefill.py),
#                                             once more with each of thirteen parts broken (each must
#                                             fail; HOPPER_BREAKS="NAME ...": those only, as 13 at
#                                             once outrun the tests' cap), its same-process A/B against the Triton kernel
#                                             (reports/hopper_ab.py; HOPPER_AB_ARGS="--variants
#                                             --previous .ab" adds its variants and the previous
#                                             commit's, carry .ab; "--vllm .vllm" vLLM's kernel, carry
#                                             .vllm) and ncu's stall reasons (NCU_LAUNCHES=0: none)
#   bash reports/gpu_check.sh OUT_DIR engine   the engine's graphs and the planned prefill's replans on the
#                                             GPU (tests/engine, the plan, walk, specialization and
#                                             Hopper tests), then reports/engine_steps.py and the
#                                             engine TTFT (issue 17)
#   bash reports/gpu_check.sh OUT_DIR blas     issue 17's linear layers by measured cost (engine/blas_choice.py):
#                                             the engine's tests, then the tree's graphs against graphs of
#                                             torch's default library and of each bucket's chosen one, in turns
#                                             (host_ab), the calibration's times and choices, and each layer
#                                             from the L2 against from HBM (reports/l2_probe.py)
#   bash reports/gpu_check.sh OUT_DIR split-one-round   issue 17's attention split (hopper_prefill's
#                                             SPLIT_ONE_ROUND, off): the Hopper path's split and replan
#                                             tests, the engine's tests in a copy of the tree with it
#                                             on, the kernel's A/B on the engine's 2k step
#                                             (hopper_ab --rows engine) and the engine's steps with it
#                                             off and on in turns (engine_steps --rows split-one-round)
#   bash reports/gpu_check.sh OUT_DIR walk     issue 17's lone-round walk written on the GPU (kernels/device_walk.py),
#                                             in a prefill graph's lead, its items split over the idle programs:
#                                             the engine's and the planned prefill's tests, the engine with it, with
#                                             the items whole and with the host's walk in turns (host_ab;
#                                             HOST_AB_ARMS), the TTFT phases
#   bash reports/gpu_check.sh OUT_DIR table    issue 17's check of the tree as landed, in one call: the walk's,
#                                             graphs' and split's GPU tests, then the whole TTFT table
#                                             (reports/bench_engine.py, into OUT_DIR/ttft); TABLE_AB="tree,ARM":
#                                             then reports/host_ab.py's arms; TABLE_PHASES=1: then
#                                             reports/ttft_phases.py --phases
#   bash reports/gpu_check.sh OUT_DIR dependent   issue 17's dependent launches (kernels/_common.py's
#                                             DEPENDENT_LAUNCH, off): its kernels', the graphs' and the
#                                             engine's tests in a copy of the tree with it on, then the
#                                             engine with it and without in turns (host_ab)
#   bash reports/gpu_check.sh OUT_DIR verdicts-rest    sharpness and false alarms on the GPU
#                                             (sharpness.md), and an illegal memory access in the
#                                             campaign (worker replaced), in --replay and in pytest
set -u
out=${1:?usage: gpu_check.sh OUT_DIR suite|bench}
part=${2:?usage: gpu_check.sh OUT_DIR suite|bench}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$out/device.txt"
step() {  # cap_s, log name, command...
  local cap=$1 log=$2
  shift 2
  local t0=$SECONDS
  timeout "$cap" "$@" > "$out/$log.log" 2>&1
  echo "$log: exit $? in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
}
host_ab() {  # cap_s, arms, runs: reports/host_ab.py's arms in turns, their TTFT lines into the summary
  step "$1" host-ab python3 -m reports.host_ab --arms "$2" --runs "$3"
  grep "^ttft" "$out/host-ab.log" >> "$out/summary.txt"
}
switched_on() {  # dir, file, setting: a copy of the tree in dir with `setting = False` made True in file
  local dir=$1 file=$2 setting=$3
  rm -rf "$dir" && mkdir -p "$dir" && tar --exclude=./.ab --exclude=./.vllm -cf - . | tar -xf - -C "$dir"
  sed -i "s/^$setting = False/$setting = True/" "$dir/$file"
  grep -q "^$setting = True" "$dir/$file" || echo "$setting on: the edit did not apply" >> "$out/summary.txt"
}
case $part in
  suite)
    # -n 4: eight workers ran out of GPU memory on the 8k float64 Phi-3 oracle cases.
    # -vv (over gpu_kernel_check's -q) -rf: a run cut short by its cap still names its failures.
    HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci} step "${SUITE_CAP:-400}" tests \
      python3 -m reports.gpu_kernel_check --out "$out" -- ${SUITE_PATHS:-tests} -n 4 -vv -rf
    grep -E "FAILED|ERROR" "$out/tests.log" >> "$out/summary.txt"
    tail -n 3 "$out/tests.log" >> "$out/summary.txt"
    SANITIZER_TOOLS=memcheck SANITIZER_CAP=110 step 120 sanitizer bash reports/gpu_sanitizer.sh "$out"
    ;;
  bench)
    step 300 bench-kernels python3 -m reports.bench --only kernels --out "$out" --previous .ab
    step 240 bench-engine python3 -m reports.bench --only engine --out "$out"
    step 150 accuracy python3 -m reports.accuracy --device cuda --out "$out"
    ;;
  verdicts-tests)
    HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} step 420 tests \
      python3 -m reports.gpu_kernel_check --out "$out" -- tests/kernels -n 4
    tail -n 25 "$out/tests.log" >> "$out/summary.txt"
    ;;
  layouts)
    HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-smoke} step 200 tests \
      python3 -m reports.gpu_kernel_check --out "$out" -- tests/kernels tests/reference/test_layouts.py -n 4
    tail -n 25 "$out/tests.log" >> "$out/summary.txt"
    step 300 kernel-probe python3 -m reports.kernel_probe --out "$out" --previous .ab
    ;;
  probe)
    step 330 kernel-probe python3 -m reports.kernel_probe --out "$out" --previous .ab --only "${PROBE_PARTS:-enqueue,decode,prefill}"
    HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-smoke} step 240 tests python3 -m reports.gpu_kernel_check \
      --out "$out" -- ${PROBE_TESTS:-tests/kernels/test_plan.py tests/kernels/test_paged_decode.py tests/kernels/test_paged_prefill.py} -n 4
    tail -n 25 "$out/tests.log" >> "$out/summary.txt"
    broken=/tmp/broken-launch
    rm -rf "$broken" && mkdir -p "$broken" && tar --exclude=./.ab -cf - . | tar -xf - -C "$broken"
    sed -i 's/(t.dtype, t.data_ptr() % 16 == 0)/(t.dtype,)/' "$broken/kernels/_common.py"
    grep -q "(t.dtype,) for t in bases" "$broken/kernels/_common.py" || echo "broken-launch: the edit did not apply" >> "$out/summary.txt"
    (cd "$broken" && step 60 broken-launch python3 -m pytest tests/kernels/test_plan.py -k any_address -q -p no:cacheprovider)
    tail -n 5 "$out/broken-launch.log" >> "$out/summary.txt"
    ;;
  hopper)
    # The tests and the broken trees run side by side (their compiles fill the CPUs), each tree in
    # its own copy; the timing runs after them, alone on the GPU.
    step 240 tests python3 -m pytest tests/kernels/test_hopper_prefill.py -q -p no:cacheprovider -n 4 &
    # Broken on purpose, one capability each (name, sed edit, what the edit leaves, the tests that
    # must fail):
    # - v-copy: the consumers' copy of V keeps its non-finite rows (the non-finite V cases);
    # - mode: each group takes its partial tiles as the other group's modes say (the layout cases);
    # - causal: the partial tiles a group sees part of are taken unmasked (the Phi-3 and dense cases);
    # - layout: the tiles the layout masks are masked by causality alone (the per-element case);
    # - descriptor: the programs' TMA descriptors (DEVICE_DESCRIPTORS) end a page short of the caches
    #   (every case whose block table reaches the caches' last page);
    # - host-descriptor: the host-made descriptors do (the same cases, by default);
    # - encoded-key: a cache's encoded map is found by its shape alone (a second cache reuses the first's);
    # - pairs: a pair of full tiles takes its first slot's V for both halves (the cases with pairs);
    # - epilogue: the finalize step no longer finds NaN or Inf in a row's accumulator (the non-finite
    #   V cases whose row sees the key in a full tile);
    # - walk: every program of a dealt round takes the round's costliest item, the others none (the
    #   balanced walk's cases);
    # - cheapest-last: the walk with the cheapest items last takes its first tail item twice and its last
    #   one never (the cheapest-last walk's case);
    # - check-after: V_CHECK_AFTER never finds its product non-finite (the non-finite V cases).
    names=()
    while IFS='|' read -r name edit left tests; do
      # HOPPER_BREAKS: only the breaks it names (default: every one)
      [ -n "${HOPPER_BREAKS:-}" ] && [[ " $HOPPER_BREAKS " != *" $name "* ]] && continue
      names+=("$name")
      broken=/tmp/broken-hopper-$name
      rm -rf "$broken" && mkdir -p "$broken" && tar --exclude=./.ab -cf - . | tar -xf - -C "$broken"
      sed -i "$edit" "$broken/kernels/hopper_prefill.py"
      grep -qF "$left" "$broken/kernels/hopper_prefill.py" || echo "broken-$name: the edit did not apply" >> "$out/summary.txt"
      (cd "$broken" && step 240 "broken-$name" python3 -m pytest tests/kernels/test_hopper_prefill.py -k "$tests" -q -p no:cacheprovider -n 2) < /dev/null &
    done <<'BREAKS'
v-copy|s/v_own.store(gl.where(m_v_bad\[:, None\], gl.zeros_like(b_v), b_v))/v_own.store(b_v)/|v_own.store(b_v)|v_cache
mode|s/(TILE_BITS + 2 \* CONSUMER)/(TILE_BITS + 2 * (1 - CONSUMER))/|(TILE_BITS + 2 * (1 - CONSUMER))|phi3 or rows or none
causal|s/elif mode == WHOLE:/elif mode != SKIP:/|elif mode != SKIP:|phi3 or dense
layout|s/mode != CAUSAL, seq_len/mode == CAUSAL, seq_len/|mode == CAUSAL, seq_len|elements
descriptor|s/shape = \[cache_rows, width\]/shape = [cache_rows - page_size, width]/|shape = [cache_rows - page_size, width]|device_descriptors
host-descriptor|s/self.shape = \[num_pages \* page_size, /self.shape = [num_pages * page_size - page_size, /|self.shape = [num_pages * page_size - page_size, |not v_cache and not k_cache and not device_descriptors
encoded-key|s/key = (self.base.data_ptr(), /key = (/|key = (self.base.dtype|encoded_once
pairs|s/warpgroup_mma(b_x1, v_smem.index(slot1)/warpgroup_mma(b_x1, v_smem.index(slot0)/|warpgroup_mma(b_x1, v_smem.index(slot0)|phi3-ctx0 or dense-P256 or rows
epilogue|s/gl.sum(b_acc \* 0.0, 1) != 0.0/gl.sum(b_acc * 0.0, 1) > 0.0/|gl.sum(b_acc * 0.0, 1) > 0.0|v_cache
walk|s/taken\[r, takers\] = items/taken[r, takers] = items[0]/|taken[r, takers] = items[0]|walks
cheapest-last|s/np.concatenate(\[rest, tail\])/np.concatenate([rest, tail[:-1], tail[:1]])/|np.concatenate([rest, tail[:-1], tail[:1]])|cheapest
split-merge|s/gl.load(p_l) \* b_beta/gl.load(p_l) * b_alpha/|gl.load(p_l) * b_alpha|split
split-reset|s/gl.store(p_done, 0)  # for the next launch/pass  # no reset/|pass  # no reset|split
check-after|s/gl.sum(b_pv \* 0.0, 1) != 0.0/gl.sum(b_pv * 0.0, 1) > 0.0/|gl.sum(b_pv * 0.0, 1) > 0.0|v_cache and not v_checked_first
BREAKS
    wait
    tail -n 3 "$out/tests.log" >> "$out/summary.txt"
    for name in "${names[@]}"; do tail -n 6 "$out/broken-$name.log" >> "$out/summary.txt"; done
    step 330 hopper-ab python3 -m reports.hopper_ab --out "$out" --only "${HOPPER_AB_PARTS:-times,host}" ${HOPPER_AB_ARGS:-}
    tail -n 5 "$out/hopper-ab.log" >> "$out/summary.txt"
    [ "${NCU_LAUNCHES:-2}" = 0 ] || step 100 ncu ncu --clock-control none -k regex:prefill_kernel -c "${NCU_LAUNCHES:-2}" \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,gpu__time_duration.sum" \
      python3 -m reports.hopper_ab --out /tmp/hopper-profile --only profile ${HOPPER_AB_ARGS:-}
    ;;
  engine)
    step "${ENGINE_TESTS_CAP:-200}" engine-tests python3 -m pytest -q -n 8 -rf -p no:cacheprovider tests/engine \
      tests/kernels/test_plan.py tests/kernels/test_walk.py tests/kernels/test_specialization.py \
      tests/kernels/test_hopper_prefill.py
    tail -n 3 "$out/engine-tests.log" >> "$out/summary.txt"
    step 150 engine-steps python3 -m reports.engine_steps --out "$out" --runs "${ENGINE_RUNS:-3}" ${ENGINE_STEPS_ARGS:-}
    step 260 engine-ttft python3 -m reports.bench_engine --out "$out" --time-cap 240
    ;;
  walk)
    step "${WALK_TESTS_CAP:-240}" walk-tests python3 -m pytest -q -n 8 -rf -p no:cacheprovider \
      ${WALK_TESTS:-tests/engine tests/kernels/test_specialization.py} tests/kernels/test_device_walk.py \
      tests/kernels/test_plan.py tests/kernels/test_walk.py tests/kernels/test_hopper_prefill.py
    tail -n 3 "$out/walk-tests.log" >> "$out/summary.txt"
    host_ab 200 "${HOST_AB_ARMS:-tree,whole round,host walk}" "${HOST_AB_RUNS:-7}"
    step 100 ttft-phases python3 -m reports.ttft_phases --phases
    [ -n "${WALK_TTFT:-}" ] && step 300 engine-ttft python3 -m reports.bench_engine --out "$out/ttft"
    ;;
  table)
    step "${TABLE_TESTS_CAP:-230}" table-tests python3 -m pytest -q -n 8 -rf -p no:cacheprovider \
      tests/kernels/test_device_walk.py tests/engine/test_cuda_graphs.py tests/kernels/test_hopper_prefill.py \
      tests/kernels/test_walk.py tests/kernels/test_dependent_launch.py tests/kernels/test_write_kv.py \
      tests/engine/test_rope.py tests/engine/test_norm.py
    tail -n 3 "$out/table-tests.log" >> "$out/summary.txt"
    step 320 engine-ttft python3 -m reports.bench_engine --out "$out/ttft" --time-cap 255
    grep "phi3-small |" "$out/ttft/engine-ttft.md" >> "$out/summary.txt"
    # TABLE_AB="tree,ARM,...": then reports/host_ab.py's arms in turns; TABLE_PHASES=1: then where the 90%
    # cached requests' time goes (reports/ttft_phases.py --phases)
    [ -n "${TABLE_AB:-}" ] && host_ab 150 "$TABLE_AB" "${HOST_AB_RUNS:-9}"
    [ "${TABLE_PHASES:-0}" = 1 ] && step 150 ttft-phases python3 -m reports.ttft_phases --phases
    ;;
  dependent)
    # kernels/_common.py's DEPENDENT_LAUNCH on: the tests of its kernels, the engine's graphs and the model's
    # steps in a copy of the tree with it on, then the engine with it against without, in turns (host_ab)
    on=/tmp/dependent-launch-on
    switched_on "$on" kernels/_common.py DEPENDENT_LAUNCH
    (cd "$on" && step "${DEPENDENT_TESTS_CAP:-200}" tests-on python3 -m pytest -q -n 8 -rf -p no:cacheprovider \
      tests/kernels/test_dependent_launch.py tests/kernels/test_write_kv.py tests/engine/test_rope.py \
      tests/engine/test_norm.py tests/engine/test_cuda_graphs.py tests/engine/test_engine.py) < /dev/null
    tail -n 3 "$out/tests-on.log" >> "$out/summary.txt"
    host_ab 150 "tree,dependent launch" "${HOST_AB_RUNS:-9}"
    ;;
  blas)
    step 150 engine-tests python3 -m pytest -q -n 8 -rf -p no:cacheprovider tests/engine
    tail -n 3 "$out/engine-tests.log" >> "$out/summary.txt"
    step 170 host-ab python3 -m reports.host_ab --arms "tree,blas default,blas chosen" --runs "${HOST_AB_RUNS:-7}"
    step 80 blas-calibration python3 -m reports.blas_calibration --out "$out/blas-calibration.json"
    step 60 l2-probe python3 -m reports.l2_probe --out "$out/l2-probe.json"
    grep -E "^ttft|kept|libraries at (208|256|240|832|896)" "$out/host-ab.log" "$out/blas-calibration.log" >> "$out/summary.txt"
    ;;
  split-one-round)
    # The tests first, side by side (their compiles fill the CPUs); the timings after them, alone.
    step 240 tests python3 -m pytest tests/kernels/test_hopper_prefill.py -q -p no:cacheprovider -n 4 \
      -k "split or replanned" &
    on=/tmp/split-one-round-on
    switched_on "$on" kernels/hopper_prefill.py SPLIT_ONE_ROUND
    (cd "$on" && step 240 engine-tests-on python3 -m pytest -q -n 4 -rf -p no:cacheprovider tests/engine \
      tests/kernels/test_plan.py tests/kernels/test_walk.py) < /dev/null &
    wait
    tail -n 3 "$out/tests.log" "$out/engine-tests-on.log" >> "$out/summary.txt"
    step 120 hopper-ab python3 -m reports.hopper_ab --out "$out" --only times --rows engine --rounds 7 \
      --variants split_one_round,split_one_round_fine
    tail -n 3 "$out/hopper-ab.log" >> "$out/summary.txt"
    step 220 engine-steps python3 -m reports.engine_steps --out "$out" --rows split-one-round --runs 5
    ;;
  kernels)
    step 480 bench-kernels python3 -m reports.bench --only kernels --out "$out" --previous .ab
    ;;
  verdicts-rest)
    step 200 sharpness python3 -m reports.sharpness --device cuda --cases "${SHARPNESS_CASES:-40}" --out "$out"
    faults=tests.fuzz.implementations:ILLEGAL_ADDRESS
    step 120 crash-campaign python3 -m fuzz --backend "$faults" --workers 1 --max-cases 40 --target prefill \
      --max-failures 2 --max-shrinks 6 --failures-dir "$out/crash-cases" --summary "$out/crash-campaign.json"
    first=$(ls "$out"/crash-cases/*.json 2>/dev/null | head -n 1)
    [ -n "$first" ] && step 60 crash-replay python3 -m fuzz --replay "$first"
    step 120 crash-pytest python3 -m pytest tests/kernels/test_paged_prefill.py -n 2 -p no:cacheprovider \
      -k page_block_pairs --backend "$faults" --failures-dir "$out/crash-pytest-cases"
    grep -E "CRASH|summary|prefill  all|passed|failed" "$out"/crash-*.log >> "$out/summary.txt"
    ;;
  campaign)
    # Issue 15: a default campaign, cold (empty kernel cache) then warm (the same cache, the same
    # seed); then time to the first saved failure of a planted bug, cold and warm, each with a fresh
    # example database, and once more replaying the first run's database.
    minutes=${CAMPAIGN_MINUTES:-2}
    cache=/tmp/campaign-kernels
    rm -rf "$cache" /tmp/ttff-kernels
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv -l 5 > "$out/gpu-load.csv" &
    smi=$!
    for run in cold warm; do
      step $((minutes * 60 + 200)) "campaign-$run" python3 -m fuzz --minutes "$minutes" --kernel-cache "$cache" \
        --example-db none --failures-dir "$out/campaign-cases" --summary "$out/campaign-$run.json"
    done
    bug=tests.fuzz.implementations:TRITON_SHARD_OFFSET_DROPPED
    for run in cold warm replay; do
      db="$out/ttff-db-$run"
      [ "$run" = replay ] && db="$out/ttff-db-warm"
      step $((${TTFF_MINUTES:-1} * 60 + 120)) "first-failure-$run" python3 -m fuzz --backend "$bug" \
        --minutes "${TTFF_MINUTES:-1}" --target prefill --target decode --max-failures 1 --max-shrinks 30 \
        --kernel-cache /tmp/ttff-kernels \
        --example-db "$db" --failures-dir "$out/ttff-cases-$run" --summary "$out/first-failure-$run.json"
    done
    kill $smi
    python3 -m reports.campaign_speed --out "$out" cold="$out/campaign-cold.json" warm="$out/campaign-warm.json" \
      first-failure-cold="$out/first-failure-cold.json" first-failure-warm="$out/first-failure-warm.json" \
      first-failure-replay="$out/first-failure-replay.json" > /dev/null
    grep -h "worker(s) on\|done in\|summary:" "$out"/campaign-*.log "$out"/first-failure-*.log >> "$out/summary.txt"
    ;;
  *) echo "unknown part $part (suite, bench, engine, blas, split-one-round, layouts, kernels, probe, hopper, verdicts-tests, verdicts-rest or campaign)"; exit 2 ;;
esac
cat "$out/summary.txt"
# The device tool returns at most eight files per call: everything also goes back as one archive.
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
