"""Shared helpers of the DeepSpeed integration tests (no tests here).

DeepSpeed runs on its CPU accelerator over gloo. No DeepSpeed op is compiled: ``deepspeed.comm`` is
initialized over our own gloo group with its shared-memory op marked unavailable
(`ep_moe.integrations.deepspeed.init_deepspeed_comm`), and the engine uses a torch optimizer. Should any
build still happen, ``TORCH_EXTENSIONS_DIR`` points it into the repo's git-ignored ``build/`` folder.
"""

from __future__ import annotations

import os
import sys

import locations
import pytest

REPO = locations.REPO


def setup_deepspeed_env(accelerator: str = "cpu") -> None:
    """Environment for DeepSpeed (``accelerator``: ``cpu`` or ``cuda``); call before importing deepspeed
    (in spawned ranks too: they inherit the parent's variables, so this one is set, not defaulted)."""
    os.environ["DS_ACCELERATOR"] = accelerator
    os.environ.setdefault("DS_BUILD_OPS", "0")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    # A spawned rank imports the test module (and so DeepSpeed, as "cpu") before its worker runs: if
    # DeepSpeed already picked the other accelerator, replace it, or the engine keeps the model on the CPU
    # and broadcasts it over NCCL (seen on the 2-GPU machine: "No backend type associated with device type cpu").
    real = sys.modules.get("deepspeed.accelerator.real_accelerator")
    current = getattr(real, "ds_accelerator", None)
    if current is not None and current._name != accelerator:
        if accelerator == "cuda":
            from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
        else:
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
        real.set_accelerator(Accelerator())


def require_deepspeed() -> None:
    """Skip the calling test module when DeepSpeed is not installed (or does not import)."""
    setup_deepspeed_env()
    pytest.importorskip("deepspeed", reason="deepspeed is not installed "
                        "(DS_BUILD_OPS=0 pip install torch==<your torch> deepspeed==0.19.8)")
