"""The JIT intranode module's host side on CPU (`ep_moe.native.jit.intranode`, `params`, `cubin`):

* the ctypes mirrors of ``csrc/kernels.h``: field names and order parsed from the header, and (where nvcc is
  installed) every size and offset as the compiler lays them out, from the generated probe compiled as a host
  program; the launchers' constants likewise, from the CUDA sources themselves;
* the JIT source compiles with nvcc (and NVRTC where a libnvrtc is found), the layout probe too, and every kernel the
  launchers look up is found exactly once in the CUBIN's symbol table;
* the launchers: arguments checked (errors name the argument) before anything is launched, and the parameter structs
  filled as ``csrc/binding.cpp`` fills them (a recorder stands in for the GPU);
* the choice between the extension and the JIT module (``EP_MOE_JIT``), the copy-engine rules of `policy` for a
  module without one, and the ``ep-moe env`` line.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from ep_moe import NativeOptions, native
from ep_moe.native import jit, policy
from ep_moe.native.jit import cubin
from ep_moe.native.jit import intranode as I
from ep_moe.native.jit import params as P
from ep_moe.native.jit.compilers import NvccCompiler, find_nvcc, find_nvrtc

NVCC = find_nvcc()[0] if shutil.which("nvcc") else None
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here")


# ------------------------------------------------------------------------------------------ the mirrors
def _header_fields(struct: str) -> list[str]:
    """Field names of ``struct`` in kernels.h, in order (declarations ``type a, b;`` and ``type a[N];``)."""
    text = P.KERNELS_H.read_text()
    body = re.search(r"struct " + struct + r" \{(.*?)\n\};", text, re.S)
    assert body, f"struct {struct} not found in kernels.h"
    names = []
    for line in body.group(1).splitlines():
        code = line.split("//")[0].strip()
        if not code:
            continue
        assert code.endswith(";"), f"{struct}: cannot read the declaration {code!r}"
        declarators = re.sub(r"\[[^\]]*\]", "", code[:-1])  # array extents
        first, *rest = declarators.split(",")
        names.append(first.split()[-1].lstrip("*"))
        names += [d.strip().lstrip("*") for d in rest]
    return names


@pytest.mark.parametrize("struct", P.MIRRORED, ids=lambda s: s.__name__)
def test_mirror_fields_are_the_headers_in_order(struct):
    assert struct.field_names() == _header_fields(struct.__name__)


def _host_program(tmp_path, source: str, name: str) -> list[int]:
    path = tmp_path / f"{name}.cu"
    path.write_text(source)
    exe = tmp_path / name
    subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-o", str(exe), str(path)], check=True, capture_output=True,
                   timeout=600)
    return [int(line) for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                                                 timeout=60).stdout.split()]


@needs_nvcc
def test_mirror_layout_equals_the_compilers(tmp_path):
    compiled = _host_program(tmp_path, P.probe_source(host_program=True), "probe")
    assert P.layout_mismatches(compiled) == []
    assert len(compiled) == len(P.layout_of()) == sum(1 + len(s._fields_) for s in P.MIRRORED)


@needs_nvcc
def test_constants_equal_the_sources(tmp_path):
    """The constants the launchers use, printed by a host program that includes the sources the JIT compiles, and
    the order in which ``ep_intranode_constants`` writes them (the kernel's list is `CONSTANTS`' names)."""
    wrapper = (jit.KERNELS_DIR / "intranode.cu").read_text()
    listed = re.search(r"const long long values\[\] = \{(.*?)\};", wrapper, re.S).group(1)
    assert [v.strip() for v in listed.split(",")] == [name for name, _ in P.CONSTANTS]
    source = (f'#include "{(P.CSRC_DIR / "layout.cu").as_posix()}"\n#include "{(P.CSRC_DIR / "intranode.cu").as_posix()}"\n'
              "#include <cstdio>\nint main() {\n  using namespace ep_moe;\n  const long long values[] = {"
              + listed + "};\n  for (long long v : values) std::printf(\"%lld\\n\", v);\n}\n")
    compiled = _host_program(tmp_path, source, "constants")
    assert P.constant_mismatches(compiled) == []


def test_mismatches_name_the_field():
    layout = [value for _, value in P.layout_of()]
    index = [name for name, _ in P.layout_of()].index("DispatchParams.copy_engine")
    layout[index] += 8
    assert P.layout_mismatches(layout) == [
        f"DispatchParams.copy_engine: offset {layout[index]} in kernels.h, {layout[index] - 8} in the mirror"]
    assert "the probe wrote 3 numbers" in P.layout_mismatches([1, 2, 3])[0]
    constants = [value for _, value in P.CONSTANTS]
    constants[0] = 16
    assert P.constant_mismatches(constants) == ["kMaxRanks: 16 in the CUDA sources, 8 in "
                                                "ep_moe.native.jit.params.CONSTANTS"]


# ------------------------------------------------------------------------------------------ compiling
def _compilers():
    found = []
    if NVCC is not None:
        found.append(pytest.param(NvccCompiler(NVCC), id="nvcc"))
    nvrtc = find_nvrtc()[0]
    found.append(pytest.param(nvrtc, id="nvrtc", marks=pytest.mark.skipif(nvrtc is None,
                                                                           reason="nvrtc is not installed here")))
    return found or [pytest.param(None, marks=pytest.mark.skip(reason="no CUDA compiler here"))]


@pytest.mark.parametrize("compiler", _compilers())
def test_the_intranode_source_and_probe_compile_and_hold_every_kernel(tmp_path, compiler):
    store = jit.KernelCache(tmp_path / "cache")
    image = jit.build(I.SOURCE, "sm_90", compiler, store)
    symbols = cubin.function_symbols(image)
    found = {name: cubin.find_kernel(symbols, fragment) for name, fragment in I.KERNELS.items()}
    assert len(set(found.values())) == len(I.KERNELS)
    assert "ep_intranode_constants" in symbols
    probe = jit.build(jit.KernelSource.of(I.probe_file(tmp_path / "src")), "sm_90", compiler, store)
    assert "ep_params_layout" in cubin.function_symbols(probe)
    inputs = jit.key_inputs(I.SOURCE, compiler.identity, "sm_90")
    assert {"../../csrc/intranode.cu", "../../csrc/kernels.h", "../../csrc/rtc_prelude.h"} <= set(inputs["headers"]), \
        "the cache key covers the csrc sources the JIT build includes"


def test_cubin_errors():
    with pytest.raises(cubin.CubinError, match="not a 64-bit"):
        cubin.function_symbols(b"FAKECUBIN")
    names = ["_ZN6ep_moe3_A_13notify_kernelENS_12NotifyParamsE", "_ZN6ep_moe3_B_13notify_kernelENS_12NotifyParamsE",
             "_ZN6ep_moe3_A_13notify_kernelENS_12NotifyParamsE$clone", "ep_intranode_constants"]
    with pytest.raises(cubin.CubinError, match="2 kernels matching '13notify_kernelE'"):
        cubin.find_kernel(names, "13notify_kernelE")
    with pytest.raises(cubin.CubinError, match="0 kernels matching '14barrier_kernelE'"):
        cubin.find_kernel(names, "14barrier_kernelE")
    assert cubin.find_kernel(names[:1] + names[2:], "13notify_kernelE") == names[0]


# ------------------------------------------------------------------------------------------ launchers
class _Recorder:
    """Stands in for a loaded kernel: records every launch (grid, block, a copy of the params, shared bytes)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def launch_params(self, grid, block, stream, params, shared_bytes=0):
        self.calls.append((self.name, grid, block, type(params).from_buffer_copy(params), shared_bytes))


