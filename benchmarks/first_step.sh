#!/usr/bin/env bash
# On a GPU machine: `pytest -m gpu` (GPU_TESTS=0 skips it), then the wall time to the end of the first step of
# `relaymoe-train` run twice for each case NAME:ARGS (first: no plan and, on a fresh machine, an empty JAX cache;
# second: --overwrite, the plan in OUT/remat_plan.json and the compiled steps kept). Results under $OUT.
#   bash benchmarks/first_step.sh "a2a_16x4096:--config ep8 runtime.dispatcher=all_to_all runtime.remat=auto"
#   GPU_TESTS=0 bash benchmarks/first_step.sh "ring_393216:--config ep8 batch_size=1 seq_len=393216 runtime.remat=auto"
# STEPS=N trains N steps instead of 1 (the first step's time is unchanged; the rest give the step's speed).
# GPU_TESTS_TIMEOUT (300 s here) and GPU_WORKERS: how `pytest -m gpu` runs (benchmarks/gpu_tests.sh).
cd "$(dirname "$0")/.."
if [ "${GPU_TESTS:-1}" = 1 ]; then
  GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-300} bash benchmarks/gpu_tests.sh
else
  source benchmarks/gpu_setup.sh
fi
for case in "$@"; do
  name=${case%%:*}; args=${case#*:}
  for i in $(seq 1 "${RUNS:-2}"); do
    extra=""; [ "$i" = 2 ] && extra="--overwrite"
    rm -f "/tmp/$name/metrics.jsonl"
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    timeout "${RUN_TIMEOUT:-280}" relaymoe-train $args steps="${STEPS:-1}" log_every=1 checkpoint_every=0 tensorboard=false \
      --out "/tmp/$name" $extra > "$OUT/${name}_run$i.log" 2>&1 &
    pid=$!
    first=""  # seconds to the first step's metrics line, the time to first step
    while kill -0 "$pid" 2>/dev/null; do
      if [ -z "$first" ] && [ -s "/tmp/$name/metrics.jsonl" ]; then
        first=$(python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$start")
      fi
      sleep 0.5
    done
    wait "$pid"; rc=$?
    python3 -c "import sys, time; print(f'rc={sys.argv[1]} first_step_s={sys.argv[3] or None} wall_s={time.time() - float(sys.argv[2]):.1f}')" \
      "$rc" "$start" "$first" >> "$OUT/${name}_run$i.log"
  done
done
