"""The head of a script that builds one Megatron-core MoE layer on the CPU (one gloo rank, megatron-core's allgather
dispatcher, ep_moe's portable router) through benchmarks/megatron_layer_bench.py's `_build`, for the tests that run
the layer benchmark's code in a subprocess (tests/ is on sys.path: pytest puts conftest.py's folder there). The
script continues from ``spec`` and ``config``."""

SCRIPT_HEAD = r'''
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
import torch._dynamo
torch._dynamo.config.disable = True
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.transformer_config import TransformerConfig
import megatron_layer_bench as bench
from ep_moe.integrations import megatron as integ
parallel_state.initialize_model_parallel(expert_model_parallel_size=1)
config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=16,
                           moe_ffn_hidden_size=16, num_moe_experts=8, moe_router_topk=2,
                           moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                           moe_router_dtype="fp32", add_bias_linear=False, use_cpu_initialization=True,
                           params_dtype=torch.float32)
spec = integ.with_portable_router(get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False))
'''
