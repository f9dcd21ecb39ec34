"""The rates the bandwidth model runs on: link bandwidths, per-SM read/write throughput, and the fitted
corrections for one backend's kernels. Datasheet defaults here; `ep_moe.tuning.calibration` measures them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

from .machine_topology import Topology

# Defaults, measured on H200 (CHANGELOG.md, baselines): a grid-stride 16-byte copy moves ~48 GB/s per SM
# locally and pushes ~45 GB/s per SM into a peer; stores of 8 SMs saturate NVLink at ~360 of the raw
# 478 GB/s per direction (75 %). A read-only SM streams several times faster than it writes.
DEFAULT_SM_READ_GBS = 180.0
DEFAULT_SM_WRITE_GBS = 48.0
DEFAULT_SM_PEER_WRITE_GBS = 45.0
DEFAULT_NVLINK_EFFICIENCY = 0.75
DEFAULT_RDMA_EFFICIENCY = 0.9
DEFAULT_RDMA_GBS = 50.0  # 400 Gb/s, when a multi-node plan is asked for and no NIC was found
DEFAULT_SHARPNESS = 8.0  # how abruptly a kernel goes from SM-bound to link-bound (smooth-max exponent)

# DeepEP V2's own assumptions (`get_theoretical_num_sms`): 90 % of the raw NVLink rate, 200 GB/s read
# and 50 GB/s write per SM, the NIC's line rate.
DEEPEP_V2_NVLINK_FACTOR = 0.9
DEEPEP_V2_SM_READ_GBS = 200.0
DEEPEP_V2_SM_WRITE_GBS = 50.0


@dataclass(frozen=True)
class KernelFit:
    """How one operation (dispatch or combine) of the kernels departs from the ideal model.

    The model predicts ``time(n) = overhead_us + smooth_max(link_time / link_scale, sm_time(n) / sm_scale)``
    where ``smooth_max(a, b) = (a^p + b^p)^(1/p)`` with ``p = sharpness`` (infinite = plain max).

    Attributes:
        link_scale: achieved link rate / calibrated link rate (the kernel's protocol overhead on the wire).
        sm_scale: achieved SM throughput / the rate the per-SM copy benchmarks give.
        overhead_us: fixed cost per call: launch, count exchange, host wait, allocation.
        sharpness: the smooth-max exponent.
        rms_rel_error: root-mean-square relative error of the fit over its samples (0 = not fitted).
        samples: how many measurements the fit used (0 = defaults).
    """

    link_scale: float = 1.0
    sm_scale: float = 1.0
    overhead_us: float = 20.0
    sharpness: float = DEFAULT_SHARPNESS
    rms_rel_error: float = 0.0
    samples: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KernelFit:
        """The fit ``to_dict`` wrote; `ValueError` naming the field for a value that is not a number (or not
        a positive scale or sharpness, or a negative overhead)."""
        if not isinstance(data, dict):
            raise ValueError(f"KernelFit: expected an object, got {_describe(data)}")
        values = {k: _number("KernelFit", k, data[k]) for k in cls.__dataclass_fields__ if k in data}
        for name in ("link_scale", "sm_scale", "sharpness"):
            if name in values and not values[name] > 0:
                raise ValueError(f"KernelFit: '{name}' must be > 0, got {values[name]!r}")
        if values.get("overhead_us", 0.0) < 0:
            raise ValueError(f"KernelFit: 'overhead_us' must be >= 0, got {values['overhead_us']!r}")
        if "samples" in values:
            if values["samples"] != int(values["samples"]):
                raise ValueError(f"KernelFit: 'samples' must be a whole number, got {values['samples']!r}")
            values["samples"] = int(values["samples"])
        return cls(**values)


@dataclass(frozen=True)
class Rates:
    """Bandwidths the model divides by (GB/s = 1e9 bytes/s).

    Attributes:
        nvlink_gbs: NVLink bandwidth per GPU and direction that SM stores reach (all links).
        rdma_gbs: NIC bandwidth per GPU (0 = no NIC).
        sm_read_gbs, sm_write_gbs: what one SM reads / writes locally per second while copying.
        sm_peer_write_gbs: what one SM stores into a peer GPU per second.
        copy_engine_gbs: peer copy through the copy engine (reported, not used for SM counts), or None.
        dispatch, combine: the kernels' fitted corrections (defaults when not calibrated).
        measured: True when any number here was measured on the device.
        source: a short sentence saying where the numbers come from.
        notes: what could not be measured, and why.
    """

    nvlink_gbs: float
    rdma_gbs: float = 0.0
    sm_read_gbs: float = DEFAULT_SM_READ_GBS
    sm_write_gbs: float = DEFAULT_SM_WRITE_GBS
    sm_peer_write_gbs: float = DEFAULT_SM_PEER_WRITE_GBS
    copy_engine_gbs: float | None = None
    dispatch: KernelFit = field(default_factory=lambda: KernelFit(overhead_us=25.0))
    combine: KernelFit = field(default_factory=lambda: KernelFit(overhead_us=15.0))
    measured: bool = False
    source: str = "datasheet defaults (not measured)"
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("sm_read_gbs", "sm_write_gbs", "sm_peer_write_gbs"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Rates: argument '{name}' must be > 0 GB/s, got {getattr(self, name)!r}")
        for name in ("nvlink_gbs", "rdma_gbs"):
            if getattr(self, name) < 0:
                raise ValueError(f"Rates: argument '{name}' must be >= 0 GB/s, got {getattr(self, name)!r}")

    def fit(self, op: str) -> KernelFit:
        if op not in ("dispatch", "combine"):
            raise ValueError(f"Rates.fit: argument 'op' must be 'dispatch' or 'combine', got {op!r}")
        return self.dispatch if op == "dispatch" else self.combine

    @classmethod
    def defaults(cls, topology: Topology) -> Rates:
        """Datasheet rates for ``topology``: 75 % of raw NVLink, 90 % of the NIC, H200-like SMs."""
        return cls(nvlink_gbs=topology.nvlink_gbs * DEFAULT_NVLINK_EFFICIENCY,
                   rdma_gbs=(topology.nic_gbs or 0.0) * DEFAULT_RDMA_EFFICIENCY)

    @classmethod
    def deepep_v2(cls, topology: Topology) -> Rates:
        """The rates DeepEP V2's ``get_theoretical_num_sms`` assumes (never measured; no overheads)."""
        ideal = KernelFit(overhead_us=0.0, sharpness=math.inf)
        return cls(nvlink_gbs=topology.nvlink_gbs * DEEPEP_V2_NVLINK_FACTOR, rdma_gbs=topology.nic_gbs or 0.0,
                   sm_read_gbs=DEEPEP_V2_SM_READ_GBS, sm_write_gbs=DEEPEP_V2_SM_WRITE_GBS,
                   sm_peer_write_gbs=DEEPEP_V2_SM_WRITE_GBS, dispatch=ideal, combine=ideal,
                   source="DeepEP V2 assumptions (not measured)")

    def with_fits(self, dispatch: KernelFit | None = None, combine: KernelFit | None = None) -> Rates:
        return replace(self, dispatch=dispatch or self.dispatch, combine=combine or self.combine)

    def describe(self) -> str:
        ce = f", copy engine {self.copy_engine_gbs:.0f}" if self.copy_engine_gbs else ""
        lines = [f"NVLink {self.nvlink_gbs:.0f} GB/s/dir, RDMA {self.rdma_gbs:.0f} GB/s{ce}; per SM: read "
                 f"{self.sm_read_gbs:.0f}, write {self.sm_write_gbs:.0f}, peer write {self.sm_peer_write_gbs:.0f} "
                 f"GB/s  [{self.source}]"]
        for op in ("dispatch", "combine"):
            f = self.fit(op)
            fitted = f"fitted on {f.samples} runs, rms err {f.rms_rel_error:.1%}" if f.samples else "default"
            lines.append(f"  {op}: overhead {f.overhead_us:.1f} us, link x{f.link_scale:.2f}, SM x{f.sm_scale:.2f}, "
                         f"sharpness {f.sharpness:g} ({fitted})")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["notes"] = list(self.notes)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Rates:
        """The rates ``to_dict`` wrote (a calibration file's entry); `ValueError` naming the field for a value
        of the wrong type (``nvlink_gbs`` is required)."""
        if not isinstance(data, dict):
            raise ValueError(f"Rates: expected an object, got {_describe(data)}")
        if "nvlink_gbs" not in data:
            raise ValueError("Rates: 'nvlink_gbs' is missing")
        values = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for name in ("nvlink_gbs", "rdma_gbs", "sm_read_gbs", "sm_write_gbs", "sm_peer_write_gbs"):
            if name in values:
                values[name] = _number("Rates", name, values[name])
        if values.get("copy_engine_gbs") is not None:
            values["copy_engine_gbs"] = _number("Rates", "copy_engine_gbs", values["copy_engine_gbs"])
        for op in ("dispatch", "combine"):
            if op in values:
                try:
                    values[op] = KernelFit.from_dict(values[op])
                except ValueError as exc:
                    raise ValueError(f"Rates: '{op}': {exc}") from None
        if not isinstance(values.get("measured", False), bool):
            raise ValueError(f"Rates: 'measured' must be true or false, got {_describe(values['measured'])}")
        if not isinstance(values.get("source", ""), str):
            raise ValueError(f"Rates: 'source' must be a string, got {_describe(values['source'])}")
        notes = values.get("notes", ())
        if not isinstance(notes, list | tuple) or not all(isinstance(n, str) for n in notes):
            raise ValueError(f"Rates: 'notes' must be a list of strings, got {_describe(notes)}")
        values["notes"] = tuple(notes)
        return cls(**values)


def _describe(value) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


def _number(owner: str, name: str, value) -> float:
    """``value`` as a float: a finite number (inf only for a smooth-max sharpness), not a bool or a string."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{owner}: '{name}' must be a number, got {_describe(value)}")
    if math.isnan(value) or (math.isinf(value) and name != "sharpness"):
        raise ValueError(f"{owner}: '{name}' must be finite, got {value!r}")
    return float(value)


def smooth_max(values: Iterable[float], sharpness: float) -> float:
    """``(sum v^p)^(1/p)`` over the positive values (plain max for p = inf); 0 for none."""
    vals = [v for v in values if v > 0]
    if not vals:
        return 0.0
    top = max(vals)
    if math.isinf(sharpness):
        return top
    return top * sum((v / top) ** sharpness for v in vals) ** (1.0 / sharpness)


@dataclass(frozen=True)
class FitSample:
    """One measurement for `fit_kernel`: the model's ideal link time and SM time (at the SM count the
    measurement used) and the measured time, all in us."""

    link_us: float
    sm_us: float
    measured_us: float


def fit_kernel(samples: Sequence[FitSample], sharpness_grid: Sequence[float] = (1.5, 2, 3, 4, 6, 8, 12, 20, math.inf),
               ) -> KernelFit:
    """Fit `KernelFit`'s four numbers to measurements by minimising the squared relative error.

    An exhaustive grid over the link scale (0.2..2), the SM scale (0.05..8) and the sharpness, with the
    overhead solved in closed form (least squares, non-negative) at each grid point. Needs samples on
    both sides of the SM/link knee to tell the scales apart; with fewer than 3 samples it raises.
    """
    import numpy as np

    if len(samples) < 3:
        raise ValueError(f"fit_kernel: argument 'samples' needs at least 3 measurements, got {len(samples)}")
    for s in samples:
        if not (s.measured_us > 0 and s.link_us >= 0 and s.sm_us >= 0):
            raise ValueError(f"fit_kernel: every sample needs measured_us > 0 and times >= 0, got {s}")
    link = np.array([s.link_us for s in samples])[None, None, :]
    sm = np.array([s.sm_us for s in samples])[None, None, :]
    t = np.array([s.measured_us for s in samples])
    w = 1.0 / t ** 2
    link_scales = np.geomspace(0.2, 2.0, 41)[:, None, None]
    sm_scales = np.geomspace(0.05, 8.0, 81)[None, :, None]
    a = np.broadcast_to(link / link_scales, (41, 81, len(samples)))
    b = np.broadcast_to(sm / sm_scales, (41, 81, len(samples)))
    top = np.maximum(np.maximum(a, b), 1e-30)
    best = None
    for p in sharpness_grid:
        ideal = top if math.isinf(p) else top * ((a / top) ** p + (b / top) ** p) ** (1.0 / p)
        overhead = np.maximum(0.0, ((t - ideal) * w).sum(axis=2) / w.sum())
        err = (((ideal + overhead[..., None] - t) ** 2) * w).sum(axis=2)
        i, j = np.unravel_index(int(np.argmin(err)), err.shape)
        if best is None or err[i, j] < best[0] - 1e-15:
            best = (float(err[i, j]), KernelFit(float(link_scales[i, 0, 0]), float(sm_scales[0, j, 0]),
                                                float(overhead[i, j]), float(p),
                                                math.sqrt(float(err[i, j]) / len(samples)), len(samples)))
    assert best is not None
    return best[1]


__all__ = ["DEEPEP_V2_NVLINK_FACTOR", "DEEPEP_V2_SM_READ_GBS", "DEEPEP_V2_SM_WRITE_GBS", "FitSample",
           "KernelFit", "Rates", "fit_kernel", "smooth_max"]
