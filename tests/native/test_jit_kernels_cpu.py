"""The JIT expert-major kernels' host side on CPU: ``ep-moe jit warmup`` and ``list`` (with a fake compiler), the
``ep-moe env`` lines, that `specializations` (what warmup compiles) covers every specialization the launchers ask
for in a forward and backward pass, with the argument count of each kernel's signature, and, where nvcc is
installed, that every kernel source compiles standalone with it (``nvcc -std=c++17 -arch=sm_90 -cubin``), and
likewise with NVRTC where a libnvrtc is found."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from support_jit import FakeCompiler

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
        "expert_major_csrc.cu[]-sm_90" in listing and "expert_layout.cu[EP_EXPERTS=32,EP_TOPK=8]-sm_90" in listing
    assert listing.startswith(str(tmp_path / "cache" / "jit")), "the JIT cache is $EP_MOE_CACHE_DIR/jit"
    assert jit_cli.main(["list", "--cache-dir", str(tmp_path / "elsewhere")]) == 0
    assert "0 cached kernels" in capsys.readouterr().out


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


class _Recorder:
    """Stands in for `expert_major._function`: records each specialization and checks the argument count."""

    def __init__(self):
        self.sources: set = set()

    def __call__(self, file, defines, name, signature, device):
        self.sources.add(jit.KernelSource.of(file, dict(defines)))

        class _Launch:
            @staticmethod
            def launch(grid, block, stream, *args):
                assert len(args) == len(signature), f"{name}: {len(args)} arguments for {len(signature)}"

        return _Launch()


@pytest.mark.parametrize("dtype, hidden", [("bf16", 7168), ("fp32", 37), ("bf16", 6)])
def test_warmup_covers_every_specialization_of_a_pass(monkeypatch, dtype, hidden):
    recorder = _Recorder()
    monkeypatch.setattr(J, "_function", recorder)
    monkeypatch.setattr(J, "_layout", {})  # the layout's per-specialization cache of what _function gave
    monkeypatch.setattr(J, "_on", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(J, "_stream", lambda device: 0)
    monkeypatch.setattr(J, "_device_of", lambda t: 0)
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
    names = {"expert_layout.cu": [b"ep_expert_count", b"ep_expert_scan", b"ep_expert_assign", b"ep_expert_sort_rows"],
             "permute_rows.cu": [b"ep_permute_rows"], "unpermute_sum.cu": [b"ep_unpermute_sum"],
             "unpermute_sum_backward.cu": [b"ep_unpermute_sum_backward"]}
    for source, cubin in zip(picked.values(), cubins):
        for name in names[source.file.name]:
            assert b".text." + name + b"\x00" in cubin, f"{source.label}: no kernel {name.decode()}"


def test_no_top_k_columns_ask_for_no_zero_width_kernel(monkeypatch):
    """K = 0 (rows routed nowhere): the launchers never ask for an EP_TOPK=0 kernel (zero-length arrays)."""
    recorder = _Recorder()
    monkeypatch.setattr(J, "_function", recorder)
    monkeypatch.setattr(J, "_layout", {})  # the layout's per-specialization cache of what _function gave
    monkeypatch.setattr(J, "_on", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(J, "_stream", lambda device: 0)
    monkeypatch.setattr(J, "_device_of", lambda t: 0)
    idx = torch.empty(5, 0, dtype=torch.int64)
    pair_of_slot, slot_of_pair, sorted_slots, tokens, *_ = J.expert_layout(idx, 4, 4, 12)
    assert pair_of_slot.tolist() == [0] * 12 and tokens.tolist() == [0] * 4  # all padding (pair index N*K = 0)
    x = torch.zeros(5, 8, dtype=torch.bfloat16)
    J.permute_rows(x, pair_of_slot, 0, None)
    out, _ = J.unpermute_sum(torch.ones(12, 8), None, sorted_slots, None, None)
    assert torch.equal(out, torch.zeros(5, 8))
    J.unpermute_sum_backward(x, torch.zeros(12, 8, dtype=torch.bfloat16), None, pair_of_slot, 0, True, False)
    assert all(dict(s.defines)["EP_TOPK"] != "0" for s in recorder.sources), recorder.sources


@pytest.mark.parametrize("env, extension, jit_ok, triton, compiling, want", [
    ("", True, True, True, False, "native"),     # the extension first by default
    ("", False, True, True, False, "jit"),       # no extension: JIT before Triton
    ("", False, False, True, False, "triton"),   # no compiler: Triton
    ("", False, False, False, False, "torch"),
    ("1", True, True, True, False, "jit"),       # EP_MOE_JIT=1 prefers JIT
    ("1", True, False, True, False, "native"),   # ... but not when it cannot run
    ("0", False, True, True, False, "triton"),   # EP_MOE_JIT=0 never
    ("1", True, True, True, True, "native"),     # torch.compile traces the extension's ops
    ("", False, True, True, True, "torch"),      # ... and the torch definitions otherwise
])
def test_the_implementation_choice(monkeypatch, env, extension, jit_ok, triton, compiling, want):
    from types import SimpleNamespace

    from ep_moe import native
    from ep_moe import permute as P

    monkeypatch.setenv("EP_MOE_JIT", env)
    monkeypatch.setattr(native, "extension_available", lambda: extension)
    monkeypatch.setattr(jit, "available", lambda: jit_ok)
    monkeypatch.setattr(P.permute_triton, "available", lambda: triton)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    assert P.kernel_implementation(SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)) == want
    assert P.kernel_implementation(SimpleNamespace(is_cuda=True, dtype=torch.float64)) == "torch"
    assert P.kernel_implementation(SimpleNamespace(is_cuda=False, dtype=torch.bfloat16)) == "torch"
