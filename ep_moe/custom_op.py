"""`CustomOp`: a ``torch.library`` custom op that eager mode calls without the dispatcher.

ep_moe's differentiable operations (the buffer's dispatch and combine, the expert-major permute family) are custom
ops so that ``torch.compile``, CUDA-graph capture and dispatch modes see them whole: a fake implementation gives the
output shapes, and the op's implementation picks the kernels when it runs, in a compiled graph too. In eager mode
the dispatcher's Python path for a custom op, and its autograd wrapper most of all, costs more host time than the
kernels' launches, so a `CustomOp` called eagerly runs the same implementation and the same autograd formula itself
(a `torch.autograd.Function`), unless something must see the op (`needs_dispatcher`). Contract of an
implementation: its outputs never alias its inputs or each other (the custom-op rule; the eager path returns the
same tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def needs_dispatcher(args: tuple) -> bool:
    """Whether a call with these arguments (an op's, the first always a tensor) must go through the dispatcher as the
    custom op: while torch.compile or its AOT autograd traces (fake or functional tensors, where
    `torch.compiler.is_compiling` may be False; a traced call's tensors are all traced, so the first tells), and
    while a `TorchDispatchMode` is active (selective activation checkpointing, FLOP counters, fake-tensor modes),
    which must see the op by its name."""
    return (torch.compiler.is_compiling() or type(args[0]) not in _PLAIN_TENSORS
            or torch._C._len_torch_dispatch_stack() > 0)


class CustomOp:
    """The custom op ``ep_moe::<name>`` of ``impl`` (its schema inferred from ``impl``'s annotations), with the
    autograd formula ``setup`` / ``backward`` as ``register_autograd`` takes them, or none.

    Calling it runs the op (``self.op``) where `needs_dispatcher`; otherwise ``impl`` itself, through a
    `torch.autograd.Function` of the same formula when an input needs a gradient. Register the fake implementation
    on ``self.op``.
    """

    def __init__(self, name: str, impl: Callable[..., Any], setup: Callable[..., None] | None = None,
                 backward: Callable[..., Any] | None = None) -> None:
        self.impl = impl
        self.op = torch.library.custom_op(f"ep_moe::{name}", impl, mutates_args=())
        self.function: type[torch.autograd.Function] | None = None
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup)

            def forward(ctx, *args):  # ctx-style: a Function with setup_context binds its arguments per call
                output = impl(*args)
                setup(ctx, args, output)
                return output

            self.function = type(f"_{name}_function", (torch.autograd.Function,), {
                "forward": staticmethod(forward), "backward": staticmethod(backward)})

    def __call__(self, *args: Any) -> Any:
        if needs_dispatcher(args):
            return self.op(*args)
        if self.function is not None and torch.is_grad_enabled() and any(
                isinstance(a, Tensor) and a.requires_grad for a in args):
            return self.function.apply(*args)
        return self.impl(*args)
