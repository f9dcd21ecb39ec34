"""The JIT layer's cache logic on CPU, with a fake compiler (a Python object that "compiles" by writing a
deterministic blob derived from the source, the defines, the flags, the architecture and its version string):

- the cache key changes when the source, a header it includes (directly or through another header), a flag,
  the architecture, the compiler version or a define changes, and not when an unrelated file changes or the
  defines are given in another order;
- a build is published once and read back from disk by a fresh cache (the fake compiler does not run again);
- eight processes racing on a cold key: exactly one entry file is published (no temporary file is left), every
  process gets identical bytes (equal to the fake compiler's blob), and the compiler ran once (the per-key lock);
  without the lock (a file system without flock) still one entry and identical bytes;
- a truncated or corrupted entry is detected (checksum) and rebuilt;
- a failing compile raises `CompileError` with the compiler's log and the source, publishes nothing, and a second
  build of that key raises again without compiling;
- a prebuilt entry is found without a compiler (a cache warmed elsewhere);
- in a copy of the package's kernel folder, every file is an entry (``.cu``) or a header some entry includes, each
  entry's key lists exactly the headers it includes (written out here), and an edit of any header changes the key
  of every entry that includes it, and of no other;
- the launch-argument packing of `driver.Function` puts every argument at the address the kernel reads.
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing as mp
import shutil
from pathlib import Path

import pytest
from support_jit import FakeCompiler

from ep_moe.native import jit
from ep_moe.native.jit import cache as jit_cache
from ep_moe.native.jit.cache import KernelCache, cache_key
from ep_moe.native.jit.compilers import FLAGS, CompileError
from ep_moe.native.jit.source import KernelSource


@pytest.fixture
def tree(tmp_path):
    """kernel.cu -> a.cuh -> sub/b.cuh, and an unrelated file."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "kernel.cu").write_text('#include "a.cuh"\n#include <cuda_bf16.h>\nextern "C" __global__ void k() {}\n')
    (src / "a.cuh").write_text('#pragma once\n#include "sub/b.cuh"\n')
    (src / "sub" / "b.cuh").write_text("#pragma once\nconstexpr int kB = 1;\n")
    (src / "unrelated.cuh").write_text("// not included\n")
    return src


def key_of(src: Path, defines=None, version="1.0", arch="sm_90", flags=FLAGS) -> str:
    source = KernelSource.of(src / "kernel.cu", defines if defines is not None else {"EP_A": 1, "EP_B": 2})
    return cache_key(jit.key_inputs(source, FakeCompiler(version).identity, arch, flags))


def test_key_changes_with_every_input_and_nothing_else(tree):
    base = key_of(tree)
    assert key_of(tree) == base
    assert key_of(tree, {"EP_B": 2, "EP_A": 1}) == base, "define order must not matter"
    (tree / "unrelated.cuh").write_text("// changed, still not included\n")
    assert key_of(tree) == base
    changed = {
        "define": key_of(tree, {"EP_A": 1, "EP_B": 3}),
        "compiler version": key_of(tree, version="1.1"),
        "arch": key_of(tree, arch="sm_100"),
        "flags": key_of(tree, flags=(*FLAGS, "-DEXTRA")),
    }
    (tree / "sub" / "b.cuh").write_text("#pragma once\nconstexpr int kB = 2;\n")
    changed["header included by a header"] = key_of(tree)
    (tree / "a.cuh").write_text('#pragma once\n#include "sub/b.cuh"\n// edited\n')
    changed["included header"] = key_of(tree)
    (tree / "kernel.cu").write_text((tree / "kernel.cu").read_text() + "// edited\n")
    changed["source"] = key_of(tree)
    assert all(k != base for k in changed.values()), [name for name, k in changed.items() if k == base]
    assert len(set(changed.values())) == len(changed), "every change must give a new key"


def test_headers_are_found_recursively(tree):
    headers = jit.included_headers(tree / "kernel.cu")
    assert sorted(headers) == ["a.cuh", "sub/b.cuh"]  # <cuda_bf16.h> is the compiler's (its identity keys it)


