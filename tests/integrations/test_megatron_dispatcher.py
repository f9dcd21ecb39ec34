"""ep_moe as Megatron-core's token dispatcher, on CPU (gloo, 2 ranks, expert parallel 2).

One spawned run (Megatron's import dominates its cost) checks, on both ranks:

* a Megatron ``MoELayer`` (4 experts, top-2, a shared expert, fp32) built through the ModuleSpec route
  (`ep_moe_spec` -> `EpMoELayer`) and through ``install_ep_moe_dispatcher`` on a built layer: forward,
  input gradient and every parameter gradient equal a dense single-process computation over all
  ranks' tokens with the same weights (atol 1e-6);
* Megatron's own round-trip property on `EpMoETokenDispatcher` directly: with probs = 1/(experts of
  the token), dispatch -> scale -> combine returns the input and, backwards, its gradient; on a random
  routing and an adversarial one (every token to rank 0's experts, a token with no expert, a token with
  one, a rank with no tokens); ``tokens_per_expert`` is CPU int64 and counts every rank's pairs;
* Megatron's flex dispatcher with ``moe_flex_dispatcher_backend="deepep"`` on ``ep_moe.compat.deep_ep``
  (installed after Megatron was imported, exercising the re-binding) gives the same outputs and gradients;
* argument errors (drop-and-pad, an old megatron-core version).

Megatron's CPU pitfalls are avoided, not relied on: `PortableTopKRouter` (Megatron's gating moves weights
to CUDA and needs TransformerEngine), no alltoall dispatcher is ever built (its constructor makes a CUDA
stream), and dynamo is disabled because Megatron wraps the flex dispatcher's preprocessing in
``torch.compile``, whose C++ build of the backward takes ~40 s on CI CPUs and is not under test.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from ep_moe.distributed import run_distributed

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

H, FFN, SHARED_FFN, E, K, SEQ, BATCH = 16, 24, 20, 4, 2, 6, 2
ATOL = 1e-6


# ------------------------------------------------------------------------------------------ helpers
def _config(dispatcher_type: str, shared: bool = True, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
        num_moe_experts=E, moe_router_topk=K, moe_token_dispatcher_type=dispatcher_type,
        moe_shared_expert_intermediate_size=SHARED_FFN if shared else None,
        expert_model_parallel_size=2, moe_router_load_balancing_type="none", add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32)
    return TransformerConfig(**{**kwargs, **extra})


def _build(spec, **kwargs):
    """Build a Megatron spec: a ``ModuleSpec`` (callable only from 0.16) or a builder (0.19)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    return build_module(spec, **kwargs) if isinstance(spec, ModuleSpec) else spec(**kwargs)


def _global_weights() -> dict[str, torch.Tensor]:
    """Every expert's weights (the same on every rank), scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(1234)

    def rand(*shape, scale):
        return torch.randn(*shape, generator=gen) * scale

    return {"router": rand(E, H, scale=0.5), "w1": rand(E, FFN, H, scale=0.3), "w2": rand(E, H, FFN, scale=0.3),
            "s1": rand(SHARED_FFN, H, scale=0.3), "s2": rand(H, SHARED_FFN, scale=0.3)}


def _load(layer, weights: dict[str, torch.Tensor], rank: int) -> None:
    local = layer.num_local_experts
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        for i, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(weights["w1"][rank * local + i])
            expert.linear_fc2.weight.copy_(weights["w2"][rank * local + i])
        layer.shared_experts.linear_fc1.weight.copy_(weights["s1"])
        layer.shared_experts.linear_fc2.weight.copy_(weights["s2"])


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s layer input ``[S, B, H]`` and the upstream gradient of its output."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(SEQ, BATCH, H, generator=gen), torch.randn(SEQ, BATCH, H, generator=gen)


def _detached_router(router):
    """A copy of ``router`` with its own weight (deepcopy fails on the process groups it holds)."""
    twin = copy.copy(router)
    twin._parameters = dict(router._parameters)
    twin.weight = torch.nn.Parameter(router.weight.detach().clone())
    return twin


def _dense_reference(router, weights, world: int):
    """The layer over all ranks' tokens in one process: output, and gradients of sum(out * grad)."""
    xs, gs = zip(*(_inputs(r) for r in range(world)))
    x = torch.cat([t.reshape(-1, H) for t in xs]).requires_grad_(True)
    g = torch.cat([t.reshape(-1, H) for t in gs])
    params = {k: v.clone().requires_grad_(True) for k, v in weights.items() if k != "router"}
    probs, routing_map = router(x.view(-1, 1, H))
    out = torch.zeros_like(x)
    for e in range(E):  # as Megatron's MLP: activation, times the prob, then fc2
        inner = torch.nn.functional.gelu(x @ params["w1"][e].T) * probs[:, e:e + 1]
        out = out + torch.where(routing_map[:, e:e + 1], inner @ params["w2"][e].T, 0.0)
    out = out + torch.nn.functional.gelu(x @ params["s1"].T) @ params["s2"].T
    # Replicated parameters (router, shared expert): each rank's gradient covers its own tokens, so the
    # reference is taken per rank too (summing ranks first would only test the summation order).
    replicated = {"router": router.weight, "s1": params["s1"], "s2": params["s2"]}
    rows = SEQ * BATCH
    per_rank = [torch.autograd.grad((out[r * rows:(r + 1) * rows] * g[r * rows:(r + 1) * rows]).sum(),
                                    list(replicated.values()), retain_graph=True) for r in range(world)]
    (out * g).sum().backward()
    grads = {k: v.grad for k, v in params.items()}
    grads["x"] = x.grad
    for i, name in enumerate(replicated):
        grads[name] = [per_rank[r][i] for r in range(world)]
    return out.detach(), grads


