"""Expert parallelism on gloo: EP=2 (and EP=4) against the single-process model with the same global weights.

One spawned EP=2 run does every case (a spawn, and the first custom-op call that imports torch._dynamo,
cost seconds here); loading at EP=4 is checked in-process (taking slices needs no communication). Each rank builds the
single-process reference itself (same seed, so the same global weights), runs it on the whole batch, and
compares its own half of the batch and its own experts. fp32 throughout.

Tolerance: 1e-6 absolute / 1e-5 relative. The EP path does the same arithmetic in the same order as the
single-process path (rows of an expert in (source rank, token) order, per-token sums in fp32 in expert
order), so most results are bit-identical; the margin covers BLAS kernels that may block a matmul
differently when it has fewer rows (each rank runs attention and the router on half of the batch).
"""

import io
import time

import pytest
import torch
import torch.distributed as dist

from ep_moe.buffer.buffer_v1 import Buffer
from ep_moe.distributed import run_distributed
from ep_moe.layers import (
    GroupedExperts,
    ModelConfig,
    MoELayer,
    MoETransformer,
    global_state_dict,
    load_global_state_dict,
)

RTOL, ATOL = 1e-5, 1e-6


def _diff(a, b) -> float:
    """Largest violation of |a - b| <= ATOL + RTOL |b| (<= 0 means within tolerance); inf on shape mismatch."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).abs() - (ATOL + RTOL * b.abs())).max()) if a.numel() else 0.0


LAYER_CASES = {
    "softmax": dict(),
    "softmax_aux_z_dp": dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
    "sigmoid_groups_bias_scale": dict(moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                      moe_router_group_topk=2, moe_router_topk=4,
                                      moe_router_topk_scaling_factor=2.0, moe_router_enable_expert_bias=True),
    "seq_aux_shared_gate": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.05,
                                moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True),
    "force_balance_topk1": dict(moe_router_force_load_balancing=True, moe_router_topk=1,
                                moe_router_pre_softmax=True),
}


def _layer_case(rank, world, buffer, name, kw, results, impl="loop"):
    """MoELayer over the EP buffer (this rank's half of the batch) vs the whole layer in one process.
    Objective: sum over ranks of <out_r, G_r> + aux_r, i.e. <out, G> + world * aux on the whole batch."""
    config = ModelConfig(hidden_size=16, moe_ffn_hidden_size=20, num_moe_experts=8, num_layers=2, **kw)
    ref = MoELayer(config, expert_impl=impl)
    ep = MoELayer(config, buffer=buffer, dp_group=dist.group.WORLD, expert_impl=impl)
    for layer in (ref, ep):  # the same global weights, by the same seeds
        layer.router.reset_parameters(torch.Generator().manual_seed(1))
        layer.experts.reset_parameters(2)
        if layer.shared_expert is not None:
            layer.shared_expert.reset_parameters(torch.Generator().manual_seed(3))
            layer.reset_parameters(torch.Generator().manual_seed(4))
        with torch.no_grad():
            layer.router.weight.mul_(20.0)
    gen = torch.Generator().manual_seed(5)
    # [B, S, H], rank r takes sequences 2r, 2r+1: 16 tokens per rank, a multiple of E, so the round-robin
    # of force_load_balancing picks the same experts for a token on every EP size
    x = torch.randn(2 * world, 8, 16, generator=gen)
    grad = torch.randn(x.shape, generator=gen)
    mine = slice(2 * rank, 2 * rank + 2)

    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    ((out_ref * grad).sum() + world * ref.aux_loss).backward()
    x_ep = x[mine].clone().requires_grad_()
    out_ep = ep(x_ep)
    ((out_ep * grad[mine]).sum() + ep.aux_loss).backward()

    aux = ep.aux_loss.detach().clone()
    dist.all_reduce(aux)
    results[f"{name}/out"] = _diff(out_ep, out_ref[mine])
    results[f"{name}/aux"] = _diff(aux / world, ref.aux_loss)
    results[f"{name}/grad_x"] = _diff(x_ep.grad, x_ref.grad[mine])
    first, last = ep.experts.first_expert, ep.experts.first_expert + ep.experts.num_local_experts
    for w in ("w1", "w2", "w3"):
        results[f"{name}/grad_{w}"] = _diff(getattr(ep.experts, w).grad, getattr(ref.experts, w).grad[first:last])
    replicated = [("router", ep.router.weight, ref.router.weight)]
    if ep.shared_expert is not None:
        replicated += [("shared_w1", ep.shared_expert.w1, ref.shared_expert.w1),
                       ("gate", ep.shared_expert_gate, ref.shared_expert_gate)]
    for label, p_ep, p_ref in replicated:
        g = p_ep.grad.clone()
        dist.all_reduce(g)
        results[f"{name}/grad_{label}"] = _diff(g, p_ref.grad)
    if ep.router.enable_expert_bias:
        ep.router.update_expert_bias()
        ref.router.update_expert_bias()
        results[f"{name}/expert_bias"] = _diff(ep.router.expert_bias, ref.router.expert_bias)


def _one_rank_buffer_case(rank, world, results):
    """A one-rank Buffer and the LocalTokenDispatcher give bit-identical outputs and gradients."""
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    buffer = Buffer(groups[rank], backend="torch")
    config = ModelConfig(hidden_size=16, moe_ffn_hidden_size=20, num_moe_experts=8, moe_router_topk=3)
    outs = []
    for buf in (buffer, None):
        layer = MoELayer(config, buffer=buf, expert_impl="loop")
        layer.router.reset_parameters(torch.Generator().manual_seed(1))
        layer.experts.reset_parameters(2)
        x = torch.randn(13, 16, generator=torch.Generator().manual_seed(3 + rank)).requires_grad_()
        out = layer(x)
        out.square().sum().backward()
        outs.append([out, x.grad, layer.router.weight.grad, layer.experts.w1.grad, layer.experts.w2.grad])
    results["one_rank_buffer_equals_local"] = 0.0 if all(torch.equal(a, b) for a, b in zip(*outs)) else 1.0


MODEL_KW = dict(vocab_size=64, seq_length=8, num_layers=3, hidden_size=32, num_attention_heads=4,
                ffn_hidden_size=48, moe_ffn_hidden_size=24, num_moe_experts=8, moe_router_topk=2,
                moe_layer_freq=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=16)


def _batch(world, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2 * world, 8), generator=gen)
    labels = torch.randint(0, 64, (2 * world, 8), generator=gen)
    labels[0, :3] = -100
    return ids, labels


def _model_case(rank, world, results):
    """MoETransformer EP=world vs EP=1 (whole batch), with the documented gradient reduction:
    non-expert grads summed over the world / world, expert grads (expert-DP size 1 here) / world."""
    config = ModelConfig(**MODEL_KW)
    ref = MoETransformer(config, seed=3)
    ep = MoETransformer(config, buffer=Buffer(dist.group.WORLD, backend="torch", check_inputs=False),
                        dp_group=dist.group.WORLD, seed=3)
    ids, labels = _batch(world)
    ids[1] = ids[2]  # the same sequence on two ranks
    mine = slice(2 * rank, 2 * rank + 2)
    out_ref = ref(ids, labels)
    (out_ref.loss + out_ref.aux_loss).backward()
    out_ep = ep(ids[mine], labels[mine])
    (out_ep.loss + out_ep.aux_loss).backward()

    results["model/logits"] = _diff(out_ep.logits, out_ref.logits[mine])
    both = torch.stack([out_ep.loss.detach(), out_ep.aux_loss.detach()])
    dist.all_reduce(both)
    # labels[0] has 3 ignored positions, so rank 0's mean CE has fewer terms: weight by counted tokens
    counted = (labels[mine] != -100).sum().float()
    weighted = out_ep.loss.detach() * counted
    dist.all_reduce(weighted)
    results["model/loss"] = _diff(weighted / (labels != -100).sum(), out_ref.loss)
    results["model/aux_loss"] = _diff(both[1] / world, out_ref.aux_loss)

    ep.update_expert_bias()
    ref.update_expert_bias()
    for a, b in zip(ep.moe_layers, ref.moe_layers):
        results["model/expert_bias"] = max(results.get("model/expert_bias", float("-inf")),
                                           _diff(a.router.expert_bias, b.router.expert_bias))
    stats_ep, stats_ref = ep.moe_stats(), ref.moe_stats()
    results["model/load_imbalance"] = _diff(torch.tensor(stats_ep["load_imbalance"]),
                                            torch.tensor(stats_ref["load_imbalance"]))
    return ep


def _model_grad_case(rank, world, results):
    """Gradients: every label counted (equal tokens per rank), each rank's loss its local mean, and the
    trainer's reduction: non-expert sum over world / world; expert (expert-DP size 1) / world."""
    config = ModelConfig(**MODEL_KW)
    ref = MoETransformer(config, seed=4)
    ep = MoETransformer(config, buffer=Buffer(dist.group.WORLD, backend="torch", check_inputs=False),
                        dp_group=dist.group.WORLD, seed=4)
    ids, labels = _batch(world, seed=1)
    labels[labels == -100] = 0
    mine = slice(2 * rank, 2 * rank + 2)
    out_ref = ref(ids, labels)
    (out_ref.loss + out_ref.aux_loss).backward()
    out_ep = ep(ids[mine], labels[mine])
    (out_ep.loss + out_ep.aux_loss).backward()
    loss = out_ep.loss.detach().clone()
    dist.all_reduce(loss)
    results["grad_model/loss"] = _diff(loss / world, out_ref.loss)
    ref_params = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        g = p.grad.clone()
        if getattr(p, "is_expert", False):
            first = rank * g.shape[0]
            want = ref_params[name].grad[first:first + g.shape[0]]
        else:
            dist.all_reduce(g)
            want = ref_params[name].grad
        results[f"grad_model/{name}"] = _diff(g / world, want)


def _ep2_worker(rank, world):
    torch.manual_seed(100 + rank)  # the layers must not depend on the global RNG
    results = {}
    t0 = time.perf_counter()
    buffer = Buffer(dist.group.WORLD, backend="torch")
    for name, kw in LAYER_CASES.items():
        _layer_case(rank, world, buffer, name, kw, results)
    _layer_case(rank, world, buffer, "grouped_mm_aligned", dict(moe_router_topk=3), results, impl="grouped_mm")
    t1 = time.perf_counter()
    _one_rank_buffer_case(rank, world, results)
    t2 = time.perf_counter()
    ep = _model_case(rank, world, results)
    _model_grad_case(rank, world, results)
    t3 = time.perf_counter()
    if rank == 0:
        print(f"timing: layers {t1 - t0:.1f}s, one-rank buffer {t2 - t1:.1f}s, model {t3 - t2:.1f}s", flush=True)
    state = global_state_dict(ep, dist.group.WORLD)
    ids, _ = _batch(world, seed=9)
    logits = ep(ids[2 * rank:2 * rank + 2]).logits.detach()
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits)
    # tensors go back as torch.save bytes: a tensor through the queue is shared memory that dies with the rank
    return results, (_to_bytes((state, torch.cat(parts))) if rank == 0 else None)


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _check(results):
    bad = {k: v for k, v in results.items() if not v <= 0.0}
    assert not bad, f"beyond rtol={RTOL}, atol={ATOL} (excess): {bad}"