# Every entry file of ep_moe/native/kernels and the headers it includes, directly or through another header.
INTRANODE = {"dispatch_layout.cuh", "intranode_kernels.cuh", "common.cuh", "kernels.h", "rtc_prelude.h"}
EXPERT_MAJOR_EXCHANGE = {"expert_major_kernels.cuh", "expert_major.h", "rtc_prelude.h"}
SPECIALIZED = {"ep_jit.cuh"}
ENTRIES = {"intranode.cu": INTRANODE, "expert_major_exchange.cu": EXPERT_MAJOR_EXCHANGE,
           **{name: SPECIALIZED for name in ("expert_layout.cu", "permute_rows.cu", "stream_probe.cu",
                                             "unpermute_sum.cu", "unpermute_sum_backward.cu")}}


def test_every_header_of_the_kernel_folder_keys_the_entries_that_include_it(tmp_path):
    folder = tmp_path / "kernels"
    shutil.copytree(jit.KERNELS_DIR, folder)
    headers = set().union(*ENTRIES.values())
    assert {p.name for p in folder.iterdir()} == set(ENTRIES) | headers, "a file no entry includes, or a new entry"

    def keys() -> dict[str, str]:
        return {name: cache_key(jit.key_inputs(KernelSource.of(folder / name), "c 1", "sm_90")) for name in ENTRIES}

    for name, included in ENTRIES.items():
        assert set(jit.key_inputs(KernelSource.of(folder / name), "c 1", "sm_90")["headers"]) == included, name
    before = keys()
    for header in sorted(headers):
        with (folder / header).open("a") as f:
            f.write("// edited\n")
        after = keys()
        changed = {name for name in ENTRIES if after[name] != before[name]}
        assert changed == {name for name, included in ENTRIES.items() if header in included}, header
        before = after


def test_kernel_source_checks_its_defines(tree):
    with pytest.raises(ValueError, match="not a C identifier"):
        KernelSource.of(tree / "kernel.cu", {"1BAD": 1})
    with pytest.raises(ValueError, match="one non-empty token"):
        KernelSource.of(tree / "kernel.cu", {"EP_A": "1 2"})
    with pytest.raises(FileNotFoundError, match="missing.cu"):
        KernelSource.of(tree / "missing.cu")


def build(tree: Path, cache_dir: Path, compiler: FakeCompiler, defines=None) -> bytes:
    source = KernelSource.of(tree / "kernel.cu", defines or {"EP_A": 1})
    return jit.build(source, "sm_90", compiler, KernelCache(cache_dir, lock_timeout_s=60))


def test_built_once_then_read_from_disk(tree, tmp_path):
    fake = FakeCompiler(log=tmp_path / "log")
    first = build(tree, tmp_path / "cache", fake)
    assert first.startswith(b"FAKECUBIN") and fake.compiles() == 1
    assert build(tree, tmp_path / "cache", fake) == first and fake.compiles() == 1  # a fresh cache: from disk
    assert build(tree, tmp_path / "cache", FakeCompiler("2.0", log=fake.log)) != first and fake.compiles() == 2
    entries = KernelCache(tmp_path / "cache").entries()
    assert len(entries) == 2 and all(isinstance(e, jit_cache.Entry) for e in entries)
    assert {e.meta["inputs"]["compiler"] for e in entries} == {"fake 1.0", "fake 2.0"}


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "empty"])
def test_a_damaged_entry_is_rebuilt(tree, tmp_path, damage):
    fake = FakeCompiler(log=tmp_path / "log")
    good = build(tree, tmp_path / "cache", fake)
    (path,) = (tmp_path / "cache").glob("*.entry")
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:-5], "empty": b"",
                      "flip a byte": data[:-1] + bytes([data[-1] ^ 1])}[damage])
    assert isinstance(KernelCache(tmp_path / "cache").entries()[0], tuple)  # reported as invalid
    assert build(tree, tmp_path / "cache", fake) == good and fake.compiles() == 2
    assert jit_cache.decode_entry(path, path.read_bytes()).payload == good  # replaced by a whole entry


