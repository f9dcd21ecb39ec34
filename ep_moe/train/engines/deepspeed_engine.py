"""``engine: deepspeed`` recipes: a small MoE language model trained through ``deepspeed.initialize``.

The recipe is a `DeepSpeedRecipe` (`ep_moe.train.recipe_schema`: its ``model`` and ``deepspeed`` sections, the
shared ones). The MoE layer is DeepSpeed's own (``deepspeed.moe.layer.MoE``) or ep_moe's drop-in
(`ep_moe.integrations.deepspeed.MoE`), chosen by ``model.moe_layer``; everything else (model, data, seed,
DeepSpeed config) is the same, so the two can be compared step for step.

Run it with the trainer (``ep-moe train recipes/deepspeed-moe-ep2.yaml key=value ...``), which parses and
checks the recipe, then calls `train`. Ranks start through `ep_moe.distributed.launch`: spawned on the CPU
(gloo, DeepSpeed's CPU accelerator) or on GPUs (NCCL), or the ``torchrun`` job (NCCL on
``cuda:LOCAL_RANK``). The optimizer is AdamW through DeepSpeed with ``torch_adam`` (no op is compiled),
the learning rate follows the trainer's schedule (`ep_moe.train.schedule`), the data is the trainer's
(`ep_moe.train.data`), and ``deepspeed.config`` is merged over the generated DeepSpeed config.

What a user sees and gets is the trainer's, as for ``engine: ep_moe``: progress lines, the metrics records
(`ep_moe.train.metrics`), TensorBoard scalars (``logger.tensorboard_dir``), the loss plot, the summary and
exit status, checkpoints in ``<checkpoint.save>/step_<NNNNNNN>/`` (DeepSpeed's own files inside, experts in
per-expert files; DeepSpeed's ``latest`` pointer is the trainer's), ``--resume`` / ``checkpoint.load``, and
Ctrl-C (finish the step, save, exit 130).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ep_moe.train.recipe_schema import DeepSpeedModelSection, DeepSpeedRecipe, validate


# ---------------------------------------------------------------------------------------------- model
class MoEBlock(nn.Module):
    """Pre-norm block: causal self-attention, then the MoE FFN; returns ``(x, l_aux)``."""

    def __init__(self, hidden: int, heads: int, moe: nn.Module):
        super().__init__()
        self.heads = heads
        self.norm_attn = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm_moe = nn.LayerNorm(hidden)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm_attn(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        out, l_aux, exp_counts = self.moe(self.norm_moe(x))
        self.exp_counts = exp_counts  # this rank's tokens per expert (the gate's), for the load imbalance
        return x + out, l_aux


class TinyMoELM(nn.Module):
    """Token + position embeddings, `MoEBlock` layers, final norm, untied head. ``forward(tokens [B, S])``
    returns ``(logits [B, S, V] fp32, sum of the layers' l_aux)``."""

    def __init__(self, m: DeepSpeedModelSection, make_moe):
        super().__init__()
        h = m.hidden_size
        self.embed = nn.Embedding(m.vocab_size, h)
        self.pos = nn.Embedding(m.seq_length, h)
        self.blocks = nn.ModuleList(MoEBlock(h, m.num_attention_heads, make_moe(i)) for i in range(m.num_layers))
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, m.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        aux = torch.zeros((), device=tokens.device, dtype=torch.float32)
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux.float()
        return self.head(self.norm(x)).float(), aux


def build_model(recipe: DeepSpeedRecipe, rank: int) -> nn.Module:
    """The recipe's model with DeepSpeed's MoE layers, replaced by ep_moe's when ``model.moe_layer`` is
    ``ep_moe``. Identical weights for both choices and for any EP size: replicated parameters come from
    ``rng.seed``; each expert's from ``(seed, layer, global expert id)``."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    m = recipe.model
    seed, std = recipe.rng.seed, m.init_method_std
    ep_size = m.expert_model_parallel_size
    local = m.num_moe_experts // ep_size
    ep_rank = rank % ep_size  # DeepSpeed's expert groups are blocks of ep_size consecutive ranks
    h, f = m.hidden_size, m.moe_ffn_hidden_size

    def make_moe(layer: int) -> nn.Module:
        expert = nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))
        moe = DeepSpeedMoE(h, expert, num_experts=m.num_moe_experts, ep_size=ep_size, k=m.moe_router_topk,
                           capacity_factor=m.moe_capacity_factor, eval_capacity_factor=m.moe_eval_capacity_factor,
                           min_capacity=m.moe_min_capacity, noisy_gate_policy=m.moe_noisy_gate_policy,
                           drop_tokens=m.moe_drop_tokens, use_rts=m.moe_use_rts,
                           top2_2nd_expert_sampling=m.moe_top2_2nd_expert_sampling)
        for i, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 10_007 + ep_rank * local + i)
            for name, p in module.named_parameters():
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32, device="cpu") * std
                            if name.endswith("weight") else 0.0)
        return moe

    torch.manual_seed(seed)
    with torch.device("cpu"):  # on the CPU whatever the caller's default device (moved by the caller)
        model = TinyMoELM(m, make_moe)
    for name, p in model.named_parameters():
        if "deepspeed_experts" not in name and p.dim() >= 2:
            with torch.no_grad():
                p.normal_(0.0, std)
    if m.moe_layer == "ep_moe":
        from ep_moe.integrations.deepspeed import replace_deepspeed_moe

        model = replace_deepspeed_moe(model, backend=recipe.ep_moe.dispatcher_backend)
    return model


# ---------------------------------------------------------------------------------------------- training
def deepspeed_config(recipe: DeepSpeedRecipe, world_size: int) -> dict:
    """The DeepSpeed config of a recipe: a torch AdamW (``torch_adam``: nothing to compile), ZeRO stage,
    bf16, clipping, batch sizes; then ``deepspeed.config`` merged over it."""
    t, o = recipe.train, recipe.optimizer
    config = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": recipe.grad_accum_steps(world_size),
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                   "weight_decay": o.weight_decay, "torch_adam": True}},
        "gradient_clipping": o.clip_grad,
        "zero_optimization": {"stage": recipe.deepspeed.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "steps_per_print": 1 << 30,
    }
    return _merge(config, recipe.deepspeed.config)


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def lr_scheduler(optimizer: torch.optim.Optimizer, recipe: DeepSpeedRecipe) -> torch.optim.lr_scheduler.LambdaLR:
    """The trainer's schedule (`ep_moe.train.schedule.recipe_lr`) as a factor of the optimizer's
    ``optimizer.lr``; DeepSpeed steps it once per optimizer step and keeps its state in checkpoints."""
    from ep_moe.train.schedule import recipe_lr

    lr = recipe.optimizer.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: recipe_lr(recipe, step) / lr if lr else 0.0)


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)


def setup_engine(recipe: DeepSpeedRecipe, device: torch.device):
    """``(engine, dataset)`` on this rank of an initialized process group: the model built by `build_model`
    and wrapped by ``deepspeed.initialize`` with `deepspeed_config` and `lr_scheduler`."""
    import deepspeed

    from ep_moe.integrations.deepspeed import init_deepspeed_comm
    from ep_moe.train.data import build_dataset

    rank, world = dist.get_rank(), dist.get_world_size()
    validate(recipe, world, device.type)
    _quiet_deepspeed()
    init_deepspeed_comm()
    data = build_dataset(recipe)
    model = build_model(recipe, rank).to(device)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                           config=deepspeed_config(recipe, world),
                                           lr_scheduler=lambda opt: lr_scheduler(opt, recipe))
    return engine, data


def _is_deepspeed_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and any(name.endswith("model_states.pt") for name in os.listdir(path))


def find_checkpoint(recipe: DeepSpeedRecipe) -> str | None:
    """``checkpoint.resume``: the latest checkpoint in ``checkpoint.save`` (if any); else ``checkpoint.load``
    (a checkpoint folder, or a save folder: its latest); else None."""
    from ep_moe.train import checkpoint as ckpt

    c = recipe.checkpoint
    return ckpt.find_engine_checkpoint(c.save, c.load, c.resume, _is_deepspeed_checkpoint,
                                       "a DeepSpeed checkpoint folder (with *model_states.pt files)")


def _rng_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rng_rank_{rank:03d}.pt")


def _save_rng_state(folder: str, rank: int, world: int) -> None:
    """Each rank's RNG state beside DeepSpeed's files (the gate's 2nd-expert sampling and random token
    selection draw from it), so that a resumed run continues with the same draws."""
    state = {"world_size": world, "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, _rng_file(folder, rank))


def _load_rng_state(folder: str, rank: int, world: int) -> None:
    """Restore this rank's RNG state when the checkpoint has one from the same world size."""
    path = _rng_file(folder, rank)
    if not os.path.isfile(path):
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("world_size") != world:
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _expert_parallel_group(ep_size: int):
    """DeepSpeed's expert-parallel group of this rank (the world where it cannot be found)."""
    try:
        from deepspeed.utils import groups

        return groups._get_expert_parallel_group(f"ep_size_{ep_size}")
    except Exception:  # noqa: BLE001 (a private API of DeepSpeed: fall back to the world)
        return None


class DeepSpeedSteps:
    """This engine's steps for the trainer's shared loop (`ep_moe.train.loop.run_training`): a DeepSpeed engine
    (ZeRO, its optimizer and learning-rate schedule) over the trainer's data. Collective to build."""

    def __init__(self, recipe: DeepSpeedRecipe, device: torch.device) -> None:
        self.recipe, self.device = recipe, device
        self.engine, self.dataset = setup_engine(recipe, device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        m = recipe.model
        self.ep_size = m.expert_model_parallel_size
        self.accum = self.engine.gradient_accumulation_steps()
        self.ep_group = _expert_parallel_group(m.expert_model_parallel_size)
        self.blocks = list(self.engine.module.blocks)
        self.aux_losses: list[float] = []  # per step: the summed l_aux, mean over ranks and micro-batches
        torch.manual_seed(recipe.rng.seed + 17 * self.rank)  # gate sampling / RTS draw from here (a load restores it)

    def find_checkpoint(self) -> str | None:
        return find_checkpoint(self.recipe)

    def load(self, path: str) -> int:
        load_dir, tag = os.path.split(os.path.normpath(path))
        _, client = self.engine.load_checkpoint(load_dir, tag=tag)
        _load_rng_state(path, self.rank, self.world_size)
        return int((client or {}).get("step", 0))

    def opening_lines(self) -> list[str]:
        from ep_moe.train.loop import batch_line

        m = self.recipe.model
        return [f"ep-moe train (engine deepspeed): {m.moe_layer} MoE layer, {m.num_layers} layers x "
                f"{m.num_moe_experts} experts (top-{m.moe_router_topk}), ZeRO-{self.recipe.deepspeed.zero_stage}, "
                f"{self.world_size} rank(s) on {self.device.type}, EP {m.expert_model_parallel_size}, "
                f"{batch_line(self.recipe, self.accum, self.dataset)}",
                f"metrics: {self.recipe.metrics_path()}"]

    def title(self) -> str:
        m = self.recipe.model
        return f"{self.recipe.name}: deepspeed, {m.moe_layer} MoE layer, EP {m.expert_model_parallel_size}"

    def begin(self, step: int) -> tuple[float, torch.Tensor]:
        # the schedule's value for this step (DeepSpeed steps its scheduler after the update; it clears gradients)
        return self.engine.get_lr()[0], self.dataset.batch("train", step, self.recipe.train.global_batch_size)

    def step(self, batch: torch.Tensor, stop_requested: bool):
        from ep_moe.train.data import rank_slice
        from ep_moe.train.loop import StepOutcome
        from ep_moe.train.metrics import imbalance_stats

        engine, m, t, device = self.engine, self.recipe.model, self.recipe.train, self.device
        step_loss = torch.zeros(3, dtype=torch.float64, device=device)  # the group may be NCCL-only
        counts = None
        for micro in range(self.accum):
            rows = rank_slice(batch, self.rank, self.world_size, t.micro_batch_size, micro).to(device)
            logits, aux = engine(rows[:, :-1])
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
            engine.backward(ce + m.moe_aux_loss_coeff * aux)
            engine.step()
            step_loss += torch.stack([ce.detach(), aux.detach(), aux.new_zeros(())]).to(torch.float64)
            micro_counts = torch.stack([b.exp_counts.detach().to(device, torch.float64) for b in self.blocks])
            counts = micro_counts if counts is None else counts + micro_counts
        step_loss[2] = 1.0 if stop_requested else 0.0
        dist.all_reduce(step_loss)
        stop = bool(step_loss[2] > 0)
        step_loss /= self.accum * self.world_size
        self.aux_losses.append(float(step_loss[1]))
        dist.all_reduce(counts, group=self.ep_group)
        stats = imbalance_stats(counts.cpu())
        stats["aux_loss"] = self.aux_losses[-1] / m.num_layers  # raw l_aux, mean over MoE layers
        norm = engine.get_global_grad_norm()
        return StepOutcome(loss=float(step_loss[0]), aux_loss=m.moe_aux_loss_coeff * self.aux_losses[-1],
                           grad_norm=None if norm is None else float(norm), stats=stats, stop=stop)

    def evaluate(self) -> float:
        return _evaluate(self.engine, self.dataset, self.recipe, self.rank, self.world_size, self.device)

    def save(self, step: int) -> str:
        from ep_moe.train import checkpoint as ckpt

        c = self.recipe.checkpoint
        self.engine.save_checkpoint(c.save, tag=ckpt.step_dir_name(step), client_state={"step": step})
        saved = os.path.join(c.save, ckpt.step_dir_name(step))
        _save_rng_state(saved, self.rank, self.world_size)
        if self.rank == 0:
            ckpt.prune(c.save, step, c.keep_last)
        dist.barrier()
        return saved

    def close(self) -> None:
        """Nothing to release here (the ep_moe layer's buffers are released by the rank's entry point)."""


def train_rank(recipe: DeepSpeedRecipe, device: torch.device) -> dict[str, Any]:
    """Train on this rank of an initialized process group. Returns per-step mean losses over all ranks
    (``losses``: cross-entropy; ``aux_losses``: the summed ``l_aux``), the final ``eval_loss``, the data's
    entropy ``floor`` (None for text), ``tokens_per_s``, ``seconds``, the ``engine`` and the ``exit_code``
    (rank 0 decides it). The loop (progress lines, metrics records, TensorBoard scalars, checkpoint folders,
    resume, Ctrl-C, the loss plot and the summary) is the trainer's own (`ep_moe.train.loop.run_training`);
    `DeepSpeedSteps` provides the steps."""
    from ep_moe.train.loop import run_training

    started = time.monotonic()
    steps = DeepSpeedSteps(recipe, device)
    try:
        result = run_training(recipe, steps, started)
    finally:
        steps.close()
    return {"losses": result.losses, "aux_losses": steps.aux_losses, "eval_loss": result.eval_loss,
            "floor": result.entropy_floor, "seconds": result.train_time_s, "tokens_per_s": result.tokens_per_s,
            "moe_layer": recipe.model.moe_layer, "engine": steps.engine, "exit_code": result.exit_code,
            "last_step": result.last_step, "checkpoint": result.checkpoint}


def _evaluate(engine, data, recipe: DeepSpeedRecipe, rank: int, world: int, device: torch.device) -> float | None:
    """Mean cross-entropy over ``train.eval_iters`` global batches of the validation split (None if 0)."""
    from ep_moe.train.data import rank_slice

    t = recipe.train
    if not t.eval_iters:
        return None
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    per_rank = t.global_batch_size // world
    with torch.no_grad():
        for i in range(t.eval_iters):
            batch = data.batch("valid", i, t.global_batch_size)
            rows = rank_slice(batch, rank, world, per_rank, 0).to(device)
            logits, _ = engine(rows[:, :-1])
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum")
            total += torch.stack([ce.detach().to(torch.float64), ce.new_tensor(rows[:, 1:].numel(), dtype=torch.float64)])
    engine.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


# ---------------------------------------------------------------------------------------------- launching
def _setup_env(device_type: str) -> None:
    """DeepSpeed picks its accelerator when imported: set it (and no op builds) first, in every process."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device_type == "cuda" else "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")


def _rank(rank: int, world_size: int, recipe: DeepSpeedRecipe, device_type: str) -> dict[str, Any]:
    """One rank of the job (module level so that spawn can import it); its result without the engine."""
    _setup_env(device_type)
    from ep_moe.integrations.deepspeed import release_buffers
    from ep_moe.train.launch import rank_device

    try:
        out = train_rank(recipe, rank_device(device_type))
        return {k: v for k, v in out.items() if k != "engine"}
    finally:
        release_buffers()


def run(recipe: DeepSpeedRecipe, device_type: str) -> list[dict[str, Any]]:
    """Train ``recipe`` on ``device_type`` (``cpu``/``cuda``; see `ep_moe.train.launch.prepare`): every rank's
    result (under ``torchrun``, this process's only). Each rank checks the recipe against its group."""
    from ep_moe.distributed import launch

    _setup_env(device_type)
    return launch(_rank, recipe.train.nproc, recipe, device_type, device_type=device_type,
                  timeout_s=recipe.train.timeout_s, forward_signals=True)


def train(recipe: DeepSpeedRecipe, device_type: str) -> int:
    """The trainer's entry point for ``engine: deepspeed``; the trainer's exit status: 0, 1 when the target
    was missed and ``train.fail_on_target_miss`` is set, 130 when stopped by SIGINT/SIGTERM (after a
    checkpoint). Rank 0 prints the summary."""
    from ep_moe.train.launch import require_package

    require_package("deepspeed", "deepspeed", "DS_BUILD_OPS=0 pip install torch==<your torch> deepspeed==0.19.8")
    return max(int(r["exit_code"]) for r in run(recipe, device_type))