@pytest.fixture
def recorded(monkeypatch):
    """The launchers on CPU tensors: contiguity checked but not the device, pinned memory assumed, launches
    recorded."""
    calls: list = []

    class _Fake:
        fn = {name: _Recorder(name, calls) for name in I.KERNELS}

    def check(t, name):
        if not t.is_contiguous():
            raise I._fail(f"argument '{name}' must be a contiguous CUDA tensor")

    monkeypatch.setattr(I, "kernels", lambda device: _Fake)
    monkeypatch.setattr(I, "_check_cuda", check)
    monkeypatch.setattr(I, "_is_pinned", lambda t: not t.is_cuda)
    monkeypatch.setattr(I, "_device", lambda t: 0)
    monkeypatch.setattr(I, "_raw_stream", lambda device: 0)
    monkeypatch.setattr(I, "host_device_pointer", lambda ptr, device: ptr)
    return calls


def _env(ranks=2, rank=1):
    return I.Env(rank, [0x1000 * (r + 1) for r in range(ranks)], torch.zeros(8, dtype=torch.int64),
                 torch.zeros(I.ERROR_WORDS, dtype=torch.int32), 5_000_000_000, 16, 32, 4)


def test_env_fills_the_kernel_env_and_checks_its_arguments(recorded):
    env = _env(3, 2)
    assert (env.env.rank, env.env.num_ranks, list(env.env.ctrl)[:4]) == (2, 3, [0x1000, 0x2000, 0x3000, 0])
    assert (env.env.timeout_ns, env.env.chunks_per_pair, env.env.min_chunk_rows, env.combine_chunks_per_pair) == \
        (5_000_000_000, 16, 4, 32)
    assert env.env.state == env.state.data_ptr() and env.env.error == env.error.data_ptr()
    state, error = torch.zeros(8, dtype=torch.int64), torch.zeros(I.ERROR_WORDS, dtype=torch.int32)
    for args, match in (((0, [1] * 9, state, error, 1, 1, 1, 1), "'ctrl_ptrs' must hold 1 to 8"),
                        ((2, [1, 2], state, error, 1, 1, 1, 1), "'rank' must be in \\[0, 2\\)"),
                        ((0, [1], torch.zeros(2), error, 1, 1, 1, 1), "'state' must hold at least 64 bytes"),
                        ((0, [1], state, torch.zeros(4, dtype=torch.int32), 1, 1, 1, 1), "'error' must be a pinned"),
                        ((0, [1], state, error, 1, 0, 1, 1), "'dispatch_chunks' must be in \\[1, 256\\]"),
                        ((0, [1], state, error, 1, 1, 257, 1), "'combine_chunks'"),
                        ((0, [1], state, error, 1, 1, 1, 0), "'min_chunk_rows' must be >= 1")):
        with pytest.raises(ValueError, match=match):
            I.Env(*args)


