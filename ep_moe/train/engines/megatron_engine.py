"""``engine: megatron`` recipes: a Megatron-core ``GPTModel`` trained with ep_moe as its token dispatcher.

The recipe is a `MegatronRecipe` (`ep_moe.train.recipe_schema`); ``ep-moe train recipes/megatron-gpt-moe-ep2.yaml
[key=value ...]`` parses and checks it, then calls `train`. The model is Megatron's ``GPTModel`` from the local
layer spec (no TransformerEngine): every layer is an MoE layer (SequentialMLP experts, `PortableTopKRouter`), and
attention is `SdpaCoreAttention` (torch's ``scaled_dot_product_attention``). ``model.moe_token_dispatcher`` picks
the dispatcher: ``ep_moe`` (`EpMoELayer`), ``alltoall`` (Megatron's own, CUDA only) or ``flex_deepep`` (Megatron's
flex dispatcher on ``ep_moe.compat.deep_ep``).

Ranks start through `ep_moe.distributed.launch`. Data parallel runs over all ranks, expert parallel over groups of
``model.expert_model_parallel_size``, with Megatron DDP's gradient reduction, the global-norm clip and AdamW on
the trainer's schedule (`ep_moe.train.schedule`). Every expert's initial weights come from ``(seed, layer,
expert)``, so runs that differ only in the dispatcher start identical. Data: the trainer's datasets
(`ep_moe.train.data`).

Progress lines, metrics, TensorBoard scalars, the loss plot, the summary, exit statuses, ``--resume`` and Ctrl-C
are the trainer's. A checkpoint ``<checkpoint.save>/step_<NNNNNNN>/`` holds one file per rank (model and
optimizer ``state_dict``) and loads at the same world and EP size.

The full description: docs/training.md, section "Megatron-core", subsection "`engine: megatron`".
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

from ep_moe.train.recipe_schema import MegatronRecipe, RecipeError, validate


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
                w1.copy_(torch.randn(w1.shape, generator=gen, dtype=torch.float32, device="cpu") * std)
                w2.copy_(torch.randn(w2.shape, generator=gen, dtype=torch.float32, device="cpu") * out_std)


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


class _RoutingCounts:
    """Tokens per expert of every MoE layer's router since the last `take` (forward hooks on the routers:
    Megatron's ``TopKRouter.forward`` returns ``(probs, routing_map [tokens, experts])``)."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        self.counts: list[torch.Tensor | None] = [None] * len(self.layers)
        self.handles = [layer.router.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)]

    def _hook(self, i: int):
        def hook(module, args, output) -> None:
            routing_map = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if routing_map is None or routing_map.dim() != 2:
                return
            counts = routing_map.detach().sum(dim=0).to(torch.float64)
            self.counts[i] = counts if self.counts[i] is None else self.counts[i] + counts
        return hook

    def take(self) -> torch.Tensor | None:
        """``[MoE layers, experts]`` counts on this rank (None when a layer saw nothing); resets them."""
        counts, self.counts = self.counts, [None] * len(self.layers)
        if not counts or any(c is None for c in counts):
            return None
        return torch.stack(counts)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _router_losses() -> dict[str, torch.Tensor]:
    """Megatron's per-layer router loss tracker (raw losses, without coefficients, summed over the forwards
    since the last call) by name, as CPU float64 tensors; cleared. Empty where this megatron-core has none."""
    try:
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )
    except ImportError:
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    out = {name: entry["values"].detach().to("cpu", torch.float64).clone() for name, entry in tracker.items()
           if isinstance(entry, dict) and isinstance(entry.get("values"), torch.Tensor)}
    clear_aux_losses_tracker()
    return out


# ------------------------------------------------------------------------------------------ checkpoints
TRAINER_FILE = "trainer.json"  # step, world and EP size, the recipe (rank 0); beside one file per rank


def _rank_file(rank: int) -> str:
    return f"rank_{rank:03d}.pt"


def _is_megatron_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRAINER_FILE))


def find_checkpoint(recipe: MegatronRecipe) -> str | None:
    """``checkpoint.resume``: the latest checkpoint in ``checkpoint.save`` (if any); else ``checkpoint.load``
    (a checkpoint folder, or a save folder: its latest); else None."""
    from ep_moe.train import checkpoint as ckpt

    c = recipe.checkpoint
    return ckpt.find_engine_checkpoint(c.save, c.load, c.resume, _is_megatron_checkpoint,
                                       f"a megatron engine checkpoint folder (with {TRAINER_FILE})")


