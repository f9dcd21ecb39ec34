"""The benchmark's results: rows, derived columns, the printed table, JSON and the PNG plot."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .accounting import floor_fraction, floor_us, gbps

OPS = ("layout", "dispatch", "dispatch_cached", "dispatch_fixed", "combine", "expert_dispatch", "expert_dispatch_fixed",
       "expert_combine")
REFERENCE_BACKEND = "torch"


@dataclass
class Row:
    """One measured operation. Times in microseconds: the median / p10 / p90 over runs of the
    slowest rank of each run. ``recv_bytes``: DeepEP-counted bytes a rank receives (mean over ranks
    and input sets); ``link_bytes``: the busiest rank-direction over NVLink (see `accounting`).
    ``num_sms`` None: the backend does not take an SM budget (torch); ``planned``: ``num_sms`` is the tuner's
    plan for this shape (`ep_moe.tuning.plan_for_layer`)."""

    backend: str
    op: str
    dtype: str | None
    tokens: int
    num_sms: int | None
    planned: bool = False
    median_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    runs: int = 0
    rank_median_us: list[float] = field(default_factory=list)
    recv_bytes: float | None = None
    link_bytes: float | None = None
    gbps: float | None = None
    floor_us: float | None = None
    floor_fraction: float | None = None
    speedup_vs_torch: float | None = None
    check: str = "ok"  # "ok", "FAIL" (results differ; see problems) or "error" (an exception)
    kernels: str = "-"  # what ran the timed calls, e.g. "native (jit), permute jit" (`_RankBench._kernels`)
    problems: list[str] = field(default_factory=list)


def finalize(rows: list[Row], link_gbps: float | None) -> None:
    """Fill the derived columns: GB/s, floor (when the link speed is known), speedup vs torch."""
    reference = {(r.op, r.dtype, r.tokens): r.median_us for r in rows
                 if r.backend == REFERENCE_BACKEND and r.median_us}
    for r in rows:
        if r.median_us and r.recv_bytes is not None:
            r.gbps = gbps(r.recv_bytes, r.median_us)
        if link_gbps and r.link_bytes is not None:
            r.floor_us = floor_us(r.link_bytes, link_gbps)
            r.floor_fraction = floor_fraction(r.floor_us, r.median_us)
        ref = reference.get((r.op, r.dtype, r.tokens))
        if ref and r.median_us:
            r.speedup_vs_torch = ref / r.median_us


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _gbps(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"  # CPU runs move a few MB/s


def _table_order(r: Row) -> tuple:
    """Same workload and operation together (layout, then per dtype dispatch, cached, combine), torch
    first, then the other backends by SM count."""
    dtype_rank = {None: 0, "bf16": 1, "fp32": 2, "fp8": 3}.get(r.dtype, 4)
    op_rank = OPS.index(r.op) if r.op in OPS else -1  # setup failures first
    return (r.tokens, dtype_rank, op_rank, r.backend != REFERENCE_BACKEND, r.backend,
            -1 if r.num_sms is None else r.num_sms)


def table(rows: list[Row], header: list[str]) -> str:
    """A fixed-width text table after the ``header`` lines: one line per row, grouped by token count,
    dtype and operation (torch first, then the other backends by SM count; ``*`` marks the tuner's plan),
    then the problems found."""
    cols = ["backend", "dtype", "tokens", "SMs", "op", "median us", "p10-p90 us", "GB/s", "floor us",
            "of floor", "vs torch", "check", "kernels"]
    body = []
    for r in sorted(rows, key=_table_order):
        spread = "-" if r.p10_us is None else f"{r.p10_us:.1f}-{r.p90_us:.1f}"
        median = "error" if r.check == "error" else _num(r.median_us, ".1f")
        body.append([r.backend, r.dtype or "-", str(r.tokens),
                     "-" if r.num_sms is None else f"{r.num_sms}{'*' if r.planned else ''}",
                     r.op, median, spread, _gbps(r.gbps), _num(r.floor_us, ".1f"),
                     _num(r.floor_fraction, ".2f"), "-" if r.speedup_vs_torch is None else f"{r.speedup_vs_torch:.2f}x",
                     r.check, r.kernels])
    widths = [max(len(c), *(len(line[i]) for line in body)) if body else len(c) for i, c in enumerate(cols)]
    left = {0, 1, 4, 11, 12}  # text columns
    def fmt(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    lines = list(header) + [fmt(cols)] + [fmt(b) for b in body]
    notes, seen = [], set()
    for r in rows:  # one unit's problems are attached to each of its operations: list them once
        where = f"{r.backend} {r.dtype or '-'} T={r.tokens} SMs={'-' if r.num_sms is None else r.num_sms}"
        for p in r.problems:
            if (where, p) not in seen:
                seen.add((where, p))
                notes.append(f"  {where} ({r.op}): {p}")
    if notes:
        lines += ["problems:"] + notes
    return "\n".join(lines)


def write_json(path: str | Path, meta: dict, rows: list[Row]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")


def _op_label(r: Row) -> str:
    return r.op + (f" {r.dtype}" if r.dtype and r.dtype != "bf16" else "")


PANEL_WIDTH_IN, PLOT_HEIGHT_IN, PLOT_DPI = 7.0, 5.5, 110


def plot(path: str | Path, rows: list[Row], title: str, reference_tokens: int | None = None,
         num_sms: list[int] | None = None, sm_panel: bool = True) -> str | None:
    """Save a PNG: time vs tokens (left; backends with an SM budget at 24 SMs, or the largest
    measured) and, with ``sm_panel``, time vs SMs at one token count (right; backends without an SM budget
    as dashed horizontal lines; left out on CPU, where no backend uses SMs). Colour = operation, line
    style = backend. A run of one token count says so in the title. Returns None on success, or why no
    plot was made (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not available ({exc})"
    ok = [r for r in rows if r.median_us]
    sm_values = sorted({r.num_sms for r in ok if r.num_sms is not None})
    plot_sms = 24 if 24 in sm_values else (sm_values[-1] if sm_values else None)
    token_values = sorted({r.tokens for r in ok})
    if reference_tokens not in token_values:
        reference_tokens = 4096 if 4096 in token_values else (token_values[-1] if token_values else None)
    ops = sorted({_op_label(r) for r in ok})
    color = {op: f"C{i % 10}" for i, op in enumerate(ops)}
    backends = sorted({r.backend for r in ok})
    linestyle = {b: ("--" if b == REFERENCE_BACKEND else ("-", "-.", ":")[i % 3]) for i, b in enumerate(backends)}

    panels = 2 if sm_panel else 1
    fig, axes = plt.subplots(1, panels, figsize=(PANEL_WIDTH_IN * panels, PLOT_HEIGHT_IN), squeeze=False)
    ax_t = axes[0][0]
    # Left: time vs tokens.
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in ok:
        if r.num_sms is None or r.num_sms == plot_sms:
            series.setdefault((r.backend, _op_label(r)), []).append((r.tokens, r.median_us))
    for (backend, op), points in sorted(series.items()):
        points.sort()
        ax_t.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color[op],
                  linestyle=linestyle[backend], label=f"{backend}: {op}")
    floors = sorted({(r.tokens, r.floor_us) for r in ok if r.op == "dispatch" and r.dtype == "bf16" and r.floor_us})
    if floors:
        ax_t.plot([f[0] for f in floors], [f[1] for f in floors], color="black", linestyle=":", label="floor (bf16)")
    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("tokens per rank")
    ax_t.set_ylabel("time (us, median)")
    ax_t.set_title("time vs tokens" + (f" ({plot_sms} SMs where a backend takes them)" if plot_sms and sm_panel
                                       else "")
                   + (f"\n(one token count only, {token_values[0]}: pass --tokens A B C for a curve)"
                      if len(token_values) == 1 else ""), fontsize=10)
    ax_t.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    if sm_panel:
        _sm_panel(axes[0][1], ok, reference_tokens, num_sms, color, linestyle)
    fig.suptitle(textwrap.fill(title, 95 * panels), fontsize=9)  # one panel is narrower: wrap the title
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return None


def _sm_panel(ax_s, ok: list[Row], reference_tokens: int | None, num_sms: list[int] | None, color: dict,
              linestyle: dict) -> None:
    """The right panel: time vs SMs at ``reference_tokens`` (backends without an SM budget as horizontal
    lines)."""
    at = [r for r in ok if r.tokens == reference_tokens]
    by_sms: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in at:
        if r.num_sms is not None:
            by_sms.setdefault((r.backend, _op_label(r)), []).append((r.num_sms, r.median_us))
    for (backend, op), points in sorted(by_sms.items()):
        points.sort()
        ax_s.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color[op],
                  linestyle=linestyle[backend], label=f"{backend}: {op}")
    for r in at:
        if r.num_sms is None and r.op != "layout":
            ax_s.axhline(r.median_us, color=color[_op_label(r)], linestyle=linestyle[r.backend],
                         label=f"{r.backend}: {_op_label(r)}")
    floor = next((r.floor_us for r in at if r.op == "dispatch" and r.dtype == "bf16" and r.floor_us), None)
    if floor:
        ax_s.axhline(floor, color="black", linestyle=":", label="floor (bf16)")
    if not by_sms and num_sms:  # no backend takes an SM budget: show the requested range anyway
        ax_s.set_xlim(min(num_sms) - 2, max(num_sms) + 2)
    ax_s.set_xlabel("SMs (Config.num_sms)")
    ax_s.set_ylabel("time (us, median)")
    ax_s.set_yscale("log")
    ax_s.set_title(f"time vs SMs at {reference_tokens} tokens per rank")
    ax_s.grid(True, which="both", alpha=0.3)
    if ax_s.get_legend_handles_labels()[0]:
        ax_s.legend(fontsize=7)
