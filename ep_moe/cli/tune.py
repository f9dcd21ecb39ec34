"""``ep-moe tune``: print the per-layer SM/QP plan of a recipe or of shapes given on the command line.

    ep-moe tune recipes/small-gpu-ep2.yaml
    ep-moe tune --experts 256 --topk 8 --hidden 7168 --tokens 4096 512 --ranks 2 [--gpu H200]
    torchrun --nproc-per-node 2 -m ep_moe.cli tune --experts 256 --topk 8 --hidden 7168 --tokens 4096 \\
        --ranks 2 --measure [--refine] [--calibrate] --json plans.json

Without a GPU the plan is made for a datasheet GPU (``--gpu``, default H200). ``--measure``, ``--refine``
and ``--calibrate`` run dispatch/combine through `ep_moe.Buffer` and need one process per rank (torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import init_from_torchrun, torchrun_env
from ..tuning import DEEPEP_V2_POLICY, LayerShape, PlanCache, Rates, dtype_bytes, format_table
from ..tuning.hybrid_model import DEFAULT_NIC_GBS, plan_hybrid
from ..tuning.layer_plans import recipe_layers
from ..tuning.machine_topology import DATASHEET, FALLBACK_GPU, Topology, detect_topology
from ..tuning.theoretical import estimate_theoretical_sms, get_theoretical_num_qps, v2_allocated_qps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ep-moe tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", help="a YAML recipe (reads its model and ep_moe blocks)")
    shape = p.add_argument_group("shapes (instead of a recipe)")
    shape.add_argument("--experts", type=int, help="number of experts E")
    shape.add_argument("--topk", type=int, help="experts per token K")
    shape.add_argument("--hidden", type=int, help="hidden size H")
    shape.add_argument("--tokens", type=int, nargs="+", help="tokens per rank (one plan per value)")
    shape.add_argument("--dtype", default="bf16", help="dispatch dtype: bf16, fp8 or fp32 (default bf16)")
    topo = p.add_argument_group("topology")
    topo.add_argument("--ranks", type=int, help="EP group size (default: the recipe's, else the world size)")
    topo.add_argument("--ranks-per-node", type=int, help="ranks per NVLink domain (default: all ranks)")
    topo.add_argument("--gpu", choices=sorted(DATASHEET), help="plan for this GPU's datasheet instead of detecting")
    topo.add_argument("--nic-gbps", type=float, help="NIC rate in Gb/s for multi-node plans (with --gpu)")
    policy = p.add_argument_group("policy")
    policy.add_argument("--rule", choices=("ep_moe", "deepep_v2"), default="ep_moe",
                        help="ep_moe: fewest SMs within --tolerance of the predicted time at 1.6 x the SMs "
                             "matching the bottleneck link (PlanPolicy.knee_cap); deepep_v2: "
                             "DeepEP V2's rule (1.25 x the SMs matching the bottleneck link)")
    policy.add_argument("--tolerance", type=float, help="time tolerance of the ep_moe rule (default 0.05)")
    policy.add_argument("--max-sms", type=int, help="upper bound on SMs")
    gpu = p.add_argument_group("on GPU (one process per rank, e.g. torchrun)")
    gpu.add_argument("--measure", action="store_true", help="time dispatch + combine at each plan's SM count")
    gpu.add_argument("--refine", action="store_true", help="search +-2/+-4 SMs around each plan, keep the best")
    gpu.add_argument("--budget", type=int, default=5, help="measurements per plan for --refine")
    gpu.add_argument("--calibrate", action="store_true", help="measure the rates again (copy kernels and probe)")
    gpu.add_argument("--backend", default="auto", choices=("auto", "native", "torch"), help="Buffer backend")
    p.add_argument("--calibration", help="calibration cache file (default: $EP_MOE_CALIBRATION or ~/.cache/ep_moe)")
    p.add_argument("--json", help="write the plans (and measurements) to this JSON file")
    p.add_argument("--trainer-plan", help="with a recipe: write {num_sms: [one per MoE layer]} here, the form "
                                          "the trainer's ep_moe.tuning_plan reads")
    return p


# ------------------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    on_device = args.measure or args.refine or args.calibrate
    if not on_device or dist.is_initialized():  # a plan only, or a caller that joined its group already
        return _run(args)
    if torchrun_env() is None:
        raise SystemExit("ep-moe tune: --measure/--refine/--calibrate need one process per rank: run under "
                         "torchrun --nproc-per-node R (R = --ranks)")
    init_from_torchrun("cuda" if torch.cuda.is_available() else "cpu", timeout_s=300.0)
    try:
        return _run(args)
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    if args.calibration:
        os.environ["EP_MOE_CALIBRATION"] = args.calibration
    on_device = args.measure or args.refine or args.calibrate
    rank, world = (dist.get_rank(), dist.get_world_size()) if on_device else (0, None)
    say = print if rank == 0 else (lambda *a, **k: None)

    recipe_block: Mapping = {}
    layers: list[str] = []  # MoE layer ordinals
    model_layers: list[int] = []
    if args.recipe:
        import yaml

        try:
            recipe = yaml.safe_load(Path(args.recipe).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            print(f"ep-moe tune: cannot read recipe {args.recipe}: {exc}", file=sys.stderr)
            return 2
        try:
            shape, ep, model_layers = recipe_layers(recipe)
            layers = [str(i) for i in range(len(model_layers))]
        except ValueError as exc:
            print(f"ep-moe tune: {exc}", file=sys.stderr)
            return 2
        shapes = [shape]
        recipe_block = recipe.get("ep_moe") or {}
        ranks = args.ranks or ep
    else:
        missing = [f"--{n}" for n in ("experts", "topk", "hidden", "tokens") if getattr(args, n) is None]
        if missing:
            print(f"ep-moe tune: give a recipe or all of --experts --topk --hidden --tokens (missing {' '.join(missing)})",
                  file=sys.stderr)
            return 2
        try:
            shapes = [LayerShape(args.experts, args.topk, args.hidden, t, dtype_bytes(args.dtype)) for t in args.tokens]
        except ValueError as exc:
            print(f"ep-moe tune: {exc}", file=sys.stderr)
            return 2
        ranks = args.ranks or world or 1
    if args.trainer_plan and not args.recipe:
        print("ep-moe tune: --trainer-plan needs a recipe", file=sys.stderr)
        return 2
    if world is not None and ranks != world:
        print(f"ep-moe tune: --ranks {ranks} must equal the number of processes ({world}) to measure", file=sys.stderr)
        return 2
    per_node = args.ranks_per_node or ranks
    if args.gpu:
        topology = Topology.preset(args.gpu, ranks, per_node, nic_gbps=args.nic_gbps)
    else:
        topology = detect_topology(world_size=ranks, local_world_size=per_node)
        if not on_device and (not topology.has_gpu or topology.nvlink_links == 0):
            say(f"note: no {'NVLink' if topology.has_gpu else 'GPU'} on this machine: the plan below is the "
                "bandwidth model's prediction only, nothing was measured (the native kernels cannot run here)")
        if not topology.has_gpu:
            say(f"(no GPU here: planning for the {FALLBACK_GPU} datasheet; --gpu picks another)")
            topology = Topology.preset(FALLBACK_GPU, ranks, per_node, nic_gbps=args.nic_gbps)
    rates = None
    if args.calibration and not args.calibrate:  # a file the user names must be used, not quietly replaced
        from ..tuning.calibration import CalibrationFileError, load_rates

        try:
            rates = load_rates(topology, path=args.calibration)  # what the plans are made with
        except CalibrationFileError as exc:
            print(f"ep-moe tune: --calibration: {exc}", file=sys.stderr)
            return 2

    buffer = None
    if on_device:
        from ..buffer.buffer_v1 import Buffer
        from ..tuning.calibration import PROBE_SHAPES

        sized = list(shapes) + (list(PROBE_SHAPES) if args.calibrate else [])
        nvl_bytes = max(Buffer.get_buffer_size_hint(s.tokens, s.hidden, ranks, s.topk) for s in sized)
        buffer = Buffer(num_nvl_bytes=nvl_bytes, backend=args.backend)
        if buffer.backend_name != "native":
            say(f"note: backend {buffer.backend_name!r} ignores the SM count: measured times will not depend on it")
    if args.calibrate:
        from ..tuning.calibration import calibrate

        rates = calibrate(topology=topology, buffer=buffer, force=True, say=say)
    try:
        if args.rule == "deepep_v2":
            rates = Rates.deepep_v2(topology)
        base_dir = os.path.dirname(os.path.abspath(args.recipe)) if args.recipe else None
        cache = PlanCache.from_recipe(recipe_block, topology, rates, base_dir=base_dir)
        if args.rule == "deepep_v2":
            cache.policy = replace(DEEPEP_V2_POLICY, max_sms=args.max_sms)
        if args.tolerance is not None or args.max_sms is not None:
            cache.policy = replace(cache.policy, time_tolerance=cache.policy.time_tolerance if args.tolerance is None
                                   else args.tolerance, max_sms=args.max_sms or cache.policy.max_sms)
        plans = [cache.plan(shape, layer) for shape in shapes for layer in (layers or [None])]
    except ValueError as exc:
        print(f"ep-moe tune: {exc}", file=sys.stderr)
        return 2

    if buffer is not None:
        from ..tuning.calibration import DispatchBench, buffer_measure_fn

        for shape in shapes:
            for layer in layers or [None]:
                plan = cache.plan(shape, layer)
                if plan.measured_us is not None:
                    continue
                if args.refine:
                    cache.refine(shape, buffer_measure_fn(buffer, shape), args.budget, layer=layer)
                else:
                    plan.record(*DispatchBench(buffer, shape).measure(plan.num_sms))
        plans = cache.plans()

    say(f"topology: {topology.describe()}")
    say("rates:    " + cache.rates.describe().replace("\n", "\n          "))
    if layers:
        shown = ", ".join(f"{i}=layer {j}" for i, j in list(enumerate(model_layers))[:8])
        say(f"MoE layers: {len(layers)} ({shown}{' ...' if len(layers) > 8 else ''}); tokens per rank "
            f"{shapes[0].tokens}")
    unique = list({id(p): p for p in plans}.values())  # layers of one shape share a plan
    say(format_table(unique))
    say("times in us; g = distinct ranks per token; * = SM-bound at the planned SMs; V2 SMs = DeepEP V2's rule "
        "on this topology")
    for line in _theoretical_lines(shapes, topology, cache.policy):
        say(line)
    for line in _hybrid_lines(shapes, topology):
        say(line)
    if args.json and rank == 0:
        cache.save(args.json)
        say(f"wrote {args.json}")
    if args.trainer_plan and rank == 0:
        counts = [cache.plan(shapes[0], layer).num_sms for layer in layers]
        Path(args.trainer_plan).write_text(json.dumps({"num_sms": counts}) + "\n")
        say(f"wrote {args.trainer_plan} (ep_moe.tuning_plan for the trainer: num_sms per MoE layer)")
    if buffer is not None:
        buffer.destroy()
    return 0


def _theoretical_lines(shapes: list[LayerShape], topology: Topology, policy) -> list[str]:
    """One line per (experts, top-k) of ``shapes``: DeepEP V2's analytic SM and QP counts on ``topology`` at
    its own rates (0.9 x NVLink, the NIC's line rate, 200 / 50 GB/s per SM); tokens and hidden size do not
    enter it. Shapes are named without the table's ``E.. K..`` labels, so rows stay found by them."""
    lines = []
    for experts, topk in dict.fromkeys((s.num_experts, s.topk) for s in shapes):
        v2 = Rates.deepep_v2(topology)
        est = estimate_theoretical_sms(experts, topk, rdma_gbs=v2.rdma_gbs, nvlink_gbs=v2.nvlink_gbs,
                                       num_ranks=topology.world_size, num_nvlink_ranks=topology.nvlink_ranks,
                                       hybrid=policy.hybrid, max_sms=policy.max_sms or topology.num_sms or None)
        if topology.intranode:
            qps = "no QPs (one NVLink domain)"
        else:
            cap = policy.num_allocated_qps or v2_allocated_qps(policy.hybrid)
            qps = f"{get_theoretical_num_qps(est.num_sms, policy.hybrid, cap)} QPs"
        why = ("nothing crosses a link: the whole device" if est.bottleneck == "none" else
               f"{est.bottleneck}-bound at {est.rdma_gbs if est.bottleneck == 'rdma' else est.nvlink_gbs:.0f} "
               f"GB/s, 1.25 x {est.exact_sms:.1f} SMs")
        lines.append(f"theoretical (DeepEP V2's analytic model, not calibrated): {est.num_sms} SMs, {qps} for "
                     f"experts {experts}, top-k {topk} on EP{topology.world_size} ({why})")
    return lines


def _hybrid_lines(shapes: list[LayerShape], topology: Topology) -> list[str]:
    """For a group over several nodes: per shape, the plan `ep_moe.ElasticBuffer` runs its hybrid view with
    (`ep_moe.tuning.hybrid_model.plan_hybrid`: chunk count, SMs of each hop, predicted times; the table above is the
    flat calibration's, which a hybrid group does not use)."""
    per_node = topology.ranks_per_domain
    if topology.world_size <= per_node or topology.world_size % per_node:
        return []
    nodes = topology.world_size // per_node
    lines = [f"hybrid view {nodes} x {per_node} (ElasticBuffer with allow_hybrid_mode; the hybrid model, NIC "
             f"{topology.nic_gbs or DEFAULT_NIC_GBS:g} GB/s per GPU):"]
    for shape in shapes:
        plan = plan_hybrid(shape, nodes, per_node, nic_gbs=topology.nic_gbs or DEFAULT_NIC_GBS)
        lines.append(f"  hybrid plan E{shape.num_experts} K{shape.topk} H{shape.hidden} T{shape.tokens}: "
                     + plan.describe())
    return lines


if __name__ == "__main__":
    sys.exit(main())