def test_a_failing_compile_raises_with_the_log_once(tree, tmp_path):
    fake = FakeCompiler(log=tmp_path / "log", fail=True)
    with pytest.raises(CompileError, match=r"kernel\.cu\(3\): error: fake failure"):
        build(tree, tmp_path / "cache", fake, {"EP_FAIL": 1})
    with pytest.raises(CompileError, match="fake failure"):
        build(tree, tmp_path / "cache", fake, {"EP_FAIL": 1})
    assert fake.compiles() == 1, "a failed key is not compiled again in this process"
    assert not list((tmp_path / "cache").glob("*.entry"))


def test_a_prebuilt_entry_is_used_without_a_compiler(tree, tmp_path, monkeypatch):
    fake = FakeCompiler()
    source = KernelSource.of(tree / "kernel.cu", {"EP_A": 7})
    payload = jit.build(source, "sm_90", fake, KernelCache(tmp_path / "cache"))
    monkeypatch.setattr(jit, "_compiler_found", (None, "no compiler in this test"))
    assert jit.build(source, "sm_90", None, KernelCache(tmp_path / "cache")) == payload
    with pytest.raises(jit.JitUnavailable, match="no compiler in this test.*ep-moe jit warmup"):
        jit.build(source, "sm_80", None, KernelCache(tmp_path / "cache"))


def _race(tree: str, cache_dir: str, log: str, lock: bool, barrier, results) -> None:
    if not lock:
        jit_cache.fcntl = None
    barrier.wait(timeout=60)
    payload = build(Path(tree), Path(cache_dir), FakeCompiler(log=Path(log), delay_s=0.3), {"EP_RACE": 1})
    results.put(hashlib.sha256(payload).hexdigest())


@pytest.mark.parametrize("lock", [True, False], ids=["flock", "no-flock"])
def test_eight_processes_racing_on_a_cold_key_publish_one_entry(tree, tmp_path, lock):
    ctx = mp.get_context("fork")  # forked from this process: no interpreter start per worker
    barrier, results = ctx.Barrier(8), ctx.Queue()
    log, cache_dir = tmp_path / "log", tmp_path / "cache"
    workers = [ctx.Process(target=_race, args=(str(tree), str(cache_dir), str(log), lock, barrier, results))
               for _ in range(8)]
    for w in workers:
        w.start()
    digests = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    want = hashlib.sha256(build(tree, tmp_path / "other", FakeCompiler(), {"EP_RACE": 1})).hexdigest()
    assert digests == [want] * 8, "every process must get the same, whole binary"
    assert len(list(cache_dir.glob("*.entry"))) == 1
    assert not list(cache_dir.glob("*.tmp")), "no temporary file may be left behind"
    compiles = FakeCompiler(log=log).compiles()
    assert compiles == 1 if lock else 1 <= compiles <= 8


def test_launch_arguments_are_packed_where_the_kernel_reads_them():
    from ep_moe.native.jit.driver import F32, I32, I64, PTR, Function

    seen = {}

    def fake_launch(handle, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        types = (PTR, I64, I32, F32, PTR)
        seen["args"] = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(types)]
        seen["grid"], seen["block"], seen["stream"] = (gx, gy, gz), (bx, by, bz), stream.value
        return 0

    f = Function(1234, "k", (PTR, I64, I32, F32, PTR), launch_fn=fake_launch)
    f.launch(7, 256, 0x7F00_0000_2000, 0x7F00_0000_1000, -(2**40), -3, 0.5, 0)
    assert seen == {"args": [0x7F00_0000_1000, -(2**40), -3, 0.5, 0], "grid": (7, 1, 1), "block": (256, 1, 1),
                    "stream": ctypes.c_void_p(0x7F00_0000_2000).value}
    f.launch((2, 3, 4), 128, 0, 1, 2, 3, 4.0, 5)
    assert seen["args"] == [1, 2, 3, 4.0, 5] and seen["grid"] == (2, 3, 4)
    with pytest.raises(TypeError, match="k takes 5 arguments"):
        f.launch(1, 32, 0, 1, 2, 3)


