"""The environment ep_moe runs in: multicast switched off by ``import ep_moe``, the launcher's argument
checks, ``setup.py`` (it compiles nothing and needs no torch), and the ``ep-moe env`` report (also
``python -m ep_moe.native``): whether the kernels can run, and why not."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import locations
import pytest
import torch

from ep_moe import native
from ep_moe.cli import env as env_cli
from ep_moe.distributed import MULTICAST_OFF, init_from_torchrun, launch

NATIVE_LINE = re.compile(r"^intranode kernels:\s+(.+)$", re.MULTILINE)


def _python(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run a fresh interpreter (this one's executable) and capture its output."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


# ------------------------------------------------------------------------------------------ multicast
def test_multicast_is_turned_off_when_a_buffer_is_made_not_at_import():
    """``import ep_moe`` sets no variable; the first `Buffer` sets the unset ones (a user's value stays) and says so
    in one log line; a second buffer sets nothing and logs nothing."""
    env = {k: v for k, v in os.environ.items() if k not in MULTICAST_OFF}
    env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "0"  # the user's choice; the other two are unset
    code = (
        "import json, logging, os, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "import torch.distributed as dist\n"
        "import ep_moe\n"
        "from ep_moe.distributed import free_port\n"
        f"names = {sorted(MULTICAST_OFF)!r}\n"
        "seen = [{k: os.environ.get(k) for k in names}]\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "ep_moe.Buffer(backend='torch')\n"
        "seen.append({k: os.environ.get(k) for k in names})\n"
        "ep_moe.Buffer(backend='torch')\n"
        "dist.destroy_process_group()\n"
        "print(json.dumps(seen))\n")
    run = _python("-c", code, env=env)
    assert run.returncode == 0, run.stderr
    at_import, after_buffer = json.loads(run.stdout.strip().splitlines()[-1])
    assert at_import == {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "NCCL_NVLS_ENABLE": None,
                         "NVSHMEM_DISABLE_NVLS": None}
    assert after_buffer == {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "NCCL_NVLS_ENABLE": "0",
                            "NVSHMEM_DISABLE_NVLS": "1"}
    lines = [line for line in run.stderr.splitlines() if "NVLink multicast off" in line]
    assert len(lines) == 1 and "NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1" in lines[0], run.stderr


# ------------------------------------------------------------------------------------------ launcher
def test_launcher_rejects_an_unknown_device_type(monkeypatch):
    with pytest.raises(ValueError, match="device_type must be one of .*'gpu'"):
        launch(print, 2, device_type="gpu")
    with pytest.raises(ValueError, match="device_type must be one of"):
        init_from_torchrun("tpu")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="start the program with torchrun"):
        init_from_torchrun("cpu")


# ------------------------------------------------------------------------------------------ setup.py
def test_setup_py_compiles_nothing_and_needs_no_torch(tmp_path):
    """``setup.py`` (run for its metadata in a copy of the source tree) imports no torch and writes nothing beside
    the sources: an install needs neither a compiler nor torch at build time."""
    pytest.importorskip("setuptools", reason="setup.py needs setuptools in this interpreter")
    shutil.copy(locations.REPO / "setup.py", tmp_path / "setup.py")
    (tmp_path / "ep_moe" / "native").mkdir(parents=True)
    (tmp_path / "torch").mkdir()  # a torch that cannot be imported
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch at build time')\n")
    run = _python("setup.py", "--version", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "0.1.0"
    assert os.listdir(tmp_path / "ep_moe" / "native") == []


# ------------------------------------------------------------------------------------------ ep-moe env
NATIVE_ITEMS = ("python", "torch", "CUDA", "GPUs", "NCCL", "symmetric memory", "JIT kernels", "JIT compiler",
                "JIT cache", "multicast")


def _check_report(text: str, calibration: str | None = None) -> None:
    """The native items, and with ``calibration`` (``ep-moe env``) the installation's too."""
    found = NATIVE_LINE.search(text)
    assert found, text
    why = native.kernels_unavailable_reason()
    assert found.group(1).strip() == (f"unavailable, and so is the native backend ({why})" if why else
                                      "available: JIT kernels, one build per architecture "
                                      "(ep_moe.native.jit.intranode)")
    for name in NATIVE_ITEMS + (("ep_moe", "calibration cache") if calibration else ()):
        assert re.search(rf"^{name}:\s+\S", text, re.MULTILINE), name
    assert re.search(rf"^python:\s+{re.escape(sys.executable)} ", text, re.MULTILINE)
    assert re.search(rf"^torch:\s+{re.escape(torch.__version__)} ", text, re.MULTILINE)
    if calibration:
        assert f"calibration cache: {calibration} (not written yet)" in text


def test_env_report_says_whether_the_kernels_run(capsys, monkeypatch, tmp_path):
    calibration = str(tmp_path / "calibration.json")
    monkeypatch.setenv("EP_MOE_CALIBRATION", calibration)
    assert env_cli.main([]) == 0
    _check_report(capsys.readouterr().out, calibration)


def test_python_m_ep_moe_native_prints_the_native_part(tmp_path):
    run = _python("-m", "ep_moe.native", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    _check_report(run.stdout)