def test_ep2_layers_model_and_checkpoint():
    outs = run_distributed(_ep2_worker, 2, timeout_s=60, join_timeout_s=240)
    for results, _ in outs:
        _check(results)
    state, logits = torch.load(io.BytesIO(outs[0][1]))
    assert "layers.0.moe.experts.w1.7" in state and "layers.0.moe.experts.w1" not in state
    assert state["layers.0.moe.experts.w1.7"].shape == (32, 24)
    assert state["layers.0.moe.router.expert_bias"].abs().sum() > 0  # updated, then saved

    # saved at EP=2 -> loaded at EP=1 (a model built with another seed): the same outputs
    model = MoETransformer(ModelConfig(**MODEL_KW), seed=123)
    load_global_state_dict(model, state)
    ids, _ = _batch(2, seed=9)
    _check({"ckpt_ep2_to_ep1": _diff(model(ids).logits, logits)})
    assert all(torch.equal(v, global_state_dict(model)[k]) for k, v in state.items())

    # ... and at EP=4: every rank takes its own experts' slices (to_local needs no communication, so the
    # EP=4 ranks' expert modules are built here in one process)
    for rank in range(4):
        model4 = MoETransformer(ModelConfig(**MODEL_KW), seed=321)
        for moe in model4.moe_layers:
            e = moe.experts
            moe.experts = GroupedExperts(e.num_experts, e.hidden_size, e.ffn_hidden_size, rank, 4)
        load_global_state_dict(model4, state)
        for name, value in model4.state_dict().items():
            if name.split(".")[-1] in ("w1", "w2", "w3") and ".experts." in name:
                assert torch.equal(value, torch.stack([state[f"{name}.{g}"] for g in (2 * rank, 2 * rank + 1)]))
            else:
                assert torch.equal(value, state[name]), name


def test_checkpoint_errors():
    model = MoETransformer(ModelConfig(**MODEL_KW))
    state = global_state_dict(model)
    missing = {k: v for k, v in state.items() if k != "layers.2.moe.experts.w2.5"}
    with pytest.raises(ValueError, match=r"missing 'layers.2.moe.experts.w2.<g>' for experts \[5\]"):
        load_global_state_dict(model, missing)
    extra = dict(state, **{"layers.0.moe.experts.w1.8": state["layers.0.moe.experts.w1.0"]})
    with pytest.raises(ValueError, match=r"experts \[8\]"):
        load_global_state_dict(model, extra)
