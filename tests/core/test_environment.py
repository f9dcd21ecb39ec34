"""The environment ep_moe runs in: multicast switched off by ``import ep_moe``, the launcher's argument
checks, ``setup.py``'s build record and what `ep_moe.native` makes of it, and the ``ep-moe env`` report
(also ``python -m ep_moe.native``)."""

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

NATIVE_LINE = re.compile(r"^native kernels:\s+not built \((.+)\)$", re.MULTILINE)
NOT_BUILT = pytest.mark.skipif(native.extension_available(), reason="the native extension is built here")


def _python(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run a fresh interpreter (this one's executable) and capture its output."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


# ------------------------------------------------------------------------------------------ multicast
def test_import_turns_multicast_off_but_keeps_a_users_value():
    env = {k: v for k, v in os.environ.items() if k not in MULTICAST_OFF}
    env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "0"  # the user's choice; the other two are unset
    code = ("import json, os; import ep_moe; "
            f"print(json.dumps({{k: os.environ.get(k) for k in {sorted(MULTICAST_OFF)!r}}}))")
    run = _python("-c", code, env=env)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}


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


# ------------------------------------------------------------------------------------------ build record
def _record(tmp_path, **fields) -> str:
    record = {"built": False, "reason": "torch 2.13.0+cpu is a CPU build", "python": sys.executable,
              "prefix": sys.prefix, "torch": torch.__version__, "torch_cuda": None, "cuda_home": None,
              "cuda_arch": None, "time": "2026-01-02T03:04:05+00:00"}
    record.update(fields)
    path = tmp_path / "build_info.json"
    path.write_text(json.dumps(record))
    return str(path)


def test_record_not_built_is_quoted(tmp_path):
    path = _record(tmp_path)
    assert native.read_build_record(path)["reason"] == "torch 2.13.0+cpu is a CPU build"
    assert native.explain_missing_extension(None, path) == \
        "setup.py built no extension: torch 2.13.0+cpu is a CPU build"
    # setup.py run by another interpreter (a pip of another Python): both are named.
    other = _record(tmp_path, python="/usr/bin/python3", prefix="/usr",
                    reason="torch is not importable at build time (ModuleNotFoundError)")
    text = native.explain_missing_extension(None, other)
    assert text.startswith("setup.py built no extension: torch is not importable at build time")
    assert f"setup.py ran under /usr/bin/python3 (prefix /usr), this is {sys.executable}" in text


def test_record_built_but_the_extension_does_not_import(tmp_path):
    same = _record(tmp_path, built=True, reason=None, torch_cuda="12.8", cuda_home="/usr/local/cuda",
                   cuda_arch="90a")
    text = native.explain_missing_extension("libc10_cuda.so: cannot open shared object file", same)
    assert text.startswith("setup.py built the kernels (2026-01-02T03:04:05+00:00, torch "
                           f"{torch.__version__}, CUDA 12.8, sm_90a) but they do not import")
    assert text.endswith("import error: libc10_cuda.so: cannot open shared object file")
    assert "ran under" not in text and "torch here" not in text
    other = _record(tmp_path, built=True, reason=None, python="/opt/other/bin/python3", prefix="/opt/other",
                    torch="2.0.0+cu118", torch_cuda="11.8", cuda_arch="90a")
    text = native.explain_missing_extension(None, other)  # no _C file at all (another Python's ABI tag)
    assert "but no compiled _C is in" in text and f"torch here is {torch.__version__}" in text
    assert f"setup.py ran under /opt/other/bin/python3 (prefix /opt/other), this is {sys.executable}" in text


def test_record_missing(tmp_path):
    path = tmp_path / "build_info.json"
    assert native.read_build_record(path) is None
    assert native.explain_missing_extension(None, path) == \
        "no build record: ep_moe was installed without running setup.py here"
    assert native.explain_missing_extension("bad ELF", path).endswith("; import error: bad ELF")


def _check_malformed(path, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)) as caught:
        native.read_build_record(path)
    assert str(path) in str(caught.value)
    text = native.explain_missing_extension(None, path)
    assert text.startswith(f"unreadable build record {path}: ") and problem in text


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps({"built": False, "reason": "x"}), "field 'python' is missing"),
])
def test_record_malformed_file(tmp_path, content, problem):
    path = tmp_path / "build_info.json"
    path.write_text(content)
    _check_malformed(path, problem)


