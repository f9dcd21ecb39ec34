"""The MoE trainer: ``ep-moe train RECIPE.yaml [key=value ...]`` (also ``python -m ep_moe.train``).

Modules: `config` (the recipe schema of every engine, YAML, overrides), `data` (synthetic topic corpus,
text files), `schedule` (learning rate), `parallel` (process groups, gradient reduction), `loop` (one rank's
training), `checkpoint` (EP-size-independent checkpoints), `metrics` / `plot` (what a user sees),
`launch` (the command: device, checks, ranks through `ep_moe.distributed.launch`), `engines` (the megatron
and deepspeed recipe runners).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ep-moe train``; returns the exit status (0 ok, 1 failed, 2 bad recipe, 130 stopped)."""
    from .launch import main as launch_main

    return launch_main(argv)


__all__ = ["main"]
