#!/usr/bin/env bash
# One device call on a 2-, 4- or 8-GPU NVLink machine (the two-GPU issue: N=2): build, the native GPU suite at EP N,
# ep-moe bench at DeepEP's workload and 8192 tokens (BF16 + FP8, SM sweep + the tuner's count), the tuner's
# check at EP N, the Megatron / DeepSpeed layer benchmarks (real and trivial experts) and the GPU training recipe,
# each at EP N and at EP 1 in the same call (the same global batch, so tokens/s should grow with N; at EP 1 the
# layer benches add the no-dispatcher floor). Logs and JSON under $OUT. Over the 10-minute limit of one device call,
# run it as several calls with STEPS.
#
#   N=8 bash benchmarks/scaling_check.sh          # default N: every visible GPU
#   WHEELS=".whl/*.whl" N=4 bash benchmarks/scaling_check.sh   # megatron-core / deepspeed wheels to install
#
# STEPS picks among: build test bench providers services copyengine tune layers train (default: all). `providers`:
# ep-moe bench with each symmetric memory provider (EP_MOE_SYMMETRIC_MEMORY=torch / nccl / vmm). `services`:
# ElasticBuffer's PP/AGRS, the two-stage pipeline and ZeRO-1 trainer, hybrid views (1 x N, N x 1), Engram on
# hybrid memory and the JIT kernels' GPU suites at EP N, engram_fetch's GB/s beside the H2D copy rate, and
# agrs_bench (the native PP/AGRS transport vs NCCL, GB/s, SMs used). Multicast stays off
# (importing ep_moe turns it off). `copyengine`: cached dispatch and combine by pushers and by the copy engine
# at EP N (its `auto` is off above 2 ranks until this is measured; the GPU suite above forces it in half its
# cases), the combine's reducers with and without bulk copies.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ep_moe_scaling}
mkdir -p "$OUT"
N=${N:-$(nvidia-smi -L | wc -l)}
STEPS=${STEPS:-"build test bench providers services copyengine tune layers train"}
has() { [[ " $STEPS " == *" $1 "* ]]; }
echo "EP $N on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"

if has build; then
  OUT=$OUT/build STEPS=build bash benchmarks/gpu_check.sh 2>&1 | tail -2 || exit 1
fi
if has test; then
  EP_MOE_TEST_WORLD=$N timeout 900 python3 -m pytest -m gpu tests/native/test_native_gpu.py -q -p no:cacheprovider \
    > "$OUT/tests_ep$N.log" 2>&1
  echo "native GPU tests at EP $N: rc $?"; grep -E "passed|failed|Error |assert" "$OUT/tests_ep$N.log" | head -12
  EP_MOE_TEST_WORLD=$N timeout 900 python3 -m pytest -m gpu tests/native/test_native_mismatch_gpu.py -q -p no:cacheprovider \
    > "$OUT/mismatch_ep$N.log" 2>&1
  echo "rank-agreement GPU tests at EP $N: rc $?"; grep -E "passed|failed|^FAILED" "$OUT/mismatch_ep$N.log" | tail -6
fi
if has bench; then
  timeout 600 python3 -m ep_moe.cli bench --ranks "$N" --tokens 4096 8192 --num-sms 16 24 32 48 --plan-sms --runs 30 --expert-major \
    --measure-link --json "$OUT/bench_ep$N.json" --plot "$OUT/bench_ep$N.png" > "$OUT/bench_ep$N.txt" 2>&1
  echo "bench at EP $N: rc $?"; sed -n '/^ep-moe bench:/,$p' "$OUT/bench_ep$N.txt"
  # the expert-major ops with the receive/combine fused into the kernels (default) and without (permute apart)
  EP_MOE_NATIVE_EXPERT_MAJOR_FUSED=0 timeout 600 python3 -m ep_moe.cli bench --ranks "$N" --tokens 128 4096 \
    --num-sms 24 32 --runs 30 --expert-major --dtype bf16 fp8 > "$OUT/bench_unfused_ep$N.txt" 2>&1
  echo "bench, expert-major unfused, at EP $N: rc $?"; sed -n '/^ep-moe bench:/,$p' "$OUT/bench_unfused_ep$N.txt"
