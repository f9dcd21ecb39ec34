"""The buffer's differentiable ops as `ep_moe.custom_op.CustomOp`s, on CPU (a one-rank gloo group, torch backend):
eager calls run the implementations and autograd formulas without the dispatcher and give the bits of the
dispatcher's path, forward and gradients; under a dispatch mode (selective activation checkpointing) every call
goes through the dispatcher, so a policy sees each op by its name and can keep its output."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import ep_moe
from ep_moe import Buffer
from ep_moe.buffer import autograd_ops
from ep_moe.custom_op import CustomOp

NUM_EXPERTS = 4
OP_NAMES = {"ep_moe.dispatch.default", "ep_moe.combine.default", "ep_moe.cached_dispatch.default"}


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: its presence alone sends every `CustomOp` call to the dispatcher."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=gen)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [3, 2], [2, 0], [1, 3]])
    return x, idx, torch.rand(6, 2, generator=gen)


def _model(buffer: Buffer, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out = ep_moe.dispatch(buffer, x, idx, w, NUM_EXPERTS)
    y = out.recv_x * 2 + out.recv_topk_weights.sum(1, keepdim=True)
    combined, combined_w = ep_moe.combine(buffer, y, out.handle, topk_weights=out.recv_topk_weights)
    again = ep_moe.cached_dispatch(buffer, combined.sin(), out.handle)
    return combined, combined_w, again


def _run(buffer: Buffer) -> list[torch.Tensor]:
    x, idx, w = _inputs()
    x, w = x.requires_grad_(), w.requires_grad_()
    outputs = _model(buffer, x, w, idx)
    sum(t.square().sum() for t in outputs).backward()
    return [t.detach() for t in outputs] + [x.grad, w.grad]


def test_eager_calls_skip_the_dispatcher_with_its_bits(solo_group, monkeypatch):
    buffer = Buffer(solo_group, backend="torch")
    ops = [value for value in vars(autograd_ops).values() if isinstance(value, CustomOp)]
    assert len(ops) == 3
    with _PassThrough():
        want = _run(buffer)

    def refuse(*args):
        raise AssertionError("an eager call went through the dispatcher")

    for op in ops:
        monkeypatch.setattr(op, "op", refuse)
    got = _run(buffer)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"output {i} differs"
    buffer.destroy()


def test_selective_checkpointing_sees_and_keeps_the_ops(solo_group, monkeypatch):
    """A selective-checkpointing policy that must save the ``ep_moe`` ops sees each of them by name, and the
    recomputation in backward then moves no tokens again (as many backend dispatches as without checkpointing:
    the forward's two and the combine backward's two); the outputs and gradients equal the plain run's."""
    buffer = Buffer(solo_group, backend="torch")
    calls = []
    exchange = buffer.backend.dispatch
    monkeypatch.setattr(buffer.backend, "dispatch", lambda *a, **k: calls.append(1) or exchange(*a, **k))
    want = _run(buffer)
    plain_calls, calls[:] = len(calls), []
    seen: set[str] = set()

    def policy(ctx, func, *args, **kwargs):
        seen.add(str(func))
        return CheckpointPolicy.MUST_SAVE if str(func) in OP_NAMES else CheckpointPolicy.PREFER_RECOMPUTE

    x, idx, w = _inputs()
    x, w = x.requires_grad_(), w.requires_grad_()
    outputs = checkpoint(_model, buffer, x, w, idx, use_reentrant=False,
                         context_fn=lambda: create_selective_checkpoint_contexts(policy))
    sum(t.square().sum() for t in outputs).backward()
    assert OP_NAMES <= seen, seen
    assert plain_calls == 4 and len(calls) == plain_calls, (plain_calls, calls)
    for i, (a, b) in enumerate(zip([t.detach() for t in outputs] + [x.grad, w.grad], want, strict=True)):
        assert torch.equal(a, b), f"output {i} differs"
    buffer.destroy()
