"""Recipe schema of the three engines, YAML loading and ``key=value`` overrides.

A recipe is a YAML mapping with Megatron-Bridge style sections plus a top-level ``engine``: ``ep_moe``
(this package's trainer), ``megatron`` (a Megatron-core ``GPTModel``) or ``deepspeed`` (a model trained
through ``deepspeed.initialize``). Every engine shares the ``train``, ``optimizer``, ``scheduler``,
``dataset``, ``checkpoint``, ``logger``, ``rng`` and ``ep_moe`` sections; each has its own ``model``
section, and ``deepspeed`` a ``deepspeed`` section. Every section is a dataclass below; its fields are the
only keys accepted. Loading checks each value's type and reports problems with the key's full dotted path
(``train.global_batch_size``) and, for an unknown key, the closest known one. Overrides
(``train.train_iters=50``) are parsed as YAML scalars and go through the same checks. A shared key that an
engine does not use is an error when it is set to anything but its default.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import yaml

from ..layers.model_config import ModelConfig

ENGINES = ("ep_moe", "megatron", "deepspeed")


class RecipeError(ValueError):
    """A recipe or override that cannot be used; the message names the key's dotted path."""


# ---------------------------------------------------------------------------------------------- shared sections
@dataclass
class TrainSection:
    """Batching, length, evaluation cadence, processes and device."""

    global_batch_size: int = 16       # sequences per optimizer step, over all ranks
    micro_batch_size: int = 4         # sequences per rank per forward/backward
    train_iters: int = 100            # optimizer steps
    eval_interval: int = 0            # evaluate every N steps (and at the end); 0 = only at the end
    eval_iters: int = 2               # global batches per evaluation; 0 = never evaluate
    nproc: int = 2                    # ranks to spawn when not under torchrun
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"   # bf16: autocast on CUDA, fp32 master weights
    deterministic: bool = False       # seeds + deterministic algorithms + fixed-order reductions
    timeout_s: float = 300.0          # bound on every collective (a dead peer raises instead of hanging)
    target_loss_gap: float | None = None  # synthetic data: the final eval loss should be within this many
    #                                       nats/token of the entropy floor (reported in the summary)
    fail_on_target_miss: bool = False     # exit with status 1 when target_loss_gap is missed (default: report only)
    # ep_moe engine only. 2: a two-stage pipeline (ep_moe.train.pipeline): ranks [0, W/2) run the first half of
    # the layers, [W/2, W) the second, activations and gradients through an ElasticBuffer's pp_send / pp_recv.
    pp_size: int = 1
    # ep_moe engine only. 1: ZeRO-1 (ep_moe.train.zero): gradients reduce-scattered and parameters all-gathered
    # through an ElasticBuffer's AGRS sessions, each rank's optimizer holding its shard of the parameters only.
    # 0: gradients all-reduced, the whole optimizer state on every rank.
    zero_stage: int = 0


@dataclass
class OptimizerSection:
    """AdamW. The ep_moe and megatron engines decay matrices only (not norms, biases or the expert bias);
    the deepspeed engine hands ``weight_decay`` to DeepSpeed's AdamW for every parameter."""

    optimizer: Literal["adamw"] = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    clip_grad: float = 1.0            # global gradient-norm clip; 0 = off


@dataclass
class SchedulerSection:
    """Linear warm-up from 0 to ``optimizer.lr``, then cosine/linear decay to ``min_lr`` or constant
    (`ep_moe.train.schedule`, for every engine)."""

    lr_warmup_iters: int = 0
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    lr_decay_iters: int | None = None  # None = train.train_iters
    min_lr: float = 0.0


@dataclass
class DatasetSection:
    """``synthetic`` (the built-in topic Markov corpus, the default) or ``text`` (any .txt file)."""

    type: Literal["synthetic", "text"] = "synthetic"
    seed: int | None = None           # data seed (corpus and batch order); None = rng.seed
    # synthetic
    num_topics: int = 4               # topic tags are tokens 0..num_topics-1
    order: int = 1                    # Markov order of each topic's chain (1 or 2)
    branching: int = 4                # successors per state in each chain
    concentration: float = 1.0        # Dirichlet concentration of the successor probabilities
    # text
    path: str | None = None           # relative paths are resolved against the cwd, then the recipe's folder
    tokenizer: Literal["char", "byte"] = "char"
    split: list[float] = field(default_factory=lambda: [0.95, 0.05])   # train, validation fractions


