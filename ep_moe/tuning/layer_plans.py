"""`PlanCache`: one plan per layer shape, with overrides, JSON files, a printable table and refinement.

Layers are named by their ordinal among the model's MoE layers (``"0"``, ``"1"``, ...), as the
trainer's per-layer lists are. This is the one place a layer's SM count is decided; first match wins (0 or
"auto" in any of them means "no override here"):

1. ``EP_MOE_NUM_SMS`` (environment; every layer) -- for quick sweeps;
2. an explicit per-layer value: the recipe's ``ep_moe.num_sms`` as a list (one per MoE layer), or
   ``PlanCache(layer_num_sms=...)``;
3. the recipe's ``ep_moe.num_sms`` as a number (every layer);
4. a plan file (``EP_MOE_PLAN=path``, else the recipe's ``ep_moe.tuning_plan``): either the form
   ``num_sms: N | [per MoE layer]`` (``ep-moe tune --trainer-plan``) or the plans `PlanCache.save` writes (the
   entry for that layer, else for that shape); JSON or YAML;
5. the bandwidth model (`plan_layer`) with the calibrated rates, where the backend takes an SM count;
6. else `ep_moe.config.DEFAULT_NUM_SMS` (`PlanCache.num_sms_per_layer` with ``use_model=False``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ..config import DEFAULT_NUM_SMS
from .bandwidth_model import LayerShape, dtype_bytes
from .machine_topology import Topology, detect_topology
from .plan import CommPlan, PlanPolicy, check_num_sms, plan_layer
from .rates import Rates
from .refine import MeasureFn, refine

log = logging.getLogger("ep_moe")

ENV_NUM_SMS = "EP_MOE_NUM_SMS"
ENV_PLAN = "EP_MOE_PLAN"
PLAN_FILE_VERSION = 1
# Keys of a recipe's ``ep_moe`` block that the tuner reads (the trainer owns the others).
RECIPE_KEYS = ("num_sms", "tuning_plan", "min_sms", "max_sms", "time_tolerance", "knee_cap", "margin")
POLICY_KEYS = ("min_sms", "max_sms", "time_tolerance", "knee_cap", "margin")


def _read_structured(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"plan file {str(path)!r} does not exist") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"plan file {str(path)!r} is neither JSON nor YAML: {exc}") from None
    if not isinstance(data, dict) or not ("plans" in data or "num_sms" in data):
        raise ValueError(f"plan file {str(path)!r} must hold a 'plans' list (ep-moe tune --json) or "
                         f"'num_sms: N | [one per MoE layer]'")
    if data.get("version", PLAN_FILE_VERSION) > PLAN_FILE_VERSION:
        raise ValueError(f"plan file {str(path)!r} has version {data['version']}; this ep_moe reads "
                         f"<= {PLAN_FILE_VERSION}")
    return data


def load_plans(path: str | os.PathLike) -> list[CommPlan]:
    """The plans in a file written by `PlanCache.save` (``ep-moe tune --json``); [] for a ``num_sms`` file."""
    path = Path(path)
    data = _read_structured(path)
    if not isinstance(data.get("plans", []), list):
        raise ValueError(f"plan file {str(path)!r}: 'plans' must be a list")
    try:
        return [CommPlan.from_dict(p) for p in data.get("plans", [])]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"plan file {str(path)!r} has a malformed plan: {exc}") from None


def _auto(value) -> bool:
    return value is None or value == 0 or (isinstance(value, str) and value.strip().lower() in ("auto", "", "0"))


def split_num_sms(where: str, value, num_moe_layers: int | None = None) -> tuple[int | None, dict[str, int]]:
    """``num_sms`` as (one count for every layer or None, {MoE layer ordinal: count}); a list gives one
    count per MoE layer (exactly ``num_moe_layers`` of them, when given), 0 / "auto" entries meaning "the
    model's"."""
    if isinstance(value, list | tuple):
        if num_moe_layers is not None and len(value) != num_moe_layers:
            raise ValueError(f"{where}: num_sms needs one entry per MoE layer ({num_moe_layers}), got {len(value)}")
        return None, {str(i): check_num_sms(where, f"num_sms[{i}]", n) for i, n in enumerate(value) if not _auto(n)}
    return (None if _auto(value) else check_num_sms(where, "num_sms", value)), {}


