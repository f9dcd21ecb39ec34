"""The JIT expert-major kernels' host side on CPU: ``ep-moe jit warmup`` and ``list`` (with a fake compiler), the
``ep-moe env`` lines, that `specializations` (what warmup compiles) covers every specialization the launchers ask
for in a forward and backward pass, with the argument count of each kernel's signature; the layout launcher's
sequence of memset and launches (cooperative, two at the exact size; the four plain kernels in their place)
and its outputs, each kernel run as its contract on the CPU memory it is handed; and, where nvcc is installed, that
every kernel source compiles standalone with it (``nvcc -std=c++17 -arch=sm_90 -cubin``; the layout at 1, 7 and
1024 experts), and likewise with NVRTC where a libnvrtc is found."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess

import pytest
import torch
from support_jit import NVCC, FakeCompiler, needs_nvcc

from ep_moe.cli import jit as jit_cli
from ep_moe.native import jit
from ep_moe.native.jit import expert_major as J
from ep_moe.native.jit.compilers import NvccCompiler, find_nvcc, find_nvrtc


@pytest.fixture
def fake_jit(tmp_path, monkeypatch):
    """The JIT layer with a fake compiler and a fresh cache under tmp_path."""
    fake = FakeCompiler(log=tmp_path / "log")
    monkeypatch.setenv("EP_MOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jit, "_compiler_found", (fake, "fake compiler of the test"))
    monkeypatch.setattr(jit, "_cache", None)
    monkeypatch.setattr(jit, "_failures", {})  # the process's failed builds, which a test may add to
    return fake


def test_parse_shape():
    assert jit_cli.parse_shape("hidden=7168,topk=8,experts=32") == {"hidden": 7168, "topk": 8, "experts": 32}
    assert jit_cli.parse_shape("hidden=64, topk=2, experts=4, dtype=fp32")["dtype"] == "fp32"
    for bad, match in (("hidden=64,topk=2", "missing experts"), ("hidden=x,topk=2,experts=4", "integer"),
                       ("width=64,topk=2,experts=4", "width=64")):
        with pytest.raises(Exception, match=match):
            jit_cli.parse_shape(bad)


def test_warmup_compiles_then_reads_from_disk(fake_jit, capsys, monkeypatch, tmp_path):
    argv = ["warmup", "--shapes", "hidden=7168,topk=8,experts=32", "hidden=64,topk=2,experts=4,dtype=fp8",
            "--arch", "sm_90", "--jobs", "2"]
    assert jit_cli.main(argv) == 0
    out = capsys.readouterr().out
    # 13 expert-major specializations, the intranode build, the generic expert-major build, a probe for each
    assert "17 of 17 kernels ready" in out and out.count("\ncompiled ") == 17 and fake_jit.compiles() == 17
    monkeypatch.setattr(jit, "_cache", None)  # a new process: nothing in memory
    assert jit_cli.main(argv) == 0
    assert capsys.readouterr().out.count("\ndisk ") == 17 and fake_jit.compiles() == 17
    assert jit_cli.main(["list"]) == 0
    listing = capsys.readouterr().out
    assert "17 cached kernels" in listing and "intranode.cu[]-sm_90" in listing and \
        "expert_major_exchange.cu[]-sm_90" in listing and "expert_layout.cu[EP_EXPERTS=32,EP_TOPK=8]-sm_90" in listing
    assert listing.startswith(str(tmp_path / "cache" / "jit")), "the JIT cache is $EP_MOE_CACHE_DIR/jit"
    assert jit_cli.main(["list", "--cache-dir", str(tmp_path / "elsewhere")]) == 0
    assert "0 cached kernels" in capsys.readouterr().out


def test_after_warmup_a_process_without_a_compiler_loads_every_kernel_of_the_shape(fake_jit, capsys, monkeypatch):
    """``ep-moe jit warmup`` on a machine with a compiler; then a process on a machine without one (a new cache
    object, the compiler search answering none, sm_90 as the GPU's): the native kernels count as available, and
    every kernel of the shape loads from the disk, none compiled; a shape not warmed up is an error naming it."""
    from ep_moe import native
    from ep_moe.native.jit import expert_major_exchange, intranode

    assert jit_cli.main(["warmup", "--shapes", "hidden=1024,topk=4,experts=8", "--arch", "sm_90"]) == 0
    assert "14 of 14 kernels ready" in capsys.readouterr().out
    compiled = fake_jit.compiles()
    monkeypatch.setattr(jit, "_compiler_found", (None, "hidden by the test"))
    monkeypatch.setattr(jit, "_cache", None)
    monkeypatch.setattr(jit, "unavailable_reason", lambda: None)  # a GPU and the driver
    monkeypatch.setattr(jit, "device_arch", lambda device: "sm_90")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(native, "_decided", False)
    assert native.kernels_unavailable_reason() is None
    assert jit.cached_archs() == {"sm_90"}
    before = len(jit.history())
    sources = intranode.specializations() + expert_major_exchange.specializations() + J.specializations(1024, 4, 8)
    for source in sources:
        jit.build(source, "sm_90")
    assert [e.how for e in jit.history()[before:]] == ["disk"] * len(sources) and fake_jit.compiles() == compiled
    with pytest.raises(jit.JitUnavailable, match=r"no cache entry of expert_layout.cu\[EP_EXPERTS=8,EP_TOPK=2\]"):
        jit.build(J.specializations(1024, 2, 8)[0], "sm_90")


def test_warmup_reports_a_failed_compile_and_bad_shapes(fake_jit, capsys):
    fake_jit.fail = True
    assert jit_cli.main(["warmup", "--shapes", "hidden=8,topk=1,experts=1,dtype=fp8", "--arch", "sm_90"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "fake failure" in out and "0 of 7 kernels ready" in out
    assert jit_cli.main(["warmup", "--shapes", "hidden=8,topk=1,experts=2000", "--arch", "sm_90"]) == 2
    assert "'experts' must be <= 1024" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is visible")
def test_warmup_without_a_gpu_needs_an_arch(fake_jit, capsys):
    assert jit_cli.main(["warmup", "--shapes", "hidden=8,topk=1,experts=1"]) == 2
    assert "pass --arch sm_90" in capsys.readouterr().err


def test_env_reports_the_jit_compiler_and_cache(fake_jit):
    from ep_moe.cli.env import report

    jit.build(J.specializations(64, 2, 4, "fp8")[0], "sm_90")
    text = report()
    assert "JIT compiler:      fake 1.0 (fake compiler of the test)" in text
    assert "JIT cache:" in text and "(1 kernels)" in text and "expert_layout.cu[EP_EXPERTS=4,EP_TOPK=2]" in text
    assert "JIT kernels:" in text


def _memory(address: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` at ``address`` of this process's memory (CPU tensors' storage), writable."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    kind = {torch.int64: ctypes.c_int64, torch.int32: ctypes.c_int32}[dtype]
    return torch.frombuffer((kind * count).from_address(address), dtype=dtype)


class _LayoutDevice:
    """The layout kernels' contract in Python, run on the CPU memory that a launch's arguments point at (so the
    launcher's addresses, sizes and phases are what is tested), and the log of memsets and launches.

    A cooperative launch checks the barrier's words (no arrivals; generation 0 before the count phase) and
    advances the generation past the barriers it passes, as the kernel does. The count phase (the cooperative kernel's bit
    1, or ``ep_expert_scan`` after ``ep_expert_count``) writes the block counts' exclusive offsets, the pairs and the aligned sizes;
    the place phase (bit 2, or ``ep_expert_sort_rows`` after ``ep_expert_assign``) checks that what the count phase
    wrote is still there and writes pair_of_slot, slot_of_pair and sorted_slots as the torch definition does."""

    def __init__(self, resident: int = 264):
        self.log: list[tuple] = []
        self.resident = resident
        self.written: dict[int, list[int]] = {}

    def memset(self, address, words, stream, device):
        self.log.append(("memset", words))
        ctypes.memset(address, 0, 4 * words)

    def _count(self, L, K, args):
        idx_p, pairs, A, M, C, nb, ppb, bc, tok, cnt, pos, sop, srt, barrier = args[:14]
        idx = _memory(idx_p, pairs, torch.int64)
        key = torch.where((idx >= 0) & (idx < L), idx, L)
        blocks = torch.stack([torch.bincount(key[b * ppb:(b + 1) * ppb], minlength=L + 1)[:L] for b in range(nb)])
        assert nb == max(-(-pairs // ppb), 1) and ppb % 256 == 0, (nb, ppb, pairs)
        _memory(bc, nb * L, torch.int32).copy_((blocks.cumsum(0) - blocks).flatten())
        total = blocks.sum(0)
        _memory(tok, L, torch.int64).copy_(torch.full_like(total, C) if C else (total + A - 1) // A * A)
        _memory(cnt, L, torch.int64).copy_(total.clamp(max=C) if C else total)
        self.written[tok] = _memory(tok, 2 * L, torch.int64).tolist()

    def _place(self, L, K, args):
        from ep_moe import permute as P

        idx_p, pairs, A, M, C, nb, ppb, bc, tok, cnt, pos, sop, srt, barrier = args[:14]
        assert _memory(tok, 2 * L, torch.int64).tolist() == self.written.pop(tok), "the counts were overwritten"
        idx = _memory(idx_p, pairs, torch.int64).view(-1, K)
        want = P._expert_layout_torch(idx, L, A, None if C else M, C)
        assert want.num_slots == M, (want.num_slots, M)
        _memory(pos, M, torch.int64).copy_(want.pair_of_slot)
        _memory(sop, pairs, torch.int64).copy_(want.slot_of_pair.flatten())
        _memory(srt, pairs, torch.int64).copy_(want.sorted_slots.flatten())

    def function(self, L: int, K: int, name: str, signature):
        device = self

        class _Fake:
            def __init__(self):
                self.name = name

            def launch(self, grid, block, stream, *args):
                assert len(args) == len(signature), f"{name}: {len(args)} arguments for {len(signature)}"
                device.log.append((name, grid, block))
                if name == "ep_expert_scan":
                    device._count(L, K, args)
                elif name == "ep_expert_sort_rows":
                    device._place(L, K, args)

            def launch_cooperative(self, grid, block, stream, *args):
                assert len(args) == len(signature), f"{name}: {len(args)} arguments for {len(signature)}"
                assert name == "ep_expert_layout" and block == 256 and grid == args[5] <= device.resident, \
                    (name, grid, block, args[5])
                device.log.append(("cooperative", grid, args[-1]))
                barrier = _memory(args[13], 2, torch.int32)  # arrivals, generation
                assert barrier[0] == 0 and (barrier[1] == 0 or not args[-1] & J.PHASE_COUNT), \
                    f"the barrier's words before phase {args[-1]}: {barrier.tolist()}"
                if args[-1] & J.PHASE_COUNT:
                    device._count(L, K, args)
                    barrier[1] += 2 if args[-1] & J.PHASE_PLACE else 1  # the barriers passed, as the kernel's
                if args[-1] & J.PHASE_PLACE:
                    device._place(L, K, args)
                    barrier[1] += 1

        return _Fake()


class _Recorder:
    """Stands in for `expert_major._function`: records each specialization and checks the argument count; the
    layout's kernels run their contract on CPU memory (`_LayoutDevice`)."""

    def __init__(self):
        self.sources: set = set()
        self.device = _LayoutDevice()

    def __call__(self, file, defines, name, signature, device):
        self.sources.add(jit.KernelSource.of(file, dict(defines)))
        if file == "expert_layout.cu":
            values = dict(defines)
            return self.device.function(values["EP_EXPERTS"], values["EP_TOPK"], name, signature)

        class _Launch:
            @staticmethod
            def launch(grid, block, stream, *args):
                assert len(args) == len(signature), f"{name}: {len(args)} arguments for {len(signature)}"

        return _Launch()


@pytest.fixture
def recorder(monkeypatch) -> _Recorder:
    """The launchers on CPU tensors: `_Recorder` for `_function`, no device or stream, no capture, the memset
    and the occupancy of the fake layout device."""
    rec = _Recorder()
    monkeypatch.setattr(J, "_function", rec)
    monkeypatch.setattr(J, "_layout", {})  # the layout's per-specialization cache of what _function gave
    monkeypatch.setattr(J, "_on", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(J, "raw_stream", lambda device: 0)
    monkeypatch.setattr(J, "device_index", lambda t: 0)
    monkeypatch.setattr(J, "memset_zero_async", rec.device.memset)
    monkeypatch.setattr(J, "_resident_blocks", lambda fn, device: rec.device.resident)
    return rec


@pytest.mark.parametrize("dtype, hidden", [("bf16", 7168), ("fp32", 37), ("bf16", 6)])
def test_warmup_covers_every_specialization_of_a_pass(recorder, dtype, hidden):
    N, K, L = 16, 4, 8
    rows_dtype = J.SHAPE_DTYPES[dtype]
    idx = torch.randint(0, L, (N, K))
    pair_of_slot, slot_of_pair, sorted_slots, *_ = J.expert_layout(idx, L, 1, N * K)
    x = torch.zeros(N, hidden, dtype=rows_dtype)
    values = torch.rand(N * K)
    J.permute_rows(x, pair_of_slot, K, None)
    _, slot_values = J.permute_rows(x, pair_of_slot, K, values)
    y, w = torch.zeros(N * K, hidden, dtype=rows_dtype), torch.rand(N * K)
    J.unpermute_sum(y, w, sorted_slots, None, None)  # combine
    J.unpermute_sum(y, None, sorted_slots, None, None)  # permute's backward, rows only
    J.unpermute_sum(y, None, sorted_slots, slot_values, slot_of_pair)  # permute's backward with values
    grad = torch.zeros(N, hidden, dtype=rows_dtype)
    for need_y, need_w in ((True, True), (True, False), (False, True)):
        J.unpermute_sum_backward(grad, y, w, pair_of_slot, K, need_y, need_w)
    J.unpermute_sum_backward(grad, y, None, pair_of_slot, K, True, False)
    warm = set(J.specializations(hidden, K, L, dtype))
    assert recorder.sources == warm, (recorder.sources ^ warm)


LAYOUT_CASES = [  # (routing, N, K, L, A)
    ("random", 37, 4, 16, 1), ("random", 300, 8, 3, 16), ("random", 2000, 8, 256, 128), ("none", 40, 4, 4, 4),
    ("random", 0, 4, 4, 1), ("random", 5, 0, 4, 4), ("one_expert", 500, 6, 8, 1),
]


def _routing(kind: str, N: int, K: int, L: int) -> torch.Tensor:
    if kind == "none":
        return torch.full((N, K), -1, dtype=torch.int64)
    if kind == "one_expert":
        return torch.full((N, K), L - 1, dtype=torch.int64)
    return torch.randint(-1, L + 1, (N, K), generator=torch.Generator().manual_seed(N * 31 + K * 7 + L))


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[f"{c[0]}-N{c[1]}-K{c[2]}-L{c[3]}-A{c[4]}" for c in LAYOUT_CASES])
@pytest.mark.parametrize("mode", ["exact", "fixed", "below", "capacity", "plain", "small_grid"])
def test_layout_launches_and_outputs(recorder, monkeypatch, case, mode):
    """The layout launcher's sequence (a memset of the barrier's words, then one cooperative launch, two at the
    exact size with the host read between; ``plain``: the four plain kernels (the GPU tests' check of the
    cooperative kernel) in its place; no pairs: one launch and
    no read) and its outputs, every kernel run as its contract on the CPU memory it is handed (`_LayoutDevice`):
    equal to the torch definition, so the launcher's addresses, sizes and views are right. ``small_grid``: fewer
    resident blocks than tiles (blocks take several sub-tiles)."""
    from ep_moe import permute as P

    kind, N, K, L, A = case
    idx = _routing(kind, N, K, L)
    pairs = N * K
    exact = P._expert_layout_torch(idx, L, A, None)
    C = 0
    if mode == "exact":
        num_slots, want = -1, exact
    elif mode == "capacity":
        C = max(int(exact.pairs_per_expert.max()) // 2, 1) if pairs else 3
        num_slots, want, A = -1, P._expert_layout_torch(idx, L, 1, None, C), 1
    else:
        num_slots = {"fixed": P.max_slots(N, K, L, A), "plain": exact.num_slots + 5, "small_grid": exact.num_slots,
                     "below": max(exact.num_slots - 2 * A - 1, 0)}[mode]
        want = P._expert_layout_torch(idx, L, A, num_slots)
    if mode == "plain":
        monkeypatch.setattr(J._LayoutKernels, "cooperative", J._LayoutKernels.separately)
    if mode == "small_grid":
        recorder.device.resident = 3
    got = J.expert_layout(idx, L, A, num_slots, C)
    names = ("pair_of_slot", "slot_of_pair", "sorted_slots", "tokens_per_expert", "pairs_per_expert")
    for name, g in zip(names, got):
        w = getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), f"{name} ({mode})"
    host = got[5]
    if mode == "capacity":
        assert host.tolist() == [C] * L
    elif mode == "exact":
        assert torch.equal(host, exact.tokens_per_expert_host)
    else:
        assert host.numel() == 0
    tiles = max(-(-pairs // 256), 1)
    blocks = min(tiles, J.LAYOUT_MAX_BLOCKS, recorder.device.resident)
    nb = max(-(-pairs // (-(-tiles // blocks) * 256)), 1)
    if mode == "plain":
        want_log = [("ep_expert_count", nb, 256), ("ep_expert_scan", 1, J.SCAN_THREADS), ("ep_expert_assign", nb, 256),
                    ("ep_expert_sort_rows", max(-(-N // 256), 1) if K else 1, 256)]
    elif mode == "exact" and pairs:
        want_log = [("memset", 2), ("cooperative", nb, J.PHASE_COUNT), ("cooperative", nb, J.PHASE_PLACE)]
    else:
        want_log = [("memset", 2), ("cooperative", nb, J.PHASE_ALL)]
    assert recorder.device.log == want_log
    if mode == "small_grid" and pairs > 3 * 256:
        assert nb <= 3
    # the outputs are views of one allocation (pair_of_slot apart at the exact size), and no specialization
    # depends on the capacity
    storages = {t.untyped_storage().data_ptr() for t in got[1:5] if t.numel()}
    assert len(storages) <= 1
    if mode != "exact" and pairs and num_slots:
        assert got[0].untyped_storage().data_ptr() in storages
    assert all(set(dict(s.defines)) == {"EP_EXPERTS", "EP_TOPK"} for s in recorder.sources), recorder.sources


def test_layout_signature_matches_the_kernels_parameters():
    """`_LAYOUT_SIG` against ``EP_LAYOUT_PARAMS`` of expert_layout.cu, parameter by parameter."""
    import re

    from ep_moe.native.jit.driver import I32, I64, PTR

    text = (jit.KERNELS_DIR / "expert_layout.cu").read_text()
    body = re.search(r"#define EP_LAYOUT_PARAMS(.*?)\n#define", text, re.S).group(1).replace("\\", " ")
    kinds = []
    for param in body.split(","):
        words = param.replace("*", " * ").split()
        kinds.append(PTR if "*" in words else {"i64": I64, "int": I32}[words[0]])
    assert tuple(kinds) == J._LAYOUT_SIG


def test_specializations_check_their_arguments():
    with pytest.raises(ValueError, match="'dtype'"):
        J.specializations(64, 2, 4, "fp16")
    with pytest.raises(ValueError, match="'topk'"):
        J.specializations(64, 0, 4)


def _compiler(name: str):
    if name == "nvcc":
        path = find_nvcc()[0]
        return NvccCompiler(path) if path and shutil.which("nvcc") else None
    return find_nvrtc()[0]


@pytest.mark.parametrize("name", ["nvcc", "nvrtc"])
def test_every_kernel_source_compiles(tmp_path, name):
    """One specialization of each source (plus 1- and 2-byte words), compiled standalone for sm_90 by nvcc or by
    NVRTC (with no include path but the kernels' folder: no host or toolkit header)."""
    compiler = _compiler(name)
    if compiler is None:
        pytest.skip(f"{name} is not installed here")
    sources = J.specializations(37, 3, 5, "fp32")
    picked = {s.file.name: s for s in sources}  # the last of each file
    picked["words"] = J.specializations(7, 2, 3, "bf16")[1]  # 14-byte rows: 2-byte words
    picked["bytes"] = J.specializations(13, 1, 2, "fp8")[2]  # 13-byte rows: 1-byte words
    from concurrent.futures import ThreadPoolExecutor

    store = jit.KernelCache(tmp_path)
    with ThreadPoolExecutor(4) as pool:
        cubins = list(pool.map(lambda s: jit.build(s, "sm_90", compiler, store), picked.values()))
    assert all(c[:4] == b"\x7fELF" for c in cubins), "a CUBIN is an ELF image"
    names = {"expert_layout.cu": [b"ep_expert_layout", b"ep_expert_count", b"ep_expert_scan", b"ep_expert_assign",
                                  b"ep_expert_sort_rows"],
             "permute_rows.cu": [b"ep_permute_rows"], "unpermute_sum.cu": [b"ep_unpermute_sum"],
             "unpermute_sum_backward.cu": [b"ep_unpermute_sum_backward"]}
    for source, cubin in zip(picked.values(), cubins):
        for name in names[source.file.name]:
            assert b".text." + name + b"\x00" in cubin, f"{source.label}: no kernel {name.decode()}"


@needs_nvcc
def test_the_layout_compiles_for_every_expert_count(tmp_path):
    """expert_layout.cu with nvcc at the extremes of its specialization (1 and 1024 experts: the fused kernel's
    static shared memory, 45 KiB at 1024, must stay under 48 KiB) and an odd top-k: every kernel in the CUBIN."""
    from concurrent.futures import ThreadPoolExecutor

    def build(experts_topk):
        experts, topk = experts_topk
        out = tmp_path / f"layout_{experts}_{topk}.cubin"
        subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-cubin", f"-DEP_EXPERTS={experts}", f"-DEP_TOPK={topk}",
                        str(jit.KERNELS_DIR / "expert_layout.cu"), "-o", str(out)],
                       check=True, capture_output=True, timeout=600)
        return out.read_bytes()

    with ThreadPoolExecutor(3) as pool:
        cubins = list(pool.map(build, [(1, 1), (7, 3), (1024, 8)]))
    for cubin in cubins:
        for name in (b"ep_expert_layout", b"ep_expert_count", b"ep_expert_scan", b"ep_expert_assign",
                     b"ep_expert_sort_rows"):
            assert b".text." + name + b"\x00" in cubin, name


def test_no_top_k_columns_ask_for_no_zero_width_kernel(recorder):
    """K = 0 (rows routed nowhere): the launchers never ask for an EP_TOPK=0 kernel (zero-length arrays)."""
    idx = torch.empty(5, 0, dtype=torch.int64)
    pair_of_slot, slot_of_pair, sorted_slots, tokens, *_ = J.expert_layout(idx, 4, 4, 12)
    assert pair_of_slot.tolist() == [0] * 12 and tokens.tolist() == [0] * 4  # all padding (pair index N*K = 0)
    x = torch.zeros(5, 8, dtype=torch.bfloat16)
    J.permute_rows(x, pair_of_slot, 0, None)
    out, _ = J.unpermute_sum(torch.ones(12, 8), None, sorted_slots, None, None)
    assert torch.equal(out, torch.zeros(5, 8))
    J.unpermute_sum_backward(x, torch.zeros(12, 8, dtype=torch.bfloat16), None, pair_of_slot, 0, True, False)
    assert all(dict(s.defines)["EP_TOPK"] != "0" for s in recorder.sources), recorder.sources


@pytest.mark.parametrize("jit_ok, compiling, want", [
    (True, False, "jit"),
    (False, False, "torch"),  # no JIT kernels (no compiler, no cache)
    (True, True, "jit"),      # a compiled graph runs the custom ops, whose implementations choose alike
])
def test_the_implementation_choice(monkeypatch, jit_ok, compiling, want):
    from types import SimpleNamespace

    from ep_moe import permute as P

    monkeypatch.setattr(jit, "available", lambda: jit_ok)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    assert P.kernel_implementation(SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)) == want
    assert P.kernel_implementation(SimpleNamespace(is_cuda=True, dtype=torch.float64)) == "torch"
    assert P.kernel_implementation(SimpleNamespace(is_cuda=False, dtype=torch.bfloat16)) == "torch"


def test_word_and_pack_widths_follow_every_address_and_the_row_size():
    """`row_word_bytes` / `pack_elements` (one bitwise OR of the addresses) against their definition: the widest
    word dividing the row bytes and every address, and 16-byte packs only where the hidden size and every address
    allow them; views at byte offsets 0-17 of one buffer give every alignment."""
    base = torch.zeros(4096, dtype=torch.uint8)
    views = [base[offset:] for offset in range(18)]
    for row_bytes in (1, 2, 3, 4, 6, 8, 12, 16, 32, 14336):
        for a in views[::3]:
            for b in views:
                want = next(w for w in (16, 4, 2, 1) if row_bytes % w == 0 and a.data_ptr() % w == 0
                            and b.data_ptr() % w == 0)
                assert J.row_word_bytes(row_bytes, a, b) == want, (row_bytes, a.data_ptr() % 16, b.data_ptr() % 16)
    for element_size, hidden in ((2, 7168), (2, 6), (4, 37), (4, 8)):
        vec = 16 // element_size
        for a in views[::4]:
            for b in (None, *views[::5]):
                aligned = all(t is None or t.data_ptr() % 16 == 0 for t in (a, b))
                want = vec if hidden % vec == 0 and aligned else 1
                assert J.pack_elements(element_size, hidden, a, b) == want
