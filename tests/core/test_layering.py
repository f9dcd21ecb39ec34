"""The package's layers: no module imports a home above its own (the picture in docs/architecture.md).

A home is a top-level module or folder of ``ep_moe``, or a module or folder inside one where the folder spans
levels (``buffer.dispatch_handle`` at the bottom, ``buffer.buffer_v1`` above the backends). A module belongs to
the longest home that contains it; it may import its own home, and homes of its level or below. Function-level
imports count too (the graph of `support_imports`)."""

from __future__ import annotations

from support_imports import PACKAGE, import_graph

# Bottom to top. `__init__` is the public API (it re-exports up to the layers' MoELayer).
LEVELS = {
    "config": 0, "distributed": 0, "reference": 0, "custom_op": 0,
    "buffer.dispatch_handle": 0, "buffer.event_overlap": 0, "buffer.routing_layout": 0, "buffer.argument_checks": 0,
    "elastic.wire_format": 0, "elastic.peer_wait": 0, "elastic.transport_choice": 0,
    "native": 1, "elastic.memory": 1,
    "backends": 2, "permute": 2, "elastic.engram": 2,
    "buffer": 3,
    "buffer.autograd_ops": 4, "buffer.expert_major_ops": 4, "tuning": 4, "elastic.pipeline_comm": 4,
    "elastic.agrs": 4,
    "token_dispatcher": 5, "elastic": 5,
    "layers": 6, "__init__": 6,
    "compat": 7, "integrations": 7, "train": 7, "benchmarking": 7,
    "cli": 8,
    "__main__": 9,
}


def home_of(module: str) -> str:
    """The home of a dotted module name (``ep_moe.buffer.buffer_v1`` -> ``buffer``): the longest key of `LEVELS`
    that is the module or a package holding it; ``ep_moe`` itself is ``__init__``."""
    parts = module.split(".")[1:]
    for cut in range(len(parts), 0, -1):
        if ".".join(parts[:cut]) in LEVELS:
            return ".".join(parts[:cut])
    return "__init__" if not parts else parts[0]


def test_every_home_has_a_level():
    homes = {home_of(module) for module in import_graph()}
    assert homes <= set(LEVELS), f"give these a level: {sorted(homes - set(LEVELS))}"


def test_every_level_names_a_module_or_folder():
    missing = [home for home in LEVELS if home != "__init__" and not (PACKAGE / home.replace(".", "/")).is_dir()
               and not (PACKAGE / (home.replace(".", "/") + ".py")).is_file()]
    assert not missing, f"levels of homes that do not exist: {missing}"


def test_no_import_runs_up_the_layers():
    upward = []
    for module, imported in sorted(import_graph().items()):
        home = home_of(module)
        for target in sorted({home_of(m) for m in imported} - {home}):
            if LEVELS[target] > LEVELS[home]:
                upward.append(f"{module} ({home}, level {LEVELS[home]}) imports {target} (level {LEVELS[target]})")
    assert not upward, "\n".join(upward)
