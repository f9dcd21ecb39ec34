"""Drop-in replacements inside other training frameworks.

* `ep_moe.integrations.megatron`: a Megatron-core token dispatcher and MoE layer spec (needs megatron-core).
* `ep_moe.integrations.deepspeed`: a ``deepspeed.moe.layer.MoE`` drop-in (needs DeepSpeed).

Each module imports its framework when it is imported; this package imports neither.
"""