def test_layout_launch(recorded):
    idx = torch.randint(-1, 16, (600, 4))
    per_rank, per_expert, in_rank = I.layout(idx, 16, 4)
    (name, grid, block, p, shared), = recorded
    assert (name, grid, block, shared) == ("layout", 3, 256, 0)
    assert (p.num_tokens, p.num_topk, p.num_experts, p.num_ranks) == (600, 4, 16, 4)
    assert (p.topk_idx, p.num_tokens_per_rank, p.num_tokens_per_expert, p.is_token_in_rank) == (
        idx.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr())
    assert per_rank.tolist() == [0] * 4 and per_expert.dtype == torch.int32 and in_rank.shape == (600, 4)
    I.layout(idx[:0], 16, 4)
    assert len(recorded) == 1, "no tokens: zeroed outputs, no launch"
    with pytest.raises(ValueError, match="'topk_idx' must be \\[T, K\\] int64"):
        I.layout(idx.int(), 16, 4)
    with pytest.raises(ValueError, match="'num_ranks' \\(3\\) and 'num_experts' \\(16\\)"):
        I.layout(idx, 16, 3)


def _notify_args(T=10, R=2):
    return dict(is_token_in_rank=torch.zeros(T, R, dtype=torch.bool), num_tokens_per_rank=torch.zeros(R, dtype=torch.int64),
                rank_prefix_matrix=torch.zeros(R, R, dtype=torch.int32), pos=torch.zeros(T, R, dtype=torch.int32),
                send_list=torch.zeros(R, T, dtype=torch.int32), host_counts=torch.zeros(R * (R + 1), dtype=torch.int32),
                num_worst_tokens=0, rows_capacity=999, topk_idx=torch.zeros(T, 3, dtype=torch.int64),
                experts_per_rank=4, expert_alignment=16, host_expert_counts=torch.zeros(4, dtype=torch.int64))


