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
Timing: ``--warmup`` untimed iterations, ``--iters`` timed ones with CUDA events around forward + backward, a
barrier before each, inputs rotated among 3 sets; the variants take turns (``--rounds`` turns of ``iters /
rounds`` iterations each), so that a drift of the machine's speed does not favour one; the median per rank, then
the slowest rank's median.

Checked: the last timed call of every turn of every variant, on every rank, as that call left them (kept by the
timed step, not a call made again): its output and input gradient against ``alltoall``'s untimed call on the same
input set, within `_checked.RTOL` of the dtype (the dispatchers order and round the sums over a token's experts
differently); the floor's experts' output and their input's gradient against the floor's own untimed call, bit
for bit (the same computation). The table's ``check`` column says ``ok`` or ``DIFF``, ``max rel diff`` is the
largest difference from alltoall seen, and any mismatch is printed (variant, rank, turn, first differing element)
with exit status 1. The header names the native kernels' build where a variant used the native backend, and the
``permute`` column which implementations of ep_moe's expert-major permute ran in the variant's timed calls
(``ep_moe.permute.implementations_run``; ``-``: none). Printed last: a table with ms and the ratio to alltoall;
``--json PATH`` saves it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from _checked import RTOL, gather_problems, max_rel_diff, mismatch, report, verdict

from ep_moe import permute
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


class LayerStep:
    """One forward + backward of ``layer`` on input ``x`` with output gradient ``g``. ``kept``: the latest call's
    ``(x, output, x's gradient)``, so that the outputs of the last timed call are the ones checked."""

    def __init__(self, layer):
        self.layer = layer
        self.kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, g: torch.Tensor) -> None:
        out, _ = self.layer(x)
        out.backward(g)
        self.kept = (x, out.detach(), x.grad)


class NoDispatcher:
    """The layer's router and experts with nothing between them (one rank): for each input, its rows grouped by
    expert (tokens in order within an expert, as Megatron's permute) and their expert counts on the host are made
    once, untimed; a step runs the router, gathers the routed probs in that order, runs the experts on the rows
    (a leaf that requires grad, so the experts' input gradient is computed as in the layer) and back-propagates a
    gradient of the experts' output. What every dispatcher adds on top of this is its own share. ``kept``: the
    latest call's ``(x, the experts' output, the rows' gradient)``."""

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
        self.kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, g: torch.Tensor) -> None:
        rows, tokens_per_expert, pair_index, grad_rows = self.prepared[id(x)]
        rows.grad = None  # each call's own gradient, as the layer steps' inputs get
        probs, _ = self.layer.router(x)
        out, _ = self.layer.experts(rows, tokens_per_expert, probs.reshape(-1)[pair_index])
        out.backward(grad_rows)
        self.kept = (x, out.detach(), rows.grad)


