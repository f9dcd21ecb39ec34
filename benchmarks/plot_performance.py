"""Draw ep_moe's speed against its baselines, as ratios, from the JSON the benchmarks write.

    python3 benchmarks/plot_performance.py bench.json megatron.json deepspeed.json [--out docs/performance.png]

Each file is one benchmark's ``--json`` output, recognised by its keys:

* ``ep-moe bench --json``: per operation (and dtype) at one token count (``--tokens``, default 4096 where measured,
  else the largest), torch's median time over the other backend's at one SM count (``--num-sms``, default 24 where
  measured, else the largest);
* ``benchmarks/megatron_layer_bench.py --json``: ``alltoall``'s fwd+bwd time over each other dispatcher's (the
  no-dispatcher floor is left out);
* ``benchmarks/deepspeed_layer_bench.py --json``: DeepSpeed's layer's fwd+bwd time over ep_moe's, per mode
  (capacity, dropless).

A ratio above 1 means ep_moe is faster. Every panel's title names the GPU (or CPU) and the kernels the JSON
records. A row whose check is not ``ok`` stops the script (exit status 1, naming the file and the row): a chart is
drawn only from checked results. Also prints one line per bar.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "performance.png"
BENCH_BASELINE = "torch"
MEGATRON_BASELINE = "alltoall"
MEGATRON_FLOOR = "no dispatcher (router + experts)"


class PlotError(ValueError):
    """A JSON file that cannot be plotted: unknown format, a failed check, nothing to compare."""


@dataclass
class Panel:
    """One benchmark's bars: ``bars`` are ``(label, ratio)``, ratio = baseline time / ep_moe time."""

    source: str
    title: str
    baseline: str
    bars: list[tuple[str, float]] = field(default_factory=list)


def kind_of(data: object, source: str) -> str:
    """``"bench"``, ``"megatron"`` or ``"deepspeed"``: which benchmark wrote ``data`` (the parsed JSON of
    ``source``). Raises `PlotError` naming ``source`` for anything else."""
    if isinstance(data, dict):
        rows = data.get("rows")
        if isinstance(data.get("meta"), dict) and isinstance(rows, list):
            return "bench"
        if isinstance(rows, list) and rows and all(isinstance(r, dict) and "dispatcher" in r for r in rows):
            return "megatron"
        if isinstance(data.get("timings"), dict) and isinstance(data.get("timed_checks"), dict):
            return "deepspeed"
    raise PlotError(f"{source}: not the JSON of ep-moe bench, megatron_layer_bench.py or deepspeed_layer_bench.py")


def _pick(values: set[int], preferred: int | None, default: int, what: str, source: str) -> int:
    if preferred is not None:
        if preferred not in values:
            raise PlotError(f"{source}: no rows at {what} {preferred} (measured: {sorted(values)})")
        return preferred
    return default if default in values else max(values)


