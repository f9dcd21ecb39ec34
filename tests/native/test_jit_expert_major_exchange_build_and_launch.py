"""The generic expert-major ops (`ep_moe.native.jit.expert_major_exchange`:
``permute_received_rows``, ``unpermute_own_rows``, ``routing_map_to_topk`` and its backward) on CPU:

* the ctypes mirrors of ``kernels/expert_major.h``: field names and order parsed from the header, and (where nvcc is
  installed) every size and offset and the launchers' constants as the compiler sees them;
* the JIT source compiles with nvcc (and NVRTC where a libnvrtc is found) and holds every instantiation the
  launchers look up, exactly once; its cache key covers every header it includes;
* the launchers, end to end on CPU tensors: a fake launch runs each kernel's contract in Python on the memory the
  parameter struct points at (so every pointer, size and the chosen instantiation are checked) and the results
  equal the torch definitions bit for bit; arguments checked (errors name them) before anything is launched;
* who calls them: `ep_moe.permute.permute_received_rows`, the native backend's own rows (`_own_rows`) and fused
  modes, and the Megatron integration's routing map, where the JIT kernels run.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch
from support.bits import assert_bits_equal
from support_jit import NVCC, header_fields, host_program, needs_nvcc

from ep_moe import permute as P
from ep_moe.native import jit
from ep_moe.native.jit import cubin, launch_args
from ep_moe.native.jit import expert_major_exchange as E
from ep_moe.native.jit import params as M
from ep_moe.native.jit.compilers import NvccCompiler, find_nvrtc


# ------------------------------------------------------------------------------------------ mirrors and source
@pytest.mark.parametrize("struct", M.EXPERT_MAJOR_MIRRORED, ids=lambda s: s.__name__)
def test_mirror_fields_are_the_headers_in_order(struct):
    assert struct.field_names() == header_fields(M.EXPERT_MAJOR_H, struct.__name__)


@needs_nvcc
def test_mirror_layout_and_constants_equal_the_compilers(tmp_path):
    probe = M.probe_source(M.EXPERT_MAJOR_MIRRORED, host_program=True, header=M.EXPERT_MAJOR_H)
    assert M.layout_mismatches(host_program(NVCC, tmp_path, probe, "probe"), M.EXPERT_MAJOR_MIRRORED) == []
    wrapper = E.SOURCE.file.read_text()
    listed = re.search(r"const long long values\[\] = \{(.*?)\};", wrapper, re.S).group(1)
    assert [v.strip() for v in listed.split(",")] == [name for name, _ in M.EXPERT_MAJOR_CONSTANTS]
    source = (f'#include "{(jit.KERNELS_DIR / "expert_major_kernels.cuh").as_posix()}"\n'
              "#include <cstdio>\nint main() {\n"
              f"  using namespace ep_moe;\n  const long long values[] = {{{listed}}};\n"
              "  for (long long v : values) std::printf(\"%lld\\n\", v);\n}\n")
    compiled = host_program(NVCC, tmp_path, source, "constants")
    assert M.constant_mismatches(compiled, M.EXPERT_MAJOR_CONSTANTS) == []
    wrong = list(compiled)
    wrong[2] = 5  # kRowBF16 is 0: a zero is checked here (unlike the intranode table's "not checked" zeros)
    assert M.constant_mismatches(wrong, M.EXPERT_MAJOR_CONSTANTS) == [
        "kRowBF16: 5 in the CUDA sources, 0 in ep_moe.native.jit.params.EXPERT_MAJOR_CONSTANTS"]


def _compilers():
    found = [pytest.param(NvccCompiler(NVCC), id="nvcc")] if NVCC else []
    nvrtc = find_nvrtc()[0]
    found.append(pytest.param(nvrtc, id="nvrtc", marks=pytest.mark.skipif(nvrtc is None,
                                                                           reason="nvrtc is not installed here")))
    return found


@pytest.mark.parametrize("compiler", _compilers())
def test_the_source_and_probe_compile_and_hold_every_kernel(tmp_path, compiler):
    store = jit.KernelCache(tmp_path / "cache")
    symbols = cubin.function_symbols(jit.build(E.SOURCE, "sm_90", compiler, store))
    found = {fragment: cubin.find_kernel(symbols, fragment) for fragment in E.KERNELS.values()}
    assert len(set(found.values())) == len(E.KERNELS) == 12
    assert "ep_expert_major_constants" in symbols
    from ep_moe.native.jit.intranode import probe_file

    probe = jit.build(jit.KernelSource.of(probe_file(tmp_path / "src", E.probe_source())), "sm_90", compiler, store)
    assert "ep_params_layout" in cubin.function_symbols(probe)
    assert set(jit.key_inputs(E.SOURCE, compiler.identity, "sm_90")["headers"]) == {
        f"ep_moe/native/kernels/{name}" for name in ("expert_major_kernels.cuh", "expert_major.h", "rtc_prelude.h")}, \
        "the cache key covers every header the JIT build includes"


def test_specializations_are_the_build_and_its_probe():
    source, probe = E.specializations()
    assert source == E.SOURCE and source.defines == () and probe.file.read_text() == E.probe_source()
    assert "expert_major.h's parameter structs" in E.probe_source()


# ------------------------------------------------------------------------------------------ the fake launch
def _view(address: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` at a host ``address`` (no copy): what a kernel reads or writes there."""
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8).view(dtype)


