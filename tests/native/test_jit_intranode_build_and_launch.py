"""The JIT intranode module's host side on CPU (`ep_moe.native.jit.intranode`, `params`, `cubin`):

* the ctypes mirrors of ``kernels/kernels.h``: field names and order parsed from the header, and (where nvcc is
  installed) every size and offset as the compiler lays them out, from the generated probe compiled as a host
  program; the launchers' constants likewise, from the CUDA sources themselves;
* the JIT source compiles with nvcc (and NVRTC where a libnvrtc is found), the layout probe too, and every kernel the
  launchers look up is found exactly once in the CUBIN's symbol table;
* the launchers: arguments checked (errors name the argument) before anything is launched, and the parameter structs
  filled as the kernels read them (a recorder stands in for the GPU);
* the copy engine's schedule (`ep_moe.native.jit.copy_engine`) run on host memory by a fake driver: every peer's
  buffer holds what the kernels read, flags written after their chunk's copies, checks before any launch;
* whether the intranode kernels can run (a compiler, or a cache that holds them), and the ``ep-moe env`` lines.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch
from support.bits import assert_bits_equal, bits
from support.native_backend_fakes import FakeData, fake_native_backend
from support_jit import NVCC, header_fields, host_program, needs_nvcc

from ep_moe import native
from ep_moe.backends import native_backend as nb
from ep_moe.buffer.dispatch_handle import DispatchHandle
from ep_moe.config import Config
from ep_moe.native import jit
from ep_moe.native.jit import cubin, expert_major_exchange, launch_args
from ep_moe.native.jit import intranode as I
from ep_moe.native.jit import params as P
from ep_moe.native.jit.compilers import NvccCompiler, find_nvrtc


# ------------------------------------------------------------------------------------------ the mirrors
@pytest.mark.parametrize("struct", P.MIRRORED, ids=lambda s: s.__name__)
def test_mirror_fields_are_the_headers_in_order(struct):
    assert struct.field_names() == header_fields(P.KERNELS_H, struct.__name__)


@needs_nvcc
def test_mirror_layout_equals_the_compilers(tmp_path):
    compiled = host_program(NVCC, tmp_path, P.probe_source(host_program=True), "probe")
    assert P.layout_mismatches(compiled) == []
    assert len(compiled) == len(P.layout_of()) == sum(1 + len(s._fields_) for s in P.MIRRORED)


@needs_nvcc
def test_constants_equal_the_sources(tmp_path):
    """The constants the launchers use, printed by a host program that includes the sources the JIT compiles, and
    the order in which ``ep_intranode_constants`` writes them (the kernel's list is `CONSTANTS`' names)."""
    wrapper = (jit.KERNELS_DIR / "intranode.cu").read_text()
    listed = re.search(r"const long long values\[\] = \{(.*?)\};", wrapper, re.S).group(1)
    assert [v.strip() for v in re.split(r",(?![^()]*\))", listed)] == [name for name, _ in P.CONSTANTS]
    offset_of = re.search(r"^#define EP_OFFSET_OF.*$", wrapper, re.M).group(0)
    source = (f'#include "{(jit.KERNELS_DIR / "dispatch_layout.cuh").as_posix()}"\n'
              f'#include "{(jit.KERNELS_DIR / "intranode_kernels.cuh").as_posix()}"\n'
              f"#include <cstdio>\n{offset_of}\nint main() {{\n  using namespace ep_moe;\n  const long long values[] = {{"
              + listed + "};\n  for (long long v : values) std::printf(\"%lld\\n\", v);\n}\n")
    compiled = host_program(NVCC, tmp_path, source, "constants")
    assert P.constant_mismatches(compiled) == []
    # the copy-engine flags' offset, read from the device at first use: as the sum of Control's members before it
    ranks, chunks, experts = P.MAX_RANKS, dict(P.CONSTANTS)["kMaxChunks"], dict(P.CONSTANTS)["kMaxNotifyExperts"]
    before = 8 * ranks + 8 * 2 * ranks + 4 * 2 * ranks * ranks + 4 * 2 * ranks + 4 * 2 * ranks * experts
    assert compiled[-1] == before + 2 * 8 * ranks * chunks, "Control's members before copy_engine_flag changed"


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
    assert {f"ep_moe/native/kernels/{name}" for name in ("dispatch_layout.cuh", "intranode_kernels.cuh", "common.cuh",
                                                         "kernels.h", "rtc_prelude.h")} == set(inputs["headers"]), \
        "the cache key covers every header the JIT build includes"


def test_the_probe_keys_alike_wherever_it_is_written(tmp_path):
    """The probe is generated into the cache folder: its key must not depend on that folder (or on where the
    package is installed), so that a cache warmed on one machine serves another."""
    keys = [jit.cache_key(jit.key_inputs(jit.KernelSource.of(I.probe_file(tmp_path / d)), "c 1", "sm_90"))
            for d in ("a", "b/c")]
    assert keys[0] == keys[1]
    assert set(jit.key_inputs(jit.KernelSource.of(I.probe_file(tmp_path / "a")), "c 1", "sm_90")["headers"]) == {
        "ep_moe/native/kernels/kernels.h", "ep_moe/native/kernels/rtc_prelude.h"}


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

    def launch_params(self, grid, block, stream, *params, shared_bytes=0):
        copies = [type(p).from_buffer_copy(p) if isinstance(p, ctypes.Structure) else p.value for p in params]
        self.calls.append((self.name, grid, block, copies[0], shared_bytes, copies[1:]))

    def launch_prepared(self, grid, block, stream, args, shared_bytes=0):
        """A prepared struct (reused across calls): copied as it is at the launch, as the driver copies it."""
        struct = _PREPARED_TYPES[self.name.split("_")[0]]
        self.calls.append((self.name, grid, block, struct.from_buffer_copy(struct.from_address(args[0])),
                           shared_bytes, []))


_PREPARED_TYPES = {"layout": P.LayoutParams, "notify": P.NotifyParams, "dispatch": P.DispatchParams,
                   "combine": P.CombineParams}


@pytest.fixture
def recorded(monkeypatch):
    """The launchers on CPU tensors: contiguity checked but not the device, pinned memory assumed, launches
    recorded."""
    calls: list = []
    loaded: list = []

    class _Fake:
        fn = {name: _Recorder(name, calls) for name in I.KERNELS}

    def check(t, name):
        if not t.is_contiguous():
            raise I._fail(f"argument '{name}' must be a contiguous CUDA tensor")

    monkeypatch.setattr(I, "kernels", lambda device: _Fake)
    monkeypatch.setattr(expert_major_exchange, "kernels", lambda device: loaded.append(device))  # Env loads them early
    monkeypatch.setattr(I, "_check_cuda", check)
    monkeypatch.setattr(launch_args, "check_cuda", check)  # what `_ptr` and `_check_all` fall back to
    monkeypatch.setattr(I, "_is_pinned", lambda t: not t.is_cuda)
    monkeypatch.setattr(I, "_device", lambda t: 0)
    monkeypatch.setattr(I, "_raw_stream", lambda device: 0)
    monkeypatch.setattr(I, "host_device_pointer", lambda ptr, device: ptr)
    monkeypatch.setattr(I, "_zero", lambda device, t, stream: t.zero_())  # cuMemsetD32Async
    return calls


def _env(ranks=2, rank=1):
    return I.Env(rank, [0x1000 * (r + 1) for r in range(ranks)], torch.zeros(8, dtype=torch.int64),
                 torch.zeros(I.ERROR_WORDS + I.MISMATCH_WORDS, dtype=torch.int32), 5_000_000_000, 16, 32, 4)


def test_env_fills_the_kernel_env_and_checks_its_arguments(recorded, monkeypatch):
    loaded = []
    monkeypatch.setattr(expert_major_exchange, "kernels", lambda device: loaded.append(device))
    _env(1, 0)
    assert loaded == [], "one rank: no fused expert-major path, nothing more to load"
    env = _env(3, 2)
    assert loaded == [0], "the fused paths' expert-major ops are loaded with the Env, not in a first call"
    assert (env.env.rank, env.env.num_ranks, list(env.env.ctrl)[:4]) == (2, 3, [0x1000, 0x2000, 0x3000, 0])
    assert (env.env.timeout_ns, env.env.chunks_per_pair, env.env.min_chunk_rows, env.combine_chunks_per_pair) == \
        (5_000_000_000, 16, 4, 32)
    assert env.env.state == env.state.data_ptr() and env.env.error == env.error.data_ptr()
    state, error = torch.zeros(8, dtype=torch.int64), torch.zeros(I.ERROR_WORDS + I.MISMATCH_WORDS, dtype=torch.int32)
    for args, match in (((0, [1] * 9, state, error, 1, 1, 1, 1), "'ctrl_ptrs' must hold 1 to 8"),
                        ((2, [1, 2], state, error, 1, 1, 1, 1), "'rank' must be in \\[0, 2\\)"),
                        ((0, [1], torch.zeros(2), error, 1, 1, 1, 1), "'state' must hold at least 64 bytes"),
                        ((0, [1], state, torch.zeros(4, dtype=torch.int32), 1, 1, 1, 1), "'error' must be a pinned"),
                        ((0, [1], state, error, 1, 0, 1, 1), "'dispatch_chunks' must be in \\[1, 256\\]"),
                        ((0, [1], state, error, 1, 1, 257, 1), "'combine_chunks'"),
                        ((0, [1], state, error, 1, 1, 1, 0), "'min_chunk_rows' must be >= 1")):
        with pytest.raises(ValueError, match=match):
            I.Env(*args)


def test_env_maps_each_pinned_buffer_once(recorded, monkeypatch):
    """The notify's pinned count buffers are mapped once per tensor (no driver call per call), and a new tensor at
    the same address is mapped again (the Env holds the old one, so that cannot happen while it lives)."""
    env = _env()
    looked_up = []
    monkeypatch.setattr(I, "host_device_pointer", lambda ptr, device: looked_up.append(ptr) or ptr + 1)
    args = _notify_args()
    for _ in range(3):
        I.notify(env, **args)
    counts, experts = args["host_counts"], args["host_expert_counts"]
    assert sorted(looked_up) == sorted([counts.data_ptr(), experts.data_ptr()])
    assert recorded[-1][3].host_counts == counts.data_ptr() + 1
    I.notify(env, **{**args, "host_counts": counts.clone()})
    assert len(looked_up) == 3


def test_notify_asks_whether_a_buffer_is_pinned_once_per_mapped_tensor(recorded, monkeypatch):
    """``Tensor.is_pinned`` is a CUDA query per call: the notify asks it only for a tensor its Env has not mapped
    (the same object at the same address stays pinned); a new tensor is asked again and refused with the named
    error, and a mapped one that shrank is still refused by its size check."""
    env = _env()
    asked = []
    monkeypatch.setattr(I, "_is_pinned", lambda t: asked.append(t.data_ptr()) or not t.is_cuda)
    args = _notify_args()
    for _ in range(3):
        I.notify(env, **args)
    counts, experts = args["host_counts"], args["host_expert_counts"]
    assert sorted(asked) == sorted([counts.data_ptr(), experts.data_ptr()]), "asked once per tensor"
    monkeypatch.setattr(I, "_is_pinned", lambda t: asked.append(t.data_ptr()) or False)  # nothing else is pinned
    with pytest.raises(ValueError, match="argument 'host_counts' must be pinned"):
        I.notify(env, **{**args, "host_counts": counts.clone()})
    with pytest.raises(ValueError, match="argument 'host_counts' must be pinned"):
        I.notify(env, **{**args, "host_counts": counts[:]})  # another object at the same address: asked again
    with pytest.raises(ValueError, match="argument 'host_expert_counts' must be pinned"):
        I.notify(env, **{**args, "host_expert_counts": experts.clone()})
    with pytest.raises(ValueError, match="argument 'host_counts' must be pinned int32"):
        I.exchange(env, HEADER, None, counts.clone(), None)
    I.exchange(env, HEADER, None, counts, None)  # mapped: no question
    count = len(asked)
    counts.resize_(3)  # same object, same address, too small now
    with pytest.raises(ValueError, match="argument 'host_counts' must be pinned"):
        I.notify(env, **args)
    assert len(asked) == count, "the size check refused it, not the pinned question"


def test_layout_launch(recorded):
    idx = torch.randint(-1, 16, (600, 4))
    per_rank, per_expert, in_rank = I.layout(idx, 16, 4)
    (name, grid, block, p, shared, _), = recorded
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


HEADER = [1, 64, 2, 0, 2, 8, 0, 12345, 0, 0]  # a call's header (agreement's slots, then the native words)


def _notify_args(T=10, R=2):
    return dict(is_token_in_rank=torch.zeros(T, R, dtype=torch.bool), num_tokens_per_rank=torch.zeros(R, dtype=torch.int64),
                rank_prefix_matrix=torch.zeros(R, R, dtype=torch.int32), pos=torch.zeros(T, R, dtype=torch.int32),
                send_list=torch.zeros(R, T, dtype=torch.int32), host_counts=torch.zeros(I._host_words(R), dtype=torch.int32),
                num_worst_tokens=0, rows_capacity=999, topk_idx=torch.zeros(T, 3, dtype=torch.int64),
                experts_per_rank=4, expert_alignment=16, host_expert_counts=torch.zeros(4, dtype=torch.int64),
                header=HEADER, test_perturb=None)


def test_notify_launch_and_checks(recorded):
    env = _env()
    args = _notify_args()
    I.notify(env, **args)
    (name, grid, block, p, shared, _), = recorded
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
                copy_engine_shares=[], copy_engine_tokens=[], host_prefix=[], cached_src_idx=None, header=HEADER,
                test_perturb=None, rows_in_place=False)


def test_dispatch_launch_and_checks(recorded):
    env = _env()
    args = _dispatch_args()
    I.dispatch(env, **args)
    (name, grid, block, p, shared, _), = recorded
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
           ({"copy_engine_seq": 3}, "no pusher blocks and the go word"),
           ({"trace": torch.zeros(5, dtype=torch.int64)}, "'trace' must be int64 with 6 slots per block"))
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            I.dispatch(env, **{**args, **change})
    assert len(recorded) == 2, "no launch after a failed check"
    # rows left in place: no recv_x rows (N from recv_topk_idx), no recv_scales, never the copy engine
    in_place = {**args, "rows_in_place": True, "recv_x": torch.zeros(0, 64, dtype=torch.bfloat16)}
    I.dispatch(env, **in_place)
    p = recorded[-1][3]
    assert p.rows_in_place and p.recv_x == 0 and p.num_recv_rows == 9 and p.recv_scales == 0
    for change in ({"recv_x": torch.zeros(9, 64, dtype=torch.bfloat16)}, {"copy_engine_seq": 3},
                   {**cached, "rows_in_place": True}):
        with pytest.raises(ValueError, match="rows in place"):
            I.dispatch(env, **{**in_place, **change})
    assert len(recorded) == 3
    # a cached dispatch with rows in place: N from cached_src_idx (the handle's recv_src_idx), which is not read
    cached_in_place = {**cached, "rows_in_place": True, "recv_x": torch.zeros(0, 64, dtype=torch.bfloat16),
                       "write_arrival": True}
    with pytest.raises(ValueError, match="rows in place"):
        I.dispatch(env, **cached_in_place)
    I.dispatch(env, **{**cached_in_place, "cached_src_idx": torch.zeros(9, dtype=torch.int32)})
    p = recorded[-1][3]
    assert p.rows_in_place and not p.has_topk and p.num_recv_rows == 9 and p.recv_x == 0 and p.cached_src_idx == 0
    assert len(recorded) == 4


def _combine_args(T=5, R=2, H=2048, K=3, N=7, dtype=torch.bfloat16):
    return dict(data_ptrs=[0x10000, 0x20000], off_y=0, off_weights=4096, rows_capacity=100,
                rank_prefix_matrix=torch.zeros(R, R, dtype=torch.int32), is_token_in_rank=torch.zeros(T, R, dtype=torch.bool),
                pos=torch.zeros(T, R, dtype=torch.int32), y=torch.zeros(N, H, dtype=dtype), weights=torch.zeros(N, K),
                bias0=torch.zeros(T, H, dtype=torch.float32), bias1=None, out=torch.zeros(T, H, dtype=dtype),
                out_weights=torch.zeros(T, K), num_blocks=6, num_push_blocks=2, trace=None, copy_engine_streams=[],
                copy_engine_flag_stream=0, copy_engine_seq=0, copy_engine_go=None, copy_engine_shares=[],
                host_prefix=[], bulk_reduce=False, header=HEADER, test_perturb=None, expert_y=None,
                expert_weights=None, sorted_slots=None)


def test_combine_launch_and_checks(recorded):
    env = _env()
    args = _combine_args()
    I.combine(env, **args)
    (name, grid, block, p, shared, _), = recorded
    assert (name, grid, block, shared) == ("combine_bf16", 6, 512, 0)
    assert p.env.chunks_per_pair == 32, "a combine's chunks are the Env's combine chunks"
    assert (p.y_type, p.hidden, p.num_topk, p.has_weights, p.bias0_type, p.bias1_type) == (1, 2048, 3, True, 2, 0)
    assert (p.num_tokens, p.off_weights, p.rows_capacity, p.bulk_reduce, p.bulk_piece16) == (5, 4096, 100, False, 0)
    I.combine(env, **{**_combine_args(dtype=torch.float32, H=7168), "bulk_reduce": True})
    name, _, _, p, shared, _ = recorded[-1]
    assert name == "combine_fp32" and p.bulk_piece16 == I.bulk_piece16(2, 7168 * 4 // 16) > 0
    assert shared == I.bulk_smem_bytes(2, p.bulk_piece16) <= P.CONSTANTS[15][1]
    bad = (({"out": torch.zeros(4, 2048, dtype=torch.bfloat16)}, "'out' must be \\[T, H\\] of y's dtype"),
           ({"y": torch.zeros(7, 2048, dtype=torch.float16), "out": torch.zeros(5, 2048, dtype=torch.float16)},
            "'y' must be bfloat16 or float32"),
           ({"bias1": torch.zeros(5, 2048, dtype=torch.float64)}, "'bias1' must be bfloat16 or float32"),
           ({"out_weights": None}, "'topk_weights' and 'out_weights' go together"),
           ({"out_weights": torch.zeros(5, 2)}, "'out_weights' must be \\[T, K\\]"),
           ({"pos": torch.zeros(2, 2, dtype=torch.int32)}, "'pos' does not match"),
           ({"copy_engine_seq": 1}, "no pusher blocks and the go word"))
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            I.combine(env, **{**args, **change})
    assert len(recorded) == 2
    # an expert-major combine: the expert rows, their weights and slots in the params; y holds the own rows
    expert = dict(expert_y=torch.zeros(11, 2048, dtype=torch.bfloat16), expert_weights=torch.zeros(11),
                  sorted_slots=torch.zeros(7, 3, dtype=torch.int64))
    I.combine(env, **{**args, **expert})
    p = recorded[-1][3]
    assert (p.expert_y, p.expert_weights, p.sorted_slots) == tuple(t.data_ptr() for t in expert.values())
    assert (p.expert_topk, p.expert_slots) == (3, 11)
    for change, match in (({"sorted_slots": None}, "needs 'sorted_slots'"),
                          ({"expert_y": torch.zeros(11, 2048)}, "'expert_y' must be"),
                          ({"sorted_slots": torch.zeros(6, 3, dtype=torch.int64)}, "'sorted_slots' \\[N, K\\]"),
                          ({"expert_weights": torch.zeros(10)}, "'expert_weights' must be \\[M\\]")):
        with pytest.raises(ValueError, match=match):
            I.combine(env, **{**args, **expert, **change})
    assert len(recorded) == 3


def test_bulk_piece16_follows_the_kernels_rule():
    """As kernels/intranode_kernels.cuh's bulk_piece16: the most words per warp pass that fit the budget, rows cut evenly."""
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