def _layer_errors(layer, ref_out, ref_grads, rank: int, world: int) -> dict[str, float]:
    """Run ``layer`` on this rank's input; max |difference| to the dense reference, per quantity."""
    x, g = _inputs(rank)
    x.requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    (out * g).sum().backward()
    rows = slice(rank * SEQ * BATCH, (rank + 1) * SEQ * BATCH)
    local = layer.num_local_experts
    errors = {"out": (out.reshape(-1, H) - ref_out[rows]).abs().max().item(),
              "grad_x": (x.grad.reshape(-1, H) - ref_grads["x"][rows]).abs().max().item()}
    for i, expert in enumerate(layer.experts.local_experts):
        e = rank * local + i
        errors[f"grad_w1[{e}]"] = (expert.linear_fc1.weight.grad - ref_grads["w1"][e]).abs().max().item()
        errors[f"grad_w2[{e}]"] = (expert.linear_fc2.weight.grad - ref_grads["w2"][e]).abs().max().item()
    for name, param in (("router", layer.router.weight), ("s1", layer.shared_experts.linear_fc1.weight),
                        ("s2", layer.shared_experts.linear_fc2.weight)):
        errors[f"grad_{name}"] = (param.grad - ref_grads[name][rank]).abs().max().item()
    return errors


def _round_trip(dispatcher, x: torch.Tensor, routing_map: torch.Tensor, all_maps: list[torch.Tensor]) -> dict:
    """Megatron's dispatcher property: probs = 1/(experts of the token); dispatch, scale, combine = x."""
    count = routing_map.sum(dim=1, keepdim=True)
    probs = torch.where(routing_map, 1.0 / count.clamp(min=1), 0.0)
    x = x.clone().requires_grad_(True)
    hidden, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
    tokens, p = dispatcher.token_dispatch(hidden, p)
    tokens, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(tokens, p)
    expert_out = dispatcher.combine_preprocess(tokens * permuted_probs.unsqueeze(-1))
    out = dispatcher.combine_postprocess(dispatcher.token_combine(expert_out))
    routed = (count > 0).float()
    out.backward(x.detach())
    local = dispatcher.local_expert_indices
    expected_counts = sum(m[:, local[0]:local[-1] + 1].sum(dim=0) for m in all_maps).to(torch.int64)
    return {"out": (out - x.detach() * routed).abs().max().item() if x.numel() else 0.0,
            "grad": (x.grad - x.detach() * routed).abs().max().item() if x.numel() else 0.0,
            "tpe_cpu_int64": tokens_per_expert.device.type == "cpu" and tokens_per_expert.dtype == torch.int64,
            "tpe": tokens_per_expert.tolist(), "tpe_expected": expected_counts.tolist(),
            "rows": tokens.shape[0], "probs_dtype": str(permuted_probs.dtype)}


def _random_routing(num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, E, generator=gen)
    return torch.zeros(num_tokens, E, dtype=torch.bool).scatter(1, scores.topk(K, dim=1).indices, True)


def _adversarial_routing(rank: int) -> torch.Tensor:
    """Rank 0: 7 tokens, all to experts 0/1 (rank 0's), one with no expert, one with one; rank 1: none."""
    if rank == 1:
        return torch.zeros(0, E, dtype=torch.bool)
    routing = torch.zeros(7, E, dtype=torch.bool)
    routing[:, :2] = True
    routing[3] = False
    routing[5, 1] = False
    return routing


_SMOKE_RECIPE = {
    "engine": "megatron",
    "model": {"vocab_size": 32, "seq_length": 16, "num_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
              "moe_ffn_hidden_size": 32, "num_moe_experts": 4, "moe_router_topk": 2, "expert_model_parallel_size": 2,
              "moe_shared_expert_intermediate_size": 16},
    "train": {"global_batch_size": 8, "micro_batch_size": 2, "train_iters": 25, "eval_iters": 1, "nproc": 2,
              "device": "cpu"},
    "optimizer": {"lr": 1.0e-2, "weight_decay": 0.0},
    "scheduler": {"lr_warmup_iters": 5, "lr_decay_style": "constant"},
    "ep_moe": {"dispatcher_backend": "torch"},
}


