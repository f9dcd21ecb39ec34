"""torch.compile of an `MoELayer` on one GPU runs the expert-major JIT kernels (the ``ep_moe::`` custom ops'
implementations run inside the compiled graph): every kernel of the layout, the permute, the weighted reduce and
their gradients is launched as often as in eager, and the output and every gradient equal eager's bit for bit.
Needs one GPU and JIT kernels (``pytest -m gpu``)."""

from __future__ import annotations

import collections

import pytest
import torch

from ep_moe import permute as P
from ep_moe.native import jit

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and not jit.available(),
                                 reason=f"no JIT kernels: {jit.unavailable_reason()}")]

KERNELS = ("expert_layout", "permute_rows", "unpermute_sum", "unpermute_sum_backward")


@pytest.fixture
def launches(monkeypatch):
    """Calls of each launcher of `ep_moe.native.jit.expert_major` (what `ep_moe.permute` calls on CUDA)."""
    from ep_moe.native.jit import expert_major

    counts: collections.Counter = collections.Counter()

    def counted(name, launch):
        def call(*args, **kwargs):
            counts[name] += 1
            return launch(*args, **kwargs)
        return call

    for name in KERNELS:
        monkeypatch.setattr(expert_major, name, counted(name, getattr(expert_major, name)))
    return counts


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compiled_layer_runs_the_jit_kernels_with_eagers_bits(launches, dtype):
    from ep_moe.layers.model_config import ModelConfig
    from ep_moe.layers.moe import MoELayer

    torch.manual_seed(0)
    torch._dynamo.reset()
    config = ModelConfig(hidden_size=256, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                         num_layers=1, params_dtype=dtype)
    T = 512
    layer = MoELayer(config, num_worst_tokens=T).cuda()
    x0 = torch.randn(T, 256, device="cuda").to(getattr(torch, dtype))
    grad = torch.randn(T, 256, device="cuda").to(x0.dtype)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        launches.clear()
        P.reset_implementations_run()
        x = x0.clone().requires_grad_()
        out = fn(x)
        out.backward(grad)
        torch.cuda.synchronize()
        grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
        return out.detach(), x.grad, grads, dict(launches), P.implementations_run()

    want = run(layer)
    assert want[4] == ("jit",), want[4]
    compiled = torch.compile(layer, backend="aot_eager")  # aot_eager: the ops around the custom ops run as eager's
    run(compiled)  # the first call compiles
    out, x_grad, grads, counts, ran = run(compiled)
    assert ran == ("jit",), ran
    assert counts == want[3] and all(counts.get(name, 0) >= 1 for name in KERNELS), (counts, want[3])
    assert torch.equal(_bits(out), _bits(want[0])), "output differs from eager"
    assert torch.equal(_bits(x_grad), _bits(want[1])), "input gradient differs from eager"
    assert grads.keys() == want[2].keys() and grads
    for name, g in grads.items():
        assert torch.equal(_bits(g), _bits(want[2][name])), f"gradient of {name} differs from eager"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