def test_cooperative_launch_packs_like_launch_and_names_a_refusal(monkeypatch):
    """`Function.launch_cooperative`: the same packing through ``cuLaunchCooperativeKernel``'s ten arguments (no
    ``extra``); a refused launch raises `DriverError` naming the call, the kernel and the grid."""
    from ep_moe.native.jit import driver
    from ep_moe.native.jit.driver import I32, I64, PTR, DriverError, Function

    seen = {}

    def fake_cooperative(handle, gx, gy, gz, bx, by, bz, shared, stream, params):
        types = (PTR, I64, I32)
        seen["args"] = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(types)]
        seen["grid"], seen["block"], seen["stream"] = (gx, gy, gz), (bx, by, bz), stream.value
        return seen.get("status", 0)

    def plain(*args):
        raise AssertionError("a cooperative launch must not go through cuLaunchKernel")

    f = Function(99, "coop", (PTR, I64, I32), launch_fn=plain, cooperative_fn=fake_cooperative)
    f.launch_cooperative(132, 256, 0x7F00_0000_3000, 0x7F00_0000_1000, -(2**40), 3)
    assert seen == {"args": [0x7F00_0000_1000, -(2**40), 3], "grid": (132, 1, 1), "block": (256, 1, 1),
                    "stream": ctypes.c_void_p(0x7F00_0000_3000).value}
    with pytest.raises(TypeError, match="coop takes 3 arguments"):
        f.launch_cooperative(1, 32, 0, 1, 2)

    class _Driver:  # names the error as the real one does (cuGetErrorName)
        def check(self, status, call):
            if status:
                raise DriverError(f"jit: {call} failed: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE")

    monkeypatch.setattr(driver, "_driver", _Driver())
    seen["status"] = 720
    with pytest.raises(DriverError, match=r"cuLaunchCooperativeKernel\(coop, grid=1000, block=256"):
        f.launch_cooperative(1000, 256, 0, 1, 2, 3)


def test_host_event_records_on_the_given_stream_then_waits_and_names_a_failure(monkeypatch):
    """`HostEvent.wait`: one record of its own event on the raw stream it is given, then one synchronize of that
    event; a failing record (nothing waited for) or synchronize raises `DriverError` naming the call."""
    from ep_moe.native.jit import driver
    from ep_moe.native.jit.driver import DriverError, HostEvent

    calls, status = [], {"cuEventRecord": 0, "cuEventSynchronize": 0}

    class _Lib:
        def cuEventCreate(self, out, flags):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p)).contents.value = 0xE0
            calls.append(("create", flags))
            return 0

        def cuEventDestroy_v2(self, event):
            return 0

    class _Driver:
        lib = _Lib()

        def use_primary_context(self, device):
            calls.append(("context", device))

        def event_record(self, event, stream):
            calls.append(("record", event.value, stream))
            return status["cuEventRecord"]

        def event_synchronize(self, event):
            calls.append(("synchronize", event.value))
            return status["cuEventSynchronize"]

        def check(self, code, call):
            if code:
                raise DriverError(f"jit: {call} failed: CUDA_ERROR_ILLEGAL_ADDRESS")

    monkeypatch.setattr(driver, "_driver", _Driver())
    monkeypatch.setattr(driver._thread, "device", 3, raising=False)
    event = HostEvent(3)
    event.wait(0x7F00_0000_3000)
    assert calls == [("context", 3), ("create", 2), ("record", 0xE0, 0x7F00_0000_3000), ("synchronize", 0xE0)]
    for failing in ("cuEventSynchronize", "cuEventRecord"):
        status[failing], before = 700, len(calls)
        with pytest.raises(DriverError, match=failing):
            event.wait(0)
        assert [c[0] for c in calls[before:]] == (["record"] if failing == "cuEventRecord" else
                                                  ["record", "synchronize"])


def test_per_device_makes_one_object_per_device_under_racing_threads():
    """`jit.PerDevice`: eight threads asking for the same device at once get one object, made once; another device
    gets its own; after a clear (tests) the next lookup makes a new one."""
    import threading
    import time

    made = []

    def make(device: int) -> object:
        time.sleep(0.01)  # widen the window in which a second maker could slip in
        made.append(device)
        return object()

    per_device = jit.PerDevice(make)
    start = threading.Barrier(8)
    got: list[object] = []

    def ask() -> None:
        start.wait()
        got.append(per_device.of(0))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [0] and all(g is got[0] for g in got)
    assert per_device.of(1) is not got[0] and made == [0, 1]
    per_device.clear()
    assert per_device.of(0) is not got[0] and made == [0, 1, 0]
