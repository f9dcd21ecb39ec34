#!/usr/bin/env bash
# The GPU check of a machine with N NVLink-connected GPUs: install, fill the JIT cache, run the GPU test suites and
# the benchmarks at EP N (and at EP 1 where a step compares), each step's log, table or JSON in one folder.
#
#   bash benchmarks/gpu_check.sh [--gpus N] [--out DIR] [--steps "STEP ..."] [--wheels GLOB] [--dry-run]
#
#   --gpus N      the EP size (default: every GPU `nvidia-smi -L` lists; 2 for --dry-run without nvidia-smi)
#   --out DIR     where the logs and JSON go (default: ./gpu_check_out)
#   --steps LIST  steps to run, space- or comma-separated, in the order below (default: all)
#   --wheels GLOB megatron-core / DeepSpeed wheels the `layers` step installs into DIR/site first
#   --dry-run     print each step's commands and where their output goes; run nothing (no GPU needed)
#
# Steps:
#   build       pip install -e . (compiles nothing), `ep-moe jit warmup` for two shapes; the native kernels load
#   test        the native GPU suite at EP N (back-to-back soak included) and the rank-agreement GPU tests
#   tune        the tuner's GPU tests (a plan against a measured sweep) and benchmarks/tune_check.py (--refine)
#   sweep       native only, DeepEP's workload (4096 tokens, hidden 7168, top-8 of 256): SM budget x pusher
#               fraction (SWEEP_SMS, SWEEP_FRACS), layout, cached and num_worst dispatch, a 128-token round trip
#   bench       ep-moe bench at EP N: 4096 and 8192 tokens, an SM sweep and the tuner's count, the link measured,
#               JSON and plot; 128 and 4096 tokens (JSON and plot); the expert-major ops unfused
#   providers   ep-moe bench with each symmetric memory provider (EP_MOE_SYMMETRIC_MEMORY=torch / nccl / vmm)
#   services    ElasticBuffer's PP/AGRS, the two-stage pipeline and ZeRO-1 trainer, hybrid views, Engram on hybrid
#               memory and the JIT kernels' GPU suites; benchmarks/engram_fetch.py; the native PP/AGRS transport's
#               GPU tests; benchmarks/agrs_bench.py (native transport vs NCCL)
#   copyengine  benchmarks/profile_native.py: cached dispatch and combine by pushers and by the copy engine, the
#               combine's reducers with and without bulk copies
#   layers      the Megatron and DeepSpeed layer benchmarks at EP N and EP 1, real and trivial experts (JSON)
#   train       the GPU training recipe at EP N and EP 1, the same global batch
#
# Each step prints its commands' exit codes and a summary; the script exits 1 if any command failed. Timeouts
# (seconds) can be set with TEST_TIMEOUT, TUNE_TIMEOUT, SWEEP_TIMEOUT, BENCH_TIMEOUT. NVLink multicast stays off in
# every process (ep_moe turns it off where a buffer is made or a rank joins its group).
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