def _permute(p, word):
    """permute_rows_kernel's contract (kernels/expert_major_kernels.cuh) on the memory ``p`` points at."""
    assert p.row_bytes % word == 0 and p.x % word == 0 and p.out % word == 0 and p.own_x % word == 0
    pos = _view(p.pair_of_slot, p.num_slots, torch.int64)
    R = p.num_ranks
    prefix = _view(p.rank_prefix_matrix, R * R, torch.int32).view(R, R) if p.own_x else None
    out = _view(p.out, p.num_slots * p.row_bytes, torch.uint8).view(p.num_slots, p.row_bytes)
    for s in range(p.num_slots):
        pair = int(pos[s])
        valid = 0 <= pair < p.num_pairs
        row = pair // p.num_topk
        src = _view(p.x + row * p.row_bytes, p.row_bytes, torch.uint8) if valid else None
        if valid and p.own_x:
            first = int(prefix[p.rank - 1, p.rank]) if p.rank > 0 else 0
            end = int(prefix[p.rank, p.rank])
            if first <= row < end and row - first < p.num_own_rows:
                t = int(_view(p.own_tokens + 4 * (row - first), 1, torch.int32)[0])
                if 0 <= t < p.num_own_rows:
                    src = _view(p.own_x + t * p.row_bytes, p.row_bytes, torch.uint8)
        out[s] = src if valid else 0
        if p.slot_values:
            _view(p.slot_values + 4 * s, 1, torch.float32)[0] = (
                _view(p.values + 4 * pair, 1, torch.float32)[0] if valid else 0.0)


def _unpermute(p, dtype, vec):
    """unpermute_sum_kernel's contract with the own-rows range: fp32, products rounded, then added, in slot order."""
    assert p.hidden % vec == 0 and (vec == 1 or (p.y % 16 == 0 and p.out % 16 == 0))
    y = _view(p.y, p.num_slots * p.hidden, dtype).view(p.num_slots, p.hidden)
    out = _view(p.out, p.num_rows * p.hidden, dtype).view(p.num_rows, p.hidden)
    slots = _view(p.sorted_slots, p.num_rows * p.num_topk, torch.int64).view(p.num_rows, p.num_topk)
    weights = _view(p.weights, p.num_slots, torch.float32) if p.weights else None
    R = p.num_ranks
    for row in range(p.num_rows):
        if p.rank_prefix_matrix:
            prefix = _view(p.rank_prefix_matrix, R * R, torch.int32).view(R, R)
            first = int(prefix[p.rank - 1, p.rank]) if p.rank > 0 else 0
            if not first <= row < int(prefix[p.rank, p.rank]):
                continue
        acc = torch.zeros(p.hidden)
        for s in slots[row].tolist():
            if 0 <= s < p.num_slots:
                term = y[s].float()
                acc = acc + (weights[s] * term if weights is not None else term)
        out[row] = acc.to(dtype)


