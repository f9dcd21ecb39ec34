"""MoE-layer forward + backward: ep_moe's DeepSpeed layer vs ``deepspeed.moe.layer.MoE``, same run.

Four layers with identical weights: DeepSpeed's MoE and ours in capacity mode (``drop_tokens=True``), and
DeepSpeed's ``drop_tokens=False`` (pads every expert to the largest) vs our dropless mode. Each is first
checked against DeepSpeed's output on the same input and RNG state, then timed: forward (returning
``(out, l_aux, exp_counts)``) and backward of ``sum(out * g) + 0.01 * l_aux``, inputs rotated so that
caches do not serve them, a barrier before every iteration, median and quartiles over ``--iters``; the layers
take turns (``--rounds``), so that a drift of the machine's speed does not favour one.

Checked: the last timed call of every turn of every layer, on every rank, as that call left them (kept, not made
again): its output, ``l_aux``, ``exp_counts`` and input gradient. An ep_moe layer's against DeepSpeed's layer of
the same mode on the same input and gate seed (an untimed call; built for the check if that mode is not timed):
output and input gradient within `_checked.RTOL` of the dtype (the two order and round the weighted sums
differently), ``l_aux`` and counts equal. DeepSpeed's layers and the floor against their own untimed call on the
same input and seed, bit for bit (the same computation). The row's ``check`` says ``ok`` or ``DIFF``; an ep_moe
row adds the largest relative difference from DeepSpeed seen; any mismatch is printed (layer, rank, turn, first
differing element) with exit status 1. The header names the ep_moe backend (the native kernels' build where it is
native) and the ``permute`` column which implementations of ep_moe's expert-major permute ran in the layer's
timed calls (``ep_moe.permute.implementations_run``; ``-``: none).

At one rank a last row, ``dropless-floor``, times DeepSpeed's gate (dropless) and the same experts with nothing
between them: for each input its rows are grouped by expert once, untimed; an iteration runs the gate, the experts
on those rows, weights each row by its gate value (one gather) and back-propagates a gradient of that and of
``l_aux``. A dropless layer's time minus this row's is the token movement's own share (printed as ``own ms``).

``--trivial-experts`` replaces every expert of all four layers (DeepSpeed's and ours, capacity and
dropless) by the same trivial, parameter-free module (`TrivialExpert`: the identity), so that the time is the
gate's and the token movement's own share of forward + backward (``--ffn`` is then unused; the gate weights
stay those of the full run). The check still runs and must agree as with real experts. The table's header
and ``--json`` (``config.trivial_experts``, ``expert_fn``) say so.

GPU (one process per GPU, NCCL; DeepSpeed on its CUDA accelerator):

    torchrun --nproc-per-node 2 benchmarks/deepspeed_layer_bench.py --dtype bf16

CPU smoke run (spawns gloo ranks; small defaults):

    python benchmarks/deepspeed_layer_bench.py --nproc 2
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _checked import RTOL, gather_problems, max_rel_diff, mismatch, report, verdict

from ep_moe import permute
from ep_moe.distributed import launch, torchrun_env

MODES = ("deepspeed-capacity", "ep_moe-capacity", "deepspeed-dropless", "ep_moe-dropless")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (GPU 4096, CPU 256)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (GPU 4096, CPU 64)")
    p.add_argument("--ffn", type=int, default=None, help="expert FFN size (GPU 2048, CPU 128)")
    p.add_argument("--experts", type=int, default=None, help="experts (GPU 16, CPU 4)")
    p.add_argument("--k", type=int, default=2, help="top-k (DeepSpeed: 1, 2 or more)")
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--skew", type=float, default=0.0,
                   help="routing imbalance: 0 = random gate; larger sends more tokens to higher expert ids")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="GPU bf16, CPU fp32")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (GPU 30, CPU 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (GPU 5, CPU 2)")
    p.add_argument("--rounds", type=int, default=None,
                   help="layers take turns this many times, iters / rounds each turn, against drift (GPU 5, CPU 1)")
    p.add_argument("--backend", choices=("auto", "torch", "native"), default="auto", help="ep_moe backend")
    p.add_argument("--trivial-experts", action="store_true",
                   help="make every expert of every layer the identity: the gate's + dispatcher's share")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    return p


def _fill_defaults(args: argparse.Namespace, cuda: bool) -> argparse.Namespace:
    gpu = dict(tokens=4096, hidden=4096, ffn=2048, experts=16, dtype="bf16", iters=30, warmup=5, rounds=5)
    cpu = dict(tokens=256, hidden=64, ffn=128, experts=4, dtype="fp32", iters=5, warmup=2, rounds=1)
    for key, value in (gpu if cuda else cpu).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    args.mode_list = modes
    return args


class TrivialExpert(torch.nn.Module):
    """A DeepSpeed expert that returns its input (differentiable, no parameters). Elementwise, so it fits
    both callers: DeepSpeed's ``Experts`` calls each expert on its ``[ep, 1, C, H]`` capacity block, ep_moe's
    layer on its ``[n, H]`` rows; each layer then weights and combines as it does with real experts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _layers(args, rank: int, device: torch.device, dtype: torch.dtype, modes: list[str]
            ) -> dict[str, torch.nn.Module]:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from ep_moe.integrations.deepspeed import replace_deepspeed_moe

    world = dist.get_world_size()
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.ffn), torch.nn.GELU(),
                                 torch.nn.Linear(args.ffn, args.hidden))
    base = DeepSpeedMoE(args.hidden, expert, num_experts=args.experts, ep_size=world, k=args.k,
                        capacity_factor=args.capacity_factor, eval_capacity_factor=args.capacity_factor,
                        min_capacity=0, drop_tokens=True)
    local = args.experts // world
    for i, module in enumerate(base.deepspeed_moe.experts.deepspeed_experts):  # distinct experts
        gen = torch.Generator().manual_seed(1000 + rank * local + i)
        for p in module.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    if args.trivial_experts:  # after the MLP experts were built: the same RNG draws, so the same gate weights
        experts = base.deepspeed_moe.experts.deepspeed_experts
        for i in range(len(experts)):
            experts[i] = TrivialExpert()
    if args.skew:
        with torch.no_grad():  # a gate row component along the inputs' shared mean direction
            wg = base.deepspeed_moe.gate.wg.weight
            wg += args.skew * torch.linspace(0, 1, args.experts)[:, None] * _mean_direction(args)[None, :]
    layers = {}
    for mode in modes:
        layer = copy.deepcopy(base)
        if mode.startswith("ep_moe"):
            layer = replace_deepspeed_moe(layer, drop_tokens=mode.endswith("capacity"), backend=args.backend)
        else:
            layer.deepspeed_moe.gate.drop_tokens = mode.endswith("capacity")
        layer = layer.to(device=device, dtype=dtype)
        layer.set_deepspeed_parallelism()
        layers[mode] = layer
    return layers


