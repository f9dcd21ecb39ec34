"""The compilers behind the JIT layer, one small interface (`Compiler`): NVRTC (the ``libnvrtc`` that CUDA torch
ships in the ``nvidia-cuda-nvrtc`` wheel, or a CUDA toolkit's, through ctypes) and ``nvcc`` (a subprocess with
``-cubin``). Both turn one source file plus defines into a CUBIN for one architecture; neither needs a GPU.

`find_compiler` picks one: ``EP_MOE_JIT_COMPILER=nvrtc|nvcc`` when set, else NVRTC, else nvcc; None (with the
reasons) when there is neither.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from .source import Define

# The compile flags every compiler applies (part of the cache key); each compiler spells them its own way.
# -default-device (NVRTC only): functions without an execution space are device functions, so that the host
# declarations of kernels/kernels.h (the launchers, never defined in a JIT build) are legal in JIT mode.
FLAGS: tuple[str, ...] = ("-std=c++17", "-O3", "-lineinfo", "-default-device")
NVRTC_ONLY_FLAGS = ("-default-device",)


class CompileError(RuntimeError):
    """A kernel did not compile: the message names the source, the specialization, the architecture and the
    compiler, and holds the compiler's log (with the file and line of each error)."""


class Compiler(Protocol):
    """Turns a source file into a CUBIN. ``identity`` names the compiler and its version exactly (part of the
    cache key: a new compiler never loads an old binary)."""

    name: str
    identity: str

    def compile(self, source: Path, include_dirs: Sequence[Path], defines: Sequence[Define], flags: Sequence[str],
                arch: str) -> bytes:
        """The CUBIN of ``source`` for ``arch`` (``sm_90``); raises `CompileError` with the log."""
        ...


def _fail(compiler: str, source: Path, defines: Sequence[Define], arch: str, log: str) -> CompileError:
    spec = ",".join(f"{k}={v}" for k, v in defines)
    return CompileError(f"jit: {compiler} could not compile {source} [{spec}] for {arch}:\n{log.strip()}")


# ------------------------------------------------------------------------------------------ nvcc
def _cuda_home() -> Path | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return Path(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc:
        return Path(os.path.realpath(nvcc)).parent.parent
    return Path("/usr/local/cuda") if Path("/usr/local/cuda").is_dir() else None


class NvccCompiler:
    """``nvcc -cubin`` in a temporary directory; the source's own folder and ``include_dirs`` are on the path."""

    name = "nvcc"

    def __init__(self, path: str) -> None:
        self.path = path
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"{path} --version failed: {out.stderr.strip()}")
        # "Cuda compilation tools, release 13.0, V13.0.88" and "Build cuda_13.0.r13.0/compiler.36424714_0"
        lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        release = next((line for line in lines if "release" in line), "unknown")
        build = lines[-1].removeprefix("Build ") if lines else ""
        self.identity = f"nvcc {release.rsplit(',', 1)[-1].strip().lstrip('V')} ({build})"

    def compile(self, source: Path, include_dirs: Sequence[Path], defines: Sequence[Define], flags: Sequence[str],
                arch: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="ep_moe_nvcc_") as tmp:
            out = Path(tmp) / "kernel.cubin"
            dirs = dict.fromkeys([str(source.parent), *map(str, include_dirs)])  # in order, once each
            cmd = [self.path, *(f for f in flags if f not in NVRTC_ONLY_FLAGS), "-cubin", f"-arch={arch}", *(f"-I{d}" for d in dirs),
                   *(f"-D{k}={v}" for k, v in defines), "-o", str(out), str(source)]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if result.returncode != 0 or not out.is_file():
                raise _fail(self.identity, source, defines, arch,
                            f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}")
            return out.read_bytes()


def find_nvcc() -> tuple[str | None, str]:
    """(path of nvcc, or None; where it was looked for)."""
    home = _cuda_home()
    for candidate in ([str(home / "bin" / "nvcc")] if home else []) + [shutil.which("nvcc") or ""]:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate, f"found {candidate}"
    return None, f"no nvcc in {home}/bin or on PATH" if home else "no nvcc on PATH and no CUDA_HOME"


# ------------------------------------------------------------------------------------------ NVRTC
_NVRTC_SUCCESS = 0


def nvrtc_candidates() -> list[str]:
    """Where libnvrtc may be, most trusted first: already loaded into this process (torch loads it for its own
    JIT), the ``nvidia`` wheels beside torch (``nvidia/cuda_nvrtc/lib``, ``nvidia/cu13/lib``, ...), the CUDA
    toolkit, then the loader's search path."""
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            found += sorted({line.split()[-1] for line in maps if "libnvrtc.so" in line and "builtins" not in line})
    except OSError:
        pass
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in sorted(r for r in roots if r and os.path.isdir(os.path.join(r, "nvidia"))):
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")), reverse=True)
    home = _cuda_home()
    if home:
        for lib in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            found += sorted(glob.glob(str(home / lib / "libnvrtc.so*")), reverse=True)
    found += ["libnvrtc.so"] + [f"libnvrtc.so.{v}" for v in (13, 12, 11)]
    out: list[str] = []
    for path in found:
        if "alt" in os.path.basename(path) or "builtins" in os.path.basename(path) or path in out:
            continue
        out.append(path)
    return out