def _routing(p, dtype, backward):
    T, E_, K = p.num_tokens, p.num_experts, p.num_topk
    idx = _view(p.topk_idx, T * K, torch.int64).view(T, K)
    weights = _view(p.topk_weights, T * K, torch.float32).view(T, K)
    if backward:
        grad = _view(p.grad_probs, T * E_, dtype).view(T, E_)
        grad.zero_()
        for t in range(T):
            for k in range(K):
                if 0 <= int(idx[t, k]) < E_:
                    grad[t, int(idx[t, k])] = (0.0 + weights[t, k]).to(dtype)
        return
    selected = _view(p.routing_map, T * E_, torch.bool).view(T, E_)
    probs = _view(p.probs, T * E_, dtype).view(T, E_)
    for t in range(T):
        chosen = [e for e in range(E_) if selected[t, e]][:K]
        idx[t] = torch.tensor(chosen + [-1] * (K - len(chosen)))
        weights[t] = torch.tensor([float(probs[t, e]) for e in chosen] + [0.0] * (K - len(chosen)))


class _FakeKernel:
    """Stands in for a loaded kernel: records the launch and runs its contract in Python."""

    def __init__(self, fragment, calls):
        self.fragment, self.calls = fragment, calls

    def launch_prepared(self, grid, block, stream, args, shared_bytes=0):
        # the launchers pass a pointer array to their one struct (prepared_args): copy the struct it points at
        struct = M.PermuteRowsParams if self.fragment in E.PERMUTE_KERNELS.values() else \
            M.UnpermuteSumParams if self.fragment in E.UNPERMUTE_KERNELS.values() else M.RoutingMapParams
        p = struct.from_buffer_copy(struct.from_address(args[0]))
        self.calls.append((self.fragment, grid, block, p))
        word = {f: w for w, f in E.PERMUTE_KERNELS.items()}.get(self.fragment)
        if word is not None:
            return _permute(p, word)
        for (dtype, vec), fragment in E.UNPERMUTE_KERNELS.items():
            if fragment == self.fragment:
                return _unpermute(p, dtype, vec)
        for backward, table in ((False, E.ROUTING_KERNELS), (True, E.ROUTING_BACKWARD_KERNELS)):
            for dtype, fragment in table.items():
                if fragment == self.fragment:
                    return _routing(p, dtype, backward)
        raise AssertionError(f"unknown kernel {self.fragment}")


@pytest.fixture
def launched(monkeypatch):
    """The launchers on CPU tensors (contiguity checked, not the device), their kernels run by `_FakeKernel`."""
    calls: list = []

    class _Fake:
        fn = {fragment: _FakeKernel(fragment, calls) for fragment in E.KERNELS.values()}

    def check(t, op, name, device):  # the device index of a CPU tensor is -1 (`device_index`: t.get_device())
        if t.get_device() != device:
            raise E.fail(f"argument '{name}' must be on {device}, got {t.device}", op)
        if not t.is_contiguous():
            raise E.fail(f"argument '{name}' must be contiguous", op)

    monkeypatch.setattr(E, "kernels", lambda device: _Fake)
    monkeypatch.setattr(E, "check_on", check)
    monkeypatch.setattr(launch_args, "check_on", check)  # what `check_typed` checks first
    monkeypatch.setattr(E, "raw_stream", lambda device: 0)
    return calls