def save_checkpoint(recipe: MegatronRecipe, model, optimizer, step: int, rank: int, world: int) -> str:
    """Save step ``step`` into ``<checkpoint.save>/step_<NNNNNNN>/`` (collective): every rank its model and
    optimizer ``state_dict`` and RNG state, rank 0 `TRAINER_FILE`; written into a temporary folder that is
    renamed, then ``latest`` is pointed at it and ``checkpoint.keep_last`` applied."""
    import shutil

    from ep_moe.train import checkpoint as ckpt

    save_dir, name = recipe.checkpoint.save, ckpt.step_dir_name(step)
    final, tmp = os.path.join(save_dir, name), os.path.join(save_dir, f".tmp_{name}")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng, "step": step},
               os.path.join(tmp, _rank_file(rank)))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, TRAINER_FILE), "w", encoding="utf-8") as f:
            json.dump({"engine": "megatron", "step": step, "world_size": world,
                       "ep_size": recipe.model.expert_model_parallel_size,
                       "consumed_samples": step * recipe.train.global_batch_size, "recipe": recipe.to_dict(),
                       "saved_at": time.time()}, f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        ckpt.write_latest(save_dir, name)
        ckpt.prune(save_dir, step, recipe.checkpoint.keep_last)
    dist.barrier()
    return final


def load_checkpoint(path: str, recipe: MegatronRecipe, model, optimizer, rank: int, world: int) -> int:
    """Load this rank's part of a checkpoint saved by `save_checkpoint` at the same world and EP size;
    returns its step."""
    with open(os.path.join(path, TRAINER_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    ep = recipe.model.expert_model_parallel_size
    if (meta["world_size"], meta["ep_size"]) != (world, ep):
        raise ValueError(f"checkpoint {path!r}: saved by {meta['world_size']} ranks at EP {meta['ep_size']}; the "
                         f"megatron engine loads its checkpoints at the same world and EP size only (this run: "
                         f"{world} ranks, EP {ep}); the ep_moe engine's checkpoints load at any EP size")
    state = torch.load(os.path.join(path, _rank_file(rank)), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return int(meta["step"])


# ------------------------------------------------------------------------------------------ one rank
class MegatronSteps:
    """This engine's steps for the trainer's shared loop (`ep_moe.train.loop.run_training`): the model, its
    optimizer, the data, and one optimizer step as Megatron's DDP would take it (see the module docstring).
    Collective to build: every rank of an initialised process group."""

    def __init__(self, recipe: MegatronRecipe, device: torch.device) -> None:
        _quiet_megatron()
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        from ep_moe.train.data import build_dataset

        self.recipe, self.device = recipe, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        m, t, o = recipe.model, recipe.train, recipe.optimizer
        self.ep_size = m.expert_model_parallel_size
        validate(recipe, self.world_size, device.type)
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
        self.dataset = build_dataset(recipe)
        self.model = model = build_model(recipe, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.dense = [p for p in self.params if not _is_expert(p)]
        self.experts = [p for p in self.params if _is_expert(p)]
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in self.params if p.dim() >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        self.accum = t.global_batch_size // (t.micro_batch_size * self.world_size)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / self.accum, dtype=torch.float32, device=device))
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.positions = torch.arange(m.seq_length, device=device)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16,
                                       enabled=device.type == "cuda" and t.precision == "bf16")
        self.counts = _RoutingCounts(model)
        self.coeff = m.moe_aux_loss_coeff if m.moe_router_load_balancing_type != "none" else 0.0
        model.train()

    def _batch_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with self.autocast:
            per_token = self.model(inputs, self.positions.expand_as(inputs), None, labels=labels)
        return per_token.float().mean()

    def find_checkpoint(self) -> str | None:
        return find_checkpoint(self.recipe)

    def load(self, path: str) -> int:
        return load_checkpoint(path, self.recipe, self.model, self.optimizer, self.rank, self.world_size)

    def opening_lines(self) -> list[str]:
        from ep_moe.train.loop import batch_line

        m = self.recipe.model
        return [f"ep-moe train (engine megatron): megatron-core GPTModel, {m.num_layers} MoE layers x "
                f"{m.num_moe_experts} experts (top-{m.moe_router_topk}), dispatcher {m.moe_token_dispatcher}, "
                f"{self.world_size} rank(s) on {self.device.type}, EP {m.expert_model_parallel_size}, "
                f"{batch_line(self.recipe, self.accum, self.dataset)}",
                f"metrics: {self.recipe.metrics_path()}"]

    def title(self) -> str:
        m = self.recipe.model
        return f"{self.recipe.name}: megatron, dispatcher {m.moe_token_dispatcher}, EP {m.expert_model_parallel_size}"

    def begin(self, step: int) -> tuple[float, torch.Tensor]:
        from ep_moe.train.schedule import begin_step

        _router_losses()  # only this step's training forwards count
        self.counts.take()
        return begin_step(self.recipe, self.optimizer, self.dataset, step)

    def step(self, batch: torch.Tensor, stop_requested: bool):
        from ep_moe.train.data import rank_slice
        from ep_moe.train.loop import StepOutcome
        from ep_moe.train.metrics import imbalance_stats

        m, t, o, device = self.recipe.model, self.recipe.train, self.recipe.optimizer, self.device
        accum, world = self.accum, self.world_size
        step_loss = torch.zeros((), dtype=torch.float64, device=device)
        for micro in range(accum):
            loss = self._batch_loss(rank_slice(batch, self.rank, world, t.micro_batch_size, micro))
            (loss / accum).backward()
            step_loss += loss.detach().double()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _sum_grads(self.dense, None, 1.0 / world)
        _sum_grads(self.experts, self.expert_dp_group, 1.0 / world)
        zero = torch.zeros((), dtype=torch.float32, device=device)
        dense_sq = sum((p.grad.float() ** 2).sum() for p in self.dense) if self.dense else zero
        expert_sq = sum((p.grad.float() ** 2).sum() for p in self.experts) if self.experts else zero
        expert_sq = expert_sq.clone()
        dist.all_reduce(expert_sq, group=self.ep_group)
        grad_norm = float((dense_sq + expert_sq).sqrt())
        if o.clip_grad > 0 and grad_norm > o.clip_grad:
            for p in self.params:
                p.grad.mul_(o.clip_grad / (grad_norm + 1e-6))
        self.optimizer.step()
        # Router losses (raw, mean over micro-batches and MoE layers), this step's loss and the stop flag: one
        # all-reduce over the world.
        router = _router_losses()
        no_loss = torch.zeros(m.num_layers, dtype=torch.float64, device="cpu")
        aux_raw = sum((v for k, v in router.items() if "load_balancing_loss" in k), no_loss)
        z_raw = router.get("z_loss", no_loss)
        stop = torch.tensor([1.0 if stop_requested else 0.0], dtype=torch.float64, device="cpu")
        reduced = torch.cat([step_loss.view(1).cpu(), aux_raw / accum, z_raw / accum, stop]).to(device)
        dist.all_reduce(reduced)
        reduced = reduced.cpu()
        aux_layers = reduced[1:1 + m.num_layers] / world
        z_layers = reduced[1 + m.num_layers:1 + 2 * m.num_layers] / world
        layer_counts = self.counts.take()
        stats: dict[str, Any] = {}
        if layer_counts is not None:
            summed = layer_counts.to(device)
            dist.all_reduce(summed, group=self.ep_group)
            stats = imbalance_stats(summed.cpu())
        if router:
            stats.update(aux_loss=float(aux_layers.mean()), z_loss=float(z_layers.mean()) if "z_loss" in router
                         else None)
        return StepOutcome(loss=float(reduced[0]) / (accum * world),
                           aux_loss=self.coeff * float(aux_layers.sum()) if router else None,
                           grad_norm=grad_norm, stats=stats, stop=bool(reduced[-1] > 0))

    def evaluate(self) -> float:
        from ep_moe.train.data import rank_slice

        t = self.recipe.train
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for i in range(t.eval_iters):
                batch = self.dataset.batch("valid", i, t.global_batch_size)
                for micro in range(self.accum):
                    tokens = rank_slice(batch, self.rank, self.world_size, t.micro_batch_size, micro)
                    total += self._batch_loss(tokens).double()
        dist.all_reduce(total)
        self.model.train()
        return float(total) / (t.eval_iters * self.accum * self.world_size)

    def save(self, step: int) -> str:
        return save_checkpoint(self.recipe, self.model, self.optimizer, step, self.rank, self.world_size)

    def close(self) -> None:
        from ep_moe.integrations.megatron import destroy_ep_buffers

        self.counts.remove()
        destroy_ep_buffers()


def train_rank(recipe: MegatronRecipe, device: torch.device) -> dict[str, Any]:
    """Train on this rank of an initialised process group; returns the run's summary (same on all ranks but
    ``exit_code``, which rank 0 decides). The loop (progress lines, metrics records, TensorBoard scalars,
    checkpoints, resume, Ctrl-C, the loss plot and the summary) is the trainer's own
    (`ep_moe.train.loop.run_training`); `MegatronSteps` provides the steps."""
    from ep_moe.train.loop import run_training

    started = time.monotonic()
    steps = MegatronSteps(recipe, device)
    try:
        result = run_training(recipe, steps, started)
    finally:
        steps.close()
    return {"losses": result.losses, "evals": result.evals, "final_loss": result.final_loss,
            "eval_loss": result.eval_loss, "entropy_floor": result.entropy_floor, "tokens_per_s": result.tokens_per_s,
            "train_time_s": result.train_time_s, "total_time_s": result.total_time_s,
            "dispatcher": recipe.model.moe_token_dispatcher, "device": device.type, "world": steps.world_size,
            "exit_code": result.exit_code, "last_step": result.last_step, "checkpoint": result.checkpoint}


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
                  timeout_s=recipe.train.timeout_s, forward_signals=True)


def train(recipe: MegatronRecipe, device_type: str) -> int:
    """The trainer's entry point for ``engine: megatron``; the trainer's exit status: 0, 1 when the target was
    missed and ``train.fail_on_target_miss`` is set, 130 when stopped by SIGINT/SIGTERM (after a checkpoint)."""
    from ep_moe.train.launch import require_package

    require_package("megatron", "megatron.core", "pip install 'ep_moe[megatron]'")
    return max(int(r["exit_code"]) for r in run(recipe, device_type))