def test_notify_launch_and_checks(recorded):
    env = _env()
    args = _notify_args()
    I.notify(env, **args)
    (name, grid, block, p, shared), = recorded
    assert (name, grid, block, shared) == ("notify", 3, 1024, 0)
    assert p.env.rank == 1 and p.counts_int64 and p.num_tokens == 10 and p.rows_capacity == 999
    assert (p.num_topk, p.experts_per_rank, p.expert_alignment) == (3, 4, 16)
    assert p.host_counts == args["host_counts"].data_ptr() and p.host_expert_counts == args["host_expert_counts"].data_ptr()
    I.notify(env, **{**args, "host_expert_counts": None, "topk_idx": None})
    assert recorded[-1][3].host_expert_counts == 0 and recorded[-1][3].topk_idx == 0, "counts not exchanged"
    for change, match in (({"is_token_in_rank": torch.zeros(10, 3, dtype=torch.bool)}, "'is_token_in_rank'"),
                          ({"num_tokens_per_rank": torch.zeros(2)}, "'num_tokens_per_rank'"),
                          ({"rank_prefix_matrix": torch.zeros(2, 2, dtype=torch.int64)}, "'rank_prefix_matrix'"),
                          ({"pos": torch.zeros(9, 2, dtype=torch.int32)}, "'pos' and 'send_list'"),
                          ({"host_counts": torch.zeros(5, dtype=torch.int32)}, "'host_counts'"),
                          ({"experts_per_rank": 1025}, "'experts_per_rank' must be in \\[1, 1024\\]"),
                          ({"expert_alignment": 0}, "'expert_alignment'"),
                          ({"topk_idx": None}, "'topk_idx' must be \\[T, K\\] int64"),
                          ({"host_expert_counts": torch.zeros(3, dtype=torch.int64)}, "'host_expert_counts'")):
        with pytest.raises(ValueError, match=match):
            I.notify(env, **{**args, **change})
    assert len(recorded) == 2, "no launch after a failed check"


def _dispatch_args(T=6, R=2, H=64, K=2, L=4, N=9, topk=True):
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    ints = dict(dtype=torch.int32)
    return dict(data_ptrs=[0x10000, 0x20000], offsets=[0, 100, 200, 300, 400],
                rank_prefix_matrix=torch.zeros(R, R, **ints), send_list=torch.zeros(R, T, **ints), x=x,
                scales=None, topk_idx=torch.zeros(T, K, dtype=torch.int64) if topk else None,
                topk_weights=torch.zeros(T, K) if topk else None, experts_per_rank=L,
                recv_x=torch.zeros(N, H, dtype=torch.bfloat16), recv_scales=None,
                recv_topk_idx=torch.zeros(N, K, dtype=torch.int64) if topk else None,
                recv_topk_weights=torch.zeros(N, K) if topk else None,
                recv_src_idx=torch.zeros(N, **ints) if topk else None, recv_src_rank=torch.zeros(N, **ints) if topk else None,
                expert_scratch=torch.zeros(64, **ints) if topk else None,
                num_recv_per_expert=torch.zeros(L, dtype=torch.int64) if topk else None, expert_alignment=1,
                rows_capacity=500, write_arrival=False, num_blocks=8, num_push_blocks=3, trace=None,
                copy_engine_streams=[], copy_engine_flag_stream=0, copy_engine_seq=0, copy_engine_go=None,
                copy_engine_shares=[], copy_engine_tokens=[], host_prefix=[], cached_src_idx=None)


def test_dispatch_launch_and_checks(recorded):
    env = _env()
    args = _dispatch_args()
    I.dispatch(env, **args)
    (name, grid, block, p, shared), = recorded
    assert (name, grid, block, shared) == ("dispatch", 8, 512, 16), "hist[]: 4 bytes per local expert"
    assert list(p.data)[:3] == [0x10000, 0x20000, 0] and (p.off_x, p.off_src) == (0, 400)
    assert (p.num_tokens, p.x_bytes, p.num_recv_rows, p.num_topk, p.has_topk, p.has_scales) == (6, 128, 9, 2, True, False)
    assert (p.num_blocks, p.num_push_blocks, p.rows_capacity, p.write_arrival) == (8, 3, 500, False)
    assert p.copy_engine.seq == 0 and p.cached_src_idx == 0 and p.env.chunks_per_pair == 16
    assert p.recv_src_rank == args["recv_src_rank"].data_ptr() and p.topk_weights == args["topk_weights"].data_ptr()
    cached = _dispatch_args(topk=False)
    I.dispatch(env, **{**cached, "write_arrival": True})
    assert recorded[-1][4] == 0 and not recorded[-1][3].has_topk and recorded[-1][3].write_arrival
    bad = (({"x": torch.zeros(6, 4, dtype=torch.bfloat16), "recv_x": torch.zeros(9, 4, dtype=torch.bfloat16)},
            "16-byte multiples"),
           ({"recv_x": torch.zeros(9, 64)}, "'x' and 'recv_x' must be \\[\\*, H\\] of one dtype"),
           ({"send_list": torch.zeros(3, 6, dtype=torch.int32)}, "'send_list' does not match x"),
           ({"num_push_blocks": 8}, "bad block split"),
           ({"topk_weights": None}, "'topk_idx' and 'topk_weights' go together"),
           ({"scales": torch.zeros(6, 2)}, "'scales' and 'recv_scales' go together"),
           ({"recv_src_rank": None}, "every top-k output"),
           ({"data_ptrs": [1]}, "'data_ptrs' and 'offsets'"),
           ({"copy_engine_seq": 3}, "no copy engine"),
           ({"trace": torch.zeros(5, dtype=torch.int64)}, "'trace' must be int64 with 6 slots per block"))
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            I.dispatch(env, **{**args, **change})
    assert len(recorded) == 2, "no launch after a failed check"


