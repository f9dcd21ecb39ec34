"""The two-stage pipeline (``train.pp_size: 2``) and ZeRO-1 (``train.zero_stage: 1``) on 2 GPUs (NCCL), through the
command line: the pipeline's losses against one GPU's ``pp_size: 1`` run, ZeRO-1's against the default's on the
same 2 GPUs. fp32 with ``train.deterministic`` (no TF32, fixed-order reductions), so the tolerances are those of
the CPU test (`tests/train/test_pipeline.py`): pipeline within 1e-5 per step over 30 steps with forced routing,
ZeRO-1 bit for bit. Skipped without 2 GPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import locations
import pytest
import torch

from ep_moe.train.metrics import read_records

pytestmark = pytest.mark.gpu

ROOT = str(locations.REPO)
TINY = os.path.join(ROOT, "recipes", "tiny-cpu.yaml")
STEPS = 30
COMMON = ["model.vocab_size=32", "model.seq_length=32", "model.num_layers=4",
          "model.moe_router_load_balancing_type=seq_aux_loss", "model.moe_router_force_load_balancing=true",
          "model.expert_model_parallel_size=1", "train.global_batch_size=16", "train.micro_batch_size=4",
          f"train.train_iters={STEPS}", "train.eval_iters=0", "train.deterministic=true", "train.device=cuda",
          "logger.progress_bar=false", "checkpoint.save=null"]


def _losses(tmp: str, name: str, extra: list[str]) -> list[float]:
    path = os.path.join(tmp, f"{name}.jsonl")
    proc = subprocess.run([sys.executable, "-m", "ep_moe.train", TINY, *COMMON, f"logger.metrics_path={path}", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [r for r in read_records(path) if r["kind"] == "train"]
    return [r["loss"] for r in sorted(records, key=lambda r: r["step"])]


def test_pipeline_and_zero1_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    tmp = str(tmp_path)
    one = _losses(tmp, "pp1", ["train.nproc=1"])
    pp2 = _losses(tmp, "pp2", ["train.nproc=2", "train.pp_size=2"])
    diffs = [abs(a - b) for a, b in zip(one, pp2)]
    print(f"pp_size 2 vs 1 on GPU: max |diff| {max(diffs):.3g}; {one[0]:.4f} -> {one[-1]:.4f}")
    assert len(one) == len(pp2) == STEPS and max(diffs) <= 1e-5, diffs
    default = _losses(tmp, "dp", ["train.nproc=2"])
    zero = _losses(tmp, "zero", ["train.nproc=2", "train.zero_stage=1"])
    assert zero == default, [abs(a - b) for a, b in zip(zero, default)]
