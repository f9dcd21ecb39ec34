"""The JIT cache: a cache key from everything that changes a binary, and two levels of storage (this process's
dict, then a directory on disk shared by every process of the machine or cluster file system).

Disk entries are single files ``<dir>/<label>-<key>.entry``: one line ``EPMOEJIT1 {json}`` (the key's inputs,
the payload's size and sha256, the compile time) and then the payload (a CUBIN). A writer compiles into a
temporary file in the same directory and publishes with ``os.replace`` (atomic), so a reader sees either no
entry or a whole one; a lock file per key (``fcntl.flock``, polled with a timeout) makes concurrent first uses
compile once and the others load that entry. A reader checks size and checksum: a truncated or corrupt entry
is rebuilt and replaced.

The directory is ``jit/`` under ep_moe's cache folder: ``$EP_MOE_CACHE_DIR/jit`` when that variable is set (the
folder that also holds the calibration cache), else ``~/.cache/ep_moe/jit``.
No CUDA here (tested on CPU with a fake compiler).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock, publishing stays atomic
    fcntl = None

log = logging.getLogger("ep_moe")

KEY_FORMAT = 1  # bump when the key's inputs or the entry format change
MAGIC = b"EPMOEJIT1 "
ENTRY_SUFFIX = ".entry"
LOCK_TIMEOUT_S = float(os.environ.get("EP_MOE_JIT_LOCK_TIMEOUT_S", "900"))


def default_cache_dir() -> Path:
    """``$EP_MOE_CACHE_DIR/jit``, else ``~/.cache/ep_moe/jit``."""
    root = os.environ.get("EP_MOE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ep_moe")
    return Path(root).expanduser() / "jit"


def cache_key(inputs: Mapping[str, Any]) -> str:
    """sha256 (hex) of the key's inputs (JSON with sorted keys): source and header digests, compiler identity,
    flags, architecture, defines. Equal inputs give equal keys in every process."""
    text = json.dumps({"format": KEY_FORMAT, **inputs}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    """A readable disk entry: its path, its metadata (``label``, ``inputs``, ``size``, ``sha256``, ``compile_s``,
    ``created``) and payload."""

    path: Path
    meta: dict[str, Any]
    payload: bytes


def encode_entry(meta: Mapping[str, Any], payload: bytes) -> bytes:
    header = dict(meta, size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def decode_entry(path: Path, data: bytes) -> Entry:
    """The entry in ``data``; raises ``ValueError`` saying what is wrong (no header, size or checksum)."""
    if not data.startswith(MAGIC) or b"\n" not in data:
        raise ValueError(f"{path}: no entry header")
    head, payload = data[len(MAGIC):].split(b"\n", 1)
    try:
        meta = json.loads(head)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: unreadable header ({exc})") from exc
    if len(payload) != meta.get("size"):
        raise ValueError(f"{path}: {len(payload)} payload bytes, the header says {meta.get('size')} (truncated?)")
    if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
        raise ValueError(f"{path}: checksum mismatch (corrupt)")
    return Entry(path, meta, payload)


def _safe_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,-]+", "_", label)[:80]


class KernelCache:
    """Binaries by key: `get_or_build` returns the payload from memory, else from a valid disk entry, else builds
    it (once across processes, under the key's lock file) and publishes it. Thread-safe.

    ``directory``: None = `default_cache_dir`. An unwritable directory is not an error: binaries are then built
    in memory only, and a warning says so once.
    """

    def __init__(self, directory: str | os.PathLike | None = None, lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.lock_timeout_s = lock_timeout_s
        self._memory: dict[str, bytes] = {}
        self._mutex = threading.Lock()  # guards the dicts; a per-key lock serializes the build of one key
        self._key_locks: dict[str, threading.Lock] = {}
        self._warned = False
        self.builds = 0  # how many times this object ran a build (for reports and tests)

    def path_of(self, key: str, label: str) -> Path:
        return self.directory / f"{_safe_label(label)}-{key[:32]}{ENTRY_SUFFIX}"

    def read(self, path: Path) -> Entry | None:
        """The valid entry at ``path``, or None when it is absent or invalid (invalid ones are logged)."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("ep_moe.jit: cannot read cache entry %s (%s); rebuilding", path, exc)
            return None
        try:
            return decode_entry(path, data)
        except ValueError as exc:
            log.warning("ep_moe.jit: %s; rebuilding", exc)
            return None

    def get_or_build(self, key: str, label: str, inputs: Mapping[str, Any], build: Callable[[], bytes]
                     ) -> tuple[bytes, str]:
        """``(payload of key, where it came from: "memory", "disk" or "compiled")``: memory, disk, else ``build()``
        (its exceptions propagate; nothing is published). Threads building different keys run in parallel."""
        with self._mutex:
            if key in self._memory:
                return self._memory[key], "memory"
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._mutex:
                if key in self._memory:
                    return self._memory[key], "memory"
            payload, how = self._load_or_build(key, label, inputs, build)
            with self._mutex:
                self._memory[key] = payload
            return payload, how

    def _load_or_build(self, key: str, label: str, inputs: Mapping[str, Any], build: Callable[[], bytes]
                       ) -> tuple[bytes, str]:
        path = self.path_of(key, label)
        entry = self.read(path)
        if entry is not None:
            return entry.payload, "disk"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            lock = open(self.directory / f".{path.stem}.lock", "a+b")  # noqa: SIM115 (closed below)
        except OSError as exc:
            self._warn(f"cannot write to {self.directory} ({exc})")
            return self._build(build)[0], "compiled"
        try:
            self._lock(lock, path)
            entry = self.read(path)  # another process may have published it while this one waited
            if entry is not None:
                return entry.payload, "disk"
            payload, seconds = self._build(build)
            meta = {"label": label, "key": key, "inputs": dict(inputs), "compile_s": round(seconds, 3),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            self._publish(path, encode_entry(meta, payload))
            log.info("ep_moe.jit: compiled %s in %.2f s -> %s", label, seconds, path)
            return payload, "compiled"
        finally:
            lock.close()  # releases the flock

    def _build(self, build: Callable[[], bytes]) -> tuple[bytes, float]:
        start = time.perf_counter()
        payload = build()
        with self._mutex:
            self.builds += 1
        if not isinstance(payload, bytes) or not payload:
            raise RuntimeError(f"jit: the build returned {type(payload).__name__} of length "
                               f"{len(payload) if isinstance(payload, bytes) else '-'}, not a binary")
        return payload, time.perf_counter() - start

    def _lock(self, lock, path: Path) -> None:
        if fcntl is None:
            return
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"jit: waited {self.lock_timeout_s:.0f} s (pid {os.getpid()}) for another "
                                       f"process compiling {path.name} (lock {lock.name}); "
                                       "EP_MOE_JIT_LOCK_TIMEOUT_S sets the limit") from None
                time.sleep(0.02)
            except OSError:  # a file system without flock: publishing alone stays atomic
                return

    def _publish(self, path: Path, data: bytes) -> None:
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.stem}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared cache is read by other users
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._warn(f"cannot publish {path} ({exc})")

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("ep_moe.jit: %s; compiled kernels are kept in memory only (set EP_MOE_CACHE_DIR)", why)

    def find_prebuilt(self, label: str, inputs: Mapping[str, Any]) -> Entry | None:
        """A valid entry of ``label`` whose key inputs equal ``inputs`` in everything but ``compiler`` (for a
        machine without a compiler whose cache was filled elsewhere), or None."""
        wanted = {k: v for k, v in inputs.items() if k != "compiler"}
        for path in sorted(self.directory.glob(f"{_safe_label(label)}-*{ENTRY_SUFFIX}")):
            entry = self.read(path)
            if entry is not None and {k: v for k, v in entry.meta.get("inputs", {}).items()
                                      if k != "compiler"} == wanted:
                return entry
        return None

    def entries(self) -> list[Entry | tuple[Path, str]]:
        """Every disk entry, valid ones as `Entry`, invalid ones as ``(path, why)``, sorted by path."""
        out: list[Entry | tuple[Path, str]] = []
        if not self.directory.is_dir():
            return out
        for path in sorted(self.directory.glob(f"*{ENTRY_SUFFIX}")):
            try:
                out.append(decode_entry(path, path.read_bytes()))
            except (OSError, ValueError) as exc:
                out.append((path, str(exc)))
        return out

    def describe(self) -> list[str]:
        """One line per disk entry: label and architecture (compiler, compile time, size); an invalid one says why."""
        lines = []
        for entry in self.entries():
            if isinstance(entry, tuple):
                lines.append(f"INVALID {entry[0].name}: {entry[1]}")
                continue
            meta = entry.meta
            lines.append(f"{meta.get('label', entry.path.name)} ({meta.get('inputs', {}).get('compiler')}, "
                         f"compiled in {meta.get('compile_s', '?')} s, {meta['size']} bytes)")
        return lines


__all__ = ["ENTRY_SUFFIX", "KEY_FORMAT", "Entry", "KernelCache", "cache_key", "decode_entry", "default_cache_dir",
           "encode_entry"]
