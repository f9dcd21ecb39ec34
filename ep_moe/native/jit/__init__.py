"""JIT kernels: CUDA sources compiled on first use for the exact specialization a call needs, cached on disk, and
loaded with the driver API, so that no kernel needs an ahead-of-time build.

A kernel is a `KernelSource` (a ``.cu`` entry file under ``ep_moe/native/kernels/``, the one folder of kernel
sources and headers, and its defines, e.g. the row width in 16-byte words and the top-k) compiled for one
architecture. Its cache key (`key_inputs`, `cache.cache_key`) hashes the source, every header it includes
(recursively), the compiler's identity and version, the flags, the architecture and the defines. `build` gives the
CUBIN (memory, else disk, else the compiler: `compilers.find_compiler`); `module` loads it on a device
(`driver.Module`) and `Module.function(...).launch(...)` runs a kernel on a stream.

Three groups of kernels use it: the single-rank expert-major kernels (`expert_major`, specialized per shape), the
native backend's intranode kernels with their copy engine (`intranode`), and the generic expert-major ops
(`expert_major_exchange`: the permute of received rows, the own rows of a combine, the routing map); the last two are
one generic build per architecture each, launched from Python over ctypes mirrors of their parameter structs
(`params`).

`available` / `unavailable_reason` say whether JIT kernels can run here: CUDA torch, a GPU, the driver, and a
compiler or, without one, a disk cache holding kernels for this GPU's architecture (filled by ``ep-moe jit warmup``
where a compiler is). Without a compiler `build` takes any entry that matches in everything but the compiler
(`in_cache`), and a kernel the cache lacks raises `JitUnavailable`. `history` lists what this process compiled or
loaded, with times.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, NamedTuple

from .cache import ENTRY_SUFFIX, MAGIC, KernelCache, cache_key, default_cache_dir
from .compilers import FLAGS, CompileError, Compiler, find_compiler
from .source import KERNELS_DIR, KernelSource, included_headers, sha256_file

log = logging.getLogger("ep_moe")


class JitUnavailable(RuntimeError):
    """JIT kernels cannot run here (the message is the one-line reason)."""


class LoadEvent(NamedTuple):
    label: str      # the specialization (`KernelSource.label`) and architecture
    how: str        # "compiled" (by this process), "disk" (a cache entry), or "memory"
    seconds: float  # wall time of the compile or the read


_lock = threading.Lock()
_compiler_found: tuple[Compiler | None, str] | None = None
_cache: KernelCache | None = None
_failures: dict[str, CompileError] = {}
_modules: dict[tuple[KernelSource, int], Any] = {}
_history: list[LoadEvent] = []


def compiler() -> tuple[Compiler | None, str]:
    """(the compiler found, or None; a one-line account), searched once per process."""
    global _compiler_found
    with _lock:
        if _compiler_found is None:
            _compiler_found = find_compiler()
        return _compiler_found


def process_cache() -> KernelCache:
    """This process's cache (`default_cache_dir` at first use)."""
    global _cache
    with _lock:
        if _cache is None:
            _cache = KernelCache()
        return _cache


def set_cache_dir(directory: str | os.PathLike) -> KernelCache:
    """Use ``directory`` as this process's disk cache from now on (``ep-moe jit --cache-dir``); returns it."""
    global _cache
    with _lock:
        _cache = KernelCache(directory)
        return _cache


def key_inputs(source: KernelSource, compiler_identity: str, arch: str,
               flags: tuple[str, ...] = FLAGS) -> dict[str, Any]:
    """Everything that changes the binary of ``source``: the file's and every included header's sha256, the
    compiler identity, the flags, the architecture and the defines."""
    return {"source": source.file.name, "source_sha256": sha256_file(source.file),
            "headers": included_headers(source.file, [KERNELS_DIR]), "defines": [list(d) for d in source.defines],
            "compiler": compiler_identity, "flags": list(flags), "arch": arch}


def in_cache(source: KernelSource, arch: str, store: KernelCache | None = None) -> bool:
    """True when the disk cache (``store``, else `process_cache`) holds a build of ``source`` for ``arch`` by any
    compiler: what `build` loads where no compiler is found."""
    store = store if store is not None else process_cache()
    return store.find_prebuilt(f"{source.label}-{arch}", key_inputs(source, "", arch)) is not None


