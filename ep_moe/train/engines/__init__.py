"""Recipe runners for other training frameworks (``engine: megatron`` / ``engine: deepspeed``): each builds that
framework's model around ep_moe and trains it with the trainer's data, schedule and metrics."""
