"""Build script for ep_moe.

The pure-Python package installs everywhere. The CUDA extension ``ep_moe.native._C`` (the native
intranode kernels) is compiled only when both a CUDA toolkit and a CUDA build of torch are present
at build time; install with ``--no-build-isolation`` so that the build sees the installed torch.
Elsewhere the package installs without it and runs on the ``torch`` backend.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import find_packages, setup


def _cuda_extension():
    """Return ``(ext_modules, cmdclass)`` for the native kernels, or empty ones with a reason."""
    if os.environ.get("EP_MOE_SKIP_NATIVE", "0") == "1":
        return [], {}, "EP_MOE_SKIP_NATIVE=1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as exc:  # torch absent from the build environment (e.g. build isolation)
        return [], {}, f"torch is not importable at build time ({type(exc).__name__})"
    if torch.version.cuda is None:
        return [], {}, f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None:
        return [], {}, "no CUDA toolkit (CUDA_HOME) was found"
    sources = sorted(glob.glob("ep_moe/native/csrc/*.cu") + glob.glob("ep_moe/native/csrc/*.cpp"))
    if not sources:
        return [], {}, "no native sources under ep_moe/native/csrc"
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
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}, ""


ext_modules, cmdclass, skip_reason = _cuda_extension()
if skip_reason:
    print(f"ep_moe: building without the native CUDA kernels ({skip_reason}); "
          "the 'torch' backend will be used.", file=sys.stderr)

setup(
    name="ep_moe",
    version="0.1.0",
    description="Expert-parallel token dispatch/combine for training Mixture-of-Experts models",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ep_moe", "ep_moe.*"]),
    install_requires=["torch>=2.5", "numpy", "pyyaml", "tqdm", "matplotlib"],
    extras_require={
        "dev": ["pytest>=7", "pytest-timeout", "ruff"],
        # The versions CI tests on CPU; newer ones are tested on the GPU machine (README).
        "megatron": ["megatron-core>=0.13"],  # 0.13.1-0.16.1 tested on CPU, 0.19.2 on GPU
        "deepspeed": ["deepspeed>=0.16"],
        "test-integrations": ["megatron-core==0.16.1", "deepspeed==0.19.8"],
    },
    entry_points={"console_scripts": ["ep-moe = ep_moe.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