def cached_archs(store: KernelCache | None = None) -> set[str]:
    """The architectures (``sm_90``, ...) that the disk cache (``store``, else `process_cache`) holds kernels for,
    read from the entries' headers (an unreadable entry is skipped)."""
    store = store if store is not None else process_cache()
    found: set[str] = set()
    for path in store.directory.glob(f"*{ENTRY_SUFFIX}") if store.directory.is_dir() else ():
        try:
            with open(path, "rb") as f:
                head = f.readline()
            found.add(json.loads(head.removeprefix(MAGIC))["inputs"]["arch"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def build(source: KernelSource, arch: str, compiler_: Compiler | None = None,
          store: KernelCache | None = None) -> bytes:
    """The CUBIN of ``source`` for ``arch`` (``sm_90``): from the cache, else compiled and published. Needs no GPU.

    Raises `JitUnavailable` when no compiler is found, `CompileError` (with the compiler's log) when the source
    does not compile; a failed key raises the same error again without recompiling.
    """
    store = store if store is not None else process_cache()
    if compiler_ is None:
        compiler_, why = compiler()
        if compiler_ is None:  # a cache warmed elsewhere (`ep-moe jit warmup`) may hold it
            start = time.perf_counter()
            inputs = key_inputs(source, "", arch)
            entry = store.find_prebuilt(f"{source.label}-{arch}", inputs)
            if entry is None:
                raise JitUnavailable(f"no CUDA compiler for JIT kernels ({why}) and no cache entry of "
                                     f"{source.label} for {arch} in {store.directory}; run `ep-moe jit "
                                     "warmup` with this shape where a compiler is")
            _history.append(LoadEvent(f"{source.label}-{arch}", "disk", time.perf_counter() - start))
            return entry.payload
    inputs = key_inputs(source, compiler_.identity, arch)
    key = cache_key(inputs)
    if key in _failures:
        raise _failures[key]
    label = f"{source.label}-{arch}"
    start = time.perf_counter()

    def run_compiler() -> bytes:
        return compiler_.compile(source.file, [KERNELS_DIR], source.defines, FLAGS, arch)

    try:
        payload, how = store.get_or_build(key, label, inputs, run_compiler)
    except CompileError as exc:
        _failures[key] = exc
        raise
    _history.append(LoadEvent(label, how, time.perf_counter() - start))
    return payload


def device_arch(device: int) -> str:
    """``$EP_MOE_JIT_ARCH`` (e.g. ``sm_90a``) or ``sm_<major><minor>`` of the device."""
    if os.environ.get("EP_MOE_JIT_ARCH"):
        return os.environ["EP_MOE_JIT_ARCH"]
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def module(source: KernelSource, device: int):
    """``source`` built for ``device``'s architecture and loaded there (a `driver.Module`, kept for the process)."""
    found = _modules.get((source, device))
    if found is None:
        from .driver import Module

        cubin = build(source, device_arch(device))
        with _lock:
            found = _modules.get((source, device))
            if found is None:
                found = _modules[(source, device)] = Module(cubin, device, source.label)
    return found


_available: str | None | bool = False  # False: not decided yet


def unavailable_reason() -> str | None:
    """Why JIT kernels cannot run in this process (one line), or None when they can: a CUDA torch with a GPU, the
    driver library, and a compiler or a cache that holds kernels for the current GPU's architecture (`cached_archs`).
    Decided once per process."""
    global _available
    if _available is not False:
        return _available
    import torch

    reason = None
    if torch.version.cuda is None:
        reason = f"torch {torch.__version__} is a CPU build"
    elif not torch.cuda.is_available():
        reason = "no CUDA GPU is visible"
    else:
        found, why = compiler()
        arch = device_arch(torch.cuda.current_device()) if found is None else None
        if found is None and arch not in cached_archs():
            reason = (f"no CUDA compiler ({why}) and no kernels for {arch} in the cache {process_cache().directory}; "
                      "`ep-moe jit warmup` on a machine with a compiler fills it")
        else:
            try:
                from .driver import driver

                driver()
            except Exception as exc:  # noqa: BLE001 (any failure to load libcuda means no JIT)
                reason = str(exc)
    if reason is not None and torch.version.cuda is not None:  # said once; CPU builds need no word
        log.info("ep_moe.jit: JIT kernels cannot run here (%s); the expert-major kernels run as torch code, and "
                 "the native backend is unavailable", reason)
    _available = reason
    return reason


def available() -> bool:
    """True when JIT kernels can run here (`unavailable_reason`)."""
    return unavailable_reason() is None


class PerDevice(dict):
    """Objects made once per device by ``make(device)`` at first use, under a lock, so that two threads never make
    two; the lookup of one already made is a plain dict read. Clearing it (tests) makes them again."""

    def __init__(self, make) -> None:
        super().__init__()
        self._make = make
        self._lock = threading.Lock()

    def of(self, device: int):
        found = self.get(device)
        if found is None:
            with self._lock:
                found = self.get(device)
                if found is None:
                    found = self[device] = self._make(device)
        return found


def history() -> list[LoadEvent]:
    """What this process built or read, in order (for reports: the compile time of each kernel)."""
    return list(_history)


__all__ = ["FLAGS", "KERNELS_DIR", "CompileError", "Compiler", "JitUnavailable", "KernelCache", "KernelSource",
           "LoadEvent", "PerDevice", "available", "build", "cache_key", "cached_archs", "compiler", "default_cache_dir",
           "device_arch", "history", "in_cache", "key_inputs", "module", "process_cache", "set_cache_dir", "unavailable_reason"]
