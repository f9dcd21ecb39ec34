"""`ep_moe.integrations.deepspeed.dropless_top2_routes` against DeepSpeed's own ``TopKGate`` (top-2, no capacity) on
the CPU: the same routes, weights, ``l_aux`` and expert counts bit for bit, from the same draws of the global RNG
(with and without second-expert sampling, fp32 and bf16 tokens, 2 to 64 experts, tied logits), and the same
gradient of the gate weights; and which calls take it (`takes_dropless_top2`)."""

from __future__ import annotations

import pytest
import torch
from support_deepspeed import require_deepspeed, setup_deepspeed_env

require_deepspeed()
setup_deepspeed_env("cpu")

from deepspeed.moe.sharded_moe import TopKGate  # noqa: E402

from ep_moe.integrations.deepspeed import dropless_top2_routes, takes_dropless_top2  # noqa: E402

HIDDEN = 24


def _gate(num_experts: int, sampling: bool = True, **kwargs) -> TopKGate:
    torch.manual_seed(num_experts)
    return TopKGate(HIDDEN, num_experts, k=2, drop_tokens=False, top2_2nd_expert_sampling=sampling, **kwargs)


def _deepspeed_routes(gate: TopKGate, tokens: torch.Tensor):
    l_aux, _, _, indices, _, gates, counts = gate(tokens, None, True, False)
    return l_aux, indices.t().long(), gates.t().float(), counts


@pytest.mark.parametrize("sampling", [True, False], ids=["sampling", "no-sampling"])
@pytest.mark.parametrize("num_experts,num_tokens,dtype", [(2, 5, torch.float32), (4, 33, torch.float32),
                                                         (8, 64, torch.bfloat16), (16, 256, torch.float32),
                                                         (64, 128, torch.bfloat16)])
def test_routes_equal_deepspeed_gate(num_experts: int, num_tokens: int, dtype: torch.dtype, sampling: bool) -> None:
    gate = _gate(num_experts, sampling)
    tokens = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    assert takes_dropless_top2(gate, None)
    grads = []
    results = []
    for routes in (_deepspeed_routes, dropless_top2_routes):
        torch.manual_seed(11)  # the second expert's Gumbel draw
        gate.zero_grad(set_to_none=True)
        l_aux, topk_idx, topk_weights, counts = routes(gate, tokens)
        (l_aux + (topk_weights * torch.tensor([1.0, -2.0])).sum()).backward()
        results.append((l_aux, topk_idx, topk_weights, counts))
        grads.append(gate.wg.weight.grad.clone())
    (ref_l_aux, ref_idx, ref_w, ref_counts), (l_aux, topk_idx, topk_weights, counts) = results
    assert torch.equal(topk_idx, ref_idx)
    assert torch.equal(topk_weights, ref_w)
    assert torch.equal(l_aux, ref_l_aux)
    assert torch.equal(counts, ref_counts) and counts.dtype == torch.int64 and int(counts.sum()) == 2 * num_tokens
    assert torch.allclose(grads[1], grads[0], rtol=1e-6, atol=1e-7)


def test_tied_logits_pick_the_same_experts() -> None:
    gate = _gate(8, sampling=False)
    with torch.no_grad():
        gate.wg.weight.zero_()  # every logit equal: argmax ties everywhere
    tokens = torch.randn(16, HIDDEN)
    ref = _deepspeed_routes(gate, tokens)
    ours = dropless_top2_routes(gate, tokens)
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)


def test_which_calls_take_it() -> None:
    assert takes_dropless_top2(_gate(4), None)
    assert not takes_dropless_top2(_gate(4), torch.ones(3))  # a used_token mask
    capacity = TopKGate(HIDDEN, 4, k=2, drop_tokens=True)
    assert not takes_dropless_top2(capacity, None)
    assert not takes_dropless_top2(TopKGate(HIDDEN, 4, k=1, drop_tokens=False), None)
    assert not takes_dropless_top2(TopKGate(HIDDEN, 8, k=3, drop_tokens=False), None)
    assert not takes_dropless_top2(_gate(1), None)  # one expert: no second route
    jitter = _gate(4, noisy_gate_policy="Jitter")
    assert not takes_dropless_top2(jitter.train(), None)
    assert takes_dropless_top2(jitter.eval(), None)
    timed = _gate(4)
    timed.wall_clock_breakdown = True
    assert not takes_dropless_top2(timed, None)