def _bench(step, inputs, grads, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` forward + backward passes (``step(x, g)``) on this rank (after
    ``warmup``); CUDA events on a GPU, the wall clock on the CPU. Afterwards ``step.kept`` holds copies of the
    last call's outputs (made after its end mark, so other calls cannot overwrite what is checked)."""
    cuda = inputs[0].is_cuda
    times = []
    for i in range(warmup + iters):
        x, g = inputs[i % len(inputs)], grads[i % len(grads)]
        x.grad = None
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        step(x, g)
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    x, out, grad = step.kept
    step.kept = (x, out.clone(), grad.clone())
    return times


class Expected:
    """What a variant's calls must give, per input set: ``outputs[k]`` = ``(output, input gradient)`` on
    ``inputs[k]``, within ``rtol`` of the largest |element| (None: bit for bit); ``what`` names the reference."""

    def __init__(self, outputs: list[tuple[torch.Tensor, torch.Tensor]], rtol: float | None, what: str):
        self.outputs, self.rtol, self.what = outputs, rtol, what


def _untimed(step, inputs, grads) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``step``'s output and input gradient on every input set (untimed calls): a reference."""
    kept = []
    for x, g in zip(inputs, grads):
        x.grad = None
        step(x, g)
        _, out, grad = step.kept
        kept.append((out.clone(), grad.clone()))
    return kept


def _check_kept(name: str, step, inputs, expected: Expected, turn: int) -> tuple[list[str], float]:
    """The problems of the call ``step`` kept (its last timed call of turn ``turn``) against ``expected``, and the
    largest relative difference of its outputs."""
    x, out, grad = step.kept
    k = next(i for i, t in enumerate(inputs) if t is x)
    want_out, want_grad = expected.outputs[k]
    where = f"{name}, turn {turn + 1}'s last timed call (input set {k}) vs {expected.what}"
    problems = [p for p in (mismatch(f"{where}: output", out, want_out, expected.rtol),
                            mismatch(f"{where}: input gradient", grad, want_grad, expected.rtol)) if p]
    return problems, max(max_rel_diff(out, want_out), max_rel_diff(grad, want_grad))


def time_and_check(runs, layer, inputs, grads, warmup: int, iters: int, rounds: int) -> dict[str, dict]:
    """Time every run ``(name, step, dispatcher or None, Expected)``, the runs taking turns (``rounds`` turns of
    ``iters / rounds`` iterations; ``layer.token_dispatcher`` set to the run's dispatcher), and check the last
    timed call of every turn. Per name: ``times`` (ms), ``problems`` (this rank's), ``max_rel_diff`` and
    ``permute`` (the expert-major permute implementations its calls ran)."""
    out = {name: {"times": [], "problems": [], "max_rel_diff": 0.0, "permute": set()} for name, *_ in runs}
    per_round = max(1, iters // rounds)
    for round_index in range(rounds):
        for name, step, dispatcher, expected in runs:
            if dispatcher is not None:
                layer.token_dispatcher = dispatcher
            permute.reset_implementations_run()
            out[name]["times"] += _bench(step, inputs, grads, warmup if round_index == 0 else 1, per_round)
            out[name]["permute"].update(permute.implementations_run())
            problems, diff = _check_kept(name, step, inputs, expected, round_index)
            out[name]["problems"] += problems
            out[name]["max_rel_diff"] = max(out[name]["max_rel_diff"], diff)
    return out


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

    # alltoall's untimed calls on every input set: what every variant's timed calls must give, within the dtype's
    # tolerance (the dispatchers order and round the sums over a token's experts differently)
    reference = Expected(_untimed(LayerStep(layer), inputs, grads), RTOL[dtype], "alltoall's untimed call")
    runs = []  # (name, step, its dispatcher or None for the flex layer and the floor, Expected)
    for name, dispatcher in variants + ([("flex+deepep", None)] if flex is not None else []):
        runs.append((name, LayerStep(flex if dispatcher is None else layer), dispatcher, reference))
    if world == 1:  # the floor against its own untimed calls, bit for bit: the same computation every time
        floor = NoDispatcher(layer, inputs)
        runs.append((NO_DISPATCHER, floor, None, Expected(_untimed(floor, inputs, grads), None, "its untimed call")))
    # Variants take turns, --rounds times, so that a drift of the machine's speed spreads over all of them.
    measured = time_and_check(runs, layer, inputs, grads, args.warmup, args.iters, args.rounds)
    rows = []
    for name, step, dispatcher, _ in runs:
        if dispatcher is not None:
            layer.token_dispatcher = dispatcher
        m = measured[name]
        stats = torch.tensor([statistics.median(m["times"]), m["max_rel_diff"]], device="cuda", dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        problems = gather_problems(m["problems"])
        if args.profile:
            _profile(name, step, inputs, grads, args.profile)
        backend = dispatcher.buffer.backend_name if hasattr(dispatcher, "buffer") else None
        if dispatcher is None and name == "flex+deepep":  # say which ep_moe backend the compat module's Buffer chose
            from megatron.core.transformer.moe import fused_a2a

            backend = fused_a2a._buffer.backend_name
            name = f"flex+deepep[{backend}]"
        rows.append(_row(name, float(stats[0]), None if name == NO_DISPATCHER else float(stats[1]), problems,
                         m["permute"], backend))
    integ.destroy_ep_buffers()
    return {"rows": rows, "megatron_core": integ.MEGATRON_CORE_VERSION, "world": world,
            "gpu": torch.cuda.get_device_name(), "kernels": _kernels(rows), "args": vars(args)}


def _row(name: str, ms: float, diff: float | None, problems: list[str], permute_run, backend: str | None) -> dict:
    """One table row: the dispatcher's name, its median ms, the largest relative difference from alltoall (None
    for the floor), the check (``ok`` / ``DIFF`` and every rank's problems), the ep_moe Buffer's backend (None
    for Megatron's own dispatcher and the floor) and the expert-major permute implementations that ran."""
    return {"dispatcher": name, "ms": ms, "max_rel_diff_vs_alltoall": diff, "check": verdict(problems),
            "problems": problems, "backend": backend, "permute": ",".join(sorted(permute_run)) or "-"}


def _kernels(rows: list[dict]) -> str:
    """Which kernels the ep_moe variants ran, for the header: the JIT's where one used the native backend."""
    return "native kernels: jit" if any(r["backend"] == "native" for r in rows) else ""


NO_DISPATCHER = "no dispatcher (router + experts)"


def _spawned(rank: int, world: int, args_dict: dict) -> dict:
    return run_rank(rank, world, argparse.Namespace(**args_dict))


def _table(result: dict) -> str:
    a = result["args"]
    base_row = result["rows"][0]  # the reference dispatcher (alltoall)
    base = base_row["ms"]
    experts = "trivial experts (x * probs)" if a.get("trivial_experts") else f"{a['experts']} experts (ffn {a['ffn']})"
    kernels = f"; {result['kernels']}" if result.get("kernels") else ""
    lines = [f"MoE layer fwd+bwd, {result['world']} x {result['gpu']}, megatron-core {result['megatron_core']}: "
             f"{a['tokens']} tokens/rank, hidden {a['hidden']}, {a['experts']} routed experts, {experts}, "
             f"top-{a['topk']}, {a['dtype']}; median of {a['iters']} in {a.get('rounds', 1)} turns{kernels}",
             f"| dispatcher | ms | vs {base_row['dispatcher']} | dispatcher's own ms | own / {base_row['dispatcher']}'s "
             f"own (time) | max rel diff vs {base_row['dispatcher']} | permute | check |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    floor = next((r["ms"] for r in result["rows"] if r["dispatcher"] == NO_DISPATCHER), None)
    for r in result["rows"]:
        own = own_ratio = diff = "-"
        if floor is not None and r["dispatcher"] != NO_DISPATCHER:
            own = f"{r['ms'] - floor:.3f}"
            own_ratio = f"{(r['ms'] - floor) / (base - floor):.2f}x" if base > floor else "-"
        if r["max_rel_diff_vs_alltoall"] is not None:
            diff = f"{r['max_rel_diff_vs_alltoall']:.2e}"
        lines.append(f"| {r['dispatcher']} | {r['ms']:.3f} | {base / r['ms']:.2f}x | {own} | {own_ratio} | {diff} | "
                     f"{r['permute']} | {r['check']} |")
    return "\n".join(lines)


def finish(result: dict, json_path: str | None) -> int:
    """Save (``json_path``) and print the result, then every failed check; the exit status (1: a check
    failed)."""
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(_table(result), flush=True)
    return report("megatron_layer_bench", [p for r in result["rows"] for p in r["problems"]])


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
        return 1 if any(r["problems"] for r in result["rows"]) else 0
    return finish(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
