"""The expert-major permute family as torch.library custom ops (``ep_moe::``), on CPU: `torch.library.opcheck` of
every op on random and adversarial inputs (no rows, every entry -1, one expert, alignment > 1, fixed-size and
capacity layouts, the exact size with its data-dependent slot count), and ``torch.compile(fullgraph=True)`` of a
layout, permute, reduce and backward: the same bits as eager (values and gradients), with the ``ep_moe::`` ops in
the captured graph."""

from __future__ import annotations

import pytest
import torch

from ep_moe import permute as P
from ep_moe.custom_op import CustomOp

OPS = {name: getattr(torch.ops.ep_moe, name) for name in (
    "expert_layout", "permute_rows", "permute_rows_backward", "unpermute_sum", "unpermute_sum_backward",
    "permute_received_rows")}


def _routing(kind: str, N: int, K: int, L: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":  # with entries outside [0, L) too
        return torch.randint(-1, L + 1, (N, K), generator=gen)
    if kind == "all_minus_one":
        return torch.full((N, K), -1, dtype=torch.int64)
    if kind == "one_expert":
        return torch.where(torch.rand(N, K, generator=gen) < 0.5, 0, -1)
    raise ValueError(kind)


# (kind, N, K, L, A, layout: "exact" | "fixed" (max_slots) | capacity C)
CASES = [("random", 9, 3, 4, 1, "exact"), ("random", 9, 3, 4, 16, "fixed"), ("random", 0, 2, 3, 4, "exact"),
         ("all_minus_one", 5, 2, 3, 1, "exact"), ("all_minus_one", 5, 2, 3, 8, "fixed"),
         ("one_expert", 7, 2, 1, 4, "exact"), ("random", 8, 2, 3, 1, 2), ("random", 6, 4, 5, 128, "fixed")]
IDS = [f"{k}-N{n}-K{kk}-L{ll}-A{a}-{m}" for k, n, kk, ll, a, m in CASES]


def _layout_args(case) -> tuple[torch.Tensor, int, int, int, int]:
    kind, N, K, L, A, mode = case
    idx = _routing(kind, N, K, L, torch.Generator().manual_seed(N * 31 + K))
    if mode == "exact":
        return idx, L, A, -1, 0
    if mode == "fixed":
        return idx, L, A, P.max_slots(N, K, L, A), 0
    return idx, L, 1, -1, mode


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_opcheck_every_op(case):
    """opcheck's schema, fake-tensor, autograd-registration and AOT-dispatch checks on each op."""
    idx, L, A, M, C = _layout_args(case)
    torch.library.opcheck(OPS["expert_layout"], (idx, L, A, M, C))
    layout = P.expert_layout(idx, L, A, None if M < 0 else M, C)
    N, K = idx.shape
    gen = torch.Generator().manual_seed(7)
    H = 8
    x = torch.randn(N, H, generator=gen, requires_grad=True)
    values = torch.rand(N, K, generator=gen, requires_grad=True)
    slots = layout.pair_of_slot, layout.slot_of_pair, layout.sorted_slots
    for vals in (None, values):
        torch.library.opcheck(OPS["permute_rows"], (x, vals, *slots))
    y = torch.randn(layout.num_slots, H, generator=gen, requires_grad=True)
    w = torch.rand(layout.num_slots, generator=gen, requires_grad=True)
    for weights in (None, w):
        torch.library.opcheck(OPS["unpermute_sum"], (y, weights, layout.pair_of_slot, layout.slot_of_pair))
    grad = torch.randn(N, H, generator=gen)
    for need_y, need_w in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(OPS["unpermute_sum_backward"],
                              (grad, y.detach(), w.detach(), layout.pair_of_slot, K, need_y, need_w))
    grad_rows = torch.randn(layout.num_slots, H, generator=gen)
    for grad_values in (None, torch.randn(layout.num_slots, generator=gen)):
        torch.library.opcheck(OPS["permute_rows_backward"], (grad_rows, grad_values, layout.sorted_slots,
                                                             layout.slot_of_pair))


@pytest.mark.parametrize("rank", [0, 1])
def test_opcheck_received_rows(rank):
    """Two ranks' received rows, this rank's own ones from its input: bf16 rows, with and without values."""
    gen = torch.Generator().manual_seed(5 + rank)
    T, H, K, L = 4, 16, 2, 3
    N = 2 * T
    prefix = torch.tensor([[T, T], [2 * T, 2 * T]], dtype=torch.int32) if rank else \
        torch.tensor([[T, 2 * T], [T, 2 * T]], dtype=torch.int32)
    idx = _routing("random", N, K, L, gen)
    layout = P.expert_layout(idx, L, 4, P.max_slots(N, K, L, 4))
    rows = torch.randn(N + 3, H, generator=gen).to(torch.bfloat16)
    own_x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    own_tokens = torch.randperm(T, generator=gen).to(torch.int32)
    for values in (None, torch.rand(N, K, generator=gen)):
        torch.library.opcheck(OPS["permute_received_rows"], (rows, N, own_x, own_tokens, prefix, rank,
                                                             layout.pair_of_slot, K, values))


def _model(idx, x, values, y_scale, num_slots, alignment):
    """Layout, permute rows and values, an expert-like scale, the weighted reduce, and a loss."""
    layout = P.expert_layout(idx, 4, alignment, num_slots)
    rows, slot_values = P.permute_rows_and_values(x, values, layout)
    y = rows * y_scale
    out = P.unpermute_sum(y, layout, slot_values)
    plain = P.unpermute_sum(P.permute_rows(x, layout), layout)
    return out, plain, (out.float() * 1.5).sum() + plain.float().sum()


class _Captured:
    """A torch.compile backend that records the FX graph dynamo hands it and the forward and backward graphs AOT
    autograd makes of it, and runs them as they are (what ``backend="aot_eager"`` does)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.aot: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(graph, _inputs):
            self.aot.append(graph)
            return make_boxed_func(graph.forward)

        self.graphs.append(gm)
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    def ops(self, graphs) -> list[str]:
        """The ``ep_moe::`` ops the graphs call, by name (``ep_moe.permute_rows``)."""
        return [str(node.target).removesuffix(".default") for gm in graphs for node in gm.graph.nodes
                if node.op == "call_function" and str(node.target).startswith("ep_moe.")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_slots, alignment", [(None, 1), (None, 4), ("max", 16)], ids=["exact", "exact-A4", "fixed-A16"])
def test_compiled_equals_eager_bit_for_bit(dtype, num_slots, alignment):
    """fullgraph compile of `_model` and its backward: outputs and the gradients of x, values and the scale equal
    eager's bits, and the graph holds the ep_moe:: ops (layout, two permutes, two reduces)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    N, K, H = 12, 3, 16
    idx = torch.randint(-1, 4, (N, K), generator=gen)
    slots = P.max_slots(N, K, 4, alignment) if num_slots == "max" else None

    def run(fn):
        x = torch.randn(N, H, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
        values = torch.rand(N, K, generator=torch.Generator().manual_seed(2)).requires_grad_()
        scale = torch.tensor(0.75, dtype=dtype, requires_grad=True)
        out, plain, loss = fn(idx, x, values, scale, slots, alignment)
        loss.backward()
        return [out, plain, loss, x.grad, values.grad, scale.grad]

    want = run(_model)
    backend = _Captured()
    got = run(torch.compile(_model, backend=backend, fullgraph=True))
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8)
                           if b.numel() else b), f"output {i} differs"
    assert len(backend.graphs) == 1, "one graph, no break"
    dynamo_ops, (forward, backward) = backend.ops(backend.graphs), backend.aot
    assert sorted(dynamo_ops) == sorted(["ep_moe.expert_layout"] + ["ep_moe.permute_rows", "ep_moe.unpermute_sum"] * 2)
    assert sorted(backend.ops([forward])) == sorted(dynamo_ops)
    assert sorted(backend.ops([backward])) == ["ep_moe.permute_rows_backward"] * 2 + ["ep_moe.unpermute_sum_backward"] * 2


