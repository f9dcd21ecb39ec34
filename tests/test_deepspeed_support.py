"""Shared helpers of the DeepSpeed integration tests (no tests here).

DeepSpeed runs on its CPU accelerator over gloo. No DeepSpeed op is compiled: ``deepspeed.comm`` is
initialized over our own gloo group with its shared-memory op marked unavailable
(`ep_moe.integrations.deepspeed.init_deepspeed_comm`), and the engine uses a torch optimizer. Should any
build still happen, ``TORCH_EXTENSIONS_DIR`` points it into the repo's git-ignored ``build/`` folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def setup_deepspeed_env(accelerator: str = "cpu") -> None:
    """Environment for DeepSpeed (``accelerator``: ``cpu`` or ``cuda``); call before importing deepspeed
    (in spawned ranks too: they inherit the parent's variables, so this one is set, not defaulted)."""
    os.environ["DS_ACCELERATOR"] = accelerator
    os.environ.setdefault("DS_BUILD_OPS", "0")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))


def require_deepspeed() -> None:
    """Skip the calling test module when DeepSpeed is not installed (or does not import)."""
    setup_deepspeed_env()
    pytest.importorskip("deepspeed", reason="deepspeed is not installed "
                        "(DS_BUILD_OPS=0 pip install torch==<your torch> deepspeed==0.19.8)")