@pytest.mark.parametrize("fields, problem", [
    ({"built": "yes"}, "field 'built' has the wrong type (str)"),
    ({"reason": None}, "'built' is false but no 'reason' is given"),
])
def test_record_malformed_fields(tmp_path, fields, problem):
    _check_malformed(_record(tmp_path, **fields), problem)


def test_setup_py_writes_a_record_that_ep_moe_reads(tmp_path):
    """``setup.py`` run (for its metadata only) in a copy of the source tree records its decision in the
    form `read_build_record` accepts."""
    pytest.importorskip("setuptools", reason="setup.py needs setuptools in this interpreter")
    shutil.copy(locations.REPO / "setup.py", tmp_path / "setup.py")
    (tmp_path / "ep_moe" / "native").mkdir(parents=True)
    env = dict(os.environ, EP_MOE_SKIP_NATIVE="1")
    run = _python("setup.py", "--version", env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "building without the native CUDA extension (EP_MOE_SKIP_NATIVE=1)" in run.stderr
    record = native.read_build_record(tmp_path / "ep_moe" / "native" / "build_info.json")
    assert record["built"] is False and record["reason"] == "EP_MOE_SKIP_NATIVE=1"
    assert record["python"] == sys.executable and record["prefix"] == sys.prefix


def test_setup_py_builds_nothing_by_default(tmp_path):
    """By default ``setup.py`` compiles nothing and imports no torch (an install needs no compiler and no torch at
    build time); the record says why, and that the kernels compile on first use."""
    pytest.importorskip("setuptools", reason="setup.py needs setuptools in this interpreter")
    shutil.copy(locations.REPO / "setup.py", tmp_path / "setup.py")
    (tmp_path / "ep_moe" / "native").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("EP_MOE_SKIP_NATIVE", "EP_MOE_BUILD_EXTENSION")}
    # a torch that cannot be imported: the default build must not need one
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch at build time')\n")
    run = _python("setup.py", "--version", env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    record = native.read_build_record(tmp_path / "ep_moe" / "native" / "build_info.json")
    assert record["built"] is False and record["torch"] is None
    assert record["reason"].startswith("not asked for (the default: the kernels compile on first use")
    assert "EP_MOE_BUILD_EXTENSION=1" in record["reason"] and "compile on first use" in run.stderr
    run = _python("setup.py", "--version", env=dict(env, EP_MOE_BUILD_EXTENSION="1"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    record = native.read_build_record(tmp_path / "ep_moe" / "native" / "build_info.json")
    assert record["reason"].startswith("torch is not importable at build time"), "asked for: it tries"


# ------------------------------------------------------------------------------------------ ep-moe env
NATIVE_ITEMS = ("python", "torch", "CUDA", "GPUs", "NCCL", "symmetric memory", "build record", "multicast")


def _check_report(text: str, calibration: str | None = None) -> None:
    """The native items, and with ``calibration`` (``ep-moe env``) the installation's too."""
    found = NATIVE_LINE.search(text)
    assert found, text
    assert found.group(1).strip() == native.extension_unavailable_reason()
    assert len(found.group(1).strip()) > 10  # a reason, not a bare "no"
    for name in NATIVE_ITEMS + (("ep_moe", "calibration cache") if calibration else ()):
        assert re.search(rf"^{name}:\s+\S", text, re.MULTILINE), name
    assert re.search(rf"^python:\s+{re.escape(sys.executable)} ", text, re.MULTILINE)
    assert re.search(rf"^torch:\s+{re.escape(torch.__version__)} ", text, re.MULTILINE)
    if calibration:
        assert f"calibration cache: {calibration} (not written yet)" in text


@NOT_BUILT
def test_env_report_says_why_the_kernels_are_not_built(capsys, monkeypatch, tmp_path):
    calibration = str(tmp_path / "calibration.json")
    monkeypatch.setenv("EP_MOE_CALIBRATION", calibration)
    assert env_cli.main([]) == 0
    _check_report(capsys.readouterr().out, calibration)


@NOT_BUILT
def test_python_m_ep_moe_native_prints_the_native_part(tmp_path):
    run = _python("-m", "ep_moe.native", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    _check_report(run.stdout)