# ------------------------------------------------------------------------------------------ the run
def _megatron_worker(rank: int, world: int, metrics_path: str) -> dict:
    warnings.filterwarnings("ignore")
    import torch._dynamo

    torch._dynamo.config.disable = True  # see the module docstring
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import fused_a2a

    from ep_moe.integrations import megatron as integ

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    results: dict = {"version": integ.MEGATRON_CORE_VERSION}
    weights = _global_weights()
    moe_spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)

    # 1. ModuleSpec route.
    layer = _build(integ.ep_moe_spec(moe_spec, backend="torch"), config=_config("alltoall"))
    results["spec_types"] = (type(layer).__name__, type(layer.token_dispatcher).__name__,
                             type(layer.router).__name__)
    _load(layer, weights, rank)
    ref_out, ref_grads = _dense_reference(_detached_router(layer.router), weights, world)
    results["spec"] = _layer_errors(layer, ref_out, ref_grads, rank, world)

    # 2. Install into a built layer (allgather is the one Megatron dispatcher that builds on CPU).
    built = _build(moe_spec, config=_config("allgather"))
    results["installed"] = integ.install_ep_moe_dispatcher(built, backend="torch")
    results["install_types"] = (type(built.token_dispatcher).__name__, type(built.router).__name__)
    _load(built, weights, rank)
    results["install"] = _layer_errors(built, ref_out, ref_grads, rank, world)

    # 3. Round trip on the dispatcher itself.
    dispatcher = integ.EpMoETokenDispatcher(E // world, [rank * (E // world) + i for i in range(E // world)],
                                            _config("alltoall", shared=False), backend="torch")
    maps = [_random_routing(9 + r, seed=7 + r) for r in range(world)]
    gen = torch.Generator().manual_seed(55 + rank)
    results["round_trip_random"] = _round_trip(dispatcher, torch.randn(9 + rank, H, generator=gen), maps[rank], maps)
    maps = [_adversarial_routing(r) for r in range(world)]
    results["round_trip_adversarial"] = _round_trip(
        dispatcher, torch.randn(maps[rank].shape[0], H, generator=gen), maps[rank], maps)
    idx, w = integ.routing_map_to_topk(maps[0], maps[0].float() * 0.5, K)
    results["topk_of_adversarial"] = (idx.tolist(), w.tolist())

    # 4. Megatron's flex dispatcher through the DeepEP compatibility module, installed late.
    results["deep_ep_before"] = fused_a2a.HAVE_DEEP_EP
    import ep_moe.compat.deep_ep as compat

    compat.install()
    from megatron.core.transformer.moe import fused_a2a as reloaded

    results["deep_ep_after"] = reloaded.HAVE_DEEP_EP
    flex = _build(integ.with_portable_router(moe_spec), config=_config("flex", **integ.flex_deepep_config()))
    integ.use_portable_routers(flex)  # megatron-core < 0.16 has no router in MoESubmodules
    results["flex_types"] = (type(flex.token_dispatcher).__name__,)
    _load(flex, weights, rank)
    results["flex"] = _layer_errors(flex, ref_out, ref_grads, rank, world)
    results["flex_buffer"] = type(reloaded._buffer).__module__ + "." + type(reloaded._buffer).__name__

    # 5. The recipe's training loop (engine: megatron), a few steps in this process group.
    from ep_moe.train.engines import megatron_engine
    from ep_moe.train.recipe_schema import recipe_from_dict

    recipe = recipe_from_dict({**_SMOKE_RECIPE, "logger": {"metrics_path": metrics_path}})
    summary = megatron_engine.train_rank(recipe, torch.device("cpu"))
    results["recipe"] = {k: summary[k] for k in ("losses", "eval_loss", "entropy_floor", "dispatcher")}

    # 6. Errors.
    try:
        integ.EpMoETokenDispatcher(E // world, [rank * (E // world) + i for i in range(E // world)],
                                   _config("alltoall", shared=False, moe_expert_capacity_factor=1.0,
                                           moe_pad_expert_input_to_capacity=True))
        results["pad_error"] = None
    except ValueError as exc:
        results["pad_error"] = str(exc)
    real_version = integ.megatron_core_version
    integ.megatron_core_version = lambda: "0.12.3"
    try:
        integ._require_megatron_core()
        results["version_error"] = None
    except ImportError as exc:
        results["version_error"] = str(exc)
    finally:
        integ.megatron_core_version = real_version
    integ.destroy_ep_buffers()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    metrics_path = str(tmp_path_factory.mktemp("megatron") / "metrics.jsonl")
    return run_distributed(_megatron_worker, 2, metrics_path, timeout_s=120, join_timeout_s=400)


