"""`ModelConfig`: the hyper-parameters of `ep_moe.layers.MoETransformer` and of each of its `MoELayer` s
(Megatron-core ``TransformerConfig`` names), checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .router import LOAD_BALANCING_TYPES, SCORE_FUNCTIONS

PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    """Model and MoE hyper-parameters (Megatron-core ``TransformerConfig`` names).

    ``moe_layer_freq``: an int N (MoE in layers 0, N, 2N, ...) or a list of 0/1 per layer.
    ``hidden_dropout`` (on both residual branches) and ``attention_dropout`` (on the attention probabilities)
    apply in training mode only; they draw from torch's global RNG of the device (CPU or CUDA).
    Extras beyond the first block: ``moe_router_pre_softmax`` (softmax over all experts, no
    renormalisation over the top-k), ``moe_shared_expert_gate`` (sigmoid gate on the shared expert),
    ``moe_grouped_gemm`` (False: always the per-expert loop), ``untie_embeddings_and_output_weights``.
    """

    vocab_size: int = 256
    seq_length: int = 128
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int = 256
    moe_ffn_hidden_size: int = 128
    num_moe_experts: int = 8
    moe_router_topk: int = 2
    moe_layer_freq: int | list[int] = 1
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_shared_expert_intermediate_size: int | None = None
    moe_router_force_load_balancing: bool = False
    rotary_base: float = 10000.0
    init_method_std: float = 0.02
    norm_epsilon: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    # extras
    moe_router_pre_softmax: bool = False
    moe_shared_expert_gate: bool = False
    moe_grouped_gemm: bool = True
    untie_embeddings_and_output_weights: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"ModelConfig: '{name}' must be {expected}, got {getattr(self, name)!r}")

        for name in ("vocab_size", "seq_length", "num_layers", "hidden_size", "num_attention_heads",
                     "ffn_hidden_size", "moe_ffn_hidden_size", "num_moe_experts", "moe_router_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "a positive int")
        if self.hidden_size % self.num_attention_heads:
            raise bad("num_attention_heads", f"a divisor of hidden_size={self.hidden_size}")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise bad("num_attention_heads", "such that the head dim hidden_size/num_attention_heads is even (RoPE)")
        if self.moe_router_topk > self.num_moe_experts:
            raise bad("moe_router_topk", f"<= num_moe_experts={self.num_moe_experts}")
        if isinstance(self.moe_layer_freq, list):
            if len(self.moe_layer_freq) != self.num_layers or any(v not in (0, 1) for v in self.moe_layer_freq):
                raise bad("moe_layer_freq", f"an int >= 1 or a list of {self.num_layers} values in {{0, 1}}")
        elif not isinstance(self.moe_layer_freq, int) or self.moe_layer_freq < 1:
            raise bad("moe_layer_freq", f"an int >= 1 or a list of {self.num_layers} values in {{0, 1}}")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise bad("moe_router_group_topk", "set together with moe_router_num_groups (both or neither)")
        if groups is not None:
            if not isinstance(groups, int) or groups < 1 or self.num_moe_experts % groups:
                raise bad("moe_router_num_groups", f"a positive divisor of num_moe_experts={self.num_moe_experts}")
            if (not isinstance(group_topk, int) or not 1 <= group_topk <= groups or self.moe_router_topk % group_topk
                    or self.moe_router_topk // group_topk > self.num_moe_experts // groups):
                raise bad("moe_router_group_topk", f"in [1, moe_router_num_groups={groups}], dividing moe_router_topk="
                          f"{self.moe_router_topk}, with topk/group_topk <= experts per group")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            raise bad("moe_router_pre_softmax", "False unless moe_router_score_function is 'softmax'")
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            raise bad("moe_router_score_function", f"one of {SCORE_FUNCTIONS}")
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise bad("moe_router_load_balancing_type", f"one of {LOAD_BALANCING_TYPES}")
        if self.params_dtype not in PARAMS_DTYPES:
            raise bad("params_dtype", f"one of {tuple(PARAMS_DTYPES)}")
        if self.moe_aux_loss_coeff < 0 or (self.moe_z_loss_coeff or 0) < 0:
            raise bad("moe_aux_loss_coeff", "non-negative (and moe_z_loss_coeff too)")
        if self.moe_shared_expert_intermediate_size is not None and self.moe_shared_expert_intermediate_size < 0:
            raise bad("moe_shared_expert_intermediate_size", "None or >= 0")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise bad(name, "in [0, 1)")
        if self.norm_epsilon <= 0 or self.init_method_std <= 0 or self.rotary_base <= 0:
            raise bad("norm_epsilon", "> 0 (and init_method_std, rotary_base too)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return PARAMS_DTYPES[self.params_dtype]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[layer])
        return layer % self.moe_layer_freq == 0


__all__ = ["PARAMS_DTYPES", "ModelConfig"]