def test_compiled_graph_runs_and_records_the_ops_implementation():
    """The compiled graph runs the ops' implementations at run time: `implementations_run` records them."""
    torch._dynamo.reset()
    P.reset_implementations_run()
    idx = torch.tensor([[0, 2], [1, -1], [3, 3]])
    x = torch.randn(3, 8)
    compiled = torch.compile(lambda i, v: P.unpermute_sum(P.permute_rows(v, P.expert_layout(i, 4, 2, 16)),
                                                          P.expert_layout(i, 4, 2, 16)), backend="aot_eager",
                             fullgraph=True)
    out = compiled(idx, x)
    assert P.implementations_run() == ("torch",)
    layout = P.expert_layout(idx, 4, 2, 16)
    assert torch.equal(out, P.unpermute_sum(P.permute_rows(x, layout), layout))


def test_errors_name_the_argument_under_compile():
    """The public functions' checks run while torch.compile traces: a wrong argument is named there too."""
    torch._dynamo.reset()
    idx = torch.tensor([[0, 1]])

    def bad(i):
        layout = P.expert_layout(i, 2, 1, 4)
        return P.permute_rows(torch.zeros(5, 4), layout)

    with pytest.raises(Exception, match="argument 'x'"):
        torch.compile(bad, backend="aot_eager", fullgraph=True)(idx)