def _load_builtins(lib_path: str, version: tuple[int, int]) -> str:
    """Load the ``libnvrtc-builtins.so.X.Y`` that libnvrtc ``X.Y`` dlopens by soname on its first compile, from
    libnvrtc's own folder: the loader does not search that folder (the ``nvidia-cuda-nvrtc`` wheel's lib/ is on
    no search path unless LD_LIBRARY_PATH names it), but once a library of that soname is loaded, its dlopen finds
    it. Returns where it was found; raises RuntimeError where it is neither there nor on the loader's path (this
    libnvrtc could not compile)."""
    name = f"libnvrtc-builtins.so.{version[0]}.{version[1]}"
    # a toolkit's libnvrtc.so is a symlink that may point into another folder
    paths = (lib_path, os.path.realpath(lib_path)) if os.path.sep in lib_path else ()
    folders = dict.fromkeys(os.path.dirname(p) for p in paths)
    for folder in folders:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)  # a bare soname: the loader's own search
    except OSError as exc:
        where = f"beside {lib_path} or " if folders else ""
        raise RuntimeError(f"{name} is not {where}on the loader's path ({exc})") from None
    return name


class NvrtcCompiler:
    """NVRTC through ctypes: headers are read from the source's folder and ``include_dirs``; device code only (the
    kernels include no host header)."""

    name = "nvrtc"

    def __init__(self, lib_path: str) -> None:
        lib = ctypes.CDLL(lib_path)
        self.lib, self.path = lib, lib_path
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != _NVRTC_SUCCESS:
            raise RuntimeError(f"nvrtcVersion failed in {lib_path}")
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.version = (major.value, minor.value)
        self.builtins = _load_builtins(lib_path, self.version)
        real = os.path.basename(os.path.realpath(lib_path))
        self.identity = f"nvrtc {major.value}.{minor.value} ({real})"

    def _check(self, status: int, what: str) -> None:
        if status != _NVRTC_SUCCESS:
            raise RuntimeError(f"jit: {what} failed: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, source: Path, include_dirs: Sequence[Path], defines: Sequence[Define], flags: Sequence[str],
                arch: str) -> bytes:
        lib = self.lib
        prog = ctypes.c_void_p()
        text = source.read_bytes()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), text, str(source).encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            # NVRTC optimizes device code fully by default and has no -O flag
            options = [("--std=c++17" if f == "-std=c++17" else f) for f in flags if f != "-O3"]
            dirs = dict.fromkeys([str(source.parent), *map(str, include_dirs)])
            options += [f"--gpu-architecture={arch}", *(f"-I{d}" for d in dirs), *(f"-D{k}={v}" for k, v in defines)]
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = lib.nvrtcCompileProgram(prog, len(options), argv)
            log_size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
            log = ctypes.create_string_buffer(log_size.value)
            lib.nvrtcGetProgramLog(prog, log)
            if status != _NVRTC_SUCCESS:
                raise _fail(self.identity, source, defines, arch,
                            f"options: {' '.join(options)}\n{log.value.decode(errors='replace')}")
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def find_nvrtc() -> tuple[NvrtcCompiler | None, str]:
    """(an NVRTC compiler, or None; which libraries were tried and why they failed)."""
    tried = []
    for path in nvrtc_candidates():
        try:
            return NvrtcCompiler(path), f"loaded {path}"
        except (OSError, RuntimeError, AttributeError) as exc:
            if os.path.sep in path:  # a bare soname that is simply absent is not worth listing
                tried.append(f"{path} ({exc})")
    return None, "no libnvrtc found" + (f" (tried: {'; '.join(tried)})" if tried else
                                        " (not loaded, not in the nvidia wheels, not in the CUDA toolkit)")


# ------------------------------------------------------------------------------------------ choice
def find_compiler() -> tuple[Compiler | None, str]:
    """(the compiler to use, or None; a one-line account of the search). ``EP_MOE_JIT_COMPILER`` (``nvrtc`` or
    ``nvcc``) asks for one; unset, NVRTC wins (no subprocess per kernel), then nvcc."""
    wanted = os.environ.get("EP_MOE_JIT_COMPILER", "").strip().lower()
    if wanted not in ("", "nvrtc", "nvcc"):
        return None, f"EP_MOE_JIT_COMPILER={wanted!r} is neither 'nvrtc' nor 'nvcc'"
    notes = []
    if wanted in ("", "nvrtc"):
        nvrtc, note = find_nvrtc()
        if nvrtc is not None:
            return nvrtc, note
        notes.append(f"NVRTC: {note}")
    if wanted in ("", "nvcc"):
        path, note = find_nvcc()
        if path is not None:
            try:
                return NvccCompiler(path), note
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                note = f"{path} does not run ({exc})"
        notes.append(f"nvcc: {note}")
    return None, "; ".join(notes)


__all__ = ["FLAGS", "CompileError", "Compiler", "NvccCompiler", "NvrtcCompiler", "find_compiler", "find_nvcc",
           "find_nvrtc", "nvrtc_candidates"]
