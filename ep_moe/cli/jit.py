"""``ep-moe jit``: the JIT kernels' cache, ahead of time.

``ep-moe jit warmup [--shapes hidden=7168,topk=8,experts=32[,dtype=bf16] ...] [--arch sm_90]`` compiles the
intranode kernels and the generic expert-major ops (one build each with its layout probe,
`ep_moe.native.jit.intranode.specializations`, `ep_moe.native.jit.expert_major_exchange.specializations`) and every
expert-major specialization those shapes take (`ep_moe.native.jit.expert_major.specializations`) into the cache
(``--cache-dir``, else ``$EP_MOE_CACHE_DIR/jit``, else ``~/.cache/ep_moe/jit``), one line per kernel with how long it took: run it where a CUDA
compiler is (a login node, a container build) for compute nodes that lack one: there the kernels load from the cache
without compiling, and a kernel the cache lacks is an error naming the shape to warm up.
Without ``--arch`` the architecture of GPU 0 is used. ``ep-moe jit list`` prints the cached kernels.
Exit status 1 when a kernel does not compile (its log is printed), 2 on bad arguments or no compiler.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ..native import jit
from ..native.jit import expert_major, expert_major_exchange, intranode

SHAPE_KEYS = {"hidden": int, "topk": int, "experts": int, "dtype": str}


def parse_shape(text: str) -> dict:
    """``hidden=H,topk=K,experts=L[,dtype=bf16|fp32|fp8]`` as keyword arguments of `specializations`."""
    shape: dict = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in SHAPE_KEYS:
            raise argparse.ArgumentTypeError(f"shape {text!r}: expected hidden=H,topk=K,experts=L[,dtype=D], "
                                             f"got the part {part!r}")
        try:
            shape[name] = SHAPE_KEYS[name](value.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {text!r}: {name} must be an integer, got {value!r}") from None
    missing = [k for k in ("hidden", "topk", "experts") if k not in shape]
    if missing:
        raise argparse.ArgumentTypeError(f"shape {text!r}: missing {', '.join(missing)}")
    return shape


def _warmup(args: argparse.Namespace) -> int:
    if args.cache_dir:
        jit.set_cache_dir(args.cache_dir)
    compiler, why = jit.compiler()
    if compiler is None:
        print(f"ep-moe jit warmup: no CUDA compiler ({why})", file=sys.stderr)
        return 2
    arch = args.arch
    if arch is None:
        try:
            arch = jit.device_arch(0)
        except Exception as exc:  # noqa: BLE001 (no GPU, CPU torch, ...): the user must name the target
            print(f"ep-moe jit warmup: no GPU to take the architecture from ({exc}); pass --arch sm_90",
                  file=sys.stderr)
            return 2
    try:
        sources = list(dict.fromkeys(intranode.specializations() + expert_major_exchange.specializations() + [
            s for shape in args.shapes for s in expert_major.specializations(**shape)]))
    except ValueError as exc:
        print(f"ep-moe jit warmup: {exc}", file=sys.stderr)
        return 2
    store = jit.process_cache()
    print(f"compiler: {compiler.identity}; arch: {arch}; cache: {store.directory}; {len(sources)} kernels")
    start = time.perf_counter()

    def one(source: jit.KernelSource) -> str:
        began = time.perf_counter()
        try:
            jit.build(source, arch)
        except jit.CompileError as exc:
            return f"FAILED   {source.label}\n{exc}"
        how = next(e.how for e in reversed(jit.history()) if e.label == f"{source.label}-{arch}")
        return f"{how:<9}{time.perf_counter() - began:7.2f} s  {source.label}"

    failed = 0
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # compiles are subprocesses or NVRTC calls
        for line in pool.map(one, sources):
            failed += line.startswith("FAILED")
            print(line, flush=True)
    print(f"{len(sources) - failed} of {len(sources)} kernels ready in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


def _list(args: argparse.Namespace) -> int:
    if args.cache_dir:
        jit.set_cache_dir(args.cache_dir)
    store = jit.process_cache()
    lines = store.describe()
    print(f"{store.directory}: {len(lines)} cached kernels")
    for line in lines:
        print(f"  {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ep-moe jit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    warm = sub.add_parser("warmup", help="compile the kernels of the given shapes into the cache")
    warm.add_argument("--shapes", nargs="+", type=parse_shape, default=[], metavar="hidden=H,topk=K,experts=L",
                      help="shapes of the expert-major kernels (dtype=bf16|fp32|fp8 optional, bf16 by default); "
                           "the intranode and generic expert-major kernels are warmed in any case")
    warm.add_argument("--arch", help="target architecture, e.g. sm_90 (default: GPU 0's)")
    warm.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="compiles at once")
    warm.add_argument("--cache-dir", help="the JIT cache directory (default: $EP_MOE_CACHE_DIR/jit, else ~/.cache/ep_moe/jit)")
    listing = sub.add_parser("list", help="print the cached kernels")
    listing.add_argument("--cache-dir", help="the cache directory")
    args = parser.parse_args(argv)
    return _warmup(args) if args.action == "warmup" else _list(args)


__all__ = ["main", "parse_shape"]