def _mean_direction(args) -> torch.Tensor:
    gen = torch.Generator().manual_seed(77)
    v = torch.randn(args.hidden, generator=gen)
    return v / v.norm()


def _inputs(args, rank: int, device, dtype, count: int = 4):
    gen = torch.Generator().manual_seed(500 + rank)
    shift = 3.0 * _mean_direction(args) if args.skew else torch.zeros(args.hidden)
    xs = [(torch.randn(args.tokens, args.hidden, generator=gen) + shift).to(device, dtype) for _ in range(count)]
    gs = [torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype) for _ in range(count)]
    return xs, gs


def _step(layer, x, g, seed: int):
    torch.manual_seed(seed)  # same gate randomness (2nd-expert sampling) in every layer
    x = x.detach().requires_grad_(True)
    out, l_aux, counts = layer(x)
    return x, out, l_aux, counts


def _forward(layer, x, g, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple]:
    """A layer's forward: the tensors to back-propagate, their gradients, and ``(the input leaf, exp_counts)``."""
    leaf, out, l_aux, counts = _step(layer, x, g, seed)
    return [out, l_aux], [g, torch.full_like(l_aux, 0.01)], (leaf, counts)


FLOOR = "dropless-floor"


class DroplessFloor:
    """One rank: DeepSpeed's gate (dropless) and the experts of an ep_moe dropless layer with no token movement.
    Each input's rows grouped by expert (the layer's own expert-major layout) are made once, untimed, as a leaf that
    requires grad; `forward` runs the gate (``l_aux`` included), the experts on those rows and one gather of the
    gate values to weight them, and returns what to back-propagate (and, as `_forward`, the leaf whose gradient is
    checked: the rows)."""

    def __init__(self, layer, xs: list[torch.Tensor], seed: int = 3):
        from ep_moe.buffer.expert_major_ops import local_expert_dispatch

        self.layer, self.moe = layer, layer.deepspeed_moe
        self.prepared = {}
        gen = torch.Generator(device=xs[0].device).manual_seed(seed)
        for x in xs:
            with torch.no_grad():
                torch.manual_seed(seed)
                topk_idx, topk_weights, _ = self.moe._route(x, None)
                out = local_expert_dispatch(x, topk_idx, topk_weights, self.moe.num_local_experts, check_values=False)
            rows = out.expert_x.clone().requires_grad_(True)
            grad_rows = torch.randn(rows.shape, generator=gen, device=rows.device, dtype=rows.dtype)
            self.prepared[id(x)] = (rows, out.tokens_per_expert_list, out.handle.layout.pair_of_slot, grad_rows)

    def __call__(self, x, g, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple]:
        rows, counts, pair_of_slot, grad_rows = self.prepared[id(x)]
        torch.manual_seed(seed)
        _, topk_weights, _ = self.moe._route(x.detach().requires_grad_(True), None)
        weights = topk_weights.reshape(-1)[pair_of_slot].to(rows.dtype)
        out = self.moe._run_experts(rows, counts) * weights.unsqueeze(1)
        return [out, self.moe.l_aux], [grad_rows, torch.full_like(self.moe.l_aux, 0.01)], (rows, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.layer.zero_grad(set_to_none=set_to_none)
        for rows, *_ in self.prepared.values():
            rows.grad = None


class Kept:
    """What one call gave: its iteration number (input set ``it % len(xs)``, gate seed ``1000 * it + rank``), output,
    ``l_aux``, ``exp_counts`` (None for the floor) and the gradient of its input leaf (the floor's: its rows)."""

    def __init__(self, it: int, outputs: list[torch.Tensor], counts, grad: torch.Tensor) -> None:
        self.it, self.out, self.l_aux = it, outputs[0].detach(), outputs[1].detach()
        self.counts, self.grad = counts, grad

    def copy(self) -> Kept:
        counts = self.counts.clone() if isinstance(self.counts, torch.Tensor) else self.counts
        return Kept(self.it, [self.out.clone(), self.l_aux.clone()], counts, self.grad.clone())


def _call(layer, x, g, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple]:
    return (layer if isinstance(layer, DroplessFloor) else functools.partial(_forward, layer))(x, g, seed)


def _time(layer, xs, gs, warmup: int, iters: int, device, rank: int, first: int
          ) -> tuple[list[float], list[float], Kept]:
    """Per-iteration forward and forward + backward milliseconds of ``iters`` timed iterations (after
    ``warmup``); iteration numbers (input set, gate seed) start at ``first``. Also what the last call gave (copied
    after its end mark)."""
    cuda = device.type == "cuda"
    fwd, total = [], []
    kept = None
    for it in range(first, first + warmup + iters):
        x, g = xs[it % len(xs)], gs[it % len(gs)]
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
        else:
            t0 = time.perf_counter()
        outputs, grads, (leaf, counts) = _call(layer, x, g, 1000 * it + rank)
        if cuda:
            mid.record()
        else:
            t1 = time.perf_counter()
        torch.autograd.backward(outputs, grads)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            f, t = start.elapsed_time(mid), start.elapsed_time(end)
        else:
            t2 = time.perf_counter()
            f, t = (t1 - t0) * 1e3, (t2 - t0) * 1e3
        if it >= first + warmup:
            fwd.append(f)
            total.append(t)
        kept = Kept(it, outputs, counts, leaf.grad)
        layer.zero_grad(set_to_none=True)
    return fwd, total, kept.copy()


def _untimed(layer, xs, gs, it: int, rank: int) -> Kept:
    """``layer``'s call of iteration ``it`` (its input set and gate seed), untimed: a reference."""
    outputs, grads, (leaf, counts) = _call(layer, xs[it % len(xs)], gs[it % len(gs)], 1000 * it + rank)
    torch.autograd.backward(outputs, grads)
    kept = Kept(it, outputs, counts, leaf.grad).copy()
    layer.zero_grad(set_to_none=True)
    return kept


def _check_kept(mode: str, kept: Kept, reference, what: str, xs, gs, rank: int, turn: int, rtol: float | None
                ) -> tuple[list[str], float, bool]:
    """The problems of ``kept`` (``mode``'s last timed call of turn ``turn``) against ``reference``'s untimed call
    of the same iteration (``what`` names it): output and input gradient within ``rtol`` (None: bit for bit),
    ``l_aux`` and counts equal. Also the largest relative difference of output and gradient, and whether ``l_aux``
    and counts are equal."""
    want = _untimed(reference, xs, gs, kept.it, rank)
    where = (f"{mode}, turn {turn + 1}'s last timed call (input set {kept.it % len(xs)}, gate seed "
             f"{1000 * kept.it + rank}) vs {what}")
    problems = [p for p in (mismatch(f"{where}: output", kept.out, want.out, rtol),
                            mismatch(f"{where}: input gradient", kept.grad, want.grad, rtol),
                            mismatch(f"{where}: l_aux", kept.l_aux, want.l_aux, None)) if p]
    counts_equal = (kept.counts is None and want.counts is None) or (
        isinstance(kept.counts, torch.Tensor) and isinstance(want.counts, torch.Tensor)
        and torch.equal(kept.counts, want.counts))
    if not counts_equal:
        problems.append(f"{where}: exp_counts {kept.counts} vs expected {want.counts}")
    return (problems, max(max_rel_diff(kept.out, want.out), max_rel_diff(kept.grad, want.grad)),
            counts_equal and torch.equal(kept.l_aux, want.l_aux))


def _timings(layers: dict, references: dict, xs, gs, args, device, rank: int, rtol: float
             ) -> tuple[dict[str, dict[str, float]], dict[str, dict]]:
    """Every layer timed, the layers taking turns (``--rounds`` turns of ``iters / rounds`` iterations), so that
    a drift of the machine's speed does not favour one; the slowest rank's medians and quartiles. And the checks
    of every turn's last timed call, per layer: ``check``, ``problems`` (every rank's), ``max_rel_diff`` (an ep_moe
    layer's from DeepSpeed's; else None), ``l_aux_and_counts_equal`` and ``permute`` (the expert-major permute
    implementations its calls ran)."""
    per_round = max(1, args.iters // args.rounds)
    samples = {mode: ([], []) for mode in layers}
    checks = {mode: {"problems": [], "max_rel_diff": 0.0, "equal": True, "permute": set()} for mode in layers}
    for round_index in range(args.rounds):
        for mode, layer in layers.items():
            permute.reset_implementations_run()
            fwd, total, kept = _time(layer, xs, gs, args.warmup if round_index == 0 else 1, per_round, device, rank,
                                     first=round_index * (args.warmup + per_round))
            checks[mode]["permute"].update(permute.implementations_run())
            samples[mode][0].extend(fwd)
            samples[mode][1].extend(total)
            ours = mode.startswith("ep_moe")  # against DeepSpeed's layer of its mode; the others against themselves
            reference = references[mode.replace("ep_moe", "deepspeed")] if ours else layer
            what = "DeepSpeed's layer (untimed)" if ours else "its untimed call"
            problems, diff, equal = _check_kept(mode, kept, reference, what, xs, gs, rank, round_index,
                                                rtol if ours else None)
            checks[mode]["problems"] += problems
            checks[mode]["max_rel_diff"] = max(checks[mode]["max_rel_diff"], diff)
            checks[mode]["equal"] &= equal
    out, checked = {}, {}
    for mode, (fwd, total) in samples.items():
        stats = torch.tensor([statistics.median(fwd), statistics.median(total), _quantile(total, 0.25),
                              _quantile(total, 0.75), checks[mode]["max_rel_diff"],
                              0.0 if checks[mode]["equal"] else 1.0], device=device, dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        out[mode] = {"fwd_ms": float(stats[0]), "fwd_bwd_ms": float(stats[1]), "fwd_bwd_p25_ms": float(stats[2]),
                     "fwd_bwd_p75_ms": float(stats[3])}
        problems = gather_problems(checks[mode]["problems"])
        checked[mode] = {"check": verdict(problems), "problems": problems,
                         "max_rel_diff": float(stats[4]) if mode.startswith("ep_moe") else None,
                         "l_aux_and_counts_equal": stats[5].item() == 0,
                         "permute": ",".join(sorted(checks[mode]["permute"])) or "-"}
    return out, checked


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench(rank: int, world: int, raw_args: dict) -> dict | None:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    args = _fill_defaults(argparse.Namespace(**raw_args), device.type == "cuda")
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    from ep_moe.integrations.deepspeed import init_deepspeed_comm, release_buffers

    ds_logger.setLevel("WARNING")
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be divisible by the {world} ranks")
    init_deepspeed_comm()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    # DeepSpeed's layer of each timed ep_moe layer's mode is its reference, built (untimed) if not timed itself
    references = [m.replace("ep_moe", "deepspeed") for m in args.mode_list if m.startswith("ep_moe")]
    layers = _layers(args, rank, device, dtype, args.mode_list + [m for m in references if m not in args.mode_list])
    references = {m: layers[m] for m in references}
    layers = {m: layers[m] for m in args.mode_list}
    xs, gs = _inputs(args, rank, device, dtype)
    if world == 1 and "ep_moe-dropless" in layers:
        layers[FLOOR] = DroplessFloor(layers["ep_moe-dropless"], xs)
    timings, timed_checks = _timings(layers, references, xs, gs, args, device, rank, RTOL[dtype])
    backend = next((m.deepspeed_moe._get_dispatcher().buffer.backend_name for m in layers.values()
                    if world > 1 and hasattr(m.deepspeed_moe, "_get_dispatcher")), "local")
    checks = {mode: {"max_rel_diff": c["max_rel_diff"], "l_aux_and_counts_equal": c["l_aux_and_counts_equal"]}
              for mode, c in timed_checks.items() if mode.startswith("ep_moe")}
    release_buffers()
    if rank != 0:
        return None
    return {"config": {k: v for k, v in vars(args).items() if k not in ("mode_list", "json", "nproc")},
            "world": world, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "expert_fn": "trivial: identity, no parameters" if args.trivial_experts else
                         f"MLP: Linear {args.hidden}->{args.ffn}, GELU, Linear {args.ffn}->{args.hidden}",
            "deepspeed": deepspeed.__version__, "torch": torch.__version__, "ep_moe_backend": backend,
            "checks": checks, "timed_checks": timed_checks, "timings": timings}


def _experts_text(config: dict) -> str:
    if config.get("trivial_experts"):
        return f"{config['experts']} trivial experts (identity, no parameters)"
    return f"ffn {config['ffn']}, {config['experts']} experts"


def _table(result: dict) -> str:
    c, t = result["config"], result["timings"]
    lines = [f"MoE layer fwd+bwd, {result['world']} ranks on {result['device']}: {c['tokens']} tokens/rank, "
             f"hidden {c['hidden']}, {_experts_text(c)}, top-{c['k']}, capacity factor "
             f"{c['capacity_factor']}, {c['dtype']}, skew {c['skew']}; deepspeed {result['deepspeed']}, "
             f"torch {result['torch']}, ep_moe backend {result['ep_moe_backend']}",
             f"{'layer':<20} {'fwd ms':>8} {'fwd+bwd ms':>11} {'p25-p75':>15} {'vs DeepSpeed':>13} {'own ms':>7} "
             f"{'permute':>8} {'check':>5}  vs DeepSpeed's layer"]
    floor = t.get(FLOOR)
    for mode, r in t.items():
        ref = t.get(mode.replace("ep_moe", "deepspeed"))
        speedup = f"{ref['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if mode.startswith("ep_moe") and ref else ""
        own = f"{r['fwd_bwd_ms'] - floor['fwd_bwd_ms']:.3f}" if floor and mode.endswith("-dropless") else ""
        check = result["checks"].get(mode)
        check_text = (f"rel diff {check['max_rel_diff']:.1e}, l_aux/counts "
                      f"{'equal' if check['l_aux_and_counts_equal'] else 'DIFFER'}") if check else ""
        timed = result["timed_checks"][mode]
        lines.append(f"{mode:<20} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} "
                     f"{r['fwd_bwd_p25_ms']:7.3f}-{r['fwd_bwd_p75_ms']:<7.3f} {speedup:>13} {own:>7} "
                     f"{timed['permute']:>8} {timed['check']:>5}  {check_text}".rstrip())
    return "\n".join(lines)


def _spawned(rank: int, world: int, raw_args: dict) -> dict | None:
    return bench(rank, world, raw_args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Under torchrun this process is one rank on its GPU (--nproc ignored); otherwise --nproc ranks are
    # spawned, on GPUs when there are enough of them, else on the CPU.
    under_torchrun = torchrun_env() is not None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device_type = "cuda" if gpus and (under_torchrun or gpus >= args.nproc) else "cpu"
    result = launch(_spawned, args.nproc, vars(args), device_type=device_type, timeout_s=300,
                    join_timeout_s=1800)[0]
    if result is None:  # another rank's process under torchrun: rank 0 reports
        return 0
    print(_table(result), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return report("deepspeed_layer_bench", [p for c in result["timed_checks"].values() for p in c["problems"]])


if __name__ == "__main__":
    sys.exit(main())