@dataclass
class CheckpointSection:
    save: str | None = None           # folder for checkpoints; None = never save
    save_interval: int = 0            # steps between saves; 0 = only at the end (and on Ctrl-C)
    load: str | None = None           # a checkpoint folder (or a save folder: its latest) to start from
    resume: bool = False              # continue from the latest checkpoint in ``save`` if there is one
    keep_last: int = 2                # checkpoints kept in ``save`` (older ones are removed); 0 = all


@dataclass
class LoggerSection:
    log_interval: int = 1             # steps between metrics lines
    metrics_path: str | None = None   # JSON lines; None = <checkpoint.save or runs/<recipe name>>/metrics.jsonl
    plot_path: str | None = None      # PNG loss curve; None = <metrics file without .jsonl>_loss.png
    progress_bar: bool | Literal["auto"] = "auto"   # true, false, or auto: on when stderr is a terminal
    tensorboard_dir: str | None = None  # TensorBoard event files (rank 0, Megatron's scalar names); None = off
    wandb_project: str | None = None    # Weights & Biases project (rank 0, the same scalars); None = off
    wandb_run_name: str | None = None   # the W&B run's name; None = the run folder's name


@dataclass
class RngSection:
    seed: int = 1234


@dataclass
class EpMoeSection:
    """The ep_moe dispatcher and how its SM counts are decided (`ep_moe.tuning.layer_plans`: explicit counts, else
    the plan file, else the tuner on the native backend, else the default; ``ep-moe tune RECIPE`` prints the
    plans the trainer will use)."""

    dispatcher_backend: Literal["auto", "torch", "native"] = "auto"
    num_sms: int | list[int] = 0      # SMs for dispatch/combine: one for all MoE layers or one per MoE layer
    #                                   (0 = decided below)
    tuning_plan: str | None = None    # YAML/JSON file: ``num_sms: N | [per MoE layer]`` or ``ep-moe tune --json``
    # The tuner's policy (`ep_moe.tuning.PlanPolicy`; None = its default): fewest SMs whose predicted time is
    # within time_tolerance of the time at knee_cap x the knee, or margin x the knee, within [min_sms, max_sms].
    min_sms: int | None = None
    max_sms: int | None = None
    time_tolerance: float | None = None
    knee_cap: float | None = None
    margin: float | None = None
    # The experts choose the row alignment themselves (16 for torch._grouped_mm on CUDA, else 1): the
    # ep_moe engine accepts only the default here.
    expert_alignment: int = 1
    # > 0: fixed-size dispatch, an upper bound on the rows any EP rank receives per micro-batch (at most
    # micro_batch_size * seq_length * expert_model_parallel_size): the dispatch never waits on the host.
    num_worst_tokens: int = 0
    # ep_moe engine only. true: hybrid mode (`ep_moe.backends.hybrid`): the EP group's dispatch/combine take two hops,
    # across nodes then inside the node, where the group spans more than one node. The nodes come from the
    # launch (torchrun's GROUP_RANK, SLURM's SLURM_NODEID, else the host names; `ep_moe.backends.hybrid.node_topology`);
    # ``num_scaleout_ranks`` overrides them (that many nodes of consecutive EP ranks; None: from the launch).
    hybrid_mode: bool = False
    num_scaleout_ranks: int | None = None


TUNER_POLICY_KEYS = ("min_sms", "max_sms", "time_tolerance", "knee_cap", "margin")