ALL_STEPS="build test tune sweep bench providers services copyengine layers train"
N="" OUT="./gpu_check_out" STEPS="$ALL_STEPS" WHEELS="" DRY_RUN=0
usage() { sed -n '2,/^set -o pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) N=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --steps) STEPS=${2//,/ }; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for step in $STEPS; do
  [[ " $ALL_STEPS " == *" $step "* ]] || { echo "gpu_check.sh: --steps: unknown step '$step' (steps: $ALL_STEPS)" >&2; exit 2; }
done
if [ -z "$N" ]; then
  if ((DRY_RUN)) && ! command -v nvidia-smi >/dev/null; then N=2; else N=$(nvidia-smi -L | wc -l); fi
fi
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: --gpus must be a positive integer, got '$N'" >&2; exit 2; }
mkdir -p "$OUT"
status=0
has() { [[ " $STEPS " == *" $1 "* ]]; }

# run LOG CMD...: CMD with its output in LOG (under --dry-run: the command printed instead); returns CMD's status
run() {
  local log=$1; shift
  if ((DRY_RUN)); then
    printf '+'
    for arg in "$@"; do if [[ "$arg" =~ ^[][A-Za-z0-9_=,./:*+-]+$ ]]; then printf ' %s' "$arg"; else printf ' %q' "$arg"; fi; done
    printf ' > %s\n' "$log"
    return 0
  fi
  "$@" >"$log" 2>&1
}
# done_ LABEL RC: prints the exit code of a run (nothing under --dry-run), and remembers a failure
done_() { ((DRY_RUN)) || echo "$1: rc $2"; [ "$2" -eq 0 ] || status=1; }
# show CMD...: a summary of a log (nothing under --dry-run)
show() { ((DRY_RUN)) || "$@"; }

echo "EP $N, steps: $STEPS, output: $OUT"
((DRY_RUN)) || nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpus.txt"

if has build; then
  # the install compiles nothing; the warm-up fills the JIT cache, so that the steps below time no compile
  run "$OUT/build.log" python3 -m pip install --no-build-isolation --no-deps -e . && \
    run "$OUT/warmup.log" python3 -m ep_moe.cli jit warmup --shapes hidden=7168,topk=8,experts=32 \
      hidden=2048,topk=6,experts=64 && \
    run "$OUT/kernels.log" python3 -c "import ep_moe.native as n; assert n.kernels_available(), n.kernels_unavailable_reason()"
  rc=$?
  done_ "build" $rc
  if [ $rc -ne 0 ]; then tail -60 "$OUT/build.log" "$OUT/warmup.log" "$OUT/kernels.log" 2>/dev/null; exit 1; fi
fi

if has test; then
  run "$OUT/tests_ep$N.log" env EP_MOE_TEST_WORLD="$N" timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -m gpu \
    tests/native/test_native_gpu.py -q -p no:cacheprovider
  done_ "native GPU tests at EP $N" $?
  show grep -E "passed|failed|Error |assert" "$OUT/tests_ep$N.log" | head -12
  run "$OUT/mismatch_ep$N.log" env EP_MOE_TEST_WORLD="$N" timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -m gpu \
    tests/native/test_native_mismatch_gpu.py -q -p no:cacheprovider
  done_ "rank-agreement GPU tests at EP $N" $?
  show grep -E "passed|failed|^FAILED" "$OUT/mismatch_ep$N.log" | tail -6
fi

if has tune; then
  run "$OUT/tune.log" timeout "${TUNE_TIMEOUT:-600}" python3 -m pytest -m gpu tests/tuning/test_tuning_gpu.py -q -s \
    -p no:cacheprovider
  done_ "tuner GPU tests" $?
  show grep -E "^\||passed|failed|Error" "$OUT/tune.log" | tail -20
  run "$OUT/tune_check_ep$N.txt" env EP_MOE_CALIBRATION="$OUT/calibration_ep$N.json" timeout "${TUNE_TIMEOUT:-600}" \
    torchrun --nproc-per-node "$N" benchmarks/tune_check.py --refine --passes 3 --json "$OUT/tune_check_ep$N.json"
  done_ "tune_check at EP $N" $?
  show sed -n '/^sweep/,$p' "$OUT/tune_check_ep$N.txt"
fi

if has sweep; then
  cat >"$OUT/native_sweep.py" <<'PY'
import dataclasses
import os
import statistics

import torch
import torch.distributed as dist

from ep_moe import Buffer, Config
from ep_moe.distributed import init_from_torchrun
from ep_moe.buffer.routing_layout import dispatch_layout

init_from_torchrun("cuda", timeout_s=600.0)
rank, world = dist.get_rank(), dist.get_world_size()
buf = Buffer(backend="native")
T, H, E, K = 4096, 7168, 256, 8
SMS = [int(s) for s in os.environ.get("SWEEP_SMS", "16 24 32").split()]
FRACS = [float(f) for f in os.environ.get("SWEEP_FRACS", "0.25 0.333 0.5").split()]


def inputs(tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 101 + rank)
    idx = (torch.randn(tokens, E, generator=g, device="cuda").abs() + 1).topk(K, 1).indices
    w = torch.rand(tokens, K, generator=g, device="cuda")
    x = torch.randn(tokens, H, generator=g, device="cuda").to(torch.bfloat16)
    return x, idx, w


def median_us(fn, sets, runs=30, warmup=5):
    times = []
    for i in range(runs + warmup):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % sets)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


