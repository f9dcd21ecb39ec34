"""Which implementation ran an expert-major call is recorded (`permute.implementations_run`), and the first torch
run on a GPU is said once with its reason; `ep-moe env` names the implementation a GPU call would get."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from ep_moe import permute as P
from ep_moe.cli import env


@pytest.fixture
def fresh(monkeypatch):
    """A process that has run nothing yet and has not said the GPU fallback."""
    monkeypatch.setattr(P, "_ran", set())
    monkeypatch.setattr(P, "_fallback_said", False)


def _gpu_like(dtype=torch.bfloat16):
    return SimpleNamespace(is_cuda=True, dtype=dtype, device=torch.device("cuda", 0))


def test_cpu_calls_record_torch_and_say_nothing(fresh, caplog):
    topk_idx = torch.tensor([[0, 2], [1, -1], [2, 3]])
    x = torch.randn(3, 8)
    with caplog.at_level(logging.WARNING, logger="ep_moe"):
        assert P.implementations_run() == ()
        layout = P.expert_layout(topk_idx, 4)
        rows = P.permute_rows(x, layout)
        P.unpermute_sum(rows, layout, P.pair_values(torch.ones(3, 2), layout))
    assert P.implementations_run() == ("torch",)
    assert not [r for r in caplog.records if "torch code" in r.getMessage()]
    P.reset_implementations_run()
    assert P.implementations_run() == ()


def test_layout_past_the_kernels_expert_count_records_torch(fresh, monkeypatch):
    # The layout kernels count at most NATIVE_MAX_EXPERTS experts: past that the torch layout runs, whatever
    # kernel_implementation chose, and that is what is recorded.
    monkeypatch.setattr(P, "kernel_implementation", lambda t: "jit")
    topk_idx = torch.tensor([[0, P.NATIVE_MAX_EXPERTS + 5]])
    layout = P.expert_layout(topk_idx, P.NATIVE_MAX_EXPERTS + 8)
    assert layout.num_rows == 1
    assert P.implementations_run() == ("torch",)


def test_first_gpu_fallback_is_said_once_with_the_reasons(fresh, caplog):
    with caplog.at_level(logging.WARNING, logger="ep_moe"):
        P._note_ran("torch", _gpu_like())
        P._note_ran("torch", _gpu_like())
        P._note_ran("jit", _gpu_like())
    said = [r.getMessage() for r in caplog.records if "torch code" in r.getMessage()]
    assert len(said) == 1, said
    assert "cuda:0" in said[0] and "JIT:" in said[0]
    assert P.implementations_run() == ("jit", "torch")


def test_gpu_fallback_names_a_specific_reason(fresh, caplog):
    with caplog.at_level(logging.WARNING, logger="ep_moe"):
        P._note_ran("torch", _gpu_like(torch.float64))
    said = [r.getMessage() for r in caplog.records if "torch code" in r.getMessage()]
    assert said and "float64 has no kernel" in said[0]


def test_env_names_the_expert_major_implementation():
    line = next(line for line in env.report().splitlines() if line.startswith("permute kernels:"))
    if not torch.cuda.is_available():
        assert line.endswith("torch (no CUDA device)")
    else:
        assert line.split(":", 1)[1].strip().split()[0] in ("jit", "torch")
