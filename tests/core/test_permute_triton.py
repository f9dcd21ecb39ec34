"""The Triton kernels of `ep_moe.permute_triton` against their torch definitions (written out here, from the
contract), bit for bit; ``pair_dot`` within a tolerance of float64, and repeatable.

Triton runs a whole process either compiled or interpreted (``TRITON_INTERPRET=1`` must be set before it is
imported), so the ``interpreter`` cases (CPU tensors) run in a child pytest started with it set
(`test_child_process_runs_the_interpreted_cases`), or in this process when it was started so; the ``cuda`` cases (``gpu``) run
compiled. The compiled kernel's machine code is also checked for fused multiply-adds offline (no GPU needed).

Layouts are the expert-major ones of docs/semantics.md (per local expert, its pairs in (row, k) order, each expert's
slots aligned to ``A`` with padding, trailing padding as in fixed mode) on random and adversarial routings. Most
cases shrink ``TILE_BYTES`` so that tiny rows still take several ``BLOCK_H`` blocks with a ragged last one and
several rows per program. Without Triton every kernel test is skipped with the reason."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
from support.bits import assert_bits_equal, bits_equal

from ep_moe import permute_triton as pt

FP8 = torch.float8_e4m3fn
BF16, FP32 = torch.bfloat16, torch.float32
needs_triton = pytest.mark.skipif(pt.triton is None, reason=pt.unavailable_reason() or "")
DEVICES = [pytest.param("interpreter", id="interpreter"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """'cpu' where this process interprets Triton, 'cuda' where it compiles."""
    if pt.triton is None:
        pytest.skip(pt.unavailable_reason())
    if request.param == "interpreter":
        if not pt.INTERPRETED:
            pytest.skip("interpreter cases run in a child process (test_child_process_runs_the_interpreted_cases)")
        return "cpu"
    if pt.INTERPRETED:
        pytest.skip("this process interprets Triton (TRITON_INTERPRET=1)")
    return "cuda"


@pytest.fixture
def small_tiles(monkeypatch):
    """128-byte tiles: BLOCK_H <= 32 fp32 / 64 bf16 elements, so tiny rows take several blocks (or several
    rows one program)."""
    monkeypatch.setattr(pt, "TILE_BYTES", 128)


@needs_triton
@pytest.mark.skipif(pt.INTERPRETED, reason="this process already interprets Triton")
def test_child_process_runs_the_interpreted_cases():
    """This file's interpreter cases in a child pytest with TRITON_INTERPRET=1: all pass, none skipped."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreter",
                            __file__], capture_output=True, text=True, env=env, timeout=600)
    tail = "\n".join((child.stdout + child.stderr).splitlines()[-40:])
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    assert child.returncode == 0, tail
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary, tail