def _assert_close(errors: dict[str, float], what: str) -> None:
    bad = {k: v for k, v in errors.items() if not v <= ATOL}
    assert not bad, f"{what}: differences above {ATOL} to the dense reference: {bad}"


def test_spec_route_matches_dense_reference(results):
    for rank, res in enumerate(results):
        assert res["spec_types"] == ("EpMoELayer", "EpMoETokenDispatcher", "PortableTopKRouter")
        _assert_close(res["spec"], f"rank {rank} (ModuleSpec route, megatron-core {res['version']})")


def test_install_route_matches_dense_reference(results):
    for rank, res in enumerate(results):
        assert res["installed"] == 1
        assert res["install_types"] == ("EpMoETokenDispatcher", "PortableTopKRouter")
        _assert_close(res["install"], f"rank {rank} (install_ep_moe_dispatcher)")


@pytest.mark.parametrize("case", ["round_trip_random", "round_trip_adversarial"])
def test_round_trip_property(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["out"] <= ATOL and r["grad"] <= ATOL, f"rank {rank} {case}: {r}"
        assert r["tpe_cpu_int64"], f"rank {rank} {case}: tokens_per_expert must be CPU int64"
        assert r["tpe"] == r["tpe_expected"], f"rank {rank} {case}: {r['tpe']} != {r['tpe_expected']}"
        assert r["rows"] == sum(r["tpe"]) and r["probs_dtype"] == "torch.float32"
    assert results[1]["round_trip_adversarial"]["rows"] == 0  # rank 1 holds experts nobody chose


def test_routing_map_to_topk(results):
    idx, weights = results[0]["topk_of_adversarial"]
    assert idx == [[0, 1]] * 3 + [[-1, -1]] + [[0, 1]] + [[0, -1]] + [[0, 1]]
    assert weights == [[0.5, 0.5]] * 3 + [[0.0, 0.0]] + [[0.5, 0.5]] + [[0.5, 0.0]] + [[0.5, 0.5]]


def test_flex_deepep_through_compat_matches(results):
    for rank, res in enumerate(results):
        assert res["deep_ep_before"] is False and res["deep_ep_after"] is True
        assert res["flex_types"] == ("MoEFlexTokenDispatcher",)
        assert res["flex_buffer"] == "ep_moe.compat.deep_ep.Buffer"
        _assert_close(res["flex"], f"rank {rank} (flex + deepep via ep_moe.compat.deep_ep)")


def test_errors_name_the_problem(results):
    res = results[0]
    assert res["pad_error"] and "moe_pad_expert_input_to_capacity" in res["pad_error"]
    assert res["version_error"] and "0.12.3" in res["version_error"] and ">= 0.13" in res["version_error"]


def test_recipe_training_loop_learns(results):
    first = results[0]["recipe"]
    assert first["dispatcher"] == "ep_moe" and results[1]["recipe"] == first  # every rank reports the same run
    losses = first["losses"]
    assert len(losses) == 25 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    assert first["eval_loss"] is not None and first["eval_loss"] > first["entropy_floor"]



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 16, 4), (64, 3, 4), (0, 8, 2), (1000, 256, 8)])
def test_routing_map_to_topk_native_equals_torch(dtype, shape):
    """On CUDA with the JIT kernels, `routing_map_to_topk` is one kernel each way: indices, weights and the probs'
    gradient equal the torch ops' bit for bit (rows with fewer than K experts, none, and E < K included)."""
    from ep_moe import native
    from ep_moe.integrations import megatron as integ

    if not native.kernels_available():
        pytest.skip(f"no native kernels: {native.kernels_unavailable_reason()}")
    T, E, K = shape
    gen = torch.Generator().manual_seed(T + E)
    scores = torch.rand(T, E, generator=gen)
    width = min(K, E)
    chosen = scores.topk(width, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, chosen, True)
    routing_map[torch.rand(T, E, generator=gen) < 0.2] = False  # some rows fewer than K, some none
    probs = (scores * routing_map).to(dtype)
    grad = torch.randn(T, K, generator=gen)
    results = []
    for fast in (True, False):
        p = probs.cuda().requires_grad_()
        if fast:
            idx, w = integ.routing_map_to_topk(routing_map.cuda(), p, K, check=False)
        else:
            idx, w = integ._routing_map_to_topk_torch(routing_map.cuda(), p, K)
        w.backward(grad.cuda())
        results.append((idx.cpu(), w.detach().cpu(), p.grad.cpu()))
    for name, a, b in zip(("topk_idx", "topk_weights", "grad probs"), *results):
        assert a.dtype == b.dtype and torch.equal(a, b), name
