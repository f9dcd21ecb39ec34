"""One Megatron-core MoE layer, forward + backward, with each token dispatcher, in the same run.

    python benchmarks/megatron_layer_bench.py [--tokens 4096 --hidden 4096 --ffn 1024 --experts 16 --topk 4]

spawns one rank per GPU (2 by default; NCCL) -- or runs under ``torchrun`` -- and times, on the same layer
(Megatron's ``MoELayer``, local spec, SequentialMLP experts, `PortableTopKRouter`, bf16), weights and
inputs:

* ``alltoall``: Megatron's own ``MoEAlltoAllTokenDispatcher`` (permute + ``all_to_all_single``; its
  fused permutation needs TransformerEngine, absent here, so it runs unfused);
* ``flex+deepep``: Megatron's ``MoEFlexTokenDispatcher`` on ``ep_moe.compat.deep_ep`` (its backend:
  ``$EP_MOE_BACKEND``, default "auto");
* ``ep_moe[<backend>]``: `EpMoETokenDispatcher` (``install_ep_moe_dispatcher``) per ``--backends``.

``--trivial-experts`` replaces the experts of every variant by one trivial module (``x * probs``), so that the
time is the router's and the dispatcher's own.

At EP 1 a last row, ``no dispatcher``, times the same router and experts with nothing between them: the experts
take each input's rows already grouped by expert (made once, untimed) and its probs by one gather, and the
backward starts from a gradient of their output. A variant's time minus that row's is its dispatcher's own share of
the layer (dispatch, combine, their backward, the host reads they wait for), printed beside its ratio to
``alltoall``'s share. (Across ranks there is no such floor: the rows must cross.)

The inputs require grad, as inside a model, so the dispatch's backward (the input's gradient) is timed too.
Each variant is checked against ``alltoall`` first (relative max difference of output and input
gradient), then timed: ``--warmup`` untimed iterations, ``--iters`` timed ones with CUDA events around
forward + backward, a barrier before each, inputs rotated among 3 sets; the variants take turns
(``--rounds`` turns of ``iters / rounds`` iterations each), so that a drift of the machine's speed does not
favour one; the median per rank, then the slowest rank's median. Printed last: a table with ms and the ratio to alltoall; ``--json PATH`` saves it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings

import torch
import torch.distributed as dist

from ep_moe.distributed import launch, torchrun_env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=1024, help="each expert's FFN size")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--backends", default="auto,torch", help="ep_moe backends to time (comma separated)")
    p.add_argument("--no-flex", action="store_true", help="skip Megatron's flex dispatcher")
    p.add_argument("--trivial-experts", action="store_true",
                   help="replace the experts by x * probs on every variant: the dispatcher's own share")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30, help="timed iterations per variant, over all rounds")
    p.add_argument("--rounds", type=int, default=5,
                   help="variants take turns this many times (iters / rounds each turn), against drift")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, run N more iterations of each variant under torch.profiler and print "
                        "rank 0's top GPU kernels and host-side ops (where a dispatcher's time goes)")
    return p


def _config(args, dispatcher: str, world: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    from ep_moe.integrations.megatron import flex_deepep_config

    kwargs = dict(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=8, ffn_hidden_size=args.ffn,
        moe_ffn_hidden_size=args.ffn, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=world,
        moe_router_load_balancing_type="none", moe_router_dtype="fp32", add_bias_linear=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=False)
    if dispatcher == "flex":
        kwargs.update(flex_deepep_config())
    return TransformerConfig(**kwargs)


def _build(spec, **kwargs):
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    return build_module(spec, **kwargs) if isinstance(spec, ModuleSpec) else spec(**kwargs)


def _layer_step(layer):
    """One forward + backward of ``layer`` on input ``x`` with output gradient ``g``."""
    def step(x: torch.Tensor, g: torch.Tensor) -> None:
        out, _ = layer(x)
        out.backward(g)
    return step


class NoDispatcher:
    """The layer's router and experts with nothing between them (one rank): for each input, its rows grouped by
    expert (tokens in order within an expert, as Megatron's permute) and their expert counts on the host are made
    once, untimed; a step runs the router, gathers the routed probs in that order, runs the experts on the rows
    (a leaf that requires grad, so the experts' input gradient is computed as in the layer) and back-propagates a
    gradient of the experts' output. What every dispatcher adds on top of this is its own share."""

    def __init__(self, layer, inputs: list[torch.Tensor], seed: int = 7):
        self.layer = layer
        self.prepared = {}
        gen = torch.Generator(device=inputs[0].device).manual_seed(seed)
        with torch.no_grad():
            for x in inputs:
                _, routing_map = layer.router(x)
                num_tokens, num_experts = routing_map.shape
                expert, token = routing_map.t().nonzero(as_tuple=True)
                rows = x.reshape(num_tokens, -1)[token].clone().requires_grad_(True)
                grad_rows = torch.randn(rows.shape, generator=gen, device=rows.device, dtype=rows.dtype)
                self.prepared[id(x)] = (rows, routing_map.sum(0).cpu(), token * num_experts + expert, grad_rows)

    def __call__(self, x: torch.Tensor, g: torch.Tensor) -> None:
        rows, tokens_per_expert, pair_index, grad_rows = self.prepared[id(x)]
        probs, _ = self.layer.router(x)
        out, _ = self.layer.experts(rows, tokens_per_expert, probs.reshape(-1)[pair_index])
        out.backward(grad_rows)


def _bench(step, inputs, grads, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` forward + backward passes (``step(x, g)``) on this rank (after
    ``warmup``)."""
    times = []
    for i in range(warmup + iters):
        x, g = inputs[i % len(inputs)], grads[i % len(grads)]
        x.grad = None
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(x, g)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def _profile(name: str, step, inputs, grads, iters: int) -> None:
    """Print this rank's top GPU kernels and CPU ops over ``iters`` forward + backward passes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            step(inputs[i % len(inputs)], grads[i % len(grads)])
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        averages = prof.key_averages()
        print(f"\n== {name}: {iters} fwd+bwd under torch.profiler, rank 0, by GPU time", flush=True)
        print(averages.table(sort_by="device_time_total", row_limit=14), flush=True)
        print(f"== {name}: by CPU time (self)", flush=True)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=10), flush=True)


class TrivialExperts(torch.nn.Module):
    """Megatron's experts interface doing only ``x * probs`` (in fp32, cast back)."""

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        return (hidden.float() * probs.unsqueeze(-1)).to(hidden.dtype), None


def _check(layer, x, g) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out, _ = layer(x)
    out.backward(g)
    return out.detach().float(), x.grad.float()


def run_rank(rank: int, world: int, args) -> dict:
    warnings.filterwarnings("ignore")
    import ep_moe.compat.deep_ep as compat

    compat.install()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ep_moe.integrations import megatron as integ

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    spec = integ.with_portable_router(get_moe_module_spec(use_te=False, num_experts=args.experts,
                                                          moe_grouped_gemm=False))
    torch.manual_seed(1234)
    layer = _build(spec, config=_config(args, "alltoall", world)).cuda()
    integ.use_portable_routers(layer)
    if args.trivial_experts:
        layer.experts = TrivialExperts()
    dtype = next(layer.parameters()).dtype
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    shape = (args.tokens, 1, args.hidden)
    inputs = [torch.randn(shape, generator=gen, device="cuda", dtype=dtype).requires_grad_(True) for _ in range(3)]
    grads = [torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for _ in range(3)]
    with torch.no_grad():  # a router that spreads tokens over every expert
        layer.router.weight.normal_(0, 1.0 / args.hidden ** 0.5, generator=gen)
        dist.broadcast(layer.router.weight, 0)

    variants = [("alltoall", layer.token_dispatcher)]
    for backend in [b for b in args.backends.split(",") if b]:
        integ.install_ep_moe_dispatcher(layer, backend=backend)
        label = f"ep_moe[{layer.token_dispatcher.buffer.backend_name}]"  # "auto" says what it chose
        if label not in dict(variants):
            variants.append((label, layer.token_dispatcher))
    layer.token_dispatcher = variants[0][1]
    flex = None
    if not args.no_flex:
        flex = _build(spec, config=_config(args, "flex", world)).cuda()
        integ.use_portable_routers(flex)
        if args.trivial_experts:
            flex.experts = TrivialExperts()
        flex.load_state_dict(layer.state_dict())

    reference = _check(layer, inputs[0], grads[0])
    runs = []  # (name, step, its dispatcher or None for the flex layer and the floor, max rel diff or None)
    for name, dispatcher in variants + ([("flex+deepep", None)] if flex is not None else []):
        target = flex if dispatcher is None else layer
        if dispatcher is not None:
            layer.token_dispatcher = dispatcher
        out, grad = _check(target, inputs[0], grads[0])
        diff = max((out - reference[0]).abs().max().item() / reference[0].abs().max().item(),
                   (grad - reference[1]).abs().max().item() / reference[1].abs().max().item())
        runs.append((name, _layer_step(target), dispatcher, diff))
    if world == 1:
        runs.append((NO_DISPATCHER, NoDispatcher(layer, inputs), None, None))
    # Variants take turns, --rounds times, so that a drift of the machine's speed spreads over all of them.
    times: dict[str, list[float]] = {name: [] for name, *_ in runs}
    per_round = max(1, args.iters // args.rounds)
    for round_index in range(args.rounds):
        for name, step, dispatcher, _ in runs:
            if dispatcher is not None:
                layer.token_dispatcher = dispatcher
            times[name] += _bench(step, inputs, grads, args.warmup if round_index == 0 else 1, per_round)
    rows = []
    for name, step, dispatcher, diff in runs:
        if dispatcher is not None:
            layer.token_dispatcher = dispatcher
        ms = torch.tensor(statistics.median(times[name]), device="cuda")
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        if args.profile:
            _profile(name, step, inputs, grads, args.profile)
        if dispatcher is None and name == "flex+deepep":  # say which ep_moe backend the compat module's Buffer chose
            from megatron.core.transformer.moe import fused_a2a

            name = f"flex+deepep[{fused_a2a._buffer.backend_name}]"
        rows.append({"dispatcher": name, "ms": ms.item(), "max_rel_diff_vs_alltoall": diff})
    integ.destroy_ep_buffers()
    return {"rows": rows, "megatron_core": integ.MEGATRON_CORE_VERSION, "world": world,
            "gpu": torch.cuda.get_device_name(), "args": vars(args)}


NO_DISPATCHER = "no dispatcher (router + experts)"


def _spawned(rank: int, world: int, args_dict: dict) -> dict:
    return run_rank(rank, world, argparse.Namespace(**args_dict))


def _table(result: dict) -> str:
    a = result["args"]
    base = next(r["ms"] for r in result["rows"] if r["dispatcher"] == "alltoall")
    experts = "trivial experts (x * probs)" if a.get("trivial_experts") else f"{a['experts']} experts (ffn {a['ffn']})"
    lines = [f"MoE layer fwd+bwd, {result['world']} x {result['gpu']}, megatron-core {result['megatron_core']}: "
             f"{a['tokens']} tokens/rank, hidden {a['hidden']}, {a['experts']} routed experts, {experts}, "
             f"top-{a['topk']}, {a['dtype']}; median of {a['iters']} in {a.get('rounds', 1)} turns",
             "| dispatcher | ms | vs alltoall | dispatcher's own ms | own / alltoall's own (time) | max rel diff vs alltoall |",
             "| --- | --- | --- | --- | --- | --- |"]
    floor = next((r["ms"] for r in result["rows"] if r["dispatcher"] == NO_DISPATCHER), None)
    for r in result["rows"]:
        own = own_ratio = diff = "-"
        if floor is not None and r["dispatcher"] != NO_DISPATCHER:
            own = f"{r['ms'] - floor:.3f}"
            own_ratio = f"{(r['ms'] - floor) / (base - floor):.2f}x" if base > floor else "-"
        if r["max_rel_diff_vs_alltoall"] is not None:
            diff = f"{r['max_rel_diff_vs_alltoall']:.2e}"
        lines.append(f"| {r['dispatcher']} | {r['ms']:.3f} | {base / r['ms']:.2f}x | {own} | {own_ratio} | {diff} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if torch.cuda.device_count() < 1:
        print("megatron_layer_bench: needs CUDA GPUs", file=sys.stderr)
        return 2
    torchrun = torchrun_env()
    if torchrun is None and torch.cuda.device_count() < args.nproc:
        print(f"megatron_layer_bench: --nproc {args.nproc} needs as many GPUs", file=sys.stderr)
        return 2
    # Under torchrun this process is one rank (--nproc ignored); otherwise --nproc ranks are spawned.
    result = launch(_spawned, args.nproc, vars(args), device_type="cuda", timeout_s=600, join_timeout_s=3000)[0]
    if torchrun is not None and torchrun.rank != 0:
        return 0
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
