#!/usr/bin/env bash
# Run DeepEP's own test programs, unmodified, against ep_moe's DeepEP shim (ep_moe.compat.deep_ep):
# tests/legacy/test_intranode.py and tests/elastic/test_ep.py, test_agrs.py, test_engram.py (BF16 and --use-fp8),
# test_pp.py, test_barrier.py, each with 1 process and with 2 processes, one line per run (PASS / FAIL / SKIP) and
# a summary; the exit status is 1 if any run failed.
#
# usage: tests/peers/deepep.sh [DEEPEP_DIR] [OPTIONS]
#   DEEPEP_DIR  a DeepEP checkout (default: $DEEP_EP_DIR, else .peers/DeepEP in this repository)
#   OPTIONS     --processes 1,2  --timeout 300 (seconds per run)  --only test_ep,test_pp  --log-dir DIR
#               --dry-run (print the commands)  --gpus N  --tail N (output lines shown for a FAIL)
# Environment: PYTHON (default python3), the interpreter that holds torch and ep_moe.
#
# deep_ep is ep_moe's shim; deep_ep.utils (envs, refs, testing, math, gate) is the checkout's own; deep_ep._C is the
# shim's stand-in. Each program gets the smallest arguments of its own argparse that keep its checks (listed in
# tests/peers/deepep_runner.py, PROGRAMS). With as many GPUs as processes a program runs through
# `python -m ep_moe.compat.deep_ep --deep-ep DEEPEP_DIR program.py ARGS`, untouched.
#
# Adaptations, only for what one GPU cannot meet (no DeepEP file is edited; see deepep_runner.py):
# * More processes than GPUs (2 processes on one GPU): DeepEP's init_dist inits NCCL with
#   device_id=cuda:local_rank and calls torch.cuda.set_device(local_rank). NCCL refuses two ranks on one device
#   and there is no device 1, so init_dist runs as written except that the process group is gloo (no device_id)
#   and set_device selects local_rank % device_count; ep_moe shares the GPU through EP_MOE_SYMMETRIC_MEMORY=vmm.
#   Under gloo, all_to_all_single (DeepEP's reference dispatch in deep_ep.utils.refs), all_gather (test_intranode)
#   and all_gather_into_tensor (test_engram) move CUDA tensors through host copies, and FP8 ones as bytes:
#   gloo has no FP8 type, and the torch documentation lists no CUDA support for them under gloo.
# * test_pp with 1 process: SKIP, the program asserts num_ranks > 1.
# * test_pp: DeepEP's get_rdma_gbs reads `ibstat`; with no RDMA NIC it returns 0 and test_pp divides by it (to
#   size a sleep in its profiling loop), so 0 becomes a nominal 50 GB/s.
# * test_pp, test_engram: EP_USE_NVIDIA_TOOLS=1, DeepEP's own switch that makes bench_kineto skip profiling.
#   bench_kineto times kernels by DeepEP's CUDA kernel names, which ep_moe's kernels do not carry; it returns 0
#   for them and these two programs divide by it. test_ep runs with --skip-perf-test instead (its checks stay).
# * Every run: MASTER_PORT a free port, WORLD_SIZE / RANK unset (DeepEP's init_dist reads them as the number of
#   nodes / this node: one node), and a timeout (the whole process group is killed; the line says TIMEOUT).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${DEEP_EP_DIR:-$repo/.peers/DeepEP}"
if [[ $# -gt 0 && "$1" != -* ]]; then
  dir="$1"
  shift
fi

if [[ ! -f "$dir/deep_ep/utils/__init__.py" || ! -d "$dir/tests" ]]; then
  cat >&2 <<EOF
deepep.sh: no DeepEP checkout at $dir
Get one (the programs' arguments here were chosen for DeepEP commit dd758caf):
  git clone https://github.com/deepseek-ai/DeepEP $dir
  git -C $dir checkout dd758caf
or name another: tests/peers/deepep.sh /path/to/DeepEP (or DEEP_EP_DIR=/path/to/DeepEP).
Only its Python files are used: nothing needs to be built.
EOF
  exit 2
fi

exec "${PYTHON:-python3}" "$here/deepep_runner.py" --deep-ep "$dir" "$@"
