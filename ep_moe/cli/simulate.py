"""``ep-moe simulate``: predicted dispatch/combine bytes per hop and time, flat vs hybrid, across nodes.

Runs the model of `ep_moe.tuning.hybrid_model` (no GPU, no processes): for each node count, per GPU and call, the bytes
over the NIC and over NVLink and the time the busier link takes, for the flat path and the hybrid path with its
combine unreduced (``hybrid``, ``allow_multiple_reduction=False``) or reduced inside the node (``hybrid-node-reduced``,
True: `ep_moe.ElasticBuffer`'s default); the mode a buffer with ``--allow-multiple-reduction`` runs is marked ``*``.
DeepEP V2's SM and QP counts. Default shape: DeepSeek-V3 (hidden 7168, top-8 of 256 experts, 4096 tokens per GPU,
bf16).
"""

from __future__ import annotations

import argparse
import sys

from ..tuning.bandwidth_model import LayerShape, dtype_bytes
from ..tuning.hybrid_model import DEFAULT_NIC_GBS, MODES, Prediction, default_nvlink_gbs, hybrid_mode, predict


def _node_list(text: str) -> list[int]:
    try:
        nodes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nodes must be ints separated by commas, got {text!r}") from None
    if not nodes or any(n < 1 for n in nodes):
        raise argparse.ArgumentTypeError(f"--nodes must be positive ints, got {text!r}")
    return nodes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ep-moe simulate", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=_node_list, default=[2, 4, 8, 16], help="node counts, e.g. 2,4,8,16")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per GPU per call")
    p.add_argument("--dtype", default="bf16", help="dispatched activations: bf16 (default), fp32 or fp8")
    p.add_argument("--nic-gbs", type=float, default=DEFAULT_NIC_GBS, help="NIC GB/s per GPU (default 50: 400 Gb/s)")
    p.add_argument("--nvlink-gbs", type=float, default=None,
                   help=f"NVLink GB/s per GPU (default {default_nvlink_gbs():.0f}: ep_moe's H200 rate; pass a "
                        "calibrated one from 'ep-moe tune --calibrate')")
    p.add_argument("--allow-multiple-reduction", type=int, choices=(0, 1), default=1,
                   help="the hybrid buffer's combine mode (ElasticBuffer's allow_multiple_reduction, default 1: "
                        "reduced inside the node); its row is marked *")
    p.add_argument("--plot", default=None, help="write a plot of the predicted times to this PNG")
    return p


def table(rows: list[Prediction], runs: str | None = None) -> str:
    """The simulator's table (bytes in MB per GPU and call, times in microseconds); the rows of mode ``runs``
    (the hybrid buffer's) marked ``*``."""
    head = (f"{'nodes':>5} {'GPUs':>5} {'mode':<20} {'disp NIC MB':>11} {'disp NVL MB':>11} {'comb NIC MB':>11} "
            f"{'comb NVL MB':>11} {'dispatch us':>11} {'combine us':>11} {'bound d/c':>13} {'SMs':>4} {'QPs':>5}")
    lines = [head, "-" * len(head)]
    for p in rows:
        t = p.traffic
        mode = p.mode + ("*" if p.mode == runs else "")
        lines.append(f"{p.num_nodes:>5} {p.num_nodes * p.per_node:>5} {mode:<20} {t.dispatch_nic / 1e6:>11.1f} "
                     f"{t.dispatch_nvlink / 1e6:>11.1f} {t.combine_nic / 1e6:>11.1f} {t.combine_nvlink / 1e6:>11.1f} "
                     f"{p.dispatch_us:>11.0f} {p.combine_us:>11.0f} {p.dispatch_bound + '/' + p.combine_bound:>13} "
                     f"{p.num_sms:>4} {p.num_qps:>5}")
    return "\n".join(lines)


def plot(rows: list[Prediction], path: str, title: str) -> None:
    """Predicted dispatch and combine time vs nodes, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, op in zip(axes, ("dispatch", "combine")):
        for mode in MODES:
            mine = [p for p in rows if p.mode == mode]
            ax.plot([p.num_nodes for p in mine], [getattr(p, f"{op}_us") for p in mine], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("predicted time per call (us)")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shape = LayerShape(args.experts, args.topk, args.hidden, args.tokens, dtype_bytes(args.dtype))
        rows = [predict(shape, n, args.gpus_per_node, mode, args.nic_gbs, args.nvlink_gbs)
                for n in args.nodes for mode in MODES]
    except ValueError as exc:
        print(f"ep-moe simulate: {exc}", file=sys.stderr)
        return 2
    nvlink = args.nvlink_gbs or default_nvlink_gbs()
    title = (f"{shape.label()}, {args.gpus_per_node} GPUs/node, NIC {args.nic_gbs:g} GB/s, "
             f"NVLink {nvlink:.0f} GB/s per GPU")
    runs = hybrid_mode(bool(args.allow_multiple_reduction))
    print(title)
    print(table(rows, runs))
    print("hybrid: the dispatch crosses the network once per destination node; its combine relays every (token, rank) "
          "row unreduced (allow_multiple_reduction=False: the flat combine's bits). hybrid-node-reduced: the combine "
          "sums inside the node first and crosses once per (token, node) (allow_multiple_reduction=True, the "
          f"default; two roundings). * = what ElasticBuffer(allow_multiple_reduction={bool(args.allow_multiple_reduction)}) "
          "runs across nodes.")
    if args.plot:
        plot(rows, args.plot, title)
        print(f"plot: {args.plot}")
    return 0


__all__ = ["build_parser", "main", "plot", "table"]
