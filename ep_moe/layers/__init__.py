"""MoE layers and a small MoE language model on top of the ep_moe token dispatcher.

* `TopKRouter`: fp32 top-k router (softmax/sigmoid, group-limited, aux/seq-aux/z losses, expert bias).
* `GroupedExperts`: this EP rank's SwiGLU experts (``torch._grouped_mm`` on CUDA, a loop elsewhere).
* `MoELayer`: router + `ep_moe.TokenDispatcher` (or `LocalTokenDispatcher` without an EP group) + experts
  + optional shared expert.
* `MoETransformer` / `ModelConfig` / `ModelOutput`: decoder-only LM with MoE FFNs.
* `global_state_dict` / `load_global_state_dict`: checkpoints that load at any EP size.
"""

from .experts import GroupedExperts, SwiGLU, derive_seed, grouped_mm_available, is_expert_param
from .global_state import global_state_dict, load_global_state_dict, to_global, to_local
from .model import ModelOutput, MoETransformer
from .model_config import ModelConfig
from .moe import LocalTokenDispatcher, MoELayer
from .router import TopKRouter, group_limited_topk

__all__ = [
    "GroupedExperts",
    "LocalTokenDispatcher",
    "ModelConfig",
    "ModelOutput",
    "MoELayer",
    "MoETransformer",
    "SwiGLU",
    "TopKRouter",
    "derive_seed",
    "global_state_dict",
    "group_limited_topk",
    "grouped_mm_available",
    "is_expert_param",
    "load_global_state_dict",
    "to_global",
    "to_local",
]
