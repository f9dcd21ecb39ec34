"""The ``ep-moe`` command: one entry point, a subcommand per job. Each subcommand lives in its own
module with a ``main(argv) -> int`` and is imported only when it runs."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("ep_moe.train", "train an MoE model from a YAML recipe (ep-moe train RECIPE.yaml key=value ...)"),
    "bench": ("ep_moe.cli.bench", "benchmark dispatch/combine of every backend in one run"),
    "recipes": ("ep_moe.train.recipes", "list the built-in recipes (ep-moe train NAME runs one)"),
    "tune": ("ep_moe.cli.tune", "print the per-layer SM/QP plan of a recipe or of given shapes"),
    "simulate": ("ep_moe.cli.simulate", "predicted dispatch/combine bytes per hop and time across nodes, flat vs "
                                         "hybrid (ep-moe simulate --nodes 2,4,8,16 --gpus-per-node 8)"),
    "demo": ("ep_moe.cli.demo", "a small dispatch/combine round trip on spawned CPU ranks (checks an install)"),
    "jit": ("ep_moe.cli.jit", "compile JIT kernels ahead of time (ep-moe jit warmup [--shapes ...]), list the cache"),
    "env": ("ep_moe.cli.env", "report the installation: versions, GPUs, whether the native kernels are built "
                              "(and why not)"),
}


def usage() -> str:
    lines = ["usage: ep-moe [--version] COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<7} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'ep-moe COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version

        import ep_moe

        try:
            installed = version("ep_moe")
        except PackageNotFoundError:
            installed = None
        where = f" ({installed} installed)" if installed and installed != ep_moe.__version__ else ""
        print(f"ep-moe {ep_moe.__version__}{where}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ep-moe: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