class PlanCache:
    """Plans per (layer shape, EP size), computed once, overridable, savable.

    Args:
        topology: the machine (default: `detect_topology`); plans for other EP sizes reuse its hardware.
        rates: the model's rates (default: the calibration cache for this topology, else datasheet).
        policy: how SM counts are chosen (default `PlanPolicy()`).
        num_sms: one SM count for every layer (None, 0 or "auto" = the model).
        layer_num_sms: per-layer SM counts, by layer name (``str(layer)``).
        plan_file: plans to use where they match (a layer's entry first, then the shape's).
        use_env: read ``EP_MOE_NUM_SMS`` and ``EP_MOE_PLAN``.
        num_moe_layers: the model's MoE layers: a list of SM counts (``num_sms`` or the plan file's) must have
            exactly this many entries (None: not checked).

    Every argument and file is checked here; the topology is detected on first use.
    """

    def __init__(self, topology: Topology | None = None, rates: Rates | None = None,
                 policy: PlanPolicy | None = None, *, num_sms: int | str | list | None = None,
                 layer_num_sms: Mapping | None = None, plan_file: str | os.PathLike | None = None,
                 use_env: bool = True, num_moe_layers: int | None = None) -> None:
        self._topology = topology
        self._rates = rates
        self.policy = policy or PlanPolicy()
        self.num_sms, self.layer_num_sms = split_num_sms("PlanCache", num_sms, num_moe_layers)
        self.layer_num_sms.update({str(k): check_num_sms("PlanCache", f"layer_num_sms[{k!r}]", v)
                                   for k, v in (layer_num_sms or {}).items() if not _auto(v)})
        self.env_num_sms: int | None = None
        if use_env and os.environ.get(ENV_NUM_SMS, "").strip():
            self.env_num_sms = check_num_sms("PlanCache", f"environment variable {ENV_NUM_SMS}",
                                             os.environ[ENV_NUM_SMS].strip())
        where = "PlanCache"
        if use_env and os.environ.get(ENV_PLAN, "").strip():
            plan_file, where = os.environ[ENV_PLAN].strip(), f"PlanCache: environment variable {ENV_PLAN}"
        self.file_plans: list[CommPlan] = []
        self.file_num_sms: int | None = None
        self.file_layer_num_sms: dict[str, int] = {}
        if plan_file:
            try:
                data = _read_structured(Path(plan_file))
                self.file_plans = load_plans(plan_file) if "plans" in data else []
                self.file_num_sms, self.file_layer_num_sms = split_num_sms(f"plan file {str(plan_file)!r}",
                                                                           data.get("num_sms"), num_moe_layers)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        self.plan_file = str(plan_file) if plan_file else None
        self._plans: dict[tuple[str, int, str | None], CommPlan] = {}

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_recipe(cls, block: Mapping | None, topology: Topology | None = None, rates: Rates | None = None,
                    strict: bool = False, base_dir: str | os.PathLike | None = None,
                    num_moe_layers: int | None = None) -> PlanCache:
        """A cache configured by a recipe's ``ep_moe`` block: ``num_sms`` (one count, or one per MoE layer,
        exactly ``num_moe_layers`` of them when given), ``tuning_plan`` (a plan file; relative paths are taken
        from ``base_dir``, the recipe's folder) and the `PlanPolicy` keys ``min_sms``, ``max_sms``,
        ``time_tolerance``, ``knee_cap``, ``margin`` (None = the policy's default). Other keys are the
        trainer's and ignored unless ``strict``."""
        block = dict(block or {})
        if strict and (unknown := sorted(set(block) - set(RECIPE_KEYS))):
            raise ValueError(f"PlanCache.from_recipe: unknown key(s) ep_moe.{', ep_moe.'.join(unknown)}; "
                             f"known: {', '.join(RECIPE_KEYS)}")
        policy_args = {key: block[key] for key in POLICY_KEYS if block.get(key) is not None}
        try:
            policy = PlanPolicy(**policy_args)
        except ValueError as exc:
            raise ValueError(f"PlanCache.from_recipe: ep_moe block: {exc}") from None
        plan_file = block.get("tuning_plan")
        if plan_file and base_dir is not None and not os.path.isabs(os.path.expanduser(str(plan_file))):
            plan_file = os.path.join(base_dir, str(plan_file))
        try:
            return cls(topology, rates, policy, num_sms=block.get("num_sms"),
                       plan_file=os.path.expanduser(str(plan_file)) if plan_file else None,
                       num_moe_layers=num_moe_layers)
        except ValueError as exc:
            raise ValueError(f"PlanCache.from_recipe: ep_moe block: {exc}") from None

    @property
    def topology(self) -> Topology:
        """The machine plans are made for (detected on first use unless given)."""
        if self._topology is None:
            self._topology = detect_topology()
        return self._topology

    @property
    def rates(self) -> Rates:
        """The rates plans are made with (loaded from the calibration cache on first use)."""
        if self._rates is None:
            from .calibration import load_rates

            self._rates = load_rates(self.topology)
        return self._rates

    def topology_for(self, num_ranks: int | None) -> Topology:
        if num_ranks is None or num_ranks == self.topology.world_size:
            return self.topology
        return self.topology.with_group(num_ranks)

    # ---------------------------------------------------------------- plans
    def _file_plan(self, key: str, num_ranks: int, layer: str | None) -> CommPlan | None:
        matches = [p for p in self.file_plans if p.key == key and p.num_ranks == num_ranks]
        for p in matches:
            if layer is not None and p.layer == layer:
                return p
        return next((p for p in matches if p.layer is None), matches[0] if matches else None)

    def plan(self, shape: LayerShape, layer: str | int | None = None, num_ranks: int | None = None,
             routing=None) -> CommPlan:
        """The plan for ``shape`` (and ``layer``, for per-layer overrides), computed once and cached.

        Args:
            layer: the layer asking (its name or index); plans are shared by all layers of a shape unless
                a per-layer override or a per-layer file entry exists.
            num_ranks: the EP group size (default: the topology's world size).
            routing: a measured routing histogram (see `ep_moe.tuning.rank_loads`); such plans are made for
                the busiest rank and not cached (the histogram changes from step to step).
        """
        layer = None if layer is None else str(layer)
        topo = self.topology_for(num_ranks)
        key, n_ranks = shape.key(), topo.world_size
        override = self._override(layer)
        from_file = None if override else self._file_plan(key, n_ranks, layer)
        specific = layer if ((override and " layer " in override[1])
                             or (from_file is not None and from_file.layer == layer)) else None
        if routing is not None:
            plan = plan_layer(shape, topo, self.rates, self.policy, routing, specific,
                              num_sms=override[0] if override else None)
            if override:
                plan.source = override[1]
            return plan
        cached = self._plans.get((key, n_ranks, specific))
        if cached is not None:
            return cached
        if override is not None:
            plan = plan_layer(shape, topo, self.rates, self.policy, None, specific, num_sms=override[0])
            plan.source = override[1]
        elif from_file is not None:
            plan = replace(from_file, history=list(from_file.history), source=f"file:{self.plan_file}")
        else:
            plan = plan_layer(shape, topo, self.rates, self.policy, None, None)
        self._plans[(key, n_ranks, specific)] = plan
        return plan

    def _override(self, layer: str | None) -> tuple[int, str] | None:
        """(SMs, source) from the environment, the recipe, or a plan file's ``num_sms``; None if none."""
        if self.env_num_sms is not None:
            return self.env_num_sms, f"override:{ENV_NUM_SMS}"
        if layer is not None and layer in self.layer_num_sms:
            return self.layer_num_sms[layer], f"override:recipe layer {layer}"
        if self.num_sms is not None:
            return self.num_sms, "override:recipe num_sms"
        if layer is not None and layer in self.file_layer_num_sms:
            return self.file_layer_num_sms[layer], f"override:file layer {layer}"
        if self.file_num_sms is not None:
            return self.file_num_sms, "override:file num_sms"
        return None

    def num_sms_per_layer(self, shape: LayerShape, num_moe_layers: int, num_ranks: int | None = None,
                      use_model: bool = True) -> list[int]:
        """The SM count of each of ``num_moe_layers`` MoE layers of ``shape`` (see the module docstring for the
        order). ``use_model=False`` (a backend that takes no SM count): overrides where given, else
        `DEFAULT_NUM_SMS`; the model (and the topology) is never consulted then."""
        if use_model:
            return [self.plan(shape, layer, num_ranks).num_sms for layer in range(num_moe_layers)]
        counts = []
        n_ranks = num_ranks if num_ranks is not None else self.topology.world_size
        for layer in range(num_moe_layers):
            override = self._override(str(layer))
            plan = None if override else self._file_plan(shape.key(), n_ranks, str(layer))
            counts.append(override[0] if override else plan.num_sms if plan else DEFAULT_NUM_SMS)
        return counts

    def plans(self) -> list[CommPlan]:
        return list(self._plans.values())

    def record(self, shape: LayerShape, dispatch_us: float, combine_us: float, layer: str | int | None = None,
               num_ranks: int | None = None) -> CommPlan:
        """Store times measured at the plan's SM count."""
        plan = self.plan(shape, layer, num_ranks)
        plan.record(float(dispatch_us), float(combine_us))
        return plan

    def refine(self, shape: LayerShape, measure_fn: MeasureFn, budget: int = 5, layer: str | int | None = None,
               num_ranks: int | None = None, tolerance: float = 0.02) -> CommPlan:
        """`refine` the shape's plan with measurements (overridden plans are left alone) and keep the result,
        with its predicted times, QPs and chunk size recomputed at the chosen SM count."""
        plan = self.plan(shape, layer, num_ranks)
        if plan.source.startswith("override:"):
            return plan
        topo = self.topology_for(num_ranks)
        best = refine(plan, measure_fn, budget, tolerance=tolerance, min_sms=self.policy.min_sms,
                      max_sms=topo.num_sms or None)
        fresh = plan_layer(shape, topo, self.rates, self.policy, None, plan.layer, num_sms=best.num_sms)
        fresh.source, fresh.history = "refined", best.history
        fresh.record(best.measured_dispatch_us, best.measured_combine_us, best.measured_us)
        key = next(k for k, v in self._plans.items() if v is plan)
        self._plans[key] = fresh
        return fresh

    # ---------------------------------------------------------------- files and printing
    def to_dict(self) -> dict:
        return {"version": PLAN_FILE_VERSION, "topology": self.topology.to_dict(),
                "rates_source": self.rates.source, "plans": [p.to_dict() for p in self.plans()]}

    def save(self, path: str | os.PathLike) -> None:
        """Write every plan made so far (with measurements) as JSON; `PlanCache(plan_file=path)` reads it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike, topology: Topology | None = None, rates: Rates | None = None,
             use_env: bool = True) -> PlanCache:
        """A cache whose plans come from ``path`` where they match (and from the model elsewhere)."""
        if topology is None:
            data = json.loads(Path(path).read_text()) if Path(path).exists() else {}
            topology = Topology.from_dict(data["topology"]) if "topology" in data else None
        return cls(topology, rates, plan_file=path, use_env=use_env)

    def table(self) -> str:
        return format_table(self.plans())


COLUMNS = ("layer", "shape", "EP", "g", "bottleneck", "SMs", "QPs", "pred disp", "pred comb", "meas disp",
           "meas comb", "V2 SMs", "source")


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(plans: list[CommPlan]) -> str:
    """A plain-text table of plans (times in us; ``nvlink*``: the plan's SMs, not the link, bound the time)."""
    rows = [COLUMNS]
    for p in plans:
        rows.append((p.layer or "*", p.shape.label(), str(p.num_ranks), f"{p.expected_ranks:.2f}",
                     p.bottleneck + ("*" if p.sm_bound else ""), str(p.num_sms), str(p.num_qps),
                     _us(p.predicted_dispatch_us), _us(p.predicted_combine_us),
                     _us(p.measured_dispatch_us), _us(p.measured_combine_us),
                     "-" if p.deepep_v2_sms is None else str(p.deepep_v2_sms), p.source))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ recipes
def _lookup(recipe: Mapping, key: str, blocks=("model", "train", "dataset")):
    for block in blocks:
        section = recipe.get(block)
        if isinstance(section, Mapping) and section.get(key) is not None:
            return section[key]
    return None


def recipe_layers(recipe: Mapping) -> tuple[LayerShape, int, list[int]]:
    """(shape, EP size, the model layers that are MoE layers) from a recipe mapping's ``model`` (and
    ``train``) block: what ``ep-moe tune RECIPE`` plans and the trainer runs. Tokens per rank per call =
    ``micro_batch_size x seq_length``; the dispatched dtype is bf16 under ``train.precision: bf16`` (autocast),
    else the model's ``params_dtype``. Plans name MoE layers by their ordinal in the returned list."""
    model = recipe.get("model")
    if not isinstance(model, Mapping):
        raise ValueError("recipe: a 'model' block is required")
    values = {}
    for key in ("num_moe_experts", "moe_router_topk", "hidden_size"):
        if model.get(key) is None:
            raise ValueError(f"recipe: model.{key} is required for tuning")
        values[key] = int(model[key])
    seq, mbs = _lookup(recipe, "seq_length"), _lookup(recipe, "micro_batch_size")
    if seq is None or mbs is None:
        raise ValueError("recipe: model.seq_length and micro_batch_size (model or train block) are required: "
                         "tokens per rank = micro_batch_size x seq_length")
    train = recipe.get("train")
    dtype = "bf16" if isinstance(train, Mapping) and train.get("precision") == "bf16" else model.get("params_dtype")
    if dtype is None:  # Megatron's flags; its default is fp32
        dtype = "bf16" if model.get("bf16") else "fp16" if model.get("fp16") else "fp32"
    shape = LayerShape(values["num_moe_experts"], values["moe_router_topk"], values["hidden_size"],
                       int(mbs) * int(seq), dtype_bytes(dtype))
    ep = int(model.get("expert_model_parallel_size") or 1)
    num_layers = int(model.get("num_layers") or 1)
    freq = model.get("moe_layer_freq", 1)
    if isinstance(freq, list | tuple):
        moe = [i for i, flag in enumerate(freq) if flag]
    else:
        moe = [i for i in range(num_layers) if i % max(1, int(freq)) == 0]
    return shape, ep, moe



# ------------------------------------------------------------------------------------------ process default
_default_cache: PlanCache | None = None


def default_cache() -> PlanCache:
    """The process-wide cache (built on first use from the detected topology and the calibration cache)."""
    global _default_cache
    if _default_cache is None:
        _default_cache = PlanCache()
    return _default_cache


def set_default_cache(cache: PlanCache | None) -> None:
    """Replace the process-wide cache (a recipe's `PlanCache.from_recipe`), or reset it with None."""
    global _default_cache
    _default_cache = cache


def plan_for_layer(num_experts: int, topk: int, hidden: int, tokens: int, dtype="bf16",
                   num_ranks: int | None = None, layer: str | int | None = None,
                   cache: PlanCache | None = None) -> CommPlan:
    """The plan of one MoE layer; ``plan.num_sms`` is what `TokenDispatcher(num_sms=...)` takes.

    Every rank of the EP group must ask with the same arguments (``tokens`` = tokens per rank, the same
    on every rank, e.g. micro-batch x sequence length) so that all ranks use the same SM count.
    """
    shape = LayerShape(num_experts, topk, hidden, tokens, dtype_bytes(dtype))
    return (cache or default_cache()).plan(shape, layer, num_ranks)


__all__ = ["ENV_NUM_SMS", "ENV_PLAN", "RECIPE_KEYS", "PlanCache", "default_cache", "format_table", "load_plans",
           "plan_for_layer", "recipe_layers", "set_default_cache"]