def _received_case(rank, H, dtype, misaligned, seed=0):
    gen = torch.Generator().manual_seed(seed + rank)
    N, K, L, A, T = 21, 3, 5, 4, 9
    counts = torch.tensor([[4, 3, 2], [6, 7, 5], [1, 2, 6]])
    counts[:, rank] = torch.tensor([6, 8, 7])
    counts[rank, rank] = min(T, 8)
    prefix = torch.cumsum(counts, 0).to(torch.int32)
    N = int(prefix[2, rank])
    idx = torch.randint(-1, L, (N, K), generator=gen)
    layout = P._expert_layout_torch(idx, L, A, P.max_slots(N, K, L, A))
    buffer = torch.randn(N + 2, H, generator=gen).to(dtype)
    own = torch.randn(T * H + 1, generator=gen).to(dtype)
    own_x = own[1:].view(T, H) if misaligned else own[:-1].view(T, H)
    own_tokens = torch.randperm(T, generator=gen).to(torch.int32)
    values = torch.rand(N, K, generator=gen)
    return buffer, N, own_x, own_tokens, prefix, layout, values


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("H, dtype, misaligned, word", [(64, torch.bfloat16, False, 16), (64, torch.bfloat16, True, 2),
                                                        (6, torch.float32, False, 4), (3, torch.bfloat16, False, 2),
                                                        (5, torch.float8_e4m3fn, False, 1)])
