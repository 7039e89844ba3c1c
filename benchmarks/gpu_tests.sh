#!/usr/bin/env bash
# On a GPU machine: the whole `pytest -m gpu` within a 10-minute call on one GPU. The two Qwen3.5 tests (4–7 minutes
# each) run on their own beside the rest; each pytest-xdist worker takes GPU memory as it goes (tests/conftest.py);
# XLA's autotuner is off (it times candidate kernels on the shared GPU at every compile; the tests check values).
# Under $OUT: each run's log (gpu_tests_rest.log, gpu_tests_qwen35.log) and gpu_tests.log, the machine and every
# test's outcome (a test missing from it was cut by the timeout). GPU_WORKERS (8), GPU_TESTS_TIMEOUT (560 s).
#   OUT=DIR bash benchmarks/gpu_tests.sh
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
qwen35=tests/test_qwen35.py::test_on_a_gpu_each_dispatcher_trains_qwen35_as_dense
gpu_tests() {
  timeout "${GPU_TESTS_TIMEOUT:-560}" python3 -m pytest -m gpu -p no:cacheprovider -v -rfE --durations=10 --dist load "$@"
  echo "rc=$?"
}
gpu_tests -n "${GPU_WORKERS:-8}" --deselect "$qwen35" > "$OUT/gpu_tests_rest.log" 2>&1 &
gpu_tests -n 2 "$qwen35" > "$OUT/gpu_tests_qwen35.log" 2>&1 &
wait
{ cat "$OUT/machine.txt"; grep -hE "^\[gw[0-9]+\] .*(PASSED|FAILED|ERROR|SKIPPED)|^rc=" "$OUT/gpu_tests_rest.log" \
    "$OUT/gpu_tests_qwen35.log"; } > "$OUT/gpu_tests.log"
echo "pytest -m gpu: $(grep -c PASSED "$OUT/gpu_tests.log") passed, $(grep -cE "FAILED|ERROR" "$OUT/gpu_tests.log") failed" \
  "or errors, $(grep -c SKIPPED "$OUT/gpu_tests.log") skipped ($OUT/gpu_tests.log)"
