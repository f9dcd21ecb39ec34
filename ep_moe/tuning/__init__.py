"""Per-layer SM/QP planning from a calibrated bandwidth model (docs/native.md).

`plan_layer` turns a layer shape and a `Topology` into a `CommPlan`; `PlanCache` keeps one plan per layer
shape with overrides (``EP_MOE_NUM_SMS``, ``EP_MOE_PLAN``, a recipe's ``ep_moe`` block) and JSON files;
`refine` searches a few SM counts around the prediction on the real kernels; `plan_for_layer` is the
one-call entry point for a token dispatcher. `get_theoretical_num_sms` / `get_theoretical_num_qps` are
DeepEP V2's analytic counts, for comparison (`ep_moe.tuning.theoretical`).
"""

from .bandwidth_model import LayerShape, RankLoad, dtype_bytes, expected_groups, rank_loads
from .layer_plans import (
                    ENV_NUM_SMS,
                    ENV_PLAN,
                    RECIPE_KEYS,
                    PlanCache,
                    default_cache,
                    format_table,
                    load_plans,
                    plan_for_layer,
                    recipe_layers,
                    set_default_cache,
)
from .plan import (
                    DEEPEP_V2_POLICY,
                    CommPlan,
                    PlanPolicy,
                    deepep_v2_num_sms,
                    num_qps,
                    op_costs,
                    plan_layer,
                    predict_us,
)
from .rates import FitSample, KernelFit, Rates, fit_kernel, smooth_max
from .refine import refine
from .theoretical import get_theoretical_num_qps, get_theoretical_num_sms

__all__ = ["DEEPEP_V2_POLICY", "ENV_NUM_SMS", "ENV_PLAN", "RECIPE_KEYS", "CommPlan", "FitSample", "KernelFit",
           "LayerShape", "PlanCache", "PlanPolicy", "RankLoad", "Rates", "deepep_v2_num_sms", "default_cache",
           "dtype_bytes", "expected_groups", "fit_kernel", "format_table", "get_theoretical_num_qps",
           "get_theoretical_num_sms", "load_plans", "num_qps", "op_costs", "plan_for_layer", "plan_layer",
           "predict_us", "rank_loads", "recipe_layers", "refine", "set_default_cache", "smooth_max"]
