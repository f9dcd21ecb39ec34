"""``engine: megatron`` recipes: a Megatron-core ``GPTModel`` trained with ep_moe as its token dispatcher.

``ep-moe train recipes/megatron-gpt-moe-ep2.yaml [key=value ...]`` applies the overrides to the YAML and
calls `train`. The model is Megatron's ``GPTModel`` from the local layer spec (no TransformerEngine):
every layer is an MoE layer (SequentialMLP experts, `PortableTopKRouter`), attention is
`SdpaCoreAttention` (torch's ``scaled_dot_product_attention``; Megatron's ``DotProductAttention`` needs
CUDA). ``model.moe_token_dispatcher`` picks the dispatcher: ``ep_moe`` (`EpMoELayer`), ``alltoall``
(Megatron's own; CUDA only), or ``flex_deepep`` (Megatron's flex dispatcher on ``ep_moe.compat.deep_ep``).

Ranks: spawned (``train.nproc``; gloo on CPU, NCCL with one GPU per rank) or the ``torchrun``
environment. Data parallel over all ranks, expert parallel over groups of
``model.expert_model_parallel_size``; dense gradients are averaged over the world, expert gradients summed
over the expert-data-parallel group and divided by the world size (what Megatron's DDP does), clipped by
the global norm, then AdamW. Initialisation is independent of the dispatcher and of the EP size (every
expert's weights come from ``(seed, layer, expert)``), so runs that differ only in the dispatcher start
identical. Data: the trainer's datasets (`ep_moe.train.data`), so the synthetic corpus' entropy floor is
known. Outputs (rank 0): ``<checkpoint.save or runs/<name>>/metrics.jsonl`` and, with ``checkpoint.save``,
each rank's final ``state_dict`` (no resume).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from ep_moe.train.config import (
    DatasetSection,
    EpMoeSection,
    LoggerSection,
    OptimizerSection,
    OutputPaths,
    RecipeError,
    RngSection,
    SchedulerSection,
    TrainSection,
    build_section,
)

DISPATCHERS = ("ep_moe", "alltoall", "flex_deepep")


# ------------------------------------------------------------------------------------------ schema
@dataclass
class MegatronModelSection:
    """A Megatron ``TransformerConfig`` subset (all layers MoE) plus the expert-parallel size."""

    vocab_size: int = 64
    seq_length: int = 64
    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 2
    moe_ffn_hidden_size: int = 64
    num_moe_experts: int = 4
    moe_router_topk: int = 2
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float | None = None
    moe_shared_expert_intermediate_size: int | None = None
    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    init_method_std: float = 0.02
    expert_model_parallel_size: int = 2
    moe_token_dispatcher: Literal["ep_moe", "alltoall", "flex_deepep"] = "ep_moe"


@dataclass
class MegatronCheckpointSection:
    save: str | None = None  # output folder; with it, each rank's final state_dict is saved there


@dataclass
class MegatronRecipe(OutputPaths):
    engine: Literal["megatron"] = "megatron"
    model: MegatronModelSection = field(default_factory=MegatronModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    dataset: DatasetSection = field(default_factory=DatasetSection)
    checkpoint: MegatronCheckpointSection = field(default_factory=MegatronCheckpointSection)
    logger: LoggerSection = field(default_factory=LoggerSection)
    rng: RngSection = field(default_factory=RngSection)
    ep_moe: EpMoeSection = field(default_factory=EpMoeSection)
    name: str = field(default="megatron", metadata={"internal": True})

    def resolve_path(self, path: str) -> str:
        """An input path of the recipe (``dataset.path``): user-expanded, relative to the working folder."""
        return os.path.abspath(os.path.expanduser(path))


def parse_recipe(data: dict[str, Any], name: str = "megatron") -> MegatronRecipe:
    """Check a raw ``engine: megatron`` mapping (overrides applied); raise `RecipeError` naming the key."""
    data = {k: v for k, v in data.items() if k != "name"}
    recipe = build_section(MegatronRecipe, data, "")
    recipe.name = name
    m, t = recipe.model, recipe.train
    if m.num_moe_experts % m.expert_model_parallel_size:
        raise RecipeError(f"model.num_moe_experts: {m.num_moe_experts} is not divisible by "
                          f"model.expert_model_parallel_size={m.expert_model_parallel_size}")
    if m.hidden_size % m.num_attention_heads:
        raise RecipeError(f"model.hidden_size: {m.hidden_size} is not divisible by model.num_attention_heads")
    if not 1 <= m.moe_router_topk <= m.num_moe_experts:
        raise RecipeError(f"model.moe_router_topk: expected 1..{m.num_moe_experts}, got {m.moe_router_topk}")
    if t.global_batch_size % t.micro_batch_size:
        raise RecipeError("train.global_batch_size: must be a multiple of train.micro_batch_size")
    if recipe.ep_moe.num_worst_tokens or recipe.ep_moe.tuning_plan or recipe.ep_moe.expert_alignment != 1:
        raise RecipeError("ep_moe: engine megatron uses only ep_moe.dispatcher_backend and ep_moe.num_sms")
    if isinstance(recipe.ep_moe.num_sms, list):
        raise RecipeError("ep_moe.num_sms: engine megatron takes one SM count for all layers")
    return recipe


def _check_world(recipe: MegatronRecipe, world: int, device: str) -> None:
    m, t = recipe.model, recipe.train
    if world % m.expert_model_parallel_size:
        raise RecipeError(f"model.expert_model_parallel_size: {m.expert_model_parallel_size} does not divide the "
                          f"{world} ranks")
    if t.global_batch_size % (t.micro_batch_size * world):
        raise RecipeError(f"train.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size "
                          f"x ranks = {t.micro_batch_size * world}")
    if device == "cpu" and m.moe_token_dispatcher == "alltoall":
        raise RecipeError("model.moe_token_dispatcher: Megatron's alltoall dispatcher needs CUDA (use ep_moe)")
    if device == "cpu" and m.position_embedding_type == "rope":
        raise RecipeError("model.position_embedding_type: Megatron's rope needs CUDA (use learned_absolute)")


# ------------------------------------------------------------------------------------------ model
class SdpaCoreAttention(torch.nn.Module):
    """Megatron core attention (the ``core_attention`` of a layer spec) over torch's
    ``scaled_dot_product_attention``, causal. ``query [Sq, B, Nh, D]``, ``key``/``value [Sk, B, Ng, D]``
    -> ``[Sq, B, Nh * D]``. Dropout follows ``config.attention_dropout`` in training."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **_: Any) -> None:
        super().__init__()
        self.config = config
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaCoreAttention: packed sequences and attention bias are not supported")
        groups = query.shape[2] // key.shape[2]
        if groups > 1:  # grouped-query attention
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, N, S, D]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _layer_spec(recipe: MegatronRecipe):
    """The GPT layer spec: local (no TransformerEngine), SDPA attention, portable router, our dispatcher."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ep_moe.integrations.megatron import ep_moe_spec, with_portable_router

    m = recipe.model
    spec = get_gpt_layer_local_spec(num_experts=m.num_moe_experts, moe_grouped_gemm=False,
                                    normalization=m.normalization)
    spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    if m.moe_token_dispatcher == "ep_moe":
        num_sms = recipe.ep_moe.num_sms if isinstance(recipe.ep_moe.num_sms, int) else 0
        return ep_moe_spec(spec, recipe.ep_moe.dispatcher_backend, num_sms=num_sms, portable_router=True)
    return with_portable_router(spec)  # the same gating GEMM whichever dispatcher runs


def _transformer_config(recipe: MegatronRecipe, device: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ep_moe.integrations.megatron import flex_deepep_config

    m = recipe.model
    kwargs: dict[str, Any] = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.moe_ffn_hidden_size, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        num_moe_experts=m.num_moe_experts, moe_router_topk=m.moe_router_topk,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff if m.moe_router_load_balancing_type != "none" else 0.0,
        moe_z_loss_coeff=m.moe_z_loss_coeff, moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
        expert_model_parallel_size=m.expert_model_parallel_size, normalization=m.normalization,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=m.init_method_std,
        use_cpu_initialization=True, params_dtype=torch.float32, perform_initialization=True)
    if m.moe_token_dispatcher == "flex_deepep":
        kwargs.update(flex_deepep_config())
    return TransformerConfig(**kwargs)


def _init_experts(model: torch.nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Every expert's weights from ``(seed, layer, global expert id)``: the same whatever the EP size and
    dispatcher (Megatron's CPU initialisation would give every rank's local experts the same values)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    out_std = std / math.sqrt(2.0 * num_layers)  # Megatron's scaled init of output projections
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        for i, expert in enumerate(layer.experts.local_experts):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + layer.layer_number * 1_009
                                                + layer.local_expert_indices[i])
            with torch.no_grad():
                w1, w2 = expert.linear_fc1.weight, expert.linear_fc2.weight
                w1.copy_(torch.randn(w1.shape, generator=gen) * std)
                w2.copy_(torch.randn(w2.shape, generator=gen) * out_std)


def build_model(recipe: MegatronRecipe, device: torch.device):
    """The ``GPTModel`` on ``device`` (Megatron's parallel state must be initialised)."""
    from megatron.core.models.gpt import GPTModel

    if recipe.model.moe_token_dispatcher == "flex_deepep":
        import ep_moe.compat.deep_ep as compat

        compat.install()
    torch.manual_seed(recipe.rng.seed)  # dense parameters: the same on every rank
    m = recipe.model
    model = GPTModel(config=_transformer_config(recipe, device.type), transformer_layer_spec=_layer_spec(recipe),
                     vocab_size=m.vocab_size, max_sequence_length=m.seq_length,
                     position_embedding_type=m.position_embedding_type, share_embeddings_and_output_weights=False)
    from ep_moe.integrations.megatron import use_portable_routers

    use_portable_routers(model)  # megatron-core < 0.16 cannot take the router from the spec
    _init_experts(model, recipe.rng.seed, m.init_method_std, m.num_layers)
    return model.to(device)


# ------------------------------------------------------------------------------------------ one rank
def _is_expert(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)  # Megatron marks expert parameters allreduce=False


def _sum_grads(params: list[torch.nn.Parameter], group, scale: float) -> None:
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def _dataset(recipe: MegatronRecipe):
    """The trainer's dataset for this recipe (``dataset.seed``, else ``rng.seed``)."""
    from ep_moe.train.data import build_dataset

    if recipe.dataset.type == "text" and not recipe.dataset.path:
        raise RecipeError("dataset.path: required for dataset.type=text")
    try:
        return build_dataset(recipe)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def train_rank(recipe: MegatronRecipe, device: torch.device) -> dict[str, Any]:
    """Train on this rank of an initialised process group; returns the run's summary (same on all ranks)."""
    _quiet_megatron()
    from megatron.core import parallel_state

    from ep_moe.integrations.megatron import destroy_ep_buffers
    from ep_moe.train.data import rank_slice
    from ep_moe.train.schedule import lr_at

    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    m, t, o, s = recipe.model, recipe.train, recipe.optimizer, recipe.scheduler
    _check_world(recipe, world, device.type)
    if device.type == "cpu":
        # Megatron wraps parts of its MoE code in torch.compile; on CPU that means C++ builds per shape.
        importlib.import_module("torch._dynamo").config.disable = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=m.expert_model_parallel_size)
    elif parallel_state.get_expert_model_parallel_world_size() != m.expert_model_parallel_size:
        raise RecipeError("model.expert_model_parallel_size: Megatron's parallel state is already initialised "
                          "with another expert-parallel size")
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(recipe.rng.seed)
    if t.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    dataset = _dataset(recipe)
    model = build_model(recipe, device)
    params = [p for p in model.parameters() if p.requires_grad]
    dense = [p for p in params if not _is_expert(p)]
    experts = [p for p in params if _is_expert(p)]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    accum = t.global_batch_size // (t.micro_batch_size * world)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / accum, device=device))
    expert_dp_group = parallel_state.get_expert_data_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    positions = torch.arange(m.seq_length, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and t.precision == "bf16")
    decay_iters = s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters

    def batch_loss(tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with autocast:
            per_token = model(inputs, positions.expand_as(inputs), None, labels=labels)
        return per_token.float().mean()

    def evaluate() -> float:
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=device)
        with torch.no_grad():
            for i in range(t.eval_iters):
                batch = dataset.batch("valid", i, t.global_batch_size)
                for micro in range(accum):
                    total += batch_loss(rank_slice(batch, rank, world, t.micro_batch_size, micro)).double()
        dist.all_reduce(total)
        model.train()
        return float(total) / (t.eval_iters * accum * world)

    metrics = None
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(recipe.metrics_path())), exist_ok=True)
        metrics = open(recipe.metrics_path(), "w", encoding="utf-8")
        floor = getattr(dataset, "entropy_floor", None)
        print(f"megatron-core GPTModel, {m.num_layers} MoE layers x {m.num_moe_experts} experts (top-"
              f"{m.moe_router_topk}), dispatcher {m.moe_token_dispatcher}, {world} ranks on {device.type}, "
              f"EP {m.expert_model_parallel_size}; {dataset.describe()}", flush=True)
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    model.train()
    train_started = time.perf_counter()
    for step in range(t.train_iters):
        step_started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, o.lr, s.min_lr, s.lr_warmup_iters, decay_iters, s.lr_decay_style)
        batch = dataset.batch("train", step, t.global_batch_size)
        step_loss = torch.zeros((), dtype=torch.float64, device=device)
        for micro in range(accum):
            loss = batch_loss(rank_slice(batch, rank, world, t.micro_batch_size, micro))
            (loss / accum).backward()
            step_loss += loss.detach().double()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _sum_grads(dense, None, 1.0 / world)
        _sum_grads(experts, expert_dp_group, 1.0 / world)
        dense_sq = sum((p.grad.float() ** 2).sum() for p in dense) if dense else torch.zeros((), device=device)
        expert_sq = sum((p.grad.float() ** 2).sum() for p in experts) if experts else torch.zeros((), device=device)
        expert_sq = expert_sq.clone()
        dist.all_reduce(expert_sq, group=ep_group)
        grad_norm = float((dense_sq + expert_sq).sqrt())
        if o.clip_grad > 0 and grad_norm > o.clip_grad:
            for p in params:
                p.grad.mul_(o.clip_grad / (grad_norm + 1e-6))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss)
        losses.append(float(step_loss) / (accum * world))
        last = step + 1 == t.train_iters
        if t.eval_iters and ((t.eval_interval and (step + 1) % t.eval_interval == 0) or last):
            evals.append((step + 1, evaluate()))
        if metrics is not None:
            record = {"step": step + 1, "loss": losses[-1], "lr": optimizer.param_groups[0]["lr"],
                      "grad_norm": grad_norm,
                      "tokens_per_s": t.global_batch_size * m.seq_length / (time.perf_counter() - step_started)}
            if evals and evals[-1][0] == step + 1:
                record["eval_loss"] = evals[-1][1]
            metrics.write(json.dumps(record) + "\n")
            if (step + 1) % max(1, recipe.logger.log_interval) == 0 or last:
                print(f"step {step + 1}/{t.train_iters} loss {losses[-1]:.4f} grad_norm {grad_norm:.3f}"
                      + (f" eval {evals[-1][1]:.4f}" if evals and evals[-1][0] == step + 1 else ""), flush=True)
    train_time = time.perf_counter() - train_started
    if recipe.checkpoint.save:
        folder = os.path.join(recipe.checkpoint.save, f"iter_{t.train_iters:07d}")
        os.makedirs(folder, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(folder, f"rank_{rank:03d}.pt"))
    floor = getattr(dataset, "entropy_floor", None)
    summary = {"losses": losses, "evals": evals, "final_loss": losses[-1] if losses else float("nan"),
               "eval_loss": evals[-1][1] if evals else None, "entropy_floor": floor,
               "tokens_per_s": t.train_iters * t.global_batch_size * m.seq_length / max(train_time, 1e-9),
               "train_time_s": train_time, "total_time_s": time.perf_counter() - started,
               "dispatcher": m.moe_token_dispatcher, "device": device.type, "world": world}
    if metrics is not None:
        metrics.close()
        gap = None if floor is None else (summary["eval_loss"] or summary["final_loss"]) - floor
        target = t.target_loss_gap
        print(f"done: {t.train_iters} steps, final train loss {summary['final_loss']:.4f}"
              + (f", eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else "")
              + (f", entropy floor {floor:.4f} (gap {gap:+.4f}"
                 + (f", target <= {target:.2f}: {'met' if gap <= target else 'NOT met'}" if target else "") + ")"
                 if floor is not None else "")
              + f", {summary['tokens_per_s']:,.0f} tokens/s, train {train_time:.1f} s", flush=True)
    destroy_ep_buffers()
    return summary


# ------------------------------------------------------------------------------------------ entry points
def _quiet_megatron() -> None:
    """Megatron warns at import that TransformerEngine/Apex are missing (by design here)."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


def _spawned(rank: int, world: int, data: dict, name: str, device: str) -> dict[str, Any]:
    _quiet_megatron()
    recipe = parse_recipe(data, name)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return train_rank(recipe, dev)


def run(data: dict[str, Any], name: str = "megatron") -> list[dict[str, Any]] | dict[str, Any]:
    """Train a raw recipe mapping: under ``torchrun`` this process's summary, else every spawned rank's."""
    from ep_moe.train.launch import resolve_device

    recipe = parse_recipe(data, name)
    env = [os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")]
    if all(v is not None for v in env):
        rank, world, local_rank = (int(v) for v in env)
        device = resolve_device(recipe.train.device, world, True)
        _check_world(recipe, world, device)
        timeout = datetime.timedelta(seconds=recipe.train.timeout_s)
        if device == "cuda":
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                    device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        try:
            return train_rank(recipe, torch.device(device, local_rank) if device == "cuda" else torch.device("cpu"))
        finally:
            dist.destroy_process_group()
    from ep_moe.distributed import run_distributed

    device = resolve_device(recipe.train.device, recipe.train.nproc, False)
    _check_world(recipe, recipe.train.nproc, device)
    return run_distributed(_spawned, recipe.train.nproc, dataclasses.asdict(recipe), name, device,
                           backend="nccl" if device == "cuda" else "gloo", timeout_s=recipe.train.timeout_s,
                           join_timeout_s=7 * 24 * 3600.0)


def train(recipe: dict[str, Any]) -> int:
    """The trainer's entry point for ``engine: megatron``: train the raw recipe mapping; exit status."""
    name = recipe.get("name", "megatron") if isinstance(recipe.get("name"), str) else "megatron"
    run(recipe, name)
    return 0
