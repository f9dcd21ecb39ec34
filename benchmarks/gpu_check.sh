#!/usr/bin/env bash
# One device call: build the native extension, run the GPU tests, benchmark native vs torch.
#
#   bash benchmarks/gpu_check.sh            # build, test, bench (logs under $OUT, a table printed last)
#   STEPS="build bench" bash benchmarks/gpu_check.sh
#
# STEPS picks among: build test bench sweep. Multicast stays off in every process (shared/GPU.md).
set -o pipefail
cd "$(dirname "$0")/.."
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ep_moe_gpu_check}
mkdir -p "$OUT"
STEPS=${STEPS:-"build test bench sweep"}
status=0
has() { [[ " $STEPS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpus.txt"

if has build; then
  start=$SECONDS
  if ! MAX_JOBS=32 python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    echo "BUILD FAILED"
    exit 1
  fi
  echo "build: $((SECONDS - start)) s"
  python3 -c "import ep_moe.native as n; assert n.extension_available(), n._IMPORT_ERROR; print('native extension imports')" \
    || exit 1
fi

if has test; then
  start=$SECONDS
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu tests/test_native_gpu.py -q -s -p no:cacheprovider --timeout=${TEST_TIMEOUT:-300} \
    2>&1 | tee "$OUT/tests.log" | grep -vE "^\s*$" | tail -40 || status=1
  echo "tests: $((SECONDS - start)) s (status $status)"
fi

if has sweep; then
  # Native only, DeepEP's workload: SM budget x pusher fraction (where the time goes).
  start=$SECONDS
  cat >/tmp/ep_moe_native_sweep.py <<'PY'
PY
  timeout ${SWEEP_TIMEOUT:-150} torchrun --nproc-per-node 2 /tmp/ep_moe_native_sweep.py >"$OUT/sweep.txt" 2>&1 || status=1
  grep -vE "^(W|I)[0-9]{4}|^\*{5}|OMP_NUM_THREADS|^$" "$OUT/sweep.txt" | tail -40
  echo "sweep: $((SECONDS - start)) s"
fi

if has bench; then
  start=$SECONDS
  timeout ${BENCH_TIMEOUT:-200} python3 -m ep_moe.cli bench --tokens 128 4096 --num-sms 24 32 --runs 30 \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" >"$OUT/bench.txt" 2>&1 || status=1
  echo "bench: $((SECONDS - start)) s"
  echo "command: python3 -m ep_moe.cli bench --tokens 128 4096 --num-sms 24 32 --runs 30"
  # the table is the end of the output
  sed -n '/^backend /,$p' "$OUT/bench.txt" | tail -70
fi
exit $status

