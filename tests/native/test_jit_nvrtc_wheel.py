"""NVRTC from the ``nvidia-cuda-nvrtc`` wheel alone: a fresh process, with no LD_LIBRARY_PATH, finds it with
`find_nvrtc` and compiles a real kernel for sm_90. libnvrtc dlopens its ``libnvrtc-builtins.so.X.Y`` by soname
on the first compile, and the wheel's lib/ folder is on no search path, so the compiler must load the builtins from
libnvrtc's own folder; in this test process another test may already have loaded them, hence the subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ep_moe.native.jit import compilers
from ep_moe.native.jit.compilers import nvrtc_candidates

# a libnvrtc on disk (a wheel's or a toolkit's), whether or not this process could compile with it
NVRTC_FILES = [p for p in nvrtc_candidates() if os.path.sep in p and os.path.isfile(p)]

FRESH_PROCESS = """
from ep_moe.native.jit import expert_major as J
from ep_moe.native.jit.compilers import FLAGS, find_nvrtc
from ep_moe.native.jit.source import KERNELS_DIR

compiler, note = find_nvrtc()
assert compiler is not None, note
source = next(s for s in J.specializations(37, 3, 5, "fp32") if s.file.name == "permute_rows.cu")
cubin = compiler.compile(source.file, [KERNELS_DIR], source.defines, FLAGS, "sm_90")
assert cubin[:4] == b"\\x7fELF", "a CUBIN is an ELF image"
assert b".text.ep_permute_rows\\x00" in cubin, "no kernel ep_permute_rows in the CUBIN"
print(compiler.identity, compiler.builtins)
"""


@pytest.mark.skipif(not NVRTC_FILES, reason="no libnvrtc is installed here")
def test_a_fresh_process_compiles_with_nvrtc_without_ld_library_path():
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"the fresh process did not compile with NVRTC:\n{out.stdout}{out.stderr}"
    assert "libnvrtc-builtins.so." in out.stdout, out.stdout


def test_missing_builtins_are_named(tmp_path):
    """A libnvrtc whose builtins are neither beside it nor on the loader's path is refused with their name (so
    that `find_nvrtc` tries the next library instead of returning one that cannot compile)."""
    with pytest.raises(RuntimeError, match=r"libnvrtc-builtins\.so\.99\.9 is not beside .*libnvrtc\.so\.99"):
        compilers._load_builtins(str(tmp_path / "libnvrtc.so.99"), (99, 9))
