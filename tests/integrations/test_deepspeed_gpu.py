"""The DeepSpeed integration on 2 GPUs (NCCL; DeepSpeed's CUDA accelerator): the layer cases of
`test_deepspeed` and the ZeRO-2 / convergence / checkpoint group of `test_deepspeed_engine`, on the GPU.

Tolerances differ from the CPU runs for one reason: CUDA's ``index_add``/``scatter`` backward use atomics,
so on the GPU even DeepSpeed's own layer is not bit-reproducible run to run, and cuBLAS picks kernels by
shape. Layer outputs and input gradients: 1e-5 absolute (values of order 1); parameter gradients 1e-4.
Training: per-step losses within 1e-3 nats over 100 steps (differences at the 1e-7 level per step, which
Adam keeps at that relative level unless a near-tie in the routing flips; a wrong gradient moves the loss
by > 1e-2 within a few steps).

Run on a 2-GPU machine: ``python3 -m pytest -q -s -m gpu tests/integrations/test_deepspeed_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from support_deepspeed import require_deepspeed

require_deepspeed()

import test_deepspeed as layer_tests  # noqa: E402
import test_deepspeed_engine as engine_tests  # noqa: E402

from ep_moe.distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.gpu

GPU_LOSS_TOL = 1e-3


def _need_two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")


@pytest.fixture(scope="module")
def gpu_layer_results() -> list[dict]:
    _need_two_gpus()
    return run_distributed(layer_tests._layer_worker, 2, "cuda", backend="nccl", timeout_s=120,
                           join_timeout_s=600)


@pytest.fixture(scope="module")
def gpu_engine_results(tmp_path_factory) -> list[dict]:
    _need_two_gpus()
    return engine_tests.run_engine_group(str(tmp_path_factory.mktemp("deepspeed_engine_gpu")), "cuda")


@pytest.mark.parametrize("case", layer_tests.VS_DEEPSPEED, ids=lambda c: c.name)
def test_gpu_equals_deepspeed_moe(gpu_layer_results, case):
    layer_tests.check_vs_deepspeed(gpu_layer_results, case)


@pytest.mark.parametrize("case", layer_tests.VS_DENSE, ids=lambda c: c.name)
def test_gpu_dropless_equals_dense_reference(gpu_layer_results, case):
    layer_tests.check_vs_dense(gpu_layer_results, case)


@pytest.mark.parametrize("mode", ["capacity", "dropless"])
def test_gpu_converges_like_deepspeed_moe(gpu_engine_results, mode):
    engine_tests.check_convergence(gpu_engine_results, mode, GPU_LOSS_TOL)


def test_gpu_zero2_groups_our_experts_as_moe_params(gpu_engine_results):
    engine_tests.check_engine(gpu_engine_results)


@pytest.mark.parametrize("direction", ["deepspeed->ep_moe", "ep_moe->deepspeed"])
def test_gpu_moe_checkpoint_loads_across_layers(gpu_engine_results, direction):
    engine_tests.check_checkpoint(gpu_engine_results, direction)