# ---------------------------------------------------------------------------------------------- recipes
@dataclass
class RecipeBase:
    """What every engine's recipe has: the shared sections, where the recipe came from, where a run writes.

    Subclasses add ``model`` (and their own sections), narrow ``engine`` to their name, list the shared keys
    they do not use in ``UNSUPPORTED`` (``dotted key -> why``) and check their own rules in `engine_rules`.
    """

    engine: Literal["ep_moe", "megatron", "deepspeed"] = "ep_moe"
    train: TrainSection = field(default_factory=TrainSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    dataset: DatasetSection = field(default_factory=DatasetSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logger: LoggerSection = field(default_factory=LoggerSection)
    rng: RngSection = field(default_factory=RngSection)
    ep_moe: EpMoeSection = field(default_factory=EpMoeSection)
    # Not a key: the folder of the recipe file (relative paths in it are resolved against it).
    source_dir: str = field(default=".", metadata={"internal": True})
    # Not a key: the recipe file's name without extension (names the default output folder).
    name: str = field(default="recipe", metadata={"internal": True})

    UNSUPPORTED: ClassVar[dict[str, str]] = {}

    def engine_rules(self, world_size: int, device: str | None) -> None:
        """The engine's own cross-field rules (``device``: the resolved device type, None before that)."""

    def to_dict(self) -> dict[str, Any]:
        """The recipe as plain YAML-able data (what a checkpoint and the metrics header store)."""
        out = dataclasses.asdict(self)
        out.pop("source_dir")
        out.pop("name")
        return {"engine": out.pop("engine"), "model": out.pop("model"), **out}  # the order of a recipe file

    # ------------------------------------------------------------------ derived quantities
    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.model.seq_length

    def grad_accum_steps(self, world_size: int) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * world_size)

    def resolve_path(self, path: str) -> str:
        """An input path of the recipe: absolute as is; else relative to the cwd if it exists there, else
        relative to the recipe's folder (returned as the cwd-relative path when neither exists)."""
        expanded = os.path.expanduser(path)
        if os.path.isabs(expanded) or os.path.exists(expanded):
            return os.path.abspath(expanded)
        beside_recipe = os.path.join(self.source_dir, expanded)
        return beside_recipe if os.path.exists(beside_recipe) else os.path.abspath(expanded)

    # ------------------------------------------------------------------ outputs
    def output_dir(self) -> str:
        """Where metrics and the plot go by default: ``checkpoint.save``, else ``runs/<recipe name>``."""
        return self.checkpoint.save or os.path.join("runs", self.name)

    def metrics_path(self) -> str:
        return self.logger.metrics_path or os.path.join(self.output_dir(), "metrics.jsonl")

    def plot_path(self) -> str:
        if self.logger.plot_path:
            return self.logger.plot_path
        return os.path.splitext(self.metrics_path())[0] + "_loss.png"


# ------------------------------------------------------------------------------ engine: ep_moe
@dataclass
class ModelSection(ModelConfig):
    """The model: every `ep_moe.layers.ModelConfig` field (same names, types and defaults), plus the
    expert-parallel size."""

    # Parallelism (not a ModelConfig field): EP groups of this many contiguous ranks.
    expert_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        """No checks here: `validate` checks the recipe and names keys by their dotted path; the
        trainer's `ModelConfig` checks the model again."""

    def model_config_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for `ModelConfig` (everything but the parallel sizes)."""
        kwargs = dataclasses.asdict(self)
        kwargs.pop("expert_model_parallel_size")
        return kwargs


@dataclass
class Recipe(RecipeBase):
    """An ``engine: ep_moe`` recipe: the trainer of this package (`ep_moe.train.loop`). Uses every key."""

    engine: Literal["ep_moe"] = "ep_moe"
    model: ModelSection = field(default_factory=ModelSection)

    def engine_rules(self, world_size: int, device: str | None) -> None:
        m, e = self.model, self.ep_moe
        _require(m.ffn_hidden_size >= 1, "model.ffn_hidden_size", f"must be >= 1, got {m.ffn_hidden_size}")
        if isinstance(m.moe_layer_freq, list):
            _require(len(m.moe_layer_freq) == m.num_layers and set(m.moe_layer_freq) <= {0, 1},
                     "model.moe_layer_freq",
                     f"a list needs one 0/1 flag per layer ({m.num_layers}), got {m.moe_layer_freq}")
        else:
            _require(m.moe_layer_freq >= 1, "model.moe_layer_freq", f"must be >= 1, got {m.moe_layer_freq}")
        _require(e.expert_alignment == 1, "ep_moe.expert_alignment", "the ep_moe engine's experts choose the row "
                 f"alignment themselves; leave it at 1, got {e.expert_alignment}")
        _require(not (self.train.precision == "bf16" and m.params_dtype == "bfloat16"), "train.precision",
                 "bf16 autocast keeps fp32 master weights; leave model.params_dtype at float32")
        t = self.train
        _require(t.zero_stage in (0, 1), "train.zero_stage", f"must be 0 or 1, got {t.zero_stage}")
        _require(t.pp_size in (1, 2), "train.pp_size", f"must be 1 or 2 (a two-stage pipeline), got {t.pp_size}")
        if t.pp_size == 2:
            _require(world_size % 2 == 0, "train.pp_size", f"2 needs an even number of ranks, got {world_size}")
            _require((world_size // 2) % m.expert_model_parallel_size == 0, "model.expert_model_parallel_size",
                     f"must divide the ranks of a pipeline stage ({world_size // 2}) with train.pp_size=2, got "
                     f"{m.expert_model_parallel_size}")
            _require(m.num_layers >= 2, "model.num_layers", f"must be >= 2 with train.pp_size=2, got {m.num_layers}")
            _require(t.zero_stage == 0, "train.zero_stage", "must be 0 with train.pp_size=2")


# ------------------------------------------------------------------------------ engines megatron and deepspeed
@dataclass
class MoELMSection:
    """The model fields of the megatron and deepspeed engines (Megatron ``TransformerConfig`` names): a
    decoder-only LM whose every layer is MoE, plus the expert-parallel size."""

    vocab_size: int = 64
    seq_length: int = 64
    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 2
    moe_ffn_hidden_size: int = 64
    num_moe_experts: int = 4
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.01
    init_method_std: float = 0.02
    expert_model_parallel_size: int = 2


@dataclass
class MegatronModelSection(MoELMSection):
    """``engine: megatron``: a Megatron-core ``GPTModel`` (local layer spec) whose token dispatcher is
    ``ep_moe`` (`EpMoELayer`), ``alltoall`` (Megatron's own; CUDA only) or ``flex_deepep`` (Megatron's
    flex dispatcher on ``ep_moe.compat.deep_ep``)."""

    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    moe_z_loss_coeff: float | None = None
    moe_shared_expert_intermediate_size: int | None = None
    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    moe_token_dispatcher: Literal["ep_moe", "alltoall", "flex_deepep"] = "ep_moe"


@dataclass
class MegatronRecipe(RecipeBase):
    """An ``engine: megatron`` recipe (`ep_moe.train.engines.megatron_engine`). Checkpoints hold each rank's model and
    optimizer ``state_dict`` (they load at the same world and EP size); of the ``ep_moe`` block it uses
    ``dispatcher_backend`` and one ``num_sms``."""

    engine: Literal["megatron"] = "megatron"
    model: MegatronModelSection = field(default_factory=MegatronModelSection)

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "train.pp_size": "its pipeline is Megatron's own", "train.zero_stage": "Megatron's optimizer is its own",
        **{f"ep_moe.{key}": "it uses only ep_moe.dispatcher_backend and ep_moe.num_sms"
           for key in ("tuning_plan", "expert_alignment", "num_worst_tokens", *TUNER_POLICY_KEYS)},
        **{f"ep_moe.{key}": "hybrid mode is the ep_moe engine's (Megatron's dispatcher runs flat over its EP group)"
           for key in ("hybrid_mode", "num_scaleout_ranks")},
    }

    def engine_rules(self, world_size: int, device: str | None) -> None:
        m = self.model
        if m.moe_shared_expert_intermediate_size is not None:
            _require(m.moe_shared_expert_intermediate_size >= 1, "model.moe_shared_expert_intermediate_size",
                     f"must be >= 1 (or null: no shared expert), got {m.moe_shared_expert_intermediate_size}")
        _require(not isinstance(self.ep_moe.num_sms, list), "ep_moe.num_sms",
                 f"engine megatron takes one SM count for all layers, got {self.ep_moe.num_sms}")
        if device == "cpu":
            _require(m.moe_token_dispatcher != "alltoall", "model.moe_token_dispatcher",
                     "Megatron's alltoall dispatcher needs CUDA (use ep_moe)")
            _require(m.position_embedding_type != "rope", "model.position_embedding_type",
                     "Megatron's rope needs CUDA (use learned_absolute)")


@dataclass
class DeepSpeedModelSection(MoELMSection):
    """``engine: deepspeed``: a small LM whose MoE layers are DeepSpeed's ``deepspeed.moe.layer.MoE``
    (``moe_layer: deepspeed``) or ep_moe's drop-in (``moe_layer: ep_moe``), with DeepSpeed ``MoE``
    arguments under Megatron-style names."""

    moe_layer: Literal["ep_moe", "deepspeed"] = "ep_moe"
    moe_drop_tokens: bool = False                 # False: dropless; True: DeepSpeed's capacity semantics
    moe_capacity_factor: float = 1.0
    moe_eval_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_use_rts: bool = True                      # random token selection when dropping
    moe_top2_2nd_expert_sampling: bool = True
    moe_noisy_gate_policy: Literal["None", "Jitter", "RSample"] | None = None


@dataclass
class DeepSpeedSection:
    """``engine: deepspeed`` only: the ZeRO stage of the generated DeepSpeed config, and extra config."""

    zero_stage: Literal[0, 1, 2] = 2
    config: dict[str, Any] = field(default_factory=dict)   # merged over the generated DeepSpeed config


@dataclass
class DeepSpeedRecipe(RecipeBase):
    """An ``engine: deepspeed`` recipe (`ep_moe.train.engines.deepspeed_engine`): DeepSpeed checkpoints (experts in
    per-expert files) in the trainer's folders; of the ``ep_moe`` block it uses ``dispatcher_backend``."""

    engine: Literal["deepspeed"] = "deepspeed"
    model: DeepSpeedModelSection = field(default_factory=DeepSpeedModelSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "train.deterministic": "no deterministic mode",
        "train.pp_size": "no pipeline in this engine", "train.zero_stage": "set deepspeed.zero_stage",
        **{f"ep_moe.{key}": "it uses only ep_moe.dispatcher_backend"
           for key in ("num_sms", "tuning_plan", "expert_alignment", "num_worst_tokens", *TUNER_POLICY_KEYS)},
        **{f"ep_moe.{key}": "hybrid mode is the ep_moe engine's (DeepSpeed's MoE layer runs flat over its EP group)"
           for key in ("hybrid_mode", "num_scaleout_ranks")},
    }

    def engine_rules(self, world_size: int, device: str | None) -> None:
        m = self.model
        _require(m.moe_capacity_factor > 0, "model.moe_capacity_factor", f"must be > 0, got {m.moe_capacity_factor}")
        _require(m.moe_eval_capacity_factor > 0, "model.moe_eval_capacity_factor",
                 f"must be > 0, got {m.moe_eval_capacity_factor}")
        _require(m.moe_min_capacity >= 0, "model.moe_min_capacity", f"must be >= 0, got {m.moe_min_capacity}")


RECIPE_CLASSES: dict[str, type[RecipeBase]] = {"ep_moe": Recipe, "megatron": MegatronRecipe,
                                               "deepspeed": DeepSpeedRecipe}
AnyRecipe = Recipe | MegatronRecipe | DeepSpeedRecipe


# ---------------------------------------------------------------------------------------------- typing
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"a list of {_type_name(item)}"
    if tp is type(None):
        return "null"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """``value`` checked against (and minimally converted to) ``tp``; RecipeError naming ``path``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, path)
            except RecipeError as exc:
                errors.append(exc)
        raise RecipeError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise RecipeError(f"{path}: expected null, got {_describe(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return value
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        raise RecipeError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}"
                          + (f"; did you mean {hint[0]!r}?" if hint else ""))
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise RecipeError(f"{path}: expected {_type_name(tp)}, got {_describe(value)}")
        return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # a free-form mapping (another framework's config): string keys, values as given
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise RecipeError(f"{path}: expected a mapping with string keys, got {_describe(value)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise RecipeError(f"{path}: expected bool (true/false), got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecipeError(f"{path}: expected int, got {_describe(value)}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise RecipeError(f"{path}: expected float, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise RecipeError(f"{path}: expected str, got {_describe(value)}")
    raise TypeError(f"unsupported schema type {tp!r} at {path}")


def _keys(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _unknown_key(path: str, key: str, known: list[str]) -> RecipeError:
    full = f"{path}.{key}" if path else key
    hint = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
    where = f"section '{path}'" if path else "the recipe's top level"
    msg = f"unknown key '{full}'"
    if hint:
        msg += f"; did you mean '{(path + '.') if path else ''}{hint[0]}'?"
    else:
        msg += f" (keys of {where}: {', '.join(known)})"
    return RecipeError(msg)


def build_section(cls: type, data: Any, path: str = "") -> Any:
    """Build the dataclass ``cls`` from a mapping, checking every key and type; errors name the dotted
    ``path`` of the offending key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path or 'recipe'}: expected a mapping, got {_describe(data)}")
    keys = _keys(cls)
    values = {}
    for key, value in data.items():
        if key not in keys:
            raise _unknown_key(path, key, list(keys))
        tp = keys[key]
        sub = f"{path}.{key}" if path else key
        if dataclasses.is_dataclass(tp):
            values[key] = build_section(tp, value, sub)
        else:
            values[key] = _coerce(value, tp, sub)
    return cls(**values)