def bench_panel(data: dict, source: str, tokens: int | None = None, num_sms: int | None = None) -> Panel:
    """The panel of an ``ep-moe bench --json`` file: per (op, dtype), torch's median over the other backend's.

    Args:
        data: the parsed JSON (``meta``, ``rows``: `ep_moe.benchmarking.results.Row` as dicts).
        tokens: the token count to plot (None: 4096 where measured, else the largest).
        num_sms: the SM count of backends that take one (None: 24 where measured, else the largest).
    Raises:
        PlotError: a row at that token count whose ``check`` is not ``ok``; no backend besides torch.
    """
    meta, rows = data["meta"], data["rows"]
    t = _pick({r["tokens"] for r in rows}, tokens, 4096, "tokens", source)
    rows = [r for r in rows if r["tokens"] == t]
    for r in rows:
        if r.get("check") != "ok":
            raise PlotError(f"{source}: {r['backend']} {r['op']} {r.get('dtype') or '-'} T={t} "
                            f"SMs={r.get('num_sms')}: check {r.get('check')!r}, not ok")
    others = sorted({r["backend"] for r in rows} - {BENCH_BASELINE})
    if not others or not any(r["backend"] == BENCH_BASELINE for r in rows):
        raise PlotError(f"{source}: needs torch and another backend at T={t} (found {sorted({r['backend'] for r in rows})})")
    sms_values = {r["num_sms"] for r in rows if r["num_sms"] is not None and not r.get("planned")}
    sms = _pick(sms_values, num_sms, 24, "SMs", source) if sms_values else None
    base = {(r["op"], r["dtype"]): r for r in rows if r["backend"] == BENCH_BASELINE}
    panel = Panel(source, "", BENCH_BASELINE)
    kernels = set()
    for r in rows:
        if r["backend"] == BENCH_BASELINE or r.get("planned") or r["num_sms"] != sms:
            continue
        ref = base.get((r["op"], r["dtype"]))
        if ref is None or not r.get("median_us") or not ref.get("median_us"):
            continue
        label = r["op"] + (f" {r['dtype']}" if r["dtype"] else "") + (f" [{r['backend']}]" if len(others) > 1 else "")
        panel.bars.append((label, ref["median_us"] / r["median_us"]))
        kernels.add(r.get("kernels") or "-")
    sms_text = f" at {sms} SMs" if sms is not None else ""
    panel.title = (f"ep-moe bench, {meta['ranks']} x {meta['device']}: {t} tokens/rank, hidden {meta['hidden']}, "
                   f"top-{meta['topk']} of {meta['experts']}\n{', '.join(others)}{sms_text} vs torch; kernels: "
                   f"{'; '.join(sorted(kernels))}")
    return panel


def megatron_panel(data: dict, source: str) -> Panel:
    """The panel of a ``megatron_layer_bench.py --json`` file: ``alltoall``'s fwd+bwd ms over each other
    dispatcher's (the floor row left out). Raises `PlotError` on a row whose ``check`` is not ``ok`` or without
    an ``alltoall`` row."""
    rows = data["rows"]
    for r in rows:
        if r.get("check") != "ok":
            raise PlotError(f"{source}: {r['dispatcher']}: check {r.get('check')!r}, not ok")
    base = next((r for r in rows if r["dispatcher"] == MEGATRON_BASELINE), None)
    if base is None:
        raise PlotError(f"{source}: no {MEGATRON_BASELINE!r} row to compare with")
    a = data.get("args", {})
    experts = "trivial experts" if a.get("trivial_experts") else f"SequentialMLP experts (ffn {a.get('ffn')})"
    kernels = f"; {data['kernels']}" if data.get("kernels") else ""
    permutes = sorted({r.get("permute", "-") for r in rows if r.get("permute", "-") != "-"})
    panel = Panel(source, (f"Megatron-core {data.get('megatron_core')} MoE layer fwd+bwd, {data.get('world')} x "
                           f"{data.get('gpu')}\n{a.get('tokens')} tokens/rank, hidden {a.get('hidden')}, top-"
                           f"{a.get('topk')} of {a.get('experts')}, {experts}, {a.get('dtype')}; vs alltoall"
                           f"{kernels}; permute: {', '.join(permutes) or '-'}"), MEGATRON_BASELINE)
    for r in rows:
        if r is not base and r["dispatcher"] != MEGATRON_FLOOR:
            panel.bars.append((r["dispatcher"], base["ms"] / r["ms"]))
    return panel