def test_header_check_exchange_and_close_epoch(recorded):
    """The rank-agreement header as binding.cpp fills it: the values in order, the copy-engine number in its slot of a
    cached dispatch and a combine, the digest flag; the header exchange and the epoch closing launch their kernels."""
    env = _env()
    I.dispatch(env, **{**_dispatch_args(), "write_arrival": True})
    check = recorded[-1][3].check
    assert list(check.header) == HEADER and check.digest_from_prefix and check.test_perturb == 0
    I.combine(env, **_combine_args())
    assert recorded[-1][3].check.digest_from_prefix
    I.notify(env, **_notify_args())
    assert not recorded[-1][3].check.digest_from_prefix and list(recorded[-1][3].check.header) == HEADER
    counts = torch.zeros(I._host_words(2), dtype=torch.int32)
    prefix = torch.zeros(2, 2, dtype=torch.int32)
    I.exchange(env, HEADER, prefix, counts, None)
    name, grid, block, env_copy, _, (check, prefix_ptr, host_out) = recorded[-1]
    assert (name, grid, block, env_copy.rank) == ("exchange", 1, 32, 1)
    assert list(check.header) == HEADER and check.digest_from_prefix
    assert prefix_ptr == prefix.data_ptr() and host_out == counts.data_ptr() + 2 * 3 * 4, "after the R x R + R counts"
    I.exchange(env, HEADER, None, counts, None)
    assert not recorded[-1][5][0].digest_from_prefix and recorded[-1][5][1] == 0
    I.close_epoch(env)
    assert recorded[-1][:3] == ("close_epoch", 1, 1)
    for args, match in (((HEADER[:-1], None, counts, None), "'header' must hold 10"),
                        (([1 << 31] + HEADER[1:], None, counts, None), "does not fit int32"),
                        ((HEADER, None, counts[:5], None), "'host_counts'"),
                        ((HEADER, torch.zeros(3, dtype=torch.int32), counts, None), "'prefix'"),
                        ((HEADER, None, counts, torch.zeros(2, dtype=torch.int32)), "'test_header_perturbation'")):
        with pytest.raises(ValueError, match=match):
            I.exchange(env, *args)