fi
if has services; then
  timeout 900 python3 -m pytest -m gpu tests/core/test_pp_agrs_gpu.py tests/train/test_pipeline_gpu.py \
    tests/hybrid/test_hybrid_gpu.py tests/core/test_engram_gpu.py tests/native/test_jit_gpu.py -q -p no:cacheprovider \
    > "$OUT/services_ep$N.log" 2>&1
  echo "ElasticBuffer services / hybrid / JIT GPU tests at EP $N: rc $?"; grep -E "passed|failed|^FAILED" "$OUT/services_ep$N.log" | tail -8
  timeout 300 torchrun --nproc-per-node "$N" benchmarks/engram_fetch.py > "$OUT/engram_ep$N.txt" 2>&1
  echo "engram_fetch at EP $N: rc $?"; grep -E "GB/s" "$OUT/engram_ep$N.txt"
  EP_MOE_TEST_WORLD=$N timeout 600 python3 -m pytest -m gpu tests/native/test_stream_transport_gpu.py -q -p no:cacheprovider \
    > "$OUT/stream_transport_ep$N.log" 2>&1
  echo "native PP/AGRS transport GPU tests at EP $N: rc $?"; grep -E "passed|failed|^FAILED" "$OUT/stream_transport_ep$N.log" | tail -4
  timeout 300 torchrun --nproc-per-node "$N" benchmarks/agrs_bench.py > "$OUT/agrs_ep$N.txt" 2>&1
  echo "agrs_bench at EP $N: rc $?"; grep -E "GB/s|SMs used|batched" "$OUT/agrs_ep$N.txt"
fi
if has providers; then
  # the GPU memory type's symmetric memory providers: torch (CUDA backend), torch over NCCL windows, VMM
  for provider in torch nccl vmm; do
    EP_MOE_SYMMETRIC_MEMORY=$provider timeout 300 python3 -m ep_moe.cli bench --ranks "$N" --tokens 4096 \
      --num-sms 24 --runs 30 --dtype bf16 > "$OUT/bench_provider_${provider}_ep$N.txt" 2>&1
    echo "bench with the $provider symmetric memory at EP $N: rc $?"; sed -n '/^ep-moe bench:/,$p' "$OUT/bench_provider_${provider}_ep$N.txt"
  done
fi
if has copyengine; then
  # copy engine for dispatch and combine (0 / 1) and the combine's reducers (bulk copies: auto / 0 / 1)
  for variant in "0 auto" "0 1" "1 auto" "1 0"; do
    read -r ce bulk <<< "$variant"
    EP_MOE_NATIVE_COMBINE_COPY_ENGINE=$ce EP_MOE_NATIVE_DISPATCH_COPY_ENGINE=$ce EP_MOE_NATIVE_COMBINE_BULK_REDUCE=$bulk \
      timeout 120 torchrun --nproc-per-node "$N" benchmarks/profile_native.py --num-sms 24 32 --runs 15 --tokens 4096 \
      > "$OUT/profile_ce${ce}_bulk${bulk}_ep$N.txt" 2>&1
    echo "profile at EP $N, copy engine $ce, bulk reducers $bulk: rc $?"
    grep -E "^(op|dispatch_cached|combine) " "$OUT/profile_ce${ce}_bulk${bulk}_ep$N.txt"
  done
fi
if has tune; then
  EP_MOE_CALIBRATION="$OUT/calibration_ep$N.json" timeout 600 torchrun --nproc-per-node "$N" benchmarks/tune_check.py \
    --refine --passes 3 --json "$OUT/tune_check_ep$N.json" > "$OUT/tune_check_ep$N.txt" 2>&1
  echo "tune_check at EP $N: rc $?"; sed -n '/^sweep/,$p' "$OUT/tune_check_ep$N.txt"
fi
if has layers; then
  if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ep_moe_site $WHEELS > "$OUT/wheels.log" 2>&1
    export PYTHONPATH=/tmp/ep_moe_site${PYTHONPATH:+:$PYTHONPATH} DS_BUILD_OPS=0
  fi
  # at EP N and at EP 1 (where a no-dispatcher floor row gives each dispatcher's own share), with the real experts
  # and with trivial ones (the dispatcher's share at EP N), the same expert count everywhere
  for ep in "$N" 1; do
    for trivial in "" --trivial-experts; do
      tag="ep$ep${trivial:+_trivial}"
      timeout 300 python3 benchmarks/megatron_layer_bench.py --nproc "$ep" --experts $((4 * N)) --backends native,torch \
        --iters 300 --rounds 10 $trivial --json "$OUT/megatron_layer_$tag.json" > "$OUT/megatron_layer_$tag.txt" 2>&1
      echo "megatron layer at EP $ep $trivial: rc $?"; grep -v Warning "$OUT/megatron_layer_$tag.txt" | tail -8
      timeout 300 torchrun --nproc-per-node "$ep" benchmarks/deepspeed_layer_bench.py --experts $((4 * N)) --dtype bf16 \
        --iters 200 --rounds 10 $trivial > "$OUT/deepspeed_layer_$tag.txt" 2>&1
      echo "deepspeed layer at EP $ep $trivial: rc $?"; grep -v Warning "$OUT/deepspeed_layer_$tag.txt" | tail -8
    done
  done
fi
if has train; then
  for ep in "$N" 1; do
    timeout 600 torchrun --nproc-per-node "$ep" -m ep_moe.train recipes/small-gpu-ep2.yaml \
      model.expert_model_parallel_size="$ep" train.nproc="$ep" train.global_batch_size=$((16 * N)) \
      > "$OUT/train_ep$ep.txt" 2>&1
    echo "training at EP $ep: rc $?"; grep -E "^done:" "$OUT/train_ep$ep.txt"
  done
fi