def _combine_args(T=5, R=2, H=2048, K=3, N=7, dtype=torch.bfloat16):
    return dict(data_ptrs=[0x10000, 0x20000], off_y=0, off_weights=4096, rows_capacity=100,
                rank_prefix_matrix=torch.zeros(R, R, dtype=torch.int32), is_token_in_rank=torch.zeros(T, R, dtype=torch.bool),
                pos=torch.zeros(T, R, dtype=torch.int32), y=torch.zeros(N, H, dtype=dtype), weights=torch.zeros(N, K),
                bias0=torch.zeros(T, H, dtype=torch.float32), bias1=None, out=torch.zeros(T, H, dtype=dtype),
                out_weights=torch.zeros(T, K), num_blocks=6, num_push_blocks=2, trace=None, copy_engine_streams=[],
                copy_engine_flag_stream=0, copy_engine_seq=0, copy_engine_go=None, copy_engine_shares=[],
                host_prefix=[], bulk_reduce=False)


def test_combine_launch_and_checks(recorded):
    env = _env()
    args = _combine_args()
    I.combine(env, **args)
    (name, grid, block, p, shared), = recorded
    assert (name, grid, block, shared) == ("combine_bf16", 6, 512, 0)
    assert p.env.chunks_per_pair == 32, "a combine's chunks are the Env's combine chunks"
    assert (p.y_type, p.hidden, p.num_topk, p.has_weights, p.bias0_type, p.bias1_type) == (1, 2048, 3, True, 2, 0)
    assert (p.num_tokens, p.off_weights, p.rows_capacity, p.bulk_reduce, p.bulk_piece16) == (5, 4096, 100, False, 0)
    I.combine(env, **{**_combine_args(dtype=torch.float32, H=7168), "bulk_reduce": True})
    name, _, _, p, shared = recorded[-1]
    assert name == "combine_fp32" and p.bulk_piece16 == I.bulk_piece16(2, 7168 * 4 // 16) > 0
    assert shared == I.bulk_smem_bytes(2, p.bulk_piece16) <= P.CONSTANTS[15][1]
    bad = (({"out": torch.zeros(4, 2048, dtype=torch.bfloat16)}, "'out' must be \\[T, H\\] of y's dtype"),
           ({"y": torch.zeros(7, 2048, dtype=torch.float16), "out": torch.zeros(5, 2048, dtype=torch.float16)},
            "'y' must be bfloat16 or float32"),
           ({"bias1": torch.zeros(5, 2048, dtype=torch.float64)}, "'bias1' must be bfloat16 or float32"),
           ({"out_weights": None}, "'topk_weights' and 'out_weights' go together"),
           ({"out_weights": torch.zeros(5, 2)}, "'out_weights' must be \\[T, K\\]"),
           ({"pos": torch.zeros(2, 2, dtype=torch.int32)}, "'pos' does not match"),
           ({"copy_engine_seq": 1}, "combine_copy_engine"))
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            I.combine(env, **{**args, **change})
    assert len(recorded) == 2


def test_bulk_piece16_follows_the_kernels_rule():
    """As csrc/intranode.cu's bulk_piece16: the most words per warp pass that fit the budget, rows cut evenly."""
    header, budget = dict(P.CONSTANTS)["kBulkHeaderBytes"], dict(P.CONSTANTS)["kBulkSmemBudget"]
    for ranks in range(1, 9):
        for n16 in (0, 1, 31, 32, 448, 896, 1792, 4096):
            piece = I.bulk_piece16(ranks, n16)
            if n16 == 0:
                assert piece == 0
                continue
            assert piece % 32 == 0 and piece > 0
            assert I.bulk_smem_bytes(ranks, piece) <= budget, (ranks, n16)
            assert I.bulk_smem_bytes(ranks, piece) == header + 16 * 2 * ranks * piece * 16
            pieces = -(-n16 // piece)
            assert piece * (pieces - 1) < n16 <= piece * pieces


def test_barrier_launch(recorded):
    env = _env(4, 3)
    I.barrier(env)
    (name, grid, block, p, shared), = recorded
    assert (name, grid, block, shared, p.rank, p.num_ranks) == ("barrier", 1, 32, 0, 3, 4)
    assert I.LAUNCHES["barrier"] >= 1


# ------------------------------------------------------------------------------------------ choice and policy
@pytest.mark.parametrize("env_value, aot, jit_reason, expected", [
    ("1", True, None, "jit"), ("1", False, "no compiler", None), ("0", True, None, "aot"), ("0", False, None, None),
    (None, True, None, "aot"), (None, False, None, "jit"), (None, False, "torch 2.13 is a CPU build", None),
    ("yes", True, None, None)])
def test_kernels_choice(monkeypatch, env_value, aot, jit_reason, expected):
    if env_value is None:
        monkeypatch.delenv("EP_MOE_JIT", raising=False)
    else:
        monkeypatch.setenv("EP_MOE_JIT", env_value)
    monkeypatch.setattr(native, "_C", object() if aot else None)
    monkeypatch.setattr(native, "_choices", {})
    monkeypatch.setattr(jit, "unavailable_reason", lambda: jit_reason)
    assert native.kernels_kind() == expected
    why = native.kernels_unavailable_reason()
    assert (why is None) == (expected is not None)
    if expected is None:
        with pytest.raises(RuntimeError, match="no intranode kernels"):
            native.intranode_kernels()
        if env_value == "1":
            assert "EP_MOE_JIT=1 asks for the JIT kernels" in why and jit_reason in why
        elif env_value == "0":
            assert "EP_MOE_JIT=0 turns the JIT kernels off" in why
        elif env_value == "yes":
            assert "EP_MOE_JIT='yes'" in why
        else:
            assert jit_reason in why and "ep_moe.native._C is unavailable" in why
    elif expected == "jit":
        assert native.intranode_kernels() is I and I.KIND == "jit" and not I.COPY_ENGINE


def test_ranks_must_use_one_build():
    assert native.kinds_disagree(["jit", "jit"]) is None
    assert native.kinds_disagree(["aot", "jit", "aot"]) == (
        "the ranks use different builds of the native kernels (rank 0: extension, rank 1: JIT, rank 2: extension); "
        "set EP_MOE_JIT alike on every rank")


def test_policy_without_a_copy_engine():
    on = NativeOptions(dispatch_copy_engine="on", combine_copy_engine="auto")
    with pytest.raises(ValueError, match="field 'dispatch_copy_engine' is 'on'.*no copy engine"):
        policy.check_copy_engine(on, available=False, num_ranks=2)
    policy.check_copy_engine(on, available=False, num_ranks=1)  # one rank never uses it
    policy.check_copy_engine(on, available=True, num_ranks=8)
    policy.check_copy_engine(NativeOptions(), available=False, num_ranks=8)
    big = [[0, 1 << 20], [1 << 20, 0]]
    auto = NativeOptions()
    assert policy.wanted(auto, big, 7168 * 2) and not policy.wanted(auto, big, 7168 * 2, available=False)
    tokens = [1 << 20, 1 << 20]
    assert policy.wanted_for_dispatch(auto, big, tokens, 7168 * 2, cached=True)
    assert not policy.wanted_for_dispatch(auto, big, tokens, 7168 * 2, cached=True, available=False)


def test_env_reports_which_build(monkeypatch):
    from ep_moe.native.report import ITEMS, format_report

    monkeypatch.setattr(native, "_choices", {None: ("jit", None), "1": ("jit", None), "0": (None, "why not")})
    text = format_report([item for item in ITEMS if item[0] == "intranode kernels"])
    assert text.startswith("intranode kernels: ")
    if native._kernels_choice()[0] == "jit":
        assert "JIT: csrc's kernels compiled on first use" in text and "copy engine: no" in text