def test_barrier_launch(recorded):
    env = _env(4, 3)
    I.barrier(env)
    (name, grid, block, p, shared, _), = recorded
    assert (name, grid, block, shared, p.rank, p.num_ranks) == ("barrier", 1, 32, 0, 3, 4)
    assert I.LAUNCHES["barrier"] >= 1


# ------------------------------------------------------------------------------------------ can they run
@pytest.fixture
def warm_store(tmp_path, monkeypatch):
    """This process's cache replaced by an empty one under ``tmp_path`` (`jit.process_cache`)."""
    store = jit.KernelCache(tmp_path / "cache")
    monkeypatch.setattr(jit, "_cache", store)
    monkeypatch.setattr(native, "_decided", False)
    monkeypatch.setattr(native, "_jit_intranode", None)
    return store


def _as_if_on_a_gpu(monkeypatch, compiler):
    """The JIT kernels can run (a GPU, the driver) with ``compiler`` (None: none found), on an sm_90 device."""
    monkeypatch.setattr(jit, "unavailable_reason", lambda: None)
    monkeypatch.setattr(jit, "compiler", lambda: (compiler, "found" if compiler else "hidden by the test"))
    monkeypatch.setattr(jit, "device_arch", lambda device: "sm_90")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_kernels_unavailable_where_the_jit_kernels_cannot_run(warm_store, monkeypatch):
    monkeypatch.setattr(jit, "unavailable_reason", lambda: "torch 2.13 is a CPU build")
    assert native.kernels_unavailable_reason() == "torch 2.13 is a CPU build"
    assert not native.kernels_available()
    with pytest.raises(RuntimeError, match="no intranode kernels: torch 2.13 is a CPU build"):
        native.intranode_kernels()


def test_kernels_available_with_a_compiler(warm_store, monkeypatch, tmp_path):
    from support_jit import FakeCompiler

    _as_if_on_a_gpu(monkeypatch, FakeCompiler())
    assert native.kernels_unavailable_reason() is None
    assert native.intranode_kernels() is I and native.intranode_kernels() is I


def test_without_a_compiler_the_kernels_run_from_a_warm_cache_only(warm_store, monkeypatch, tmp_path):
    """No compiler: the intranode kernels are available exactly when the cache holds every one of their builds
    (and the generic expert-major ops') for this architecture, by whatever compiler filled it; `jit.build` then loads
    them without compiling, and a kernel the cache lacks is `JitUnavailable` naming the warm-up."""
    from support_jit import FakeCompiler

    _as_if_on_a_gpu(monkeypatch, None)
    sources = I.specializations() + expert_major_exchange.specializations()
    why = native.kernels_unavailable_reason()
    assert why.startswith("no CUDA compiler (hidden by the test) and the cache ") and "ep-moe jit warmup --arch sm_90" \
        in why and all(s.label in why for s in sources), why
    filler = FakeCompiler(log=tmp_path / "compiles.log")
    for source in sources[:-1]:  # all but one
        jit.build(source, "sm_90", filler, warm_store)
    jit.build(sources[-1], "sm_80", filler, warm_store)  # the last one for another architecture only
    monkeypatch.setattr(native, "_decided", False)
    why = native.kernels_unavailable_reason()
    assert why is not None and sources[-1].label in why and sources[0].label not in why, why
    assert not jit.in_cache(sources[-1], "sm_90") and jit.in_cache(sources[-1], "sm_80")
    jit.build(sources[-1], "sm_90", filler, warm_store)
    monkeypatch.setattr(native, "_decided", False)
    assert native.kernels_unavailable_reason() is None
    assert jit.cached_archs() == {"sm_80", "sm_90"}
    compiled = filler.compiles()
    before = len(jit.history())
    for source in sources:  # what the first use on the device builds: every one from the disk, none compiled
        assert jit.build(source, "sm_90") == warm_store.find_prebuilt(f"{source.label}-sm_90",
                                                                     jit.key_inputs(source, "", "sm_90")).payload
    assert {e.how for e in jit.history()[before:]} == {"disk"} and len(jit.history()) - before == len(sources)
    assert filler.compiles() == compiled
    missing = jit.KernelSource.of("permute_rows.cu", {"EP_ROW_WORDS": 3, "EP_TOPK": 2, "EP_VALUES": 0,
                                                      "EP_WORD_BYTES": 16})
    with pytest.raises(jit.JitUnavailable, match="run `ep-moe jit warmup` with this shape"):
        jit.build(missing, "sm_90")