rows = []
sets = [inputs(T, s) for s in range(3)]
layouts = [buf.backend.get_dispatch_layout(idx, E) for _, idx, _ in sets]
outs = [None] * 3
remote = layouts[0][2].sum(0).to(torch.float64)
remote[rank] = 0
dist.all_reduce(remote, op=dist.ReduceOp.MAX)
floor_us = remote.max().item() * H * 2 / 394e3
rows.append(("layout native", median_us(lambda i: buf.backend.get_dispatch_layout(sets[i][1], E), 3)))
rows.append(("layout torch", median_us(lambda i: dispatch_layout(sets[i][1], E, world), 3)))
for sms in SMS:
    for frac in FRACS:
        cfg = Config(num_sms=sms, native=dataclasses.replace(buf.native_options, dispatch_push_fraction=frac,
                                                             combine_push_fraction=frac))

        def dispatch(i, worst=0, cfg=cfg):
            per_rank, per_expert, in_rank = layouts[i]
            outs[i] = buf.dispatch(sets[i][0], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, topk_idx=sets[i][1],
                                   topk_weights=sets[i][2], num_worst_tokens=worst, config=cfg)

        d = median_us(dispatch, 3)
        c = median_us(lambda i, cfg=cfg: buf.combine(outs[i][0], outs[i][4], config=cfg), 3)
        cached = median_us(lambda i, cfg=cfg: buf.dispatch(sets[i][0], handle=outs[i][4], config=cfg), 3)
        worst = median_us(lambda i: dispatch(i, world * T), 3)
        rows.append((f"dispatch sms={sms} push={frac:.2f}", d))
        rows.append(("  cached", cached))
        rows.append(("  num_worst (no host sync)", worst))
        rows.append((f"combine  sms={sms} push={frac:.2f}", c))
small = [inputs(128, s) for s in range(3)]


def small_round_trip(i):
    x, idx, w = small[i]
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    buf.combine(recv_x, handle, topk_weights=recv_w)


rows.append(("128 tokens dispatch+combine sms=24", median_us(small_round_trip, 3)))
if rank == 0:
    print(f"NVLink floor per direction: {floor_us:.1f} us (T={T}, H={H}, top-{K} of {E})")
    for name, us in rows:
        print(f"{name:40s} {us:9.1f} us   floor/time {floor_us / us:.2f}")
dist.barrier()
buf.destroy()
dist.destroy_process_group()
PY
  run "$OUT/sweep_ep$N.txt" timeout "${SWEEP_TIMEOUT:-150}" torchrun --nproc-per-node "$N" "$OUT/native_sweep.py"
  done_ "native sweep at EP $N" $?
  show grep -vE "^(W|I)[0-9]{4}|^\*{5}|OMP_NUM_THREADS|^$" "$OUT/sweep_ep$N.txt" | tail -40
fi

if has bench; then
  run "$OUT/bench_ep$N.txt" timeout "${BENCH_TIMEOUT:-600}" python3 -m ep_moe.cli bench --ranks "$N" --tokens 4096 8192 \
    --num-sms 16 24 32 48 --plan-sms --runs 30 --expert-major --measure-link --json "$OUT/bench_ep$N.json" \
    --plot "$OUT/bench_ep$N.png"
  done_ "bench at EP $N" $?
  show sed -n '/^ep-moe bench:/,$p' "$OUT/bench_ep$N.txt"
  run "$OUT/bench_small_ep$N.txt" timeout "${BENCH_TIMEOUT:-600}" python3 -m ep_moe.cli bench --ranks "$N" \
    --tokens 128 4096 --num-sms 24 32 --runs 30 --expert-major --json "$OUT/bench_small_ep$N.json" \
    --plot "$OUT/bench_small_ep$N.png"
  done_ "bench, 128 and 4096 tokens, at EP $N" $?
  show sed -n '/^backend /,$p' "$OUT/bench_small_ep$N.txt" | tail -70
  # the expert-major ops with the receive/combine fused into the kernels (default) and without (permute apart)
  run "$OUT/bench_unfused_ep$N.txt" env EP_MOE_NATIVE_EXPERT_MAJOR_FUSED=0 timeout "${BENCH_TIMEOUT:-600}" \
    python3 -m ep_moe.cli bench --ranks "$N" --tokens 128 4096 --num-sms 24 32 --runs 30 --expert-major \
    --dtype bf16 fp8
  done_ "bench, expert-major unfused, at EP $N" $?
  show sed -n '/^ep-moe bench:/,$p' "$OUT/bench_unfused_ep$N.txt"
fi

if has providers; then
  # the GPU memory type's symmetric memory providers: torch (CUDA backend), torch over NCCL windows, VMM
  for provider in torch nccl vmm; do
    run "$OUT/bench_provider_${provider}_ep$N.txt" env EP_MOE_SYMMETRIC_MEMORY=$provider timeout 300 \
      python3 -m ep_moe.cli bench --ranks "$N" --tokens 4096 --num-sms 24 --runs 30 --dtype bf16
    done_ "bench with the $provider symmetric memory at EP $N" $?
    show sed -n '/^ep-moe bench:/,$p' "$OUT/bench_provider_${provider}_ep$N.txt"
  done
fi

