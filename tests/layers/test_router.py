"""TopKRouter: scores, top-k, group-limited routing, losses, expert bias, forced balance (single process)."""

import itertools

import pytest
import torch

from ep_moe.layers import TopKRouter, group_limited_topk


def _router(**kw) -> TopKRouter:
    kw.setdefault("hidden_size", 16)
    kw.setdefault("num_experts", 8)
    kw.setdefault("topk", 2)
    router = TopKRouter(**kw)
    router.reset_parameters(torch.Generator().manual_seed(1))
    with torch.no_grad():
        router.weight.mul_(50.0)  # spread the scores so top-k choices are far from ties
    return router


def _x(tokens=32, hidden=16, seed=0, dtype=torch.float32):
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_softmax_default_renormalises_over_topk():
    router = _router()
    x = _x()
    idx, w = router(x)
    logits = x @ router.weight.T
    ref_idx = logits.topk(2, dim=-1).indices
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (32, 2)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, torch.softmax(logits.gather(1, ref_idx), -1), rtol=1e-6, atol=1e-7)


def test_pre_softmax_and_scaling():
    router = _router(pre_softmax=True, topk_scaling_factor=2.5)
    x = _x()
    idx, w = router(x)
    probs = torch.softmax(x @ router.weight.T, -1)
    assert torch.equal(idx, probs.topk(2, -1).indices)
    torch.testing.assert_close(w, 2.5 * probs.gather(1, idx), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("normalize", [True, False])
def test_sigmoid(normalize):
    router = _router(score_function="sigmoid", normalize_sigmoid_topk=normalize)
    x = _x()
    idx, w = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    assert torch.equal(idx, scores.topk(2, -1).indices)
    ref = scores.gather(1, idx)
    if normalize:
        ref = ref / ref.sum(-1, keepdim=True)
    torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)


def test_router_math_is_fp32_for_bf16_input_and_after_module_to():
    router = _router().to(torch.bfloat16)
    assert router.weight.dtype == torch.float32
    x = _x(dtype=torch.bfloat16)
    idx, w = router(x)
    ref_logits = x.float() @ router.weight.T
    assert w.dtype == torch.float32
    assert torch.equal(idx, ref_logits.topk(2, -1).indices)


def _brute_force_group_topk(scores, topk, num_groups, group_topk):
    """Per token in Python: rank groups by the sum of their best topk/group_topk scores, keep the best
    group_topk groups, then take the best topk experts among them."""
    tokens, experts = scores.shape
    size = experts // num_groups
    out = []
    for t in range(tokens):
        s = scores[t].tolist()
        group_score = [sum(sorted(s[g * size:(g + 1) * size], reverse=True)[:topk // group_topk])
                       for g in range(num_groups)]
        best = max(itertools.combinations(range(num_groups), group_topk),
                   key=lambda gs: sum(group_score[g] for g in gs))
        candidates = [e for g in best for e in range(g * size, (g + 1) * size)]
        out.append(set(sorted(candidates, key=lambda e: -s[e])[:topk]))
    return out


@pytest.mark.parametrize("experts,groups,group_topk,topk", [(16, 4, 2, 4), (8, 4, 1, 2), (12, 3, 2, 2), (8, 8, 3, 3)])
def test_group_limited_topk_matches_brute_force(experts, groups, group_topk, topk):
    scores = torch.rand(64, experts, generator=torch.Generator().manual_seed(experts + groups))
    idx = group_limited_topk(scores, topk, groups, group_topk)
    assert [set(row) for row in idx.tolist()] == _brute_force_group_topk(scores, topk, groups, group_topk)


def test_group_limited_routing_in_router_with_bias_selects_on_biased_scores():
    router = _router(num_experts=16, topk=4, num_groups=4, group_topk=2, score_function="sigmoid",
                     enable_expert_bias=True)
    with torch.no_grad():
        router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 16))
    x = _x(tokens=48)
    idx, w = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    expected = _brute_force_group_topk(scores + router.expert_bias, 4, 4, 2)
    assert [set(r) for r in idx.tolist()] == expected
    ref_w = scores.gather(1, idx)  # weights come from the unbiased scores
    torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