def deepspeed_panel(data: dict, source: str) -> Panel:
    """The panel of a ``deepspeed_layer_bench.py --json`` file: DeepSpeed's layer's fwd+bwd ms over ep_moe's, per
    mode both were timed in. Raises `PlotError` on a check that is not ``ok`` (or ``l_aux`` / counts that
    differ) or when no mode has both layers."""
    for mode, c in data["timed_checks"].items():
        if c.get("check") != "ok" or not c.get("l_aux_and_counts_equal", True):
            raise PlotError(f"{source}: {mode}: check {c.get('check')!r}, not ok")
    t, c = data["timings"], data.get("config", {})
    experts = f"{c.get('experts')} trivial experts" if c.get("trivial_experts") else \
        f"{c.get('experts')} experts (ffn {c.get('ffn')})"
    permutes = sorted({v.get("permute", "-") for v in data["timed_checks"].values()} - {"-"})
    panel = Panel(source, (f"DeepSpeed {data.get('deepspeed')} MoE layer fwd+bwd, {data.get('world')} x "
                           f"{data.get('device')}\n{c.get('tokens')} tokens/rank, hidden {c.get('hidden')}, top-"
                           f"{c.get('k')}, {experts}, {c.get('dtype')}; vs deepspeed.moe.layer.MoE\nep_moe "
                           f"backend {data.get('ep_moe_backend')}; permute: {', '.join(permutes) or '-'}"),
                  "DeepSpeed")
    for mode in ("capacity", "dropless"):
        ours, theirs = t.get(f"ep_moe-{mode}"), t.get(f"deepspeed-{mode}")
        if ours and theirs:
            panel.bars.append((mode, theirs["fwd_bwd_ms"] / ours["fwd_bwd_ms"]))
    if not panel.bars:
        raise PlotError(f"{source}: no mode timed for both DeepSpeed's layer and ep_moe's")
    return panel


def panels(paths: list[str], tokens: int | None = None, num_sms: int | None = None) -> list[Panel]:
    """One `Panel` per JSON file, in the order given. Raises `PlotError` (naming the file) for a file that cannot be
    read or plotted."""
    out = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise PlotError(f"{path}: cannot be read as JSON ({exc})") from exc
        kind = kind_of(data, path)
        try:
            if kind == "bench":
                out.append(bench_panel(data, path, tokens, num_sms))
            elif kind == "megatron":
                out.append(megatron_panel(data, path))
            else:
                out.append(deepspeed_panel(data, path))
        except (KeyError, TypeError) as exc:
            raise PlotError(f"{path}: a {kind} JSON without an expected field ({exc!r})") from exc
        if not out[-1].bars:
            raise PlotError(f"{path}: nothing to compare")
    return out


def draw(plots: list[Panel], out: str | Path) -> None:
    """Save the panels as one PNG at ``out``: horizontal bars of the ratios, a line at 1 (equal speed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [1.2 + 0.38 * len(p.bars) for p in plots]
    fig, axes = plt.subplots(len(plots), 1, figsize=(9.0, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, p in zip(axes[:, 0], plots):
        labels, ratios = [b[0] for b in p.bars], [b[1] for b in p.bars]
        colours = ["tab:green" if r >= 1 else "tab:red" for r in ratios]
        ax.barh(range(len(ratios)), ratios, color=colours, height=0.6)
        ax.set_yticks(range(len(ratios)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
        for i, r in enumerate(ratios):
            ax.text(r, i, f" {r:.2f}x", va="center", fontsize=8)
        ax.set_xlim(0, max(1.1, *ratios) * 1.18)
        ax.set_xlabel(f"{p.baseline} time / ep_moe time (> 1: ep_moe faster)", fontsize=8)
        ax.set_title(p.title, fontsize=8, loc="left")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="JSON files of ep-moe bench and the layer benchmarks")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the PNG to write (default: docs/performance.png)")
    p.add_argument("--tokens", type=int, default=None, help="ep-moe bench: the token count to plot")
    p.add_argument("--num-sms", type=int, default=None, help="ep-moe bench: the SM count to plot")
    args = p.parse_args(argv)
    try:
        plots = panels(args.json, args.tokens, args.num_sms)
    except PlotError as exc:
        print(f"plot_performance: {exc}", file=sys.stderr)
        return 1
    for panel in plots:
        for label, ratio in panel.bars:
            print(f"{panel.source}: {label}: {ratio:.2f}x vs {panel.baseline}")
    draw(plots, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
