#!/usr/bin/env bash
# One device call: install, compile the kernels into the JIT cache, run the GPU tests, benchmark native vs torch.
#
#   bash benchmarks/gpu_check.sh            # build, test, bench (logs under $OUT, a table printed last)
#   STEPS="build bench" bash benchmarks/gpu_check.sh
#
# STEPS picks among: build test tune bench sweep (test: the native GPU suite, back-to-back soak included;
# tune: the tuner's plans against a measured sweep). Multicast stays off in every process (ep_moe turns it off where a buffer is made or a rank joins its group).
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ep_moe_gpu_check}
mkdir -p "$OUT"
STEPS=${STEPS:-"build test tune bench sweep"}
status=0
has() { [[ " $STEPS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpus.txt"

if has build; then
  start=$SECONDS
  # the install compiles nothing; the warm-up fills the JIT cache, so that the runs below time no compile
  if ! python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
      || ! python3 -m ep_moe.cli jit warmup --shapes hidden=7168,topk=8,experts=32 hidden=2048,topk=6,experts=64 \
        >>"$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    echo "BUILD FAILED"
    exit 1
  fi
  echo "build: $((SECONDS - start)) s"
  python3 -c "import ep_moe.native as n; assert n.kernels_available(), n.kernels_unavailable_reason(); print('native kernels available')" \
    || exit 1
fi

if has test; then
  start=$SECONDS
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -m gpu tests/native/test_native_gpu.py -q -s -p no:cacheprovider --timeout=${TEST_TIMEOUT:-480} \
    2>&1 | tee "$OUT/tests.log" | grep -vE "^\s*$" | tail -40 || status=1
  echo "tests: $((SECONDS - start)) s (status $status)"
fi

if has tune; then
  start=$SECONDS
  timeout ${TUNE_TIMEOUT:-600} python3 -m pytest -m gpu tests/tuning/test_tuning_gpu.py -q -s -p no:cacheprovider \
    2>&1 | tee "$OUT/tune.log" | grep -E "^\||passed|failed|Error" | tail -20 || status=1
  echo "tune: $((SECONDS - start)) s (status $status)"
fi

if has sweep; then
  # Native only, DeepEP's workload: SM budget x pusher fraction (where the time goes).
  start=$SECONDS
  cat >/tmp/ep_moe_native_sweep.py <<'PY'
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
  timeout ${SWEEP_TIMEOUT:-150} torchrun --nproc-per-node 2 /tmp/ep_moe_native_sweep.py >"$OUT/sweep.txt" 2>&1 || status=1
  grep -vE "^(W|I)[0-9]{4}|^\*{5}|OMP_NUM_THREADS|^$" "$OUT/sweep.txt" | tail -40
  echo "sweep: $((SECONDS - start)) s"
fi

if has bench; then
  start=$SECONDS
  timeout ${BENCH_TIMEOUT:-200} python3 -m ep_moe.cli bench --tokens 128 4096 --num-sms 24 32 --runs 30 --expert-major \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" >"$OUT/bench.txt" 2>&1 || status=1
  echo "bench: $((SECONDS - start)) s"
  echo "command: python3 -m ep_moe.cli bench --tokens 128 4096 --num-sms 24 32 --runs 30 --expert-major"
  # the table is the end of the output
  sed -n '/^backend /,$p' "$OUT/bench.txt" | tail -70
fi
exit $status