def test_permute_received_rows_equals_the_torch_definition(launched, rank, H, dtype, misaligned, word):
    buffer, N, own_x, own_tokens, prefix, layout, values = _received_case(rank, H, dtype, misaligned)
    if dtype == torch.float8_e4m3fn:
        buffer, own_x = torch.randint(0, 255, buffer.shape, dtype=torch.uint8).view(dtype), \
            torch.randint(0, 255, own_x.shape, dtype=torch.uint8).view(dtype)
    received = P._received_rows_torch(buffer, N, own_x, own_tokens, prefix, rank)
    for vals in (values, None):
        got, got_values = E.permute_received_rows(buffer, N, own_x, own_tokens, prefix, rank, layout.pair_of_slot,
                                                  layout.num_topk, None if vals is None else vals.flatten())
        fragment, grid, block, p = launched[-1]
        assert fragment == E.PERMUTE_KERNELS[word] and (grid, block) == ((layout.num_slots + 7) // 8, 256)
        assert (p.num_pairs, p.num_topk, p.num_ranks, p.rank, p.num_own_rows) == (N * 3, 3, 3, rank, own_x.shape[0])
        assert_bits_equal(got, P._permute_torch(received, layout.pair_of_slot, 3), "permuted rows")
        if vals is None:
            assert got_values.numel() == 0 and p.values == 0 and p.slot_values == 0
        else:
            assert torch.equal(got_values, P._slot_values_torch(vals, layout.pair_of_slot))


def test_permute_received_rows_checks_before_launching(launched):
    buffer, N, own_x, own_tokens, prefix, layout, values = _received_case(1, 8, torch.bfloat16, False)
    args = (buffer, N, own_x, own_tokens, prefix, 1, layout.pair_of_slot, 3, values.flatten())
    E.permute_received_rows(*args)
    assert len(launched) == 1
    bad = (((0, own_x.float()), "'rows' and 'own_x' must be \\[\\*, H\\] of one dtype"),
           ((1, buffer.shape[0] + 1), "'num_rows' must be in"), ((7, 0), "'num_topk' must be >= 1"),
           ((3, own_tokens.long()), "'own_tokens' must be torch.int32"),
           ((3, own_tokens[:-1]), "'own_tokens' must have a token per row"),
           ((4, prefix.long()), "'rank_prefix_matrix' must be torch.int32"),
           ((5, 3), "'rank_prefix_matrix' must be \\[R, R\\] with 0 <= rank < R"),
           ((6, layout.pair_of_slot.int()), "'pair_of_slot' must be torch.int64"),
           ((8, values.flatten()[1:]), "'values' must have N \\* K"), ((8, values.double().flatten()), "'values'"),
           ((2, own_x.t()), "must be \\[\\*, H\\]|'own_x' must be contiguous"))
    for (at, value), match in bad:
        changed = list(args)
        changed[at] = value
        with pytest.raises(ValueError, match=match):
            E.permute_received_rows(*changed)
    assert len(launched) == 1, "no launch after a failed check"
    E.permute_received_rows(*args[:6], layout.pair_of_slot[:0], 3, None)
    assert len(launched) == 1, "no slots: nothing to launch"


@pytest.mark.parametrize("rank", [0, 2])
@pytest.mark.parametrize("H, dtype, vec", [(16, torch.bfloat16, 8), (12, torch.float32, 4), (6, torch.bfloat16, 1),
                                           (5, torch.float32, 1)])
def test_unpermute_own_rows_equals_unpermute_sum_on_the_own_rows(launched, rank, H, dtype, vec):
    gen = torch.Generator().manual_seed(5 + H)
    N, K, L, A = 30, 3, 4, 4
    idx = torch.randint(-1, L, (N, K), generator=gen)
    layout = P._expert_layout_torch(idx, L, A, P.max_slots(N, K, L, A))
    y = torch.randn(layout.num_slots, H, generator=gen).to(dtype)
    w = torch.rand(layout.num_slots, generator=gen)
    prefix = torch.cumsum(torch.tensor([[5, 7, 9], [11, 13, 6], [9, 10, 15]]), 0).to(torch.int32)
    first, end = (int(prefix[rank - 1, rank]) if rank else 0), int(prefix[rank, rank])
    for weights in (w, None):
        got = E.unpermute_own_rows(y, weights, layout.sorted_slots, prefix, rank)
        fragment, grid, block, p = launched[-1]
        assert fragment == E.UNPERMUTE_KERNELS[(dtype, vec)] and (grid, block) == ((N + 7) // 8, 256)
        assert (p.num_rows, p.num_slots, p.num_topk, p.hidden, p.num_ranks, p.rank) == (
            N, layout.num_slots, K, H, 3, rank)
        assert p.slot_values == 0 and p.pair_values == 0 and (p.weights != 0) == (weights is not None)
        want = P._unpermute_sum_torch(y, weights, layout.sorted_slots)
        assert got.shape == want.shape, (got.shape, want.shape)
        assert_bits_equal(got[first:end], want[first:end], f"reduced rows [{first}, {end})")
    for change, match in (({"y": y.double()}, "'y' must be bfloat16 or float32"),
                          ({"weights": w[1:]}, "'weights' must be \\[M="),
                          ({"sorted_slots": layout.sorted_slots.int()}, "'sorted_slots' must be torch.int64"),
                          ({"rank": 3}, "'rank_prefix_matrix' must be \\[R, R\\]")):
        with pytest.raises(ValueError, match=match):
            E.unpermute_own_rows(**{"y": y, "weights": w, "sorted_slots": layout.sorted_slots,
                                    "rank_prefix_matrix": prefix, "rank": rank, **change})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E_, K", [(300, 16, 4), (20, 3, 4), (0, 8, 2)])
def test_routing_map_to_topk_and_back_equal_the_torch_ops(launched, dtype, T, E_, K):
    gen = torch.Generator().manual_seed(T + E_)
    scores = torch.rand(T, E_, generator=gen)
    routing_map = torch.zeros(T, E_, dtype=torch.bool).scatter_(1, scores.topk(min(K, E_), dim=1).indices, True)
    routing_map[torch.rand(T, E_, generator=gen) < 0.2] = False
    probs = (scores * routing_map).to(dtype)
    idx, w = E.routing_map_to_topk(routing_map, probs, K)
    want_idx, want_w = _routing_torch_definition(routing_map, probs, K)
    assert torch.equal(idx, want_idx) and torch.equal(w, want_w)
    grad = torch.randn(T, K, generator=gen)
    if T:
        grad[0, 0] = -0.0  # becomes +0, as a scatter-add into zeros gives
    got = E.routing_map_to_topk_backward(grad, idx, E_, dtype)
    p_ = probs.clone().requires_grad_()
    _, w_ = _routing_torch_definition(routing_map, p_, K)
    w_.backward(grad)
    assert got.dtype == dtype
    assert_bits_equal(got, p_.grad, "0 + g, rounded to the probs' dtype")
    if T:
        assert [c[0] for c in launched[-2:]] == [E.ROUTING_KERNELS[dtype], E.ROUTING_BACKWARD_KERNELS[dtype]]
        assert launched[-1][1:3] == ((T + 127) // 128, 128)
    else:
        assert not launched, "no tokens: nothing to launch"
    with pytest.raises(ValueError, match="'probs' must be bfloat16 or float32"):
        E.routing_map_to_topk(routing_map, probs.double(), K)
    with pytest.raises(ValueError, match="'num_topk' must be >= 1"):
        E.routing_map_to_topk(routing_map, probs, 0)
    with pytest.raises(ValueError, match="'dtype' must be bfloat16 or float32"):
        E.routing_map_to_topk_backward(grad, idx, E_, torch.float16)
    with pytest.raises(ValueError, match="'topk_idx' must be torch.int64"):
        E.routing_map_to_topk_backward(grad, idx.int(), E_, dtype)


def _routing_torch_definition(routing_map, probs, K):
    """Megatron's dense routing in top-k form by torch ops (the integration's torch path, without importing
    megatron-core): first K selected experts in increasing id, then -1; their probs in fp32."""
    num_experts = routing_map.shape[1]
    key = torch.where(routing_map, torch.arange(num_experts), num_experts)
    width = min(K, num_experts)
    chosen = torch.topk(key, width, dim=1, largest=False, sorted=True).values
    valid = chosen < num_experts
    idx = torch.nn.functional.pad(torch.where(valid, chosen, -1), (0, K - width), value=-1)
    weights = torch.where(valid, probs.gather(1, chosen.clamp(max=num_experts - 1)).float(), 0.0)
    return idx, torch.nn.functional.pad(weights, (0, K - width), value=0.0)


# ------------------------------------------------------------------------------------------ who calls them
def test_permute_received_rows_takes_the_jit_op_when_the_jit_is_chosen(launched, monkeypatch):
    buffer, N, own_x, own_tokens, prefix, layout, values = _received_case(1, 8, torch.bfloat16, False)
    monkeypatch.setattr(P, "kernel_implementation", lambda t: "jit")
    got, got_values = P.permute_received_rows(buffer, N, own_x, own_tokens, prefix, 1, layout, values)
    assert len(launched) == 1 and launched[0][0] == E.PERMUTE_KERNELS[16]
    received = P._received_rows_torch(buffer, N, own_x, own_tokens, prefix, 1)
    want = P._permute_torch(received, layout.pair_of_slot, layout.num_topk)
    want_values = P._slot_values_torch(values, layout.pair_of_slot)
    assert_bits_equal(got, want, "permuted rows")
    assert torch.equal(got_values, want_values)
    monkeypatch.setattr(P, "kernel_implementation", lambda t: "torch")
    P.permute_received_rows(buffer, N, own_x, own_tokens, prefix, 1, layout, values)
    assert len(launched) == 1, "the torch definitions elsewhere"


def test_native_backend_takes_the_jit_ops_where_the_kernels_run(launched, monkeypatch):
    from ep_moe import native
    from ep_moe.backends import native_backend as nb

    y = torch.randn(12, 16).to(torch.bfloat16)
    slots = torch.tensor([[0, 3], [1, -1], [2, 5], [4, -1]])
    prefix = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    monkeypatch.setattr(native, "_decided", None)
    assert nb._expert_major_ops(), "the fused modes are on where the kernels run"
    out = nb._own_rows(y, None, slots, prefix, 1)
    assert launched[-1][0] == E.UNPERMUTE_KERNELS[(torch.bfloat16, 8)]
    assert torch.equal(out[2:4], P._unpermute_sum_torch(y, None, slots)[2:4])
    monkeypatch.setattr(native, "_decided", "no kernels")
    assert not nb._expert_major_ops(), "no kernels: the fused modes are off"


def test_megatron_routing_map_takes_the_jit_op(launched, monkeypatch):
    integ = pytest.importorskip("ep_moe.integrations.megatron")
    monkeypatch.setattr(P, "kernel_implementation", lambda t: "jit")
    routing_map = torch.tensor([[True, False, True], [False, False, False]])
    probs = torch.tensor([[0.25, 0.0, 0.75], [0.0, 0.0, 0.0]]).requires_grad_()
    idx, w = integ.routing_map_to_topk(routing_map, probs, 2, check=False)
    assert idx.tolist() == [[0, 2], [-1, -1]] and w.tolist() == [[0.25, 0.75], [0.0, 0.0]]
    w.backward(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert probs.grad.tolist() == [[1.0, 0.0, 2.0], [0.0, 0.0, 0.0]]
    assert [c[0] for c in launched] == [E.ROUTING_KERNELS[torch.float32], E.ROUTING_BACKWARD_KERNELS[torch.float32]]


def test_each_call_rewrites_every_field_of_the_reused_struct(launched):
    """The ops reuse one parameter struct each (`_Prepared`): a call after another of a different shape, without
    the optional inputs, or of the other routing op must launch exactly the struct a fresh one would hold."""
    gen = torch.Generator().manual_seed(11)
    prefix = torch.tensor([[4, 6], [10, 12]], dtype=torch.int32)
    for N, K, H, weighted in ((12, 3, 16, True), (7, 2, 6, False), (12, 3, 16, False), (5, 4, 8, True)):
        srt = torch.randint(-1, N * K, (N, K), generator=gen)
        y = torch.randn(N * K, H, generator=gen).to(torch.bfloat16)
        w = torch.rand(N * K, generator=gen) if weighted else None
        out = E.unpermute_own_rows(y, w, srt, prefix, 1)
        p = launched[-1][3]
        fresh = M.UnpermuteSumParams(y=y.data_ptr(), out=out.data_ptr(), dtype=0, hidden=H, num_rows=N,
                                     num_slots=N * K, num_topk=K, weights=0 if w is None else w.data_ptr(),
                                     sorted_slots=srt.data_ptr(), rank_prefix_matrix=prefix.data_ptr(), num_ranks=2,
                                     rank=1)
        assert bytes(p) == bytes(fresh), (N, K, H, weighted)
    for T, E_, K in ((9, 6, 2), (4, 5, 3)):  # forward and backward alternate: their structs must not mix
        routing_map = torch.rand(T, E_, generator=gen) < 0.5
        probs = torch.rand(T, E_, generator=gen)
        idx, w = E.routing_map_to_topk(routing_map, probs, K)
        forward = launched[-1][3]
        grad = E.routing_map_to_topk_backward(w, idx, E_, torch.float32)
        backward = launched[-1][3]
        assert bytes(forward) == bytes(M.RoutingMapParams(
            routing_map=routing_map.data_ptr(), probs=probs.data_ptr(), probs_dtype=1, num_tokens=T, num_experts=E_,
            num_topk=K, topk_idx=idx.data_ptr(), topk_weights=w.data_ptr()))
        assert bytes(backward) == bytes(M.RoutingMapParams(
            probs_dtype=1, num_tokens=T, num_experts=E_, num_topk=K, topk_idx=idx.data_ptr(),
            topk_weights=w.data_ptr(), grad_probs=grad.data_ptr()))


def test_the_device_check_names_the_argument_without_the_cpu_stand_in():
    """`check_on` itself (the `launched` fixture replaces it): a CPU tensor, or one on another device than the op's
    first tensor, raises the named ValueError before anything is allocated or launched."""
    routing_map, probs = torch.zeros(4, 3, dtype=torch.bool), torch.zeros(4, 3)
    with pytest.raises(ValueError, match="routing_map_to_topk: argument 'routing_map' must be a CUDA tensor, got cpu"):
        E.routing_map_to_topk(routing_map, probs, 2)
    with pytest.raises(ValueError, match="argument 'probs' must be on cuda:1, got cpu"):
        E.check_on(probs, "routing_map_to_topk", "probs", 1)
    assert E.device_index(probs) == -1