# ------------------------------------------------------------------------------------------ the definitions
def row_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` of any dtype as ``[N, H * itemsize]`` uint8 (each row's bytes)."""
    return t.contiguous().view(torch.uint8)


def ref_permute_rows(x: torch.Tensor, pair_of_slot: torch.Tensor, K: int) -> torch.Tensor:
    """out[s] = x[pair_of_slot[s] // K], all-zero bytes for padding (on the bytes: any dtype)."""
    N = x.shape[0]
    valid = pair_of_slot < N * K
    out = row_bytes(x)[(pair_of_slot.clamp(max=max(N * K - 1, 0)) // K)] if N else \
        torch.zeros(len(pair_of_slot), row_bytes(x).shape[1], dtype=torch.uint8)
    return torch.where(valid[:, None], out, 0).view(x.dtype)


def ref_unpermute_sum(y, weights, sorted_slots) -> torch.Tensor:
    N, K = sorted_slots.shape
    acc = torch.zeros(N, y.shape[1], dtype=FP32)
    for j in range(K if len(y) else 0):  # no slots: every entry is -1
        s = sorted_slots[:, j]
        valid = s >= 0
        term = y[s.clamp(min=0)].float()
        if weights is not None:
            term = term * weights[s.clamp(min=0)][:, None]
        acc = torch.where(valid[:, None], acc + term, acc)
    return acc.to(y.dtype)


def ref_scale_permute(grad_out, weights, pair_of_slot, K) -> torch.Tensor:
    if weights is None:
        return ref_permute_rows(grad_out, pair_of_slot, K)
    N = grad_out.shape[0]
    valid = pair_of_slot < N * K
    rows = grad_out[pair_of_slot.clamp(max=N * K - 1) // K]
    return torch.where(valid[:, None], (weights[:, None] * rows.float()).to(grad_out.dtype), 0)


def ref_pair_dot64(grad_out, y, pair_of_slot, K) -> torch.Tensor:
    N = grad_out.shape[0]
    valid = pair_of_slot < N * K
    rows = grad_out[pair_of_slot.clamp(max=N * K - 1) // K].double()
    return torch.where(valid, (rows * y.double()).sum(1), 0.0)


# ------------------------------------------------------------------------------------------ layouts
def expert_major(idx: torch.Tensor, num_experts: int, alignment: int, trailing: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_of_slot [M], sorted_slots [N, K]) for local expert ids ``idx [N, K]`` (-1: none): expert e's
    pairs in (row, k) order from sum_{e' < e} round_up(n_e', A), padding N * K, then ``trailing`` padding."""
    N, K = idx.shape
    flat = idx.reshape(-1)
    groups = [torch.nonzero(flat == e).reshape(-1) for e in range(num_experts)]
    sizes = [-(-len(g) // alignment) * alignment for g in groups]
    pair_of_slot = torch.full((sum(sizes) + trailing,), N * K, dtype=torch.int64)
    start = 0
    for g, size in zip(groups, sizes):
        pair_of_slot[start:start + len(g)] = g
        start += size
    slot_of_pair = torch.full((N * K,), -1, dtype=torch.int64)
    used = pair_of_slot < N * K
    slot_of_pair[pair_of_slot[used]] = torch.nonzero(used).reshape(-1)
    big = torch.iinfo(torch.int64).max
    key = torch.where(slot_of_pair >= 0, slot_of_pair, big).view(N, K).sort(dim=1).values
    return pair_of_slot, torch.where(key == big, -1, key)


def routing(kind: str, N: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """Local expert ids [N, K]: ``random`` (distinct per row, ~30 % -1, every third row none),
    ``one_group`` (every pair to expert 0, repeated within a row), ``none`` (all -1)."""
    if kind == "none":
        return torch.full((N, K), -1, dtype=torch.int64)
    if kind == "one_group":
        return torch.zeros(N, K, dtype=torch.int64)
    idx = torch.stack([torch.randperm(max(E, K), generator=gen)[:K] % E for _ in range(N)])
    idx[torch.rand(idx.shape, generator=gen) < 0.3] = -1
    idx[::3] = -1
    return idx


def random_rows(shape: tuple, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values of very different magnitudes and signs (so rounding and order show); FP8 from random bytes."""
    if dtype == FP8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(FP8)
    scale = torch.exp2(torch.randint(-6, 7, shape, generator=gen).float())
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


CASES = [  # (routing, N, K, experts, alignment, trailing padding, H)
    ("random", 6, 8, 4, 4, 3, 37),
    ("random", 7, 1, 3, 1, 0, 40),
    ("random", 5, 8, 8, 1, 5, 9),
    ("one_group", 4, 8, 4, 16, 0, 35),
    ("one_group", 5, 1, 2, 3, 2, 16),
    ("none", 4, 8, 4, 4, 4, 24),
    ("none", 3, 3, 4, 1, 0, 9),
]
CASE_IDS = [f"{c[0]}-N{c[1]}-K{c[2]}-A{c[4]}-pad{c[5]}-H{c[6]}" for c in CASES]


def weighted_float_cases(test):
    """Needs Triton; every case of CASES, in bf16 and fp32, weighted and plain."""
    for mark in (pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "plain"]),
                 pytest.mark.parametrize("dtype", [BF16, FP32]),
                 pytest.mark.parametrize("case", CASES, ids=CASE_IDS), needs_triton):
        test = mark(test)
    return test


def layout_case(case: tuple, seed: int) -> tuple[torch.Generator, int, int, torch.Tensor, torch.Tensor]:
    kind, N, K, E, A, trailing, H = case
    gen = torch.Generator().manual_seed(seed)
    pair_of_slot, sorted_slots = expert_major(routing(kind, N, K, E, gen), E, A, trailing)
    return gen, N, H, pair_of_slot, sorted_slots


def garbage(shape: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    """An ``out`` of 0x7F bytes (so an element the kernel leaves unwritten shows)."""
    size = torch.tensor([], dtype=dtype).element_size()
    return torch.full((*shape[:-1], shape[-1] * size), 0x7F, dtype=torch.uint8).view(dtype).to(device)


def on(device: str, *tensors):
    return [t.to(device) if t is not None else None for t in tensors]


# ------------------------------------------------------------------------------------------ bit for bit
@needs_triton
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [BF16, FP32, FP8])
def test_permute_rows(device, small_tiles, case, dtype):
    gen, N, H, pair_of_slot, _ = layout_case(case, 1)
    K = case[2]
    x = random_rows((N, H), dtype, gen)
    scales = random_rows((N, 3), FP32, gen)  # an FP8 pair's scales
    for src in (x, scales):
        out = garbage((len(pair_of_slot), src.shape[1]), src.dtype, device)
        got = pt.permute_rows(*on(device, src, pair_of_slot), K, out)
        assert got is out
        assert_bits_equal(got, ref_permute_rows(src, pair_of_slot, K), on_host=True)


@needs_triton
@pytest.mark.parametrize("H, offset, width", [(64, 0, torch.int32), (38, 0, torch.int16), (37, 0, torch.uint8),
                                              (64, 2, torch.int16), (64, 1, torch.uint8)])
def test_permute_rows_byte_widths(device, small_tiles, H, offset, width):
    """FP8 rows moved as int32 / int16 / uint8: by the row bytes and the start address (a row slice)."""
    gen = torch.Generator().manual_seed(H + offset)
    pair_of_slot, _ = expert_major(routing("random", 8, 2, 3, gen), 3, 2, 1)
    base = random_rows((9 * H,), FP8, gen).to(device)
    x = base[offset:offset + 8 * H].view(8, H)
    out = torch.empty(len(pair_of_slot), H, dtype=FP8, device=device)
    assert pt._byte_width(x, out, row_bytes=H) == width
    assert_bits_equal(pt.permute_rows(x, pair_of_slot.to(device), 2, out), ref_permute_rows(x.cpu(), pair_of_slot, 2), on_host=True)


@weighted_float_cases
def test_unpermute_sum(device, small_tiles, case, dtype, weighted):
    gen, N, H, pair_of_slot, sorted_slots = layout_case(case, 2)
    M = len(pair_of_slot)
    y = random_rows((M, H), dtype, gen)
    weights = torch.rand(M, generator=gen) * 2 - 0.5 if weighted else None
    out = garbage((N, H), dtype, device)
    got = pt.unpermute_sum(*on(device, y, weights, sorted_slots), out)
    assert got is out
    assert_bits_equal(got, ref_unpermute_sum(y, weights, sorted_slots), on_host=True)


@weighted_float_cases
def test_scale_permute(device, small_tiles, case, dtype, weighted):
    gen, N, H, pair_of_slot, _ = layout_case(case, 3)
    K, M = case[2], len(pair_of_slot)
    grad_out = random_rows((N, H), dtype, gen)
    weights = torch.rand(M, generator=gen) * 2 - 0.5 if weighted else None
    if weighted:
        weights[pair_of_slot == N * K] = float("nan")  # padding's weight is never read
    out = garbage((M, H), dtype, device)
    got = pt.scale_permute(*on(device, grad_out, weights, pair_of_slot), K, out)
    assert got is out
    assert_bits_equal(got, ref_scale_permute(grad_out, weights, pair_of_slot, K), on_host=True)


@needs_triton
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_default_tiles_ragged_hidden(device, dtype):
    """The default TILE_BYTES, H just past one BLOCK_H (a second, ragged block), K = 8 and 1."""
    H = pt.TILE_BYTES // torch.tensor([], dtype=dtype).element_size() + 24
    for K in (8, 1):
        gen, N, H, pair_of_slot, sorted_slots = layout_case(("random", 4, K, 4, 2, 1, H), 4)
        M = len(pair_of_slot)
        x, y = random_rows((N, H), dtype, gen), random_rows((M, H), dtype, gen)
        weights = torch.rand(M, generator=gen)
        assert_bits_equal(pt.permute_rows(*on(device, x, pair_of_slot), K, torch.empty(M, H, dtype=dtype, device=device)),
                    ref_permute_rows(x, pair_of_slot, K), on_host=True)
        assert_bits_equal(pt.unpermute_sum(*on(device, y, weights, sorted_slots),
                                     torch.empty(N, H, dtype=dtype, device=device)),
                    ref_unpermute_sum(y, weights, sorted_slots), on_host=True)
        assert_bits_equal(pt.scale_permute(*on(device, x, weights, pair_of_slot), K,
                                     torch.empty(M, H, dtype=dtype, device=device)),
                    ref_scale_permute(x, weights, pair_of_slot, K), on_host=True)


def fma_sensitive_case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [2, 1], weights [2], sorted_slots [1, 2]) where acc = w0 * y0, then acc + w1 * y1 rounds differently
    with a fused multiply-add. fp32: w1 * y1 = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11 (a tie, to even), so the
    sum with -1 is 2^-11 unfused, 2^-11 + 2^-24 fused. bf16: unfused the sum is 0.5 + 2^-9 exactly, a bf16
    tie that rounds to 0.5; fused it is 2^-24 more and rounds up to 0.5 + 2^-8."""
    if dtype == FP32:
        y = torch.tensor([[-1.0], [1 + 2**-12]], dtype=FP32)
        weights = torch.tensor([1.0, 1 + 2**-12])
    else:
        y = torch.tensor([[1.0], [1 + 2**-7]], dtype=BF16)
        weights = torch.tensor([-0.5 + 2**-9 - 2**-7 - 2**-17, 1 + 2**-17])
    return y, weights, torch.tensor([[0, 1]])


@needs_triton
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_unpermute_sum_does_not_fuse_multiply_add(device, dtype):
    y, weights, sorted_slots = fma_sensitive_case(dtype)
    want = ref_unpermute_sum(y, weights, sorted_slots)
    acc = (weights[0].double() * y[0].double()).float()  # exact
    fused = (acc.double() + weights[1].double() * y[1].double()).float().to(dtype)  # exact in float64, rounded once
    assert not bits_equal(fused, want), "the case must tell a fused multiply-add apart"
    got = pt.unpermute_sum(*on(device, y, weights, sorted_slots), torch.empty(1, 1, dtype=dtype, device=device))
    assert_bits_equal(got, want[:, :1], on_host=True)
    # the same rows among others (a wide row, several blocks, several rows per program)
    H = 40
    y_wide = random_rows((6, H), dtype, torch.Generator().manual_seed(5))
    y_wide[:2, 17] = y[:, 0]
    w_wide = torch.cat([weights, torch.rand(4)])
    slots = torch.tensor([[2, 3, -1], [0, 1, -1], [4, -1, -1], [5, 0, 1]])
    out = pt.unpermute_sum(*on(device, y_wide, w_wide, slots), torch.empty(4, H, dtype=dtype, device=device))
    assert_bits_equal(out, ref_unpermute_sum(y_wide, w_wide, slots), on_host=True)
    assert_bits_equal(out[1, 17:18].cpu(), want[0], on_host=True)


# fp32 bits -> the bf16 bits torch's .to gives (round to nearest even): ties both ways, either side of a tie,
# a tie at the largest finite bf16 (to inf), subnormal ties, infinities, -0.0
ROUNDING = {0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0xBF818000: 0xBF82, 0x3F808001: 0x3F81, 0x3F807FFF: 0x3F80,
            0x7F7F8000: 0x7F80, 0x7F7F7FFF: 0x7F7F, 0x00008000: 0x0000, 0x00018000: 0x0002, 0x80018000: 0x8002,
            0x7F800000: 0x7F80, 0xFF800000: 0xFF80, 0x80000000: 0x8000}


@needs_triton
def test_rounding_to_bf16(device):
    """unpermute_sum and scale_permute with y = 1 and the weights carrying the fp32 values: each output is one
    rounding of that value to bf16, bit for bit torch's. A NaN becomes 0x7FFF (torch's own NaN bits differ
    between its CPU and CUDA kernels, so it is checked by value here)."""
    values = torch.tensor(list(ROUNDING) + [0x7FC00000, 0xFFC00001], dtype=torch.int64).to(torch.int32)
    weights, M = values.view(FP32), len(values)
    ones = torch.ones(M, 1, dtype=BF16)
    want_scaled = torch.tensor(list(ROUNDING.values()), dtype=torch.int32).to(torch.int16)
    want_sum = torch.where(want_scaled == -0x8000, 0, want_scaled)  # acc = 0.0 + -0.0 = +0.0
    got_sum = pt.unpermute_sum(*on(device, ones, weights, torch.arange(M)[:, None]), garbage((M, 1), BF16, device))
    got_scaled = pt.scale_permute(*on(device, ones, weights, torch.arange(M)), 1, garbage((M, 1), BF16, device))
    for got, want in ((got_sum, want_sum), (got_scaled, want_scaled)):
        got = got.cpu().view(torch.int16).reshape(-1)
        assert torch.equal(got[:-2], want), [hex(int(v) & 0xFFFF) for v in got]
        assert torch.equal(got[-2:], torch.tensor([0x7FFF, 0x7FFF], dtype=torch.int16))
    assert torch.equal(ref_unpermute_sum(ones, weights, torch.arange(M)[:, None]).view(torch.int16)[:-2, 0], want_sum)
    assert torch.equal(ref_scale_permute(ones, weights, torch.arange(M), 1).view(torch.int16)[:-2, 0], want_scaled)


# ------------------------------------------------------------------------------------------ pair_dot
@needs_triton
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_pair_dot(device, small_tiles, case, dtype):
    gen, N, H, pair_of_slot, _ = layout_case(case, 6)
    K, M = case[2], len(pair_of_slot)
    grad_out, y = random_rows((N, H), dtype, gen), random_rows((M, H), dtype, gen)
    out = garbage((M,), FP32, device)
    got = pt.pair_dot(*on(device, grad_out, y, pair_of_slot), K, out)
    assert got is out and got.dtype == FP32
    want = ref_pair_dot64(grad_out, y, pair_of_slot, K)
    scale = ref_pair_dot64(grad_out.abs(), y.abs(), pair_of_slot, K)  # sum |g * y|: the error's scale
    assert torch.all((got.cpu().double() - want).abs() <= 1e-6 * scale + 1e-30)
    assert torch.all(got.cpu()[pair_of_slot == N * K] == 0)
    again = pt.pair_dot(*on(device, grad_out, y, pair_of_slot), K, torch.empty(M, device=device))
    assert_bits_equal(again, got.cpu(), on_host=True)


# ------------------------------------------------------------------------------------------ empty inputs
@needs_triton
def test_empty_inputs(device):
    """No rows, no slots, no columns, K = 0: answered without a launch (padding zeroed)."""
    z = {"device": device}
    pos = torch.full((3,), 0, dtype=torch.int64, **z)  # N * K = 0: all padding
    assert torch.equal(pt.permute_rows(torch.empty(0, 4, **z), pos, 2, torch.ones(3, 4, **z)).cpu(), torch.zeros(3, 4))
    assert pt.permute_rows(torch.empty(2, 4, **z), pos[:0], 2, torch.ones(0, 4, **z)).shape == (0, 4)
    assert torch.equal(pt.scale_permute(torch.empty(0, 4, **z), torch.ones(3, **z), pos, 2,
                                        torch.ones(3, 4, **z)).cpu(), torch.zeros(3, 4))
    assert torch.equal(pt.pair_dot(torch.empty(2, 0, **z), torch.empty(3, 0, **z), pos, 2,
                                   torch.ones(3, **z)).cpu(), torch.zeros(3))
    slots = torch.full((2, 3), -1, dtype=torch.int64, **z)
    assert torch.equal(pt.unpermute_sum(torch.empty(0, 4, **z), None, slots, torch.ones(2, 4, **z)).cpu(),
                       torch.zeros(2, 4))
    assert torch.equal(pt.unpermute_sum(torch.ones(3, 4, **z), None, slots[:, :0], torch.ones(2, 4, **z)).cpu(),
                       torch.zeros(2, 4))


# ------------------------------------------------------------------------------------------ argument checks
def test_bad_arguments_name_the_argument(device):
    z = {"device": device}
    x, pos, out = torch.zeros(4, 8, **z), torch.zeros(5, dtype=torch.int64, **z), torch.zeros(5, 8, **z)
    slots = torch.zeros(4, 2, dtype=torch.int64, **z)
    bad = [
        (lambda: pt.permute_rows(x, pos, 2, torch.zeros(5, 7, **z)), "out"),
        (lambda: pt.permute_rows(x, pos, 2, torch.zeros(5, 8, dtype=BF16, **z)), "out"),
        (lambda: pt.permute_rows(x, pos, 2, torch.zeros(8, 5, **z).t()), "out"),
        (lambda: pt.permute_rows(x, pos.int(), 2, out), "pair_of_slot"),
        (lambda: pt.permute_rows(x, pos[None], 2, out), "pair_of_slot"),
        (lambda: pt.permute_rows(x, pos, 0, out), "num_topk"),
        (lambda: pt.permute_rows(x, pos, 2.0, out), "num_topk"),
        (lambda: pt.permute_rows(x.t(), pos, 2, out), "x"),
        (lambda: pt.permute_rows(x[:, ::2], pos, 2, torch.zeros(5, 4, **z)), "x"),
        (lambda: pt.permute_rows([1.0], pos, 2, out), "x"),
        (lambda: pt.scale_permute(x.double(), None, pos, 2, out), "grad_out"),
        (lambda: pt.scale_permute(x, torch.ones(4, **z), pos, 2, out), "weights"),
        (lambda: pt.scale_permute(x, torch.ones(5, dtype=BF16, **z), pos, 2, out), "weights"),
        (lambda: pt.scale_permute(x, None, pos, 2, out.double()), "out"),
        (lambda: pt.pair_dot(x, torch.zeros(5, 8, dtype=BF16, **z), pos, 2, torch.zeros(5, **z)), "y"),
        (lambda: pt.pair_dot(x, out, pos, 2, torch.zeros(5, dtype=BF16, **z)), "out"),
        (lambda: pt.unpermute_sum(out.to(FP8), None, slots, x), "y"),
        (lambda: pt.unpermute_sum(out, None, slots.int(), x), "sorted_slots"),
        (lambda: pt.unpermute_sum(out, torch.ones(5, 1, **z), slots, x), "weights"),
        (lambda: pt.unpermute_sum(out, None, slots, torch.zeros(3, 8, **z)), "out"),
    ]
    if device == "cuda":
        bad += [(lambda: pt.permute_rows(x, pos, 2, out.cpu()), "out"),
                (lambda: pt.unpermute_sum(out, None, slots.cpu(), x), "sorted_slots")]
    for call, arg in bad:
        with pytest.raises(ValueError, match=f"argument '{arg}'"):
            call()


@needs_triton
@pytest.mark.skipif(pt.INTERPRETED, reason="this process interprets Triton: CPU tensors are taken")
def test_cpu_tensors_are_refused_when_compiled():
    with pytest.raises(ValueError, match="argument 'y' must be on a CUDA device"):
        pt.unpermute_sum(torch.zeros(5, 8), None, torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 8))


def test_imports_and_reports_without_triton(monkeypatch):
    """A copy of the module loaded where ``import triton`` fails: it imports, is not available, says why,
    and a call raises that reason."""
    monkeypatch.setitem(sys.modules, "triton", None)
    spec = importlib.util.spec_from_file_location("ep_moe._permute_triton_without", pt.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.triton is None and not module.available()
    assert "Triton is not importable" in module.unavailable_reason()
    with pytest.raises(RuntimeError, match="Triton is not importable"):
        module.permute_rows(torch.zeros(1, 1, device="meta"), torch.zeros(1, dtype=torch.int64, device="meta"), 1,
                            torch.zeros(1, 1, device="meta"))
    assert pt.available() == (pt.triton is not None and torch.cuda.is_available())
    assert (pt.unavailable_reason() == "") == pt.available()


# ------------------------------------------------------------------------------------------ the GPU build
def _sass_ops(enable_fp_fusion: bool) -> dict[str, int]:
    """unpermute_sum's kernel built offline for sm_90 (weighted, bf16, H 4096, K 8) as unpermute_sum launches
    it, but for ``enable_fp_fusion``: FFMA / FMUL / FADD counts in its SASS."""
    triton = pt.triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = pt._row_kernel
    consts = {"H": 4096, "K": 8, "WEIGHTED": True, "UNROLL": 8, "BLOCK_M": 1, "BLOCK_H": 2048}
    signature = {"y_ptr": "*bf16", "w_ptr": "*fp32", "slots_ptr": "*i64", "out_ptr": "*bf16", "N": "i32", "M": "i32",
                 **{name: "constexpr" for name in consts}}
    options = {**pt.ROW_LAUNCH, "enable_fp_fusion": enable_fp_fusion}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options=options)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, f.name], capture_output=True, text=True, check=True).stdout
    return {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("FFMA", "FMUL", "FADD")}


@needs_triton
@pytest.mark.skipif(pt.INTERPRETED, reason="this process interprets Triton")
@pytest.mark.skipif(pt.triton is None or not os.path.isfile(os.path.join(
    os.path.dirname(pt.triton.__file__), "backends", "nvidia", "bin", "nvdisasm")), reason="no Triton CUDA toolchain")
def test_launch_options_compile_without_fma():
    """The compiled kernel (no GPU needed: Triton's ptxas) has no FFMA with unpermute_sum's launch options;
    the same kernel with fusion allowed has them, so the check can fail."""
    assert pt.ROW_LAUNCH["enable_fp_fusion"] is False
    fused = _sass_ops(True)
    assert fused["FFMA"] > 0, fused
    unfused = _sass_ops(pt.ROW_LAUNCH["enable_fp_fusion"])
    assert unfused["FFMA"] == 0 and unfused["FMUL"] > 0 and unfused["FADD"] > 0, unfused


# ------------------------------------------------------------------------------------------ GPU only
@needs_triton
@pytest.mark.gpu
def test_offsets_past_two_to_the_31():
    """Slots past 2**31 / H elements (int64 offsets): permute_rows writes them, unpermute_sum reads them."""
    H = 16384
    M = 2**31 // H + 64
    x = random_rows((4, H), FP8, torch.Generator().manual_seed(7)).cuda()
    pair_of_slot = torch.full((M,), 4 * 2, dtype=torch.int64, device="cuda")
    pair_of_slot[-3:] = torch.tensor([7, 0, 5])
    pair_of_slot[:2] = torch.tensor([2, 6])
    out = pt.permute_rows(x, pair_of_slot, 2, torch.empty(M, H, dtype=FP8, device="cuda"))
    want = ref_permute_rows(x.cpu(), torch.tensor([2, 6, 8, 7, 0, 5]), 2)
    assert_bits_equal(torch.cat([out[:3], out[-3:]]), want, on_host=True)
    del out
    y = torch.zeros(M, H, dtype=BF16, device="cuda")
    y[-2:] = random_rows((2, H), BF16, torch.Generator().manual_seed(8)).cuda()
    slots = torch.tensor([[M - 2, M - 1], [M - 1, -1]], device="cuda")
    weights = torch.rand(M, device="cuda")
    got = pt.unpermute_sum(y, weights, slots, torch.empty(2, H, dtype=BF16, device="cuda"))
    small = torch.tensor([[0, 1], [1, -1]])
    assert_bits_equal(got, ref_unpermute_sum(y[-2:].cpu(), weights[-2:].cpu(), small), on_host=True)


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensors_on_another_device_than_the_current_one():
    gen, N, H, pair_of_slot, sorted_slots = layout_case(CASES[0], 9)
    K, M = CASES[0][2], len(pair_of_slot)
    x, y, weights = random_rows((N, H), BF16, gen), random_rows((M, H), BF16, gen), torch.rand(M, generator=gen)
    with torch.cuda.device(0):
        got = pt.permute_rows(*on("cuda:1", x, pair_of_slot), K, torch.empty(M, H, dtype=BF16, device="cuda:1"))
        summed = pt.unpermute_sum(*on("cuda:1", y, weights, sorted_slots), torch.empty(N, H, dtype=BF16, device="cuda:1"))
    assert_bits_equal(got, ref_permute_rows(x, pair_of_slot, K), on_host=True)
    assert_bits_equal(summed, ref_unpermute_sum(y, weights, sorted_slots), on_host=True)


# ------------------------------------------------------------------------------------------ through ep_moe.permute
@needs_triton
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_permute_module_on_the_triton_kernels_equals_its_torch_definitions(device, small_tiles, monkeypatch, dtype):
    """`ep_moe.permute`'s autograd functions with the Triton implementation (what CUDA without the extension
    runs): the permute of rows and values, the weighted reduce and every gradient equal its torch definitions
    (the weights' gradient within float64's bound)."""
    from ep_moe import permute as P

    N, K, E, A, H = 7, 3, 4, 2, 40
    gen = torch.Generator().manual_seed(9)
    idx = routing("random", N, K, E, gen)
    layout = P._expert_layout_torch(idx, E, A, P.max_slots(N, K, E, A))
    x, values = random_rows((N, H), dtype, gen), torch.rand(N, K, generator=gen)
    y, w = random_rows((layout.num_slots, H), dtype, gen), torch.rand(layout.num_slots, generator=gen)
    g_rows, g_values = random_rows((layout.num_slots, H), dtype, gen), torch.randn(layout.num_slots, generator=gen)
    g_out = random_rows((N, H), dtype, gen)

    def run(implementation: str, dev: str):
        monkeypatch.setattr(P, "kernel_implementation", lambda t: implementation)
        lay = P.ExpertLayout(*(t.to(dev) for t in layout[:5]))
        xi, vi = x.to(dev).clone().requires_grad_(), values.to(dev).clone().requires_grad_()
        rows, slot_values = P.permute_rows_and_values(xi, vi, lay)
        torch.autograd.backward((rows, slot_values), (g_rows.to(dev), g_values.to(dev)))
        yi, wi = y.to(dev).clone().requires_grad_(), w.to(dev).clone().requires_grad_()
        out = P.unpermute_sum(yi, lay, wi)
        out.backward(g_out.to(dev))
        return rows, slot_values, out, xi.grad, vi.grad, yi.grad, wi.grad

    got, want = run("triton", device), run("torch", "cpu")
    names = ("rows", "slot values", "reduce", "grad x", "grad values", "grad y")
    for name, a, b in zip(names, got[:6], want[:6]):
        a, b = a.detach().cpu(), b.detach()
        assert_bits_equal(a, b, name)
    torch.testing.assert_close(got[6].cpu(), want[6], rtol=1e-5, atol=1e-5)