# ---------------------------------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[str, Any]:
    """``'a.b=VALUE'`` -> ``('a.b', yaml-parsed VALUE)``."""
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. train.train_iters=50")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {text!r}: empty key or key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return key, value


def apply_overrides(data: dict[str, Any], overrides: list[str], *, strict_paths: bool = False) -> dict[str, Any]:
    """Set each dotted ``key=value`` in (a copy of) the raw recipe mapping.

    Missing intermediate mappings are created (the schema check that follows rejects unknown keys);
    a key that runs through a non-mapping value is an error.
    """
    import copy

    data = copy.deepcopy(data)
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(f"override {text!r}: '{'.'.join(parts[:i + 1])}' is "
                                  f"{_describe(child)}, not a section")
            node = child
        node[parts[-1]] = value
    return data


# ---------------------------------------------------------------------------------------------- loading
def read_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise RecipeError(f"recipe {path!r}: no such file (nor a built-in recipe's name: ep-moe recipes lists them)")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise RecipeError(f"recipe {path!r}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path!r}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def engine_of(data: dict[str, Any]) -> str:
    engine = data.get("engine", "ep_moe")
    if engine not in ENGINES:
        hint = difflib.get_close_matches(str(engine), ENGINES, n=1)
        raise RecipeError(f"engine: expected one of {', '.join(map(repr, ENGINES))}, got {engine!r}"
                          + (f"; did you mean {hint[0]!r}?" if hint else ""))
    return engine


def recipe_from_dict(data: dict[str, Any], source_dir: str = ".", name: str = "recipe") -> AnyRecipe:
    """Check a raw mapping against its engine's schema (``engine``, default ``ep_moe``) and rules; return
    that engine's recipe (`Recipe`, `MegatronRecipe` or `DeepSpeedRecipe`)."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: expected a mapping, got {_describe(data)}")
    recipe = build_section(RECIPE_CLASSES[engine_of(data)], data, "")
    recipe.source_dir = os.path.abspath(source_dir)
    recipe.name = name
    validate(recipe)
    return recipe


def load_recipe(path: str, overrides: list[str] | None = None) -> AnyRecipe:
    """The recipe file ``path`` with ``overrides``; a ``path`` that is no file but a built-in recipe's name
    (``tiny-cpu``, see `ep_moe.train.recipes`) loads that recipe."""
    if not os.path.exists(path):
        from .recipes import find_recipe

        path = find_recipe(path) or path
    data = apply_overrides(read_yaml(path), list(overrides or []))
    return recipe_from_dict(data, os.path.dirname(os.path.abspath(path)),
                            os.path.splitext(os.path.basename(path))[0])


# ---------------------------------------------------------------------------------------------- rules
def _require(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise RecipeError(f"{path}: {message}")


def launch_world_size() -> int | None:
    """The world size of the launcher this process runs under (torchrun, or anything that sets ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK``), else None (``ep-moe train`` then spawns ``train.nproc`` ranks itself)."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        try:
            return int(os.environ["WORLD_SIZE"])
        except ValueError:
            raise RecipeError(f"WORLD_SIZE: the launcher's world size must be an int, got "
                              f"{os.environ['WORLD_SIZE']!r}") from None
    return None


def job_world_size(recipe: AnyRecipe) -> int:
    """The ranks of this job: the launcher's world (`launch_world_size`) under a launcher, where
    ``train.nproc`` is no constraint; else ``train.nproc``."""
    world = launch_world_size()
    return recipe.train.nproc if world is None else world


def validate(recipe: AnyRecipe, world_size: int | None = None, device: str | None = None) -> None:
    """Every rule of ``recipe``'s engine: shared keys it does not use left at their defaults, the rules
    shared by all engines, then its own (`RecipeBase.engine_rules`). ``world_size`` defaults to the job's
    (`job_world_size`: the launcher's world under torchrun or srun, else ``train.nproc``); ``device`` (the
    resolved ``cpu``/``cuda``) adds the rules that depend on it."""
    _check_supported(recipe)
    world = job_world_size(recipe) if world_size is None else world_size
    _shared_rules(recipe, world, device)
    recipe.engine_rules(world, device)


def _importable(package: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _check_supported(recipe: AnyRecipe) -> None:
    """A shared key the engine does not use must keep its default (it would be silently ignored)."""
    for path, why in recipe.UNSUPPORTED.items():
        section_name, key = path.split(".")
        section = getattr(recipe, section_name)
        value, default = getattr(section, key), getattr(type(section)(), key)
        _require(value == default, path, f"engine {recipe.engine} does not support it ({why}); leave it at "
                 f"{json.dumps(default)}, got {json.dumps(value)}")


def _shared_rules(recipe: AnyRecipe, world: int, device: str | None) -> None:
    m, t, o, s, d, c, lg, e = (recipe.model, recipe.train, recipe.optimizer, recipe.scheduler, recipe.dataset,
                               recipe.checkpoint, recipe.logger, recipe.ep_moe)
    for path, value, low in [
        ("model.vocab_size", m.vocab_size, 2), ("model.seq_length", m.seq_length, 1),
        ("model.num_layers", m.num_layers, 1), ("model.hidden_size", m.hidden_size, 1),
        ("model.num_attention_heads", m.num_attention_heads, 1),
        ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size, 1), ("model.num_moe_experts", m.num_moe_experts, 1),
        ("model.moe_router_topk", m.moe_router_topk, 1),
        ("model.expert_model_parallel_size", m.expert_model_parallel_size, 1),
        ("train.global_batch_size", t.global_batch_size, 1), ("train.micro_batch_size", t.micro_batch_size, 1),
        ("train.train_iters", t.train_iters, 1), ("train.eval_interval", t.eval_interval, 0),
        ("train.eval_iters", t.eval_iters, 0), ("train.nproc", t.nproc, 1),
        ("scheduler.lr_warmup_iters", s.lr_warmup_iters, 0), ("dataset.num_topics", d.num_topics, 1),
        ("dataset.branching", d.branching, 1), ("checkpoint.save_interval", c.save_interval, 0),
        ("checkpoint.keep_last", c.keep_last, 0), ("logger.log_interval", lg.log_interval, 1),
        ("rng.seed", recipe.rng.seed, 0), ("ep_moe.expert_alignment", e.expert_alignment, 1),
        ("ep_moe.num_worst_tokens", e.num_worst_tokens, 0),
    ]:
        _require(value >= low, path, f"must be >= {low}, got {value}")
    if d.seed is not None:
        _require(d.seed >= 0, "dataset.seed", f"must be >= 0, got {d.seed}")
    _require(m.hidden_size % m.num_attention_heads == 0, "model.hidden_size",
             f"must be divisible by model.num_attention_heads={m.num_attention_heads}, got {m.hidden_size}")
    _require(m.moe_router_topk <= m.num_moe_experts, "model.moe_router_topk",
             f"must be <= model.num_moe_experts={m.num_moe_experts}, got {m.moe_router_topk}")
    ep = m.expert_model_parallel_size
    _require(m.num_moe_experts % ep == 0, "model.expert_model_parallel_size",
             f"must divide model.num_moe_experts={m.num_moe_experts}, got {ep}")
    _require(world % ep == 0, "model.expert_model_parallel_size",
             f"must divide the number of ranks ({world}), got {ep}")
    if e.num_scaleout_ranks is not None:
        _require(e.num_scaleout_ranks >= 1 and ep % e.num_scaleout_ranks == 0, "ep_moe.num_scaleout_ranks",
                 f"must be a positive divisor of model.expert_model_parallel_size={ep}, got {e.num_scaleout_ranks}")
        _require(e.hybrid_mode, "ep_moe.num_scaleout_ranks", "needs ep_moe.hybrid_mode=true")
    dp_ranks = world // t.pp_size if t.pp_size >= 1 and world % t.pp_size == 0 else world  # per pipeline stage
    per_step = t.micro_batch_size * dp_ranks
    _require(t.global_batch_size % per_step == 0, "train.global_batch_size",
             f"must be a multiple of train.micro_batch_size x "
             f"{'ranks' if dp_ranks == world else 'data-parallel ranks (ranks / train.pp_size)'} = "
             f"{t.micro_batch_size} x {dp_ranks} = {per_step}, got {t.global_batch_size}")
    _require(o.lr >= 0, "optimizer.lr", f"must be >= 0, got {o.lr}")
    _require(o.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optimizer.betas",
             f"must be two numbers in [0, 1), got {o.betas}")
    _require(o.eps > 0, "optimizer.eps", f"must be > 0, got {o.eps}")
    _require(o.clip_grad >= 0, "optimizer.clip_grad", f"must be >= 0 (0 = off), got {o.clip_grad}")
    _require(0 <= s.min_lr <= o.lr, "scheduler.min_lr", f"must be in [0, optimizer.lr={o.lr}], got {s.min_lr}")
    if s.lr_decay_iters is not None:
        _require(s.lr_decay_iters >= 1, "scheduler.lr_decay_iters", f"must be >= 1, got {s.lr_decay_iters}")
    _require(d.order in (1, 2), "dataset.order", f"must be 1 or 2, got {d.order}")
    _require(d.concentration > 0, "dataset.concentration", f"must be > 0, got {d.concentration}")
    if d.type == "synthetic":
        body = m.vocab_size - d.num_topics
        _require(body >= 2, "dataset.num_topics",
                 f"must leave >= 2 body tokens in model.vocab_size={m.vocab_size}, got {d.num_topics}")
        _require(d.branching <= body, "dataset.branching",
                 f"must be <= the {body} body tokens (model.vocab_size - dataset.num_topics), got {d.branching}")
    else:
        _require(d.path is not None, "dataset.path", "required when dataset.type is 'text' "
                 "(e.g. dataset.path=../shared/data/shakespeare.txt)")
    _require(len(d.split) == 2 and all(x >= 0 for x in d.split) and d.split[0] > 0, "dataset.split",
             f"must be [train, validation] fractions (>= 0, train > 0), got {d.split}")
    if t.eval_iters > 0 and d.type == "text":
        _require(d.split[1] > 0, "dataset.split", "needs a validation fraction > 0 when train.eval_iters > 0")
    _require(not c.resume or c.save is not None, "checkpoint.resume", "needs checkpoint.save (where to look)")
    if lg.tensorboard_dir is not None and device is not None:  # at launch: before any rank starts
        _require(_importable("tensorboard"), "logger.tensorboard_dir",
                 "needs the tensorboard package, which is not installed; install it with: "
                 "pip install tensorboard (or pip install 'ep_moe[tensorboard]'), or set logger.tensorboard_dir=null")
    if lg.wandb_project is not None and device is not None:
        _require(_importable("wandb"), "logger.wandb_project",
                 "needs the wandb package, which is not installed; install it with: pip install wandb, or set "
                 "logger.wandb_project=null")
    if isinstance(e.num_sms, list):
        _require(all(n >= 0 and n % 2 == 0 for n in e.num_sms), "ep_moe.num_sms",
                 f"must be even numbers >= 0, got {e.num_sms}")
    else:
        _require(e.num_sms >= 0 and e.num_sms % 2 == 0, "ep_moe.num_sms", f"must be even and >= 0, got {e.num_sms}")


def dump_yaml(recipe: AnyRecipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)