def test_eager_calls_skip_the_dispatcher_with_its_bits(monkeypatch):
    """Eager calls run the ops' implementations and autograd formulas without the dispatcher (its Python
    custom-op path costs host time per call): with every op's dispatcher entry made to fail, `_model` and its
    backward still run, and give the bits the dispatcher path gives (each `CustomOp` called as the op)."""
    gen = torch.Generator().manual_seed(5)
    N, K, H = 10, 3, 8
    idx = torch.randint(-1, 4, (N, K), generator=gen)

    def run():
        x = torch.randn(N, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
        values = torch.rand(N, K, generator=torch.Generator().manual_seed(2)).requires_grad_()
        scale = torch.tensor(0.5, requires_grad=True)
        out, plain, loss = _model(idx, x, values, scale, None, 2)
        loss.backward()
        return [out, plain, loss, x.grad, values.grad, scale.grad]

    ops = [value for value in vars(P).values() if isinstance(value, CustomOp)]
    assert len(ops) == len(OPS)
    with monkeypatch.context() as patch:
        patch.setattr(torch.compiler, "is_compiling", lambda: True)  # every CustomOp through the dispatcher
        want = run()

    def refuse(*args):
        raise AssertionError("an eager call went through the dispatcher")

    for op in ops:
        monkeypatch.setattr(op, "op", refuse)
    got = run()
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs"


@pytest.mark.parametrize("fullgraph", [True, False])
def test_traced_calls_never_reach_the_implementations_with_fake_tensors(monkeypatch, fullgraph):
    """While torch.compile traces (its AOT autograd traces the backward formulas with fake or functional tensors;
    some torch versions do it outside `torch.compiler.is_compiling`, e.g. a backward compiled when it first runs),
    every `CustomOp` call goes to the op: an implementation reached directly with such tensors would hand them to a
    kernel launcher, which reads data pointers."""
    torch._dynamo.reset()

    def plain_only(impl):
        def call(*args):
            bad = [type(a).__name__ for a in args if isinstance(a, torch.Tensor) and type(a) is not torch.Tensor]
            assert not bad, f"an implementation was called with {bad} while tracing"
            return impl(*args)
        return call

    for op in (value for value in vars(P).values() if isinstance(value, CustomOp)):
        monkeypatch.setattr(op, "impl", plain_only(op.impl))
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(-1, 4, (9, 2), generator=gen)
    x = torch.randn(9, 8, generator=gen).requires_grad_()
    values = torch.rand(9, 2, generator=gen).requires_grad_()
    scale = torch.tensor(0.5, requires_grad=True)
    compiled = torch.compile(_model, backend="aot_eager", fullgraph=fullgraph)
    out, plain, loss = compiled(idx, x, values, scale, None, 4)  # the exact size: a data-dependent slot count
    loss.backward()
    assert x.grad is not None and values.grad is not None and scale.grad is not None