def _hand_aux(probs, idx, num_experts, topk):
    tokens = probs.shape[0]
    loss = 0.0
    for e in range(num_experts):
        f = sum(int(v == e) for v in idx.flatten().tolist()) / (tokens * topk)
        p = sum(probs[t, e].item() for t in range(tokens)) / tokens
        loss += f * p
    return num_experts * loss


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_matches_hand_formula(score_function):
    router = _router(score_function=score_function, aux_loss_coeff=0.1)
    x = _x(tokens=24)
    idx, _ = router(x)
    logits = x @ router.weight.T
    scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    probs = scores / scores.sum(-1, keepdim=True)
    expected = 0.1 * _hand_aux(probs, idx, 8, 2)
    assert abs(router.aux_loss.item() - expected) < 1e-5
    assert router.aux_loss.requires_grad
    router.aux_loss.backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_seq_aux_loss_matches_hand_formula():
    router = _router(load_balancing_type="seq_aux_loss", aux_loss_coeff=0.01, topk=3)
    seqs, seq_len = 3, 10
    x = _x(tokens=seqs * seq_len)
    idx, _ = router(x, seq_length=seq_len)
    probs = torch.softmax(x @ router.weight.T, -1)
    expected = 0.01 * sum(_hand_aux(probs[s * seq_len:(s + 1) * seq_len], idx[s * seq_len:(s + 1) * seq_len], 8, 3)
                          for s in range(seqs)) / seqs
    assert abs(router.aux_loss.item() - expected) < 1e-6
    with pytest.raises(ValueError, match="seq_length"):
        router(_x(tokens=31), seq_length=10)


def test_aux_loss_is_one_when_perfectly_balanced_and_uniform():
    router = _router(aux_loss_coeff=1.0, force_load_balancing=True)
    with torch.no_grad():
        router.weight.zero_()  # uniform probabilities
    router(_x(tokens=16))
    assert abs(router.aux_loss.item() - 1.0) < 1e-6


def test_z_loss():
    router = _router(z_loss_coeff=1e-3)
    x = _x()
    router(x)
    expected = 1e-3 * torch.logsumexp(x @ router.weight.T, -1).square().mean()
    torch.testing.assert_close(router.z_loss, expected, rtol=1e-6, atol=0)
    plain = _router()
    plain(x)
    assert plain.z_loss.item() == 0.0 and plain.aux_loss.item() == 0.0


def test_expert_bias_update_direction_and_accumulation():
    router = _router(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] += 1.0  # expert 0 favoured by every token with positive features
    x = _x().abs()
    router.train()
    router(x)
    router(x)
    counts = router.local_tokens_per_expert.clone()
    assert counts.sum() == 2 * 32 * 2
    router.eval()
    router(x)  # eval forwards do not count
    assert torch.equal(router.local_tokens_per_expert, counts)
    router.update_expert_bias()
    expected = 0.01 * torch.sign(counts.mean() - counts)
    assert torch.equal(router.expert_bias, expected)
    assert router.expert_bias[0] < 0 and router.local_tokens_per_expert.sum() == 0
    state = router.state_dict()
    assert "expert_bias" in state and "local_tokens_per_expert" not in state


def test_expert_bias_balances_load_over_steps():
    router = TopKRouter(16, 8, 2, score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.02,
                        init_method_std=0.2)
    router.reset_parameters(torch.Generator().manual_seed(1))
    x = _x(tokens=256)
    x[:, 0] = 3.0
    with torch.no_grad():
        router.weight[:2, 0] += 1.0  # experts 0 and 1 take most tokens at first
    router.train()

    def imbalance():
        counts = torch.bincount(router(x)[0].flatten(), minlength=8).float()
        return (counts.max() / counts.mean()).item()

    before = imbalance()
    assert before > 3.0
    for _ in range(40):
        router(x)
        router.update_expert_bias()
    assert imbalance() < 1.3, before


def test_force_load_balancing_is_balanced_deterministic_and_differentiable():
    router = _router(force_load_balancing=True, topk=3)
    x = _x(tokens=40)  # 40 * 3 = 120 = 15 * 8 pairs
    idx, w = router(x)
    counts = torch.bincount(idx.flatten(), minlength=8)
    assert torch.all(counts == 15)
    assert all(len(set(row)) == 3 for row in idx.tolist())
    idx2, _ = router(x)
    assert torch.equal(idx, idx2)
    (w[:, 0] ** 2).sum().backward()  # (each row of w sums to 1, so w.sum() would have no gradient)
    assert router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kw,arg", [
    (dict(topk=9), "topk"), (dict(score_function="relu"), "score_function"),
    (dict(num_groups=3, group_topk=1), "num_groups"), (dict(num_groups=4), "group_topk"),
    (dict(num_groups=4, group_topk=3), "group_topk"), (dict(load_balancing_type="x"), "load_balancing_type"),
    (dict(score_function="sigmoid", pre_softmax=True), "pre_softmax"),
])
def test_bad_arguments_raise(kw, arg):
    with pytest.raises(ValueError, match=arg):
        _router(**kw)
    with pytest.raises(ValueError, match="'x'"):
        _router()(torch.zeros(4, 5))
