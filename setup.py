"""Packaging of ep_moe: pure Python plus the CUDA sources that `ep_moe.native.jit` compiles on first use.

Installing compiles nothing and needs neither torch nor a CUDA toolkit at build time. The kernels compile where
they first run (NVRTC from the ``nvidia-cuda-nvrtc`` wheel that CUDA torch depends on, or nvcc) into a disk cache;
``ep-moe jit warmup`` fills that cache ahead of time (a login node, a container build) for machines without a
compiler. Without CUDA the ``torch`` backend runs.
"""

from __future__ import annotations

import os

from setuptools import find_packages, setup

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
    # the kernels' sources and headers ship with the package, in one folder: they are compiled on first use
    # (ep_moe.native.jit)
    package_data={"ep_moe.native": ["kernels/*.cu", "kernels/*.cuh", "kernels/*.h"],
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
        # What the kernel tests need on a CPU: NVRTC (every CUDA source compiles for sm_90), at the version that
        # CUDA torch 2.13 depends on (cuda-toolkit 13.0.3 gives nvidia-cuda-nvrtc 13.0.88), so this extra never
        # conflicts with a CUDA torch 2.13 install.
        "test-kernels": ['nvidia-cuda-nvrtc==13.0.88; platform_system == "Linux"'],
    },
    entry_points={"console_scripts": ["ep-moe = ep_moe.cli:main"]},
)
