"""``engine: deepspeed`` recipes: a small MoE language model trained through ``deepspeed.initialize``.

The recipe is a `DeepSpeedRecipe` (`ep_moe.train.config`: its ``model`` and ``deepspeed`` sections, the
shared ones). The MoE layer is DeepSpeed's own (``deepspeed.moe.layer.MoE``) or ep_moe's drop-in
(`ep_moe.integrations.deepspeed.MoE`), chosen by ``model.moe_layer``; everything else (model, data, seed,
DeepSpeed config) is the same, so the two can be compared step for step.

Run it with the trainer (``ep-moe train recipes/deepspeed-moe-ep2.yaml key=value ...``), which parses and
checks the recipe, then calls `train`. Ranks start through `ep_moe.distributed.launch`: spawned on the CPU
(gloo, DeepSpeed's CPU accelerator) or on GPUs (NCCL), or the ``torchrun`` job (NCCL on
``cuda:LOCAL_RANK``). The optimizer is AdamW through DeepSpeed with ``torch_adam`` (no op is compiled),
the learning rate follows the trainer's schedule (`ep_moe.train.schedule`), the data is the trainer's
(`ep_moe.train.data`), checkpoints are DeepSpeed's (experts in per-expert files), and ``deepspeed.config``
is merged over the generated DeepSpeed config.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ep_moe.train.config import DeepSpeedModelSection, DeepSpeedRecipe, validate


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
        out, l_aux, _ = self.moe(self.norm_moe(x))
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
                    p.copy_(torch.randn(p.shape, generator=gen) * std if name.endswith("weight") else 0.0)
        return moe

    torch.manual_seed(seed)
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


def train_rank(recipe: DeepSpeedRecipe, device: torch.device) -> dict[str, Any]:
    """Train on this rank of an initialized process group. Returns per-step mean losses over all ranks
    (``losses``: cross-entropy; ``aux_losses``: the summed ``l_aux``), the final ``eval_loss``, the data's
    entropy ``floor`` (None for text), ``tokens_per_s``, ``seconds`` and the ``engine``."""
    from ep_moe.train.data import rank_slice

    engine, data = setup_engine(recipe, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    t, m, c = recipe.train, recipe.model, recipe.checkpoint
    start_step = 0
    if c.load:
        _, client = engine.load_checkpoint(c.load)
        start_step = int((client or {}).get("step", 0))
    torch.manual_seed(recipe.rng.seed + 17 * rank + start_step)  # gate sampling / RTS draw from here
    accum = engine.gradient_accumulation_steps()
    metrics = _metrics_file(recipe) if rank == 0 else None
    losses, aux_losses = [], []
    tokens_per_step = recipe.tokens_per_step
    started = time.perf_counter()
    for step in range(start_step, t.train_iters):
        batch = data.batch("train", step, t.global_batch_size)
        step_loss = torch.zeros(2, dtype=torch.float64, device=device)  # the group may be NCCL-only
        for micro in range(accum):
            rows = rank_slice(batch, rank, world, t.micro_batch_size, micro).to(device)
            logits, aux = engine(rows[:, :-1])
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
            engine.backward(ce + m.moe_aux_loss_coeff * aux)
            engine.step()
            step_loss += torch.stack([ce.detach(), aux.detach()]).to(torch.float64)
        dist.all_reduce(step_loss)
        step_loss /= accum * world
        losses.append(float(step_loss[0]))
        aux_losses.append(float(step_loss[1]))
        done = step + 1
        if metrics is not None and (done % recipe.logger.log_interval == 0 or done == t.train_iters):
            elapsed = time.perf_counter() - started
            line = {"step": done, "loss": losses[-1], "aux_loss": aux_losses[-1],
                    "lr": engine.get_lr()[0], "tokens_per_s": tokens_per_step * (done - start_step) / elapsed}
            metrics.write(json.dumps(line) + "\n")
            metrics.flush()
            print(f"step {done:5d}  loss {losses[-1]:.4f}  aux {aux_losses[-1]:.4f}  "
                  f"{line['tokens_per_s']:,.0f} tok/s", flush=True)
        if c.save and c.save_interval and done % c.save_interval == 0:
            engine.save_checkpoint(c.save, tag=f"step{done}", client_state={"step": done})
    seconds = time.perf_counter() - started
    if c.save and (not c.save_interval or t.train_iters % c.save_interval):
        engine.save_checkpoint(c.save, tag=f"step{t.train_iters}", client_state={"step": t.train_iters})
    eval_loss = _evaluate(engine, data, recipe, rank, world, device)
    if metrics is not None:
        metrics.close()
    steps_run = t.train_iters - start_step
    return {"losses": losses, "aux_losses": aux_losses, "eval_loss": eval_loss,
            "floor": data.entropy_floor, "seconds": seconds,
            "tokens_per_s": tokens_per_step * steps_run / seconds if steps_run else 0.0,
            "moe_layer": m.moe_layer, "engine": engine}


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


def _metrics_file(recipe: DeepSpeedRecipe):
    path = recipe.metrics_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handle = open(path, "w", encoding="utf-8")
    handle.write(json.dumps({"recipe": recipe.to_dict()}) + "\n")
    return handle


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
                  timeout_s=recipe.train.timeout_s)


def train(recipe: DeepSpeedRecipe, device_type: str) -> int:
    """The trainer's entry point for ``engine: deepspeed``: 0 on success, 1 when a synthetic run misses
    ``train.target_loss_gap``; rank 0 prints the summary."""
    from ep_moe.distributed import torchrun_env
    from ep_moe.train.launch import require_package

    require_package("deepspeed", "deepspeed", "DS_BUILD_OPS=0 pip install torch==<your torch> deepspeed==0.19.8")
    out = run(recipe, device_type)[0]
    env = torchrun_env()
    if env is None or env.rank == 0:  # the launcher, or torchrun's rank 0
        summary = f"deepspeed recipe ({out['moe_layer']} MoE layer): {len(out['losses'])} steps"
        if out["losses"]:
            summary += f", final train loss {out['losses'][-1]:.4f}"
        if out["eval_loss"] is not None:
            summary += f", eval loss {out['eval_loss']:.4f}"
        if out["floor"] is not None:
            summary += f" (entropy floor {out['floor']:.4f})"
        summary += f", {out['tokens_per_s']:,.0f} tokens/s in {out['seconds']:.1f} s"
        print(summary, flush=True)
    gap = recipe.train.target_loss_gap
    if gap is not None and out["floor"] is not None and out["eval_loss"] is not None:
        if out["eval_loss"] - out["floor"] > gap:
            print(f"ep-moe train: eval loss {out['eval_loss']:.4f} is more than train.target_loss_gap={gap} "
                  f"above the floor {out['floor']:.4f}", file=sys.stderr)
            return 1
    return 0