def test_env_reports_the_kernels(monkeypatch):
    from ep_moe.native.report import ITEMS, format_report

    items = [item for item in ITEMS if item[0] in ("JIT kernels", "intranode kernels")]
    monkeypatch.setattr(jit, "unavailable_reason", lambda: None)
    monkeypatch.setattr(jit, "compiler", lambda: (None, "hidden"))
    monkeypatch.setattr(native, "_decided", None)
    assert format_report(items).splitlines() == [
        "JIT kernels:       available: loaded from the cache only (no compiler), launched from Python (ep_moe.native.jit)",
        "intranode kernels: available: JIT kernels, one build per architecture (ep_moe.native.jit.intranode)"]
    monkeypatch.setattr(jit, "unavailable_reason", lambda: "no CUDA GPU is visible")
    monkeypatch.setattr(native, "_decided", "no CUDA GPU is visible")
    assert format_report(items).splitlines() == [
        "JIT kernels:       unavailable (no CUDA GPU is visible)",
        "intranode kernels: unavailable, and so is the native backend (no CUDA GPU is visible)"]


# ------------------------------------------------------------------------------------------ the copy engine
class _HostOps:
    """The copy engine's driver calls on host memory: copies and flag writes happen at once, and every
    operation is logged per stream, to check the order the GPU would run them in."""

    def __init__(self):
        self.log: dict[int, list] = {}

    def _on(self, stream, op):
        self.log.setdefault(stream, []).append(op)

    def wait_value(self, stream, address, value):
        self._on(stream, ("wait", address, value))

    def write_value(self, stream, address, value):
        ctypes.c_uint64.from_address(address).value = value
        self._on(stream, ("write", address, value))

    def copy(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        self._on(stream, ("copy", dst, nbytes))

    def after_chunk(self, k, before, after):
        self._on(before, ("record", k))
        self._on(after, ("wait_event", k))


FLAGS_OFFSET = 99072  # where Control::copy_engine_flag starts (test_constants_equal_the_sources checks it)


class _Rank:
    """One simulated rank's memory: control block and symmetric data buffer as CPU tensors."""

    def __init__(self, data_bytes):
        self.ctrl = torch.zeros(I.CONTROL_BYTES, dtype=torch.uint8)
        self.data = torch.zeros(data_bytes, dtype=torch.uint8)

    def flag(self, src, k):
        return int(self.ctrl[FLAGS_OFFSET + (src * I.MAX_CHUNKS + k) * 8:][:8].view(torch.int64)[0])


def _layout(num_ranks, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 40, (num_ranks, num_ranks), generator=g)
    counts[0, 1 % num_ranks] = 0  # an empty pair
    return counts.tolist(), [int(v) for v in torch.cumsum(counts, 0).flatten()]


def _check_order(ops, streams, flag_stream, ctrl_ptrs, me, seq):
    """Every copy stream starts by waiting for the go word; each flag write comes after its chunk's copies into
    that peer on its stream (inline), or on the flag stream after the chunk's event, recorded behind the copies."""
    for s in streams:
        assert ops.log[s][0][0] == "wait" and ops.log[s][0][2] == seq
    for stream, entries in ops.log.items():
        for i, op in enumerate(entries):
            if op[0] != "write":
                continue
            peer = next(p for p, base in enumerate(ctrl_ptrs) if base <= op[1] < base + I.CONTROL_BYTES)
            k = (op[1] - ctrl_ptrs[peer] - FLAGS_OFFSET) // 8 - me * I.MAX_CHUNKS
            if flag_stream == 0:
                assert stream == streams[k % len(streams)]
            else:
                assert stream == flag_stream and ("wait_event", k) in entries[:i]
                copy_entries = ops.log[streams[k % len(streams)]]
                assert ("record", k) in copy_entries


@pytest.mark.parametrize("num_ranks, num_streams, flag_stream", [(2, 1, 0), (3, 2, 0), (3, 1, 99), (4, 2, 99)])
def test_copy_engine_combine_lands_every_row_and_flag(recorded, monkeypatch, num_ranks, num_streams, flag_stream):
    ops = _HostOps()
    monkeypatch.setattr(I, "cuda_ops", lambda device: ops)
    monkeypatch.setattr(I.kernels(0), "control_flags_offset", FLAGS_OFFSET, raising=False)
    counts, prefix = _layout(num_ranks, num_ranks * 10 + num_streams)
    hidden, topk, shares, streams = 24, 3, [1, 2, 1], [1000 + i for i in range(num_streams)]
    rows_cap = 200
    y_bytes, w_bytes = hidden * 2, topk * 4
    ranks = [_Rank(rows_cap * (y_bytes + w_bytes)) for _ in range(num_ranks)]
    ctrl = [r.ctrl.data_ptr() for r in ranks]
    data = [r.data.data_ptr() for r in ranks]
    g = torch.Generator().manual_seed(5)
    ys, ws = [], []
    for me in range(num_ranks):
        received = sum(counts[s][me] for s in range(num_ranks))
        y = torch.randn(received, hidden, generator=g).to(torch.bfloat16)
        w = torch.rand(received, topk, generator=g)
        ys.append(y)
        ws.append(w)
        env = I.Env(me, ctrl, torch.zeros(8, dtype=torch.int64), torch.zeros(I.ERROR_WORDS + I.MISMATCH_WORDS, dtype=torch.int32),
                    10**9, 16, 32, 4)
        args = _combine_args(T=5, R=num_ranks, H=hidden, K=topk, N=received)
        args.update(data_ptrs=data, off_y=0, off_weights=rows_cap * y_bytes, rows_capacity=rows_cap, y=y,
                    weights=w, num_push_blocks=0, copy_engine_streams=streams, copy_engine_flag_stream=flag_stream,
                    copy_engine_seq=7 + me, copy_engine_go=torch.zeros(1, dtype=torch.int64),
                    copy_engine_shares=shares, host_prefix=prefix)
        ops.log.clear()
        I.combine(env, **args)
        assert recorded[-1][0] == "combine_bf16", "the kernel goes first"
        assert recorded[-1][3].copy_engine.seq == 7 + me and list(recorded[-1][3].copy_engine.bounds)[:4] == [0, 1, 3, 4]
        _check_order(ops, streams, flag_stream, ctrl, me, 7 + me)
    for q in range(num_ranks):  # q's buffer: the rows q sent each peer s, back, after those of peers below s
        for s in range(num_ranks):
            if s == q or counts[q][s] == 0:
                continue
            first = sum(counts[p][s] for p in range(q))  # where q's rows start among those s received
            base = sum(counts[q][p] for p in range(s) if p != q)
            n = counts[q][s]
            got = ranks[q].data[base * y_bytes:(base + n) * y_bytes]
            assert_bits_equal(got, bits(ys[s][first:first + n]), f"rows {q} sent rank {s}, back in rank {q}")
            got_w = ranks[q].data[rows_cap * y_bytes + base * w_bytes:][:n * w_bytes]
            assert_bits_equal(got_w, bits(ws[s][first:first + n]), f"weights {q} sent rank {s}, back in rank {q}")
            bounds = [0, 1, 3, 4]  # the cumulative shares [1, 2, 1]
            chunks = [k for k in range(3) if n * bounds[k + 1] // 4 > n * bounds[k] // 4]
            assert [ranks[q].flag(s, k) for k in chunks] == [7 + s] * len(chunks)
            assert all(ranks[q].flag(s, k) == 0 for k in range(3) if k not in chunks), "no flag for an empty chunk"


@pytest.mark.parametrize("cached, fp8_scales", [(False, False), (True, False), (False, True)])
def test_copy_engine_dispatch_lands_every_token_and_flag(recorded, monkeypatch, cached, fp8_scales):
    ops = _HostOps()
    monkeypatch.setattr(I, "cuda_ops", lambda device: ops)
    monkeypatch.setattr(I.kernels(0), "control_flags_offset", FLAGS_OFFSET, raising=False)
    num_ranks, hidden, topk, num_scales = 3, 32, 2, 4 if fp8_scales else 0
    counts, prefix = _layout(num_ranks, 3)
    tokens = [max(counts[s]) + 3 for s in range(num_ranks)]
    slot_rows = 64
    rows_cap = slot_rows * num_ranks
    x_bytes = hidden * 2
    offsets = [0, rows_cap * x_bytes, rows_cap * (x_bytes + 4 * num_scales)]
    offsets += [offsets[2] + rows_cap * topk * 8, offsets[2] + rows_cap * topk * 12]
    ranks = [_Rank(offsets[4] + rows_cap * 4) for _ in range(num_ranks)]
    ctrl, data = [r.ctrl.data_ptr() for r in ranks], [r.data.data_ptr() for r in ranks]
    g = torch.Generator().manual_seed(9)
    inputs = []
    for me in range(num_ranks):
        T = tokens[me]
        x = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
        scales = torch.rand(T, num_scales, generator=g) if fp8_scales else None
        idx = torch.randint(0, 12, (T, topk), generator=g)
        w = torch.rand(T, topk, generator=g)
        send = torch.stack([torch.randperm(T, generator=g).to(torch.int32) for _ in range(num_ranks)])
        inputs.append((x, scales, idx, w, send))
        received = prefix[(num_ranks - 1) * num_ranks + me]
        env = I.Env(me, ctrl, torch.zeros(8, dtype=torch.int64), torch.zeros(I.ERROR_WORDS + I.MISMATCH_WORDS, dtype=torch.int32),
                    10**9, 16, 32, 4)
        args = _dispatch_args(T=T, R=num_ranks, H=hidden, K=topk, L=4, N=received, topk=not cached)
        args.update(data_ptrs=data, offsets=offsets, x=x, scales=scales, send_list=send,
                    recv_scales=torch.zeros(received, num_scales) if fp8_scales else None,
                    rows_capacity=rows_cap, num_push_blocks=0, copy_engine_streams=[5, 6], copy_engine_flag_stream=0,
                    copy_engine_seq=3, copy_engine_go=torch.zeros(1, dtype=torch.int64), copy_engine_shares=[1, 1],
                    copy_engine_tokens=tokens, host_prefix=prefix,
                    cached_src_idx=torch.zeros(received, dtype=torch.int32) if cached else None)
        if not cached:
            args.update(topk_idx=idx, topk_weights=w)
        ops.log.clear()
        I.dispatch(env, **args)
        p = recorded[-1][3]
        assert p.copy_engine_slot_rows == slot_rows and list(p.copy_engine_tokens)[:3] == tokens
        _check_order(ops, [5, 6], 0, ctrl, me, 3)
    for d in range(num_ranks):
        for s in range(num_ranks):
            if s == d:
                continue
            x, scales, idx, w, send = inputs[s]
            T, slot = tokens[s], s * slot_rows
            region = ranks[d].data[offsets[0] + slot * x_bytes:][:T * x_bytes]
            where = f"rank {s}'s slot in rank {d}"
            assert_bits_equal(region, bits(x), f"{where}: x")
            if fp8_scales:
                assert_bits_equal(ranks[d].data[offsets[1] + slot * 4 * num_scales:][:T * 4 * num_scales],
                                  bits(scales), f"{where}: scales")
            if not cached:
                n = counts[s][d]
                assert_bits_equal(ranks[d].data[offsets[4] + slot * 4:][:n * 4], bits(send[d, :n]), f"{where}: send list")
                assert_bits_equal(ranks[d].data[offsets[2] + slot * topk * 8:][:T * topk * 8], bits(idx),
                                  f"{where}: topk_idx")
                assert_bits_equal(ranks[d].data[offsets[3] + slot * topk * 4:][:T * topk * 4], bits(w),
                                  f"{where}: topk_weights")
            assert [ranks[d].flag(s, k) for k in range(2)] == [3, 3]


def test_copy_engine_checks_before_any_launch(recorded):
    env = _env()
    go = torch.zeros(1, dtype=torch.int64)
    base = {**_combine_args(), "num_push_blocks": 0, "copy_engine_streams": [5], "copy_engine_seq": 1,
            "copy_engine_go": go, "copy_engine_shares": [1], "host_prefix": [0, 0, 0, 0]}
    for change, match in (({"num_push_blocks": 1}, "no pusher blocks"), ({"copy_engine_go": None}, "go word"),
                          ({"copy_engine_streams": []}, "1 to 4 side streams"),
                          ({"copy_engine_streams": [5, 0]}, "legacy default stream"),
                          ({"copy_engine_flag_stream": 5}, "must not be one of the copy streams"),
                          ({"copy_engine_go": go.int()}, "'copy_engine_go' must be an int64"),
                          ({"copy_engine_shares": [1] * 17}, "1 to 16 shares"),
                          ({"copy_engine_shares": [0]}, "must be in \\[1, 1024\\]"),
                          ({"host_prefix": [0]}, "'host_prefix' must hold the R x R"),
                          ({"host_prefix": [0, 200, 0, 200], "rows_capacity": 100}, "gets 200 rows back"),
                          ({"trace": torch.zeros(6 * 6, dtype=torch.int64)}, "trace needs 129 slots")):
        with pytest.raises(ValueError, match=match):
            I.combine(env, **{**base, **change})
    dispatch = {**_dispatch_args(topk=False), "num_push_blocks": 0, "copy_engine_streams": [5],
                "copy_engine_seq": 1, "copy_engine_go": go, "copy_engine_shares": [1], "copy_engine_tokens": [6, 6],
                "host_prefix": [6, 3, 9, 9], "cached_src_idx": torch.zeros(9, dtype=torch.int32)}
    for change, match in (({"cached_src_idx": None}, "exactly when cached"),
                          ({"copy_engine_tokens": [6, 251]}, "rank 1's 251 tokens do not fit its slot of 250 rows"),
                          ({"copy_engine_tokens": [6, 5]}, "x has 6 tokens but the layout 5"),
                          ({"host_prefix": [6, 3, 9, 8]}, "receives exactly its rows"),
                          ({"cached_src_idx": torch.zeros(9, dtype=torch.int64)}, "'cached_src_idx' must be int32")):
        with pytest.raises(ValueError, match=match):
            I.dispatch(env, **{**dispatch, **change})
    assert recorded == [], "nothing launched"


# ------------------------------------------------------------------------------------------ prepared structs
def test_reused_structs_equal_fresh_ones_call_after_call(recorded):
    """The launchers reuse one parameter struct per Env and kind (setting only what a call can change): after any
    sequence of calls with and without the optional inputs (top-k, scales, rows in place, expert rows, biases,
    weights, traces, other headers, a perturbation), each launched struct equals, byte for byte, the one a fresh Env
    fills for the same call alone."""
    env = _env()
    perturb = torch.zeros(3, dtype=torch.int32)
    expert = dict(expert_y=torch.zeros(11, 2048, dtype=torch.bfloat16), expert_weights=torch.zeros(11),
                  sorted_slots=torch.zeros(7, 3, dtype=torch.int64))
    d, c, n = _dispatch_args(), _combine_args(), _notify_args()
    calls = [
        (I.dispatch, d), (I.dispatch, {**_dispatch_args(topk=False), "write_arrival": True}),
        (I.dispatch, {**d, "rows_in_place": True, "recv_x": torch.zeros(0, 64, dtype=torch.bfloat16)}),
        (I.dispatch, {**d, "scales": torch.zeros(6, 2), "recv_scales": torch.zeros(9, 2),
                      "trace": torch.zeros(8 * I.TRACE_SLOTS, dtype=torch.int64)}),
        (I.dispatch, {**d, "header": [2] + HEADER[1:], "test_perturb": perturb}), (I.dispatch, d),
        (I.dispatch, {**d, "data_ptrs": [0x30000, 0x40000]}), (I.dispatch, d),
        (I.combine, {**c, **expert}), (I.combine, c), (I.combine, {**c, "weights": None, "out_weights": None}),
        (I.combine, {**c, "bias0": None, "bias1": torch.zeros(5, 2048), "bulk_reduce": True}),
        (I.combine, {**_combine_args(dtype=torch.float32), "off_y": 64}), (I.combine, c),
        (I.notify, n), (I.notify, {**n, "host_expert_counts": None, "topk_idx": None}), (I.notify, n),
        (I.notify, {**n, "num_worst_tokens": 5, "header": [3] + HEADER[1:]}),
    ]
    for fn, args in calls:
        fn(env, **args)
        reused = recorded[-1]
        fn(I.Env(1, [0x1000, 0x2000], env.state, env.error, 5_000_000_000, 16, 32, 4), **args)  # same memory
        alone = recorded[-1]
        assert reused[:3] == alone[:3] and reused[4] == alone[4]
        assert bytes(reused[3]) == bytes(alone[3]), f"{reused[0]}: the reused struct differs from a fresh one"
    assert len(env._prepared) == 5, "one struct per kind and fixed inputs (2 dispatch, 2 combine, notify)"
    with pytest.raises(ValueError, match="header value"):  # a header is validated before it is cached
        I.dispatch(env, **{**d, "header": [1 << 40] + HEADER[1:]})


def _new_tensors(args: dict, names: tuple[str, ...], rows: int | None = None) -> dict:
    """``args`` with fresh tensors of the same shapes (other addresses) under ``names``; ``rows``: recv_x's rows."""
    out = dict(args)
    for name in names:
        t = args[name]
        if t is not None:
            shape = (rows, *t.shape[1:]) if name == "recv_x" and rows is not None else t.shape
            out[name] = torch.full(shape, 1, dtype=t.dtype)
    return out


def _bound_values(args: dict, fields: tuple[str, ...], sizes: dict) -> list[int]:
    return [sizes[name] if name in sizes else 0 if args[name] is None else args[name].data_ptr() for name in fields]


def test_a_bound_launch_equals_the_full_launch_of_its_tensors(recorded):
    """A `BoundLaunch` launched with other tensors launches byte for byte the struct the launcher fills for a call
    with those tensors (cached dispatch with and without FP8 scales; combine with weights and a bias, and without; a
    dispatch with top-k; a notify with and without the per-expert counts); calls that cannot be bound return None."""
    env = _env()
    scaled = {**_dispatch_args(topk=False), "scales": torch.zeros(6, 2), "recv_scales": torch.zeros(9, 2)}
    for first in ({**_dispatch_args(topk=False), "write_arrival": True}, {**scaled, "write_arrival": True}):
        bound = I.dispatch(env, **first, bind=True)
        assert isinstance(bound, I.BoundLaunch) and bound.fields.names == I.DISPATCH_BOUND, "one run, one pack"
        later = _new_tensors(first, ("rank_prefix_matrix", "send_list", "x", "scales", "recv_x", "recv_scales"),
                             rows=4)
        later["recv_scales"] = None if first["scales"] is None else torch.ones(4, 2)
        bound(*_bound_values(later, I.DISPATCH_BOUND, {"num_recv_rows": 4}))
        I.dispatch(env, **later)
        (b_name, *b_launch, b_struct, b_shared, _), (f_name, *f_launch, f_struct, f_shared, _) = recorded[-2:]
        assert (b_name, b_launch, b_shared) == (f_name, f_launch, f_shared)
        assert bytes(b_struct) == bytes(f_struct), "the bound launch differs from the launcher's for its tensors"
        assert b_struct.x == later["x"].data_ptr() and b_struct.num_recv_rows == 4
    c = {**_combine_args(), "summation_order": torch.zeros(5, 2, dtype=torch.int32)}
    for first in (c, {**c, "weights": None, "out_weights": None, "bias0": None, "summation_order": None}):
        bound = I.combine(env, **first, bind=True)
        later = _new_tensors(first, I.COMBINE_BOUND)
        bound(*_bound_values(later, I.COMBINE_BOUND, {}))
        I.combine(env, **later)
        (b_name, *b_launch, b_struct, b_shared, _), (f_name, *f_launch, f_struct, f_shared, _) = recorded[-2:]
        assert (b_name, b_launch, b_shared) == (f_name, f_launch, f_shared)
        assert bytes(b_struct) == bytes(f_struct), "the bound combine differs from the launcher's for its tensors"
    launched = len(recorded)
    with pytest.raises(ValueError, match="does not fit its field"):
        bound(*_bound_values(later, I.COMBINE_BOUND, {})[:-1], -1)  # a negative address
    assert len(recorded) == launched, "no launch after a value that does not fit"
    # what cannot be bound: rows in place, an expert-major combine
    in_place = {**_dispatch_args(topk=False), "write_arrival": True, "rows_in_place": True,
                "recv_x": torch.zeros(0, 64, dtype=torch.bfloat16), "cached_src_idx": torch.zeros(9, dtype=torch.int32)}
    assert I.dispatch(env, **in_place, bind=True) is None
    expert = dict(expert_y=torch.zeros(11, 2048, dtype=torch.bfloat16), expert_weights=torch.zeros(11),
                  sorted_slots=torch.zeros(7, 3, dtype=torch.int64))
    assert I.combine(env, **{**_combine_args(), **expert}, bind=True) is None
    fresh, n = _dispatch_args(), _notify_args()
    for kind, first, fields, sizes in (
            ("dispatch", fresh, I.FRESH_DISPATCH_BOUND, {"num_recv_rows": 5}),
            ("notify", n, I.NOTIFY_BOUND, {}),
            ("notify", {**n, "topk_idx": None, "host_expert_counts": None}, I.NOTIFY_BOUND, {})):
        bound = getattr(I, kind)(env, **first, bind=True)
        again = _new_tensors(first, tuple(f for f in fields if f not in sizes), rows=5)
        for name in ("recv_topk_idx", "recv_topk_weights", "recv_src_idx", "recv_src_rank") if sizes else ():
            again[name] = again[name][:5].clone()
        if first.get("host_expert_counts", 0) is None:  # the notify reads no top-k then: its field stays 0
            bound(*_bound_values(again, fields[:-1], sizes), 0)
        else:
            bound(*_bound_values(again, fields, sizes))
        getattr(I, kind)(env, **again)
        (b_name, *b_launch, b_struct, b_shared, _), (f_name, *f_launch, f_struct, f_shared, _) = recorded[-2:]
        assert (b_name, b_launch, b_shared) == (f_name, f_launch, f_shared)
        assert bytes(b_struct) == bytes(f_struct), f"the bound {kind} differs from the launcher's for its tensors"


def test_the_backend_binds_cached_dispatches_and_combines_where_its_full_path_only_launches(recorded, monkeypatch):
    """The native backend's bound calls (one rank, the launchers on CPU tensors): the second full-path call of a key
    binds its launch, and a cached dispatch or a combine goes through that launch from then on, launching the struct
    its full path would launch (byte for byte, the fresh outputs' addresses aside), for another exact-size layout too
    unless its rows need a larger buffer or the policy wants the copy engine; traced or perturbed calls, another data
    buffer and other shapes take the full path. A fixed-size
    dispatch launches its notify and dispatch through bound launches likewise, into the tensors it returns, and from
    its third call on skips the host path for its key."""
    b = fake_native_backend(0, 1, None, 64 << 20)
    env = I.Env(0, [0x1000], torch.zeros(8, dtype=torch.int64),
                torch.zeros(I.ERROR_WORDS + I.MISMATCH_WORDS, dtype=torch.int32), 5_000_000_000, 16, 32, 4)
    b._buffer_env, b._envs = env, {b.options: env}
    full = {"dispatch": 0, "combine": 0, "notify": 0}

    class Counted:  # the intranode module, counting the launcher calls (the full paths)
        def __getattr__(self, name):
            return getattr(I, name)

        def notify(self, *args, **kwargs):
            full["notify"] += 1
            return I.notify(*args, **kwargs)

        def dispatch(self, *args, **kwargs):
            full["dispatch"] += 1
            return I.dispatch(*args, **kwargs)

        def combine(self, *args, **kwargs):
            full["combine"] += 1
            return I.combine(*args, **kwargs)

    counted = Counted()
    monkeypatch.setattr(nb, "_c", lambda: counted)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    T, H, K = 6, 64, 2
    ints = dict(dtype=torch.int32)

    def handle(worst: int = 0) -> DispatchHandle:
        route = torch.zeros(2, T, 1, **ints)
        made = DispatchHandle(torch.tensor([[T]], **ints), torch.arange(T, **ints), torch.zeros(T, **ints),
                              torch.ones(T, 1, dtype=torch.bool), -1 if worst else T, worst, route)
        if not worst:  # an exact-size dispatch's layout, as the backend remembers it
            b._remember_layout(route, T, [[T]], [T])
        return made

    config = Config(num_sms=8)

    def cached(h, x=None):
        x = torch.randn(T, H).to(torch.bfloat16) if x is None else x
        return b.dispatch(x, None, None, None, h.is_token_in_rank, None, h, 0, 1, h.num_worst_tokens, config).recv_x

    def combine(h, weights=True):
        w = torch.rand(T, K) if weights else None
        return b.combine(torch.randn(T, H).to(torch.bfloat16), h, w, (None, None), config)[0]

    def took_full(op, call) -> bool:
        before = full[op]
        out = call()
        struct = recorded[-1][3]
        assert (struct.recv_x if op == "dispatch" else struct.out) == out.data_ptr()
        return full[op] == before + 1

    def binds_at_its_second_call(op, call) -> bool:
        return took_full(op, call) and took_full(op, call) and not took_full(op, call)

    exact, fixed = handle(), handle(worst=T)
    for h in (exact, fixed):
        assert binds_at_its_second_call("dispatch", lambda h=h: cached(h))
        assert binds_at_its_second_call("combine", lambda h=h: combine(h))
        assert took_full("combine", lambda h=h: combine(h, weights=False)), "another key: no top-k weights"
    # the bound launch equals the full path's, byte for byte, with the fresh output's address set alike
    x = torch.randn(T, H).to(torch.bfloat16)
    for op, call in (("dispatch", lambda: cached(exact, x)), ("combine", lambda: combine(exact))):
        assert not took_full(op, call)
        bound = type(recorded[-1][3]).from_buffer_copy(recorded[-1][3])
        saved, b._bound = b._bound, {}
        assert took_full(op, call)
        b._bound = saved
        want = recorded[-1][3]
        for name in ("recv_x",) if op == "dispatch" else ("y", "weights", "out", "out_weights"):
            setattr(bound, name, getattr(want, name))  # fresh tensors per call
        assert bytes(bound) == bytes(want), f"{op}: the bound launch differs from the full path's"
    # another exact-size layout takes the bound calls at once where its rows fit and the policy keeps it off the
    # copy engine; where the policy wants the copy engine or the rows need a larger buffer, the full path decides
    def bound_takes(h: DispatchHandle) -> tuple[bool, bool]:
        y = torch.randn(T, H).to(torch.bfloat16)
        return (b._bound_cached_dispatch(y, None, h, config) is not None,
                b._bound_combine(y, h, torch.rand(T, K), (None, None), config) is not None)

    assert bound_takes(handle()) == (True, True)
    with monkeypatch.context() as m:
        m.setattr(nb.policy, "wanted_for_dispatch", lambda *args: True)
        assert bound_takes(handle()) == (False, True)
        m.setattr(nb.policy, "wanted", lambda *args: True)
        assert bound_takes(handle()) == (False, False)
    too_many = handle()
    b._route_layout[id(too_many.backend_state)] = (1 << 40, [[T]], [T], {})  # rows that need a larger buffer
    assert bound_takes(too_many) == (False, False)
    b.trace_kernels = True
    assert took_full("dispatch", lambda: cached(exact)) and took_full("combine", lambda: combine(exact))
    b.trace_kernels = False
    b.test_header_perturbation = torch.zeros(3, **ints)
    assert took_full("dispatch", lambda: cached(exact)) and took_full("combine", lambda: combine(exact))
    b.test_header_perturbation = None
    b._data = FakeData(64 << 20)
    assert binds_at_its_second_call("dispatch", lambda: cached(exact)), "another data buffer: another key"
    assert took_full("dispatch", lambda: cached(exact, torch.randn(T, 2 * H).to(torch.bfloat16)[:, :H])), \
        "x not contiguous: the full path copies it"
    # a fixed-size dispatch with top-k: its notify and its dispatch launch bound from the second call on
    topk_idx, weights = torch.randint(0, 8, (T, K)), torch.rand(T, K)
    in_rank, per_rank = torch.ones(T, 1, dtype=torch.bool), torch.tensor([T], **ints)

    def fresh():
        return b.dispatch(x, None, topk_idx, weights, in_rank, per_rank, None, 8, 1, 2 * T, config)

    launches = []
    for _ in range(3):
        before = dict(full)
        result = fresh()
        launches.append([recorded[-2][3], recorded[-1][3]])  # notify, dispatch
        took = (full["notify"] - before["notify"], full["dispatch"] - before["dispatch"])
    assert took == (0, 0), "the third fixed-size dispatch goes through the launches the second bound"
    h = result.handle
    returned = {"rank_prefix_matrix": h.rank_prefix_matrix, "pos": h.backend_state[0], "send_list": h.backend_state[1],
                "recv_x": result.recv_x, "recv_topk_idx": result.recv_topk_idx,
                "recv_topk_weights": result.recv_topk_weights, "recv_src_idx": h.recv_src_idx,
                "recv_src_rank": h.recv_src_rank, "num_recv_per_expert": result.num_recv_tokens_per_expert}
    for struct in launches[2]:  # the bound launches wrote into the tensors the call returned
        for name, t in returned.items():
            if hasattr(struct, name):
                assert getattr(struct, name) == t.data_ptr(), f"{type(struct).__name__}.{name}"
    # the third call took the whole call's bound launches: the host path (its header, its fit) does not run for the
    # key again, and any change of the key (another copy-engine number in the header, another tensor's shape or
    # layout) takes it
    def host_path_runs(call) -> bool:
        ran = []
        with monkeypatch.context() as m:
            m.setattr(b, "_header", lambda *args, **kw: ran.append(1) or nb.NativeBackend._header(b, *args, **kw))
            call()
        return bool(ran)

    assert not host_path_runs(fresh)
    b._copy_seq += 1
    assert host_path_runs(fresh), "another copy-engine number: another header"
    b._copy_seq -= 1
    for other in (lambda: b.dispatch(x, None, topk_idx, torch.rand(K, T).t(), in_rank, per_rank, None, 8, 1, 2 * T,
                                     config),
                  lambda: b.dispatch(x, None, topk_idx, weights, in_rank, per_rank, None, 16, 1, 2 * T, config),
                  lambda: b.dispatch(x, None, topk_idx, weights, in_rank, per_rank.long(), None, 8, 1, 2 * T, config)):
        assert host_path_runs(other), "non-contiguous weights, other experts, int64 counts: the full path"
    b._bound.clear()
    fresh()
    for bound, want in zip(launches[2], (recorded[-2][3], recorded[-1][3])):
        bound = type(bound).from_buffer_copy(bound)
        outputs = ("rank_prefix_matrix", "pos", "send_list") if isinstance(bound, P.NotifyParams) else (
            "rank_prefix_matrix", "send_list", "recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx",
            "recv_src_rank", "num_recv_per_expert")
        for name in outputs:  # fresh tensors per call
            setattr(bound, name, getattr(want, name))
        assert bytes(bound) == bytes(want), f"{type(want).__name__}: the bound launch differs from the full path's"


def test_layout_zeroes_its_counts_without_torch_fills(recorded, monkeypatch):
    zeroed = []
    monkeypatch.setattr(I, "_zero", lambda device, t, stream: zeroed.append(t.numel()) or t.zero_())
    for experts, ranks in ((16, 4), (6, 3), (5, 5)):
        zeroed.clear()
        per_rank, per_expert, _ = I.layout(torch.randint(-1, experts, (300, 4)), experts, ranks)
        padded = (experts + 3) // 4 * 4
        assert zeroed == [padded + ranks], "one memset over both counts (the padding between them too), no fills"
        assert (per_expert.shape, per_rank.shape) == ((experts,), (ranks,))
        assert per_expert.data_ptr() % 16 == 0 and per_rank.data_ptr() % 16 == 0, "both 16-byte aligned"
        assert per_rank.data_ptr() >= per_expert.data_ptr() + 4 * experts, "the two do not overlap"


def _reference_struct(kind: str, env, a: dict):
    """The parameter struct of a call without a copy engine, filled field by field
    (the launchers' first, attribute-by-attribute version): the oracle of the launchers' batched field writes."""
    def ptr(t):
        return 0 if t is None else t.data_ptr()

    if kind == "notify":
        p = P.NotifyParams()
        p.env = env.env
        p.is_token_in_rank, p.num_tokens_per_rank = ptr(a["is_token_in_rank"]), ptr(a["num_tokens_per_rank"])
        p.counts_int64 = a["num_tokens_per_rank"].dtype == torch.int64
        p.num_tokens = a["is_token_in_rank"].shape[0]
        p.rank_prefix_matrix, p.pos, p.send_list = ptr(a["rank_prefix_matrix"]), ptr(a["pos"]), ptr(a["send_list"])
        p.host_counts = ptr(a["host_counts"])
        p.num_worst_tokens, p.rows_capacity = a["num_worst_tokens"], a["rows_capacity"]
        p.check = I.header_check(a["header"], False, a["test_perturb"])
        if a["host_expert_counts"] is not None:
            p.topk_idx, p.num_topk = ptr(a["topk_idx"]), a["topk_idx"].shape[1]
            p.experts_per_rank, p.expert_alignment = a["experts_per_rank"], a["expert_alignment"]
            p.host_expert_counts = ptr(a["host_expert_counts"])
        return p
    if kind == "dispatch":
        p = P.DispatchParams()
        p.env = env.env
        for r, value in enumerate(a["data_ptrs"]):
            p.data[r] = value
        p.off_x, p.off_scales, p.off_idx, p.off_weights, p.off_src = a["offsets"]
        x, topk, in_place = a["x"], a["topk_idx"], a["rows_in_place"]
        p.rank_prefix_matrix, p.send_list = ptr(a["rank_prefix_matrix"]), ptr(a["send_list"])
        p.num_tokens, p.x, p.x_bytes = x.shape[0], ptr(x), x.shape[1] * x.element_size()
        p.has_scales, p.scales = a["scales"] is not None, ptr(a["scales"])
        p.num_scales = a["scales"].shape[1] if a["scales"] is not None else 0
        p.has_topk, p.topk_idx, p.topk_weights = topk is not None, ptr(topk), ptr(a["topk_weights"])
        p.num_topk = topk.shape[1] if topk is not None else 0
        p.experts_per_rank = a["experts_per_rank"]
        p.recv_x = 0 if in_place else ptr(a["recv_x"])
        for name in ("recv_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "recv_src_rank",
                     "expert_scratch", "num_recv_per_expert"):
            setattr(p, name, ptr(a[name]))
        p.num_recv_rows = a["recv_topk_idx"].shape[0] if in_place else a["recv_x"].shape[0]
        p.rows_in_place, p.expert_alignment, p.rows_capacity = in_place, a["expert_alignment"], a["rows_capacity"]
        p.write_arrival, p.num_blocks, p.num_push_blocks = a["write_arrival"], a["num_blocks"], a["num_push_blocks"]
        p.trace = ptr(a["trace"])
        p.check = I.header_check(a["header"], a["write_arrival"], a["test_perturb"])
        return p
    p = P.CombineParams()
    p.env = env.env
    p.env.chunks_per_pair = env.combine_chunks_per_pair
    for r, value in enumerate(a["data_ptrs"]):
        p.data[r] = value
    y, w = a["y"], a["weights"]
    p.off_y, p.off_weights, p.rows_capacity = a["off_y"], a["off_weights"], a["rows_capacity"]
    p.rank_prefix_matrix, p.is_token_in_rank, p.pos = (ptr(a["rank_prefix_matrix"]), ptr(a["is_token_in_rank"]),
                                                        ptr(a["pos"]))
    p.num_tokens, p.y, p.y_type, p.hidden = a["is_token_in_rank"].shape[0], ptr(y), I.ELEM_TYPES[y.dtype], y.shape[1]
    p.has_weights, p.weights, p.num_topk = w is not None, ptr(w), w.shape[1] if w is not None else 0
    p.out_weights, p.bias0, p.bias1 = ptr(a["out_weights"]), ptr(a["bias0"]), ptr(a["bias1"])
    p.bias0_type = I.ELEM_TYPES[a["bias0"].dtype] if a["bias0"] is not None else 0
    p.bias1_type = I.ELEM_TYPES[a["bias1"].dtype] if a["bias1"] is not None else 0
    p.out, p.num_blocks, p.num_push_blocks, p.trace = ptr(a["out"]), a["num_blocks"], a["num_push_blocks"], ptr(a["trace"])
    p.bulk_reduce = a["bulk_reduce"]
    if a["expert_y"] is not None:
        p.expert_y, p.expert_weights, p.sorted_slots = ptr(a["expert_y"]), ptr(a["expert_weights"]), ptr(a["sorted_slots"])
        p.expert_topk, p.expert_slots = a["sorted_slots"].shape[1], a["expert_y"].shape[0]
    p.check = I.header_check(a["header"], True, a["test_perturb"])
    p.bulk_piece16 = I.bulk_piece16(env.env.num_ranks, y.shape[1] * y.element_size() // 16) if a["bulk_reduce"] else 0
    return p


def test_launched_structs_equal_the_field_by_field_reference(recorded):
    """Every launched struct (prepared, batched field writes) equals byte for byte the one filled attribute by
    attribute from the same arguments, over calls that set and unset every optional input in turn."""
    env = _env()
    expert = dict(expert_y=torch.zeros(11, 2048, dtype=torch.bfloat16), expert_weights=torch.zeros(11),
                  sorted_slots=torch.zeros(7, 3, dtype=torch.int64))
    d, c, n = _dispatch_args(), _combine_args(), _notify_args()
    calls = [
        ("dispatch", d), ("dispatch", {**_dispatch_args(topk=False), "write_arrival": True}),
        ("dispatch", {**d, "rows_in_place": True, "recv_x": torch.zeros(0, 64, dtype=torch.bfloat16)}),
        ("dispatch", {**d, "scales": torch.zeros(6, 2), "recv_scales": torch.zeros(9, 2),
                      "trace": torch.zeros(8 * I.TRACE_SLOTS, dtype=torch.int64), "test_perturb":
                      torch.zeros(3, dtype=torch.int32)}),
        ("dispatch", {**d, "expert_alignment": 16, "rows_capacity": 1 << 33}), ("dispatch", d),
        ("combine", {**c, **expert}), ("combine", c), ("combine", {**c, "weights": None, "out_weights": None}),
        ("combine", {**c, "bias0": None, "bias1": torch.zeros(5, 2048), "bulk_reduce": True}),
        ("combine", {**_combine_args(dtype=torch.float32, H=7168), "bulk_reduce": True}), ("combine", c),
        ("notify", n), ("notify", {**n, "host_expert_counts": None, "topk_idx": None}),
        ("notify", {**n, "num_tokens_per_rank": torch.zeros(2, dtype=torch.int32), "num_worst_tokens": 7}),
    ]
    for kind, args in calls:
        getattr(I, kind)(env, **args)
        got = recorded[-1][3]
        want = _reference_struct(kind, env, args)
        for name in type(want).field_names():  # a named difference first, then every byte (padding too)
            a, b = getattr(got, name), getattr(want, name)
            if isinstance(a, ctypes.Structure):
                a, b = bytes(a), bytes(b)
            elif isinstance(a, ctypes.Array):
                a, b = list(a), list(b)
            assert a == b, f"{kind}: field {name}"
        assert bytes(got) == bytes(want), kind


def test_field_writer_checks_its_run_and_values():
    w = P.FieldWriter(P.LayoutParams, ("num_tokens", "num_topk", "num_experts", "num_ranks"))
    p = P.LayoutParams(topk_idx=7, num_tokens_per_rank=8)
    w.write(memoryview(p).cast("B"), 1, 2, 3, 4)
    assert (p.topk_idx, p.num_tokens, p.num_topk, p.num_experts, p.num_ranks, p.num_tokens_per_rank) == (7, 1, 2, 3, 4, 8)
    with pytest.raises(ValueError, match="LayoutParams: a value does not fit its field"):
        w.write(memoryview(p).cast("B"), 1 << 40, 2, 3, 4)
    with pytest.raises(ValueError, match="must be a run in the struct's order"):
        P.FieldWriter(P.LayoutParams, ("num_tokens", "num_experts"))
    with pytest.raises(ValueError, match="must be a run in the struct's order"):
        P.FieldWriter(P.LayoutParams, ("num_topk", "num_tokens"))
    with pytest.raises(ValueError, match="is not a scalar"):
        P.FieldWriter(P.KernelEnv, ("num_ranks", "ctrl"))


def test_the_inline_checks_name_the_first_bad_tensor():
    """`_ptr` and `_check_all` (the launchers' checks, inline on the usual path) raise the same named ValueError as
    `_check_cuda` for a tensor that is not a contiguous CUDA tensor (here: CPU tensors, the real checks)."""
    t = torch.zeros(4, 4)
    assert I._ptr(None, "bias0") == 0
    with pytest.raises(ValueError, match="argument 'bias0' must be a contiguous CUDA tensor"):
        I._ptr(t, "bias0")
    with pytest.raises(ValueError, match="argument 'y' must be a contiguous CUDA tensor"):
        I._check_all(("y", "out"), t, t)


def test_structs_come_from_the_header_and_bad_declarations_are_named(tmp_path):
    """The ctypes structs are read from the header (a field added there appears, in place, with C's layout); a
    declaration the reader does not know raises naming the header, the struct and the line."""
    header = tmp_path / "h.h"
    header.write_text("struct Inner {\n  int a;  // a comment\n  bool b;\n};\nstruct Outer {\n  Inner inner;\n"
                      "  const float* p, *q;\n  int64_t n[kMaxRanks + 1];\n  int x, y;\n};\n")
    inner = P.struct_from_header(header, "Inner")
    outer = P.struct_from_header(header, "Outer", {"Inner": inner})
    assert outer.field_names() == ["inner", "p", "q", "n", "x", "y"]
    assert (ctypes.sizeof(inner), outer.p.offset, outer.n.offset, outer.x.offset) == (8, 8, 24, 24 + 8 * 9)
    assert ctypes.sizeof(outer) == 24 + 8 * 9 + 8
    for body, words in (("  double d;", "unknown type 'double'"), ("  int m[kNoSuch];", "'kNoSuch'"),
                        ("  int f(int);", "cannot read")):
        header.write_text(f"struct Bad {{\n{body}\n}};\n")
        with pytest.raises(ValueError, match=rf"h\.h: struct Bad: .*{re.escape(words)}"):
            P.struct_from_header(header, "Bad")
    with pytest.raises(ValueError, match="no 'struct Missing"):
        P.struct_from_header(header, "Missing")
