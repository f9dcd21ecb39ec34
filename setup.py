"""Build script for ep_moe.

By default nothing is compiled: the package installs in seconds, needs neither torch nor a CUDA toolkit at build
time, and its CUDA kernels compile on first use where a CUDA compiler is found (``ep_moe.native.jit``: NVRTC from
the ``nvidia-cuda-nvrtc`` wheel that CUDA torch depends on, or nvcc), cached on disk; ``ep-moe jit warmup`` fills
that cache ahead of time (e.g. on a login node for compute nodes without a compiler). Without CUDA the ``torch``
backend runs.

``EP_MOE_BUILD_EXTENSION=1`` also builds the ahead-of-time CUDA extension ``ep_moe.native._C`` (the same kernels),
when both a CUDA toolkit and a CUDA build of torch are present at build time; install with
``--no-build-isolation`` so that the build sees the installed torch. Where it is built it is used (``EP_MOE_JIT=1``
prefers the JIT kernels anyway). ``EP_MOE_SKIP_NATIVE=1`` never builds it.

The decision is printed to stderr (pip shows it only with ``-v``) and recorded in
``ep_moe/native/build_info.json`` (shipped with the package), which ``ep-moe env`` and
``python -m ep_moe.native`` report.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_RECORD = os.path.join("ep_moe", "native", "build_info.json")  # read by ep_moe.native


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _cuda_extension() -> tuple[list, dict, dict]:
    """``(ext_modules, cmdclass, record)`` for the native kernels: empty ones when they cannot be built,
    and the build record (fields documented in ``ep_moe.native.read_build_record``). The record says
    ``built: true`` only once the compile has succeeded (`_recording`)."""
    record = {"built": False, "reason": None, "python": sys.executable, "prefix": sys.prefix, "torch": None,
              "torch_cuda": None, "cuda_home": None, "cuda_arch": None,
              "time": _now()}

    def without(reason: str) -> tuple[list, dict, dict]:
        record["reason"] = reason
        return [], {}, record

    if os.environ.get("EP_MOE_SKIP_NATIVE", "0") == "1":
        return without("EP_MOE_SKIP_NATIVE=1")
    if os.environ.get("EP_MOE_BUILD_EXTENSION", "0") != "1":
        return without("not asked for (the default: the kernels compile on first use, ep_moe.native.jit; "
                       "EP_MOE_BUILD_EXTENSION=1 builds the extension ahead of time)")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as exc:  # torch absent from the build environment (e.g. build isolation)
        return without(f"torch is not importable at build time ({type(exc).__name__}: {exc}); install with "
                       "--no-build-isolation into the environment that has torch")
    record.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    if torch.version.cuda is None:
        return without(f"torch {torch.__version__} is a CPU build")
    if CUDA_HOME is None:
        return without("no CUDA toolkit (CUDA_HOME) was found")
    sources = sorted(glob.glob("ep_moe/native/csrc/*.cu") + glob.glob("ep_moe/native/csrc/*.cpp"))
    if not sources:
        return without("no native sources under ep_moe/native/csrc")
    arch = os.environ.get("EP_MOE_CUDA_ARCH", "90a")
    nvcc_flags = [
        "-O3",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        f"-I{os.path.join(CUDA_HOME, 'include', 'cccl')}",
    ]
    # The kernels (.cu) never include torch headers; only the binding (.cpp) does, with torch's own
    # C++ standard flag (BuildExtension adds it).
    ext = CUDAExtension(
        name="ep_moe.native._C",
        sources=sources,
        include_dirs=[os.path.abspath("ep_moe/native/csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},
    )
    record.update(reason="the compile of the kernels did not finish (pip install -v shows its output)",
                  cuda_home=CUDA_HOME, cuda_arch=arch)
    return [ext], {"build_ext": _recording(BuildExtension.with_options(use_ninja=True), record)}, record


def _recording(build_ext: type, record: dict) -> type:
    """``build_ext`` that records ``built: true`` once the kernels compiled: in the source tree (in-place
    and editable installs import from there) and in the build folder that a wheel is made from."""

    class RecordingBuildExt(build_ext):
        def run(self) -> None:
            super().run()
            built = dict(record, built=True, reason=None, time=_now())
            _write_build_record(built, HERE)
            if not self.inplace:
                _write_build_record(built, self.build_lib)

    return RecordingBuildExt


def _write_build_record(record: dict, root: str) -> None:
    """Write the record under ``root``; a read-only tree loses the record, not the build."""
    path = os.path.join(root, BUILD_RECORD)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    except OSError as exc:
        print(f"ep_moe: could not write the build record {path}: {exc}", file=sys.stderr)


ext_modules, cmdclass, build_record = _cuda_extension()
_write_build_record(build_record, HERE)
if not ext_modules:
    print(f"ep_moe: building without the native CUDA extension ({build_record['reason']}); the kernels compile on "
          "first use where a CUDA compiler is found, else the 'torch' backend is used.", file=sys.stderr)

setup(
    name="ep_moe",
    version="0.1.0",
    description="Expert-parallel token dispatch/combine for training Mixture-of-Experts models",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The top-level recipes/ folder (the one copy) ships as ep_moe/recipes/ (`ep_moe.train.recipes`).
    packages=find_packages(include=["ep_moe", "ep_moe.*"]) + ["ep_moe.recipes"],
    package_dir={"ep_moe.recipes": "recipes"},
    # the JIT kernels' sources ship with the package: they are compiled on first use (ep_moe.native.jit); the
    # intranode ones are csrc's own (kernels/intranode.cu includes them)
    package_data={"ep_moe.native": ["build_info.json", "csrc/*.cu", "csrc/*.cuh", "csrc/*.h"],
                  "ep_moe.native.jit": ["kernels/*.cu", "kernels/*.cuh"],
                  "ep_moe.recipes": ["*.yaml"]},
    install_requires=["torch>=2.5", "numpy", "pyyaml", "tqdm", "matplotlib"],
    extras_require={
        # tensorboard: the trainer's logger.tensorboard_dir (the tests write and read event files); psutil: the
        # fault tests' process checks
        "dev": ["pytest>=7", "pytest-timeout", "ruff", "tensorboard", "psutil"],
        "tensorboard": ["tensorboard"],
        # The versions CI tests on CPU; newer ones are tested on the GPU machine (README).
        "megatron": ["megatron-core>=0.13"],  # 0.13.1-0.16.1 tested on CPU, 0.19.2 on GPU
        "deepspeed": ["deepspeed>=0.16"],
        "test-integrations": ["megatron-core==0.16.1", "deepspeed==0.19.8"],
        # What the kernel tests need on a CPU: Triton (its kernels run in the interpreter) and NVRTC (every CUDA
        # source compiles for sm_90), at the versions that CUDA torch 2.13 depends on (triton==3.7.1; cuda-toolkit
        # 13.0.3 gives nvidia-cuda-nvrtc 13.0.88), so this extra never conflicts with a CUDA torch 2.13 install.
        "test-kernels": ['triton==3.7.1; platform_system == "Linux"',
                         'nvidia-cuda-nvrtc==13.0.88; platform_system == "Linux"'],
    },
    entry_points={"console_scripts": ["ep-moe = ep_moe.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
