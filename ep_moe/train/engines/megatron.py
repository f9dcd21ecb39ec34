"""``engine: megatron`` recipes: a Megatron-core ``GPTModel`` trained with ep_moe as its token dispatcher.

The recipe is a `MegatronRecipe` (`ep_moe.train.config`); ``ep-moe train recipes/megatron-gpt-moe-ep2.yaml
[key=value ...]`` parses and checks it, then calls `train`. The model is Megatron's ``GPTModel`` from the
local layer spec (no TransformerEngine): every layer is an MoE layer (SequentialMLP experts,
`PortableTopKRouter`), attention is `SdpaCoreAttention` (torch's ``scaled_dot_product_attention``;
Megatron's ``DotProductAttention`` needs CUDA). ``model.moe_token_dispatcher`` picks the dispatcher:
``ep_moe`` (`EpMoELayer`), ``alltoall`` (Megatron's own; CUDA only), or ``flex_deepep`` (Megatron's flex
dispatcher on ``ep_moe.compat.deep_ep``).

Ranks: `ep_moe.distributed.launch` (``train.nproc`` spawned ranks, gloo on CPU, NCCL with one GPU per rank;
or the ``torchrun`` job). Data parallel over all ranks, expert parallel over groups of
``model.expert_model_parallel_size``; dense gradients are averaged over the world, expert gradients summed
over the expert-data-parallel group and divided by the world size (what Megatron's DDP does), clipped by
the global norm, then AdamW with the trainer's learning-rate schedule (`ep_moe.train.schedule`).
Initialisation is independent of the dispatcher and of the EP size (every expert's weights come from
``(seed, layer, expert)``), so runs that differ only in the dispatcher start identical. Data: the trainer's
datasets (`ep_moe.train.data`), so the synthetic corpus' entropy floor is known. Outputs (rank 0):
``<checkpoint.save or runs/<recipe name>>/metrics.jsonl`` and, with ``checkpoint.save``, each rank's final
``state_dict`` (no resume).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ep_moe.train.config import MegatronRecipe, RecipeError, validate


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


def train_rank(recipe: MegatronRecipe, device: torch.device) -> dict[str, Any]:
    """Train on this rank of an initialised process group; returns the run's summary (same on all ranks)."""
    _quiet_megatron()
    from megatron.core import parallel_state

    from ep_moe.integrations.megatron import destroy_ep_buffers
    from ep_moe.train.data import build_dataset, rank_slice
    from ep_moe.train.schedule import recipe_lr

    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    m, t, o = recipe.model, recipe.train, recipe.optimizer
    validate(recipe, world, device.type)
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
    dataset = build_dataset(recipe)
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
            group["lr"] = recipe_lr(recipe, step)
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


def _rank(rank: int, world_size: int, recipe: MegatronRecipe, device_type: str) -> dict[str, Any]:
    """One rank of the job (module level so that spawn can import it)."""
    from ep_moe.train.launch import rank_device

    return train_rank(recipe, rank_device(device_type))


def run(recipe: MegatronRecipe, device_type: str) -> list[dict[str, Any]]:
    """Train ``recipe`` on ``device_type`` (``cpu``/``cuda``; see `ep_moe.train.launch.prepare`): every rank's
    summary (under ``torchrun``, this process's only). Each rank checks the recipe against its group."""
    from ep_moe.distributed import launch

    return launch(_rank, recipe.train.nproc, recipe, device_type, device_type=device_type,
                  timeout_s=recipe.train.timeout_s)


def train(recipe: MegatronRecipe, device_type: str) -> int:
    """The trainer's entry point for ``engine: megatron`` (rank 0 prints the summary); exit status 0."""
    from ep_moe.train.launch import require_package

    require_package("megatron", "megatron.core", "pip install 'ep_moe[megatron]'")
    run(recipe, device_type)
    return 0