if has services; then
  run "$OUT/services_ep$N.log" timeout 900 python3 -m pytest -m gpu tests/core/test_pp_agrs_gpu.py \
    tests/train/test_pipeline_gpu.py tests/hybrid/test_hybrid_gpu.py tests/core/test_engram_gpu.py \
    tests/native/test_jit_gpu.py -q -p no:cacheprovider
  done_ "ElasticBuffer services / hybrid / JIT GPU tests at EP $N" $?
  show grep -E "passed|failed|^FAILED" "$OUT/services_ep$N.log" | tail -8
  run "$OUT/engram_ep$N.txt" timeout 300 torchrun --nproc-per-node "$N" benchmarks/engram_fetch.py
  done_ "engram_fetch at EP $N" $?
  show grep -E "GB/s" "$OUT/engram_ep$N.txt"
  run "$OUT/stream_transport_ep$N.log" env EP_MOE_TEST_WORLD="$N" timeout 600 python3 -m pytest -m gpu \
    tests/native/test_stream_transport_gpu.py -q -p no:cacheprovider
  done_ "native PP/AGRS transport GPU tests at EP $N" $?
  show grep -E "passed|failed|^FAILED" "$OUT/stream_transport_ep$N.log" | tail -4
  run "$OUT/agrs_ep$N.txt" timeout 300 torchrun --nproc-per-node "$N" benchmarks/agrs_bench.py
  done_ "agrs_bench at EP $N" $?
  show grep -E "GB/s|SMs used|batched" "$OUT/agrs_ep$N.txt"
fi

if has copyengine; then
  # copy engine for dispatch and combine (0 / 1) and the combine's reducers (bulk copies: auto / 0 / 1)
  for variant in "0 auto" "0 1" "1 auto" "1 0"; do
    read -r ce bulk <<< "$variant"
    run "$OUT/profile_ce${ce}_bulk${bulk}_ep$N.txt" env EP_MOE_NATIVE_COMBINE_COPY_ENGINE="$ce" \
      EP_MOE_NATIVE_DISPATCH_COPY_ENGINE="$ce" EP_MOE_NATIVE_COMBINE_BULK_REDUCE="$bulk" timeout 120 \
      torchrun --nproc-per-node "$N" benchmarks/profile_native.py --num-sms 24 32 --runs 15 --tokens 4096
    done_ "profile at EP $N, copy engine $ce, bulk reducers $bulk" $?
    show grep -E "^(op|dispatch_cached|combine) " "$OUT/profile_ce${ce}_bulk${bulk}_ep$N.txt"
  done
fi

if has layers; then
  if [ -n "$WHEELS" ]; then
    # shellcheck disable=SC2086  # the glob expands here
    run "$OUT/wheels.log" python3 -m pip install -q --no-index --no-deps --no-compile --target "$OUT/site" $WHEELS
    done_ "wheels" $?
    export PYTHONPATH=$(cd "$OUT" && pwd)/site${PYTHONPATH:+:$PYTHONPATH} DS_BUILD_OPS=0
  fi
  # at EP N and at EP 1 (where a no-dispatcher floor row gives each dispatcher's own share), with the real experts
  # and with trivial ones (the dispatcher's share at EP N), the same expert count everywhere
  for ep in "$N" 1; do
    for trivial in "" --trivial-experts; do
      tag="ep$ep${trivial:+_trivial}"
      run "$OUT/megatron_layer_$tag.txt" timeout 300 python3 benchmarks/megatron_layer_bench.py --nproc "$ep" \
        --experts $((4 * N)) --backends native,torch --iters 300 --rounds 10 $trivial \
        --json "$OUT/megatron_layer_$tag.json"
      done_ "megatron layer at EP $ep $trivial" $?
      show grep -v Warning "$OUT/megatron_layer_$tag.txt" | tail -8
      run "$OUT/deepspeed_layer_$tag.txt" timeout 300 torchrun --nproc-per-node "$ep" benchmarks/deepspeed_layer_bench.py \
        --experts $((4 * N)) --dtype bf16 --iters 200 --rounds 10 $trivial
      done_ "deepspeed layer at EP $ep $trivial" $?
      show grep -v Warning "$OUT/deepspeed_layer_$tag.txt" | tail -8
    done
  done
fi

if has train; then
  for ep in "$N" 1; do
    run "$OUT/train_ep$ep.txt" timeout 600 torchrun --nproc-per-node "$ep" -m ep_moe.train recipes/small-gpu-ep2.yaml \
      model.expert_model_parallel_size="$ep" train.nproc="$ep" train.global_batch_size=$((16 * N))
    done_ "training at EP $ep" $?
    show grep -E "^done:" "$OUT/train_ep$ep.txt"
  done
fi
exit $status
