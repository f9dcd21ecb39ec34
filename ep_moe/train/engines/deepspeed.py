"""``engine: deepspeed`` recipes: a small MoE language model trained through ``deepspeed.initialize``.

The MoE layer is DeepSpeed's own (``deepspeed.moe.layer.MoE``) or ep_moe's drop-in
(`ep_moe.integrations.deepspeed.MoE`), chosen by ``model.moe_layer``; everything else (model, data,
seed, DeepSpeed config) is the same, so the two can be compared step for step.

Run it with the trainer (``ep-moe train recipes/deepspeed-moe-ep2.yaml key=value ...``), which applies the
overrides and calls `train`. On CPU the ranks are spawned here (gloo, DeepSpeed's CPU accelerator); under
``torchrun`` this process is one rank (NCCL on ``cuda:LOCAL_RANK``).

Recipe keys (sections and defaults in `DEFAULTS`; unknown keys are rejected with their dotted path):

* ``model``: the LM (``vocab_size``, ``seq_length``, ``num_layers``, ``hidden_size``,
  ``num_attention_heads``, ``moe_ffn_hidden_size``) and the MoE layer, with DeepSpeed ``MoE`` arguments
  under Megatron-style names: ``num_moe_experts``, ``moe_router_topk`` (k), ``expert_model_parallel_size``
  (ep_size), ``moe_aux_loss_coeff``, ``moe_drop_tokens`` (false = dropless), ``moe_capacity_factor``,
  ``moe_eval_capacity_factor``, ``moe_min_capacity``, ``moe_use_rts``, ``moe_top2_2nd_expert_sampling``,
  ``moe_noisy_gate_policy``; ``moe_layer``: ``ep_moe`` or ``deepspeed``.
* ``train``: ``global_batch_size``, ``micro_batch_size``, ``train_iters``, ``eval_iters``, ``nproc``,
  ``device`` (auto/cpu/cuda), ``precision`` (fp32/bf16), ``timeout_s``, ``target_loss_gap``.
* ``optimizer`` (AdamW through DeepSpeed with ``torch_adam``: no op is compiled), ``scheduler`` (linear
  warm-up, then cosine or constant), ``dataset`` (the trainer's synthetic corpus or a text file),
  ``checkpoint`` (``save``, ``save_interval``, ``load``: DeepSpeed checkpoints, experts in per-expert
  files), ``logger``, ``rng``, ``ep_moe`` (``dispatcher_backend``), and ``deepspeed``: ``zero_stage`` and
  ``config``, a mapping merged into the generated DeepSpeed config.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import json
import logging
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ANY = object()  # a default that accepts any value of the listed types

# section -> key -> (default, accepted types)
SCHEMA: dict[str, dict[str, tuple[Any, tuple[type, ...]]]] = {
    "model": {
        "vocab_size": (64, (int,)), "seq_length": (64, (int,)), "num_layers": (2, (int,)),
        "hidden_size": (32, (int,)), "num_attention_heads": (2, (int,)), "moe_ffn_hidden_size": (64, (int,)),
        "num_moe_experts": (4, (int,)), "moe_router_topk": (2, (int,)), "expert_model_parallel_size": (2, (int,)),
        "moe_aux_loss_coeff": (0.01, (float,)), "moe_layer": ("ep_moe", (str,)), "moe_drop_tokens": (False, (bool,)),
        "moe_capacity_factor": (1.0, (float,)), "moe_eval_capacity_factor": (1.0, (float,)),
        "moe_min_capacity": (4, (int,)), "moe_use_rts": (True, (bool,)),
        "moe_top2_2nd_expert_sampling": (True, (bool,)), "moe_noisy_gate_policy": (None, (str, type(None))),
        "init_method_std": (0.02, (float,)),
    },
    "train": {
        "global_batch_size": (16, (int,)), "micro_batch_size": (8, (int,)), "train_iters": (100, (int,)),
        "eval_iters": (2, (int,)), "nproc": (2, (int,)), "device": ("auto", (str,)),
        "precision": ("fp32", (str,)), "timeout_s": (300.0, (float,)),
        "target_loss_gap": (None, (float, type(None))),
    },
    "optimizer": {
        "optimizer": ("adamw", (str,)), "lr": (3e-3, (float,)), "weight_decay": (0.0, (float,)),
        "betas": ([0.9, 0.95], (list,)), "eps": (1e-8, (float,)), "clip_grad": (1.0, (float,)),
    },
    "scheduler": {
        "lr_warmup_iters": (0, (int,)), "lr_decay_style": ("constant", (str,)), "min_lr": (0.0, (float,)),
    },
    "dataset": {
        "type": ("synthetic", (str,)), "num_topics": (4, (int,)), "order": (1, (int,)), "branching": (4, (int,)),
        "concentration": (1.0, (float,)), "path": (None, (str, type(None))), "tokenizer": ("char", (str,)),
        "split": ([0.95, 0.05], (list,)),
    },
    "checkpoint": {
        "save": (None, (str, type(None))), "save_interval": (0, (int,)), "load": (None, (str, type(None))),
    },
    "logger": {"log_interval": (10, (int,)), "metrics_path": (None, (str, type(None)))},
    "rng": {"seed": (1234, (int,))},
    "ep_moe": {"dispatcher_backend": ("auto", (str,))},
    "deepspeed": {"zero_stage": (2, (int,)), "config": ({}, (dict,))},
}
CHOICES = {
    "model.moe_layer": ("ep_moe", "deepspeed"), "train.device": ("auto", "cpu", "cuda"),
    "train.precision": ("fp32", "bf16"), "optimizer.optimizer": ("adamw",),
    "scheduler.lr_decay_style": ("constant", "cosine"), "dataset.type": ("synthetic", "text"),
    "dataset.tokenizer": ("char", "byte"), "ep_moe.dispatcher_backend": ("auto", "torch", "native"),
    "model.moe_noisy_gate_policy": (None, "None", "Jitter", "RSample"), "deepspeed.zero_stage": (0, 1, 2),
}
DEFAULTS = {section: {key: copy.deepcopy(spec[0]) for key, spec in keys.items()} for section, keys in SCHEMA.items()}

log = logging.getLogger("ep_moe")


class RecipeError(ValueError):
    """A recipe value that cannot be used; the message names its dotted path."""


# ---------------------------------------------------------------------------------------------- recipe
def resolve_recipe(recipe: dict) -> dict:
    """``recipe`` (raw YAML data, overrides applied) checked and completed with `DEFAULTS`.

    Raises `RecipeError` naming the key: unknown keys (with the closest known one), wrong types, values
    outside their choices, and the batch arithmetic.
    """
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe: expected a mapping, got {type(recipe).__name__}")
    out: dict[str, Any] = {"engine": "deepspeed"}
    for section, value in recipe.items():
        if section == "engine":
            if value != "deepspeed":
                raise RecipeError(f"engine: this runner trains 'deepspeed' recipes, got {value!r}")
            continue
        if section not in SCHEMA:
            raise _unknown("", section, list(SCHEMA) + ["engine"])
        if value is not None and not isinstance(value, dict):
            raise RecipeError(f"{section}: expected a mapping, got {type(value).__name__}")
    for section, keys in SCHEMA.items():
        given = recipe.get(section) or {}
        resolved = copy.deepcopy(DEFAULTS[section])
        for key, value in given.items():
            if key not in keys:
                raise _unknown(section, key, list(keys))
            resolved[key] = _coerce(f"{section}.{key}", value, keys[key][1])
        out[section] = resolved
    _validate(out)
    return out


def _unknown(section: str, key: str, known: list[str]) -> RecipeError:
    path = f"{section}.{key}" if section else key
    hint = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
    if hint:
        return RecipeError(f"unknown key '{path}'; did you mean '{(section + '.') if section else ''}{hint[0]}'?")
    return RecipeError(f"unknown key '{path}' (known: {', '.join(known)})")


def _coerce(path: str, value: Any, types: tuple[type, ...]) -> Any:
    if float in types and isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and bool not in types:
        raise RecipeError(f"{path}: expected {' or '.join(t.__name__ for t in types)}, got bool {value!r}")
    if not isinstance(value, types):
        raise RecipeError(f"{path}: expected {' or '.join(t.__name__ for t in types)}, "
                          f"got {type(value).__name__} {value!r}")
    return value


def _validate(r: dict) -> None:
    for path, choices in CHOICES.items():
        section, key = path.split(".")
        if r[section][key] not in choices:
            hint = difflib.get_close_matches(str(r[section][key]), [str(c) for c in choices], n=1)
            raise RecipeError(f"{path}: expected one of {', '.join(map(repr, choices))}, got {r[section][key]!r}"
                              + (f"; did you mean {hint[0]!r}?" if hint else ""))
    m, t = r["model"], r["train"]
    positive = [("model.vocab_size", m["vocab_size"]), ("model.seq_length", m["seq_length"]),
                ("model.num_layers", m["num_layers"]), ("model.hidden_size", m["hidden_size"]),
                ("model.num_attention_heads", m["num_attention_heads"]),
                ("model.moe_ffn_hidden_size", m["moe_ffn_hidden_size"]),
                ("model.num_moe_experts", m["num_moe_experts"]), ("model.moe_router_topk", m["moe_router_topk"]),
                ("model.expert_model_parallel_size", m["expert_model_parallel_size"]),
                ("train.global_batch_size", t["global_batch_size"]), ("train.micro_batch_size", t["micro_batch_size"]),
                ("train.train_iters", t["train_iters"]), ("train.nproc", t["nproc"])]
    for path, value in positive:
        if value < 1:
            raise RecipeError(f"{path}: must be >= 1, got {value}")
    if m["hidden_size"] % m["num_attention_heads"]:
        raise RecipeError(f"model.num_attention_heads: must divide model.hidden_size={m['hidden_size']}, "
                          f"got {m['num_attention_heads']}")
    if m["moe_router_topk"] > m["num_moe_experts"]:
        raise RecipeError(f"model.moe_router_topk: at most model.num_moe_experts={m['num_moe_experts']}, "
                          f"got {m['moe_router_topk']}")
    if m["num_moe_experts"] % m["expert_model_parallel_size"]:
        raise RecipeError(f"model.expert_model_parallel_size: must divide model.num_moe_experts="
                          f"{m['num_moe_experts']}, got {m['expert_model_parallel_size']}")
    if len(r["optimizer"]["betas"]) != 2:
        raise RecipeError(f"optimizer.betas: expected 2 numbers, got {r['optimizer']['betas']!r}")
    if r["dataset"]["type"] == "text" and not r["dataset"]["path"]:
        raise RecipeError("dataset.path: a text dataset needs a file path")


def _check_world(r: dict, world_size: int) -> None:
    m, t = r["model"], r["train"]
    if world_size % m["expert_model_parallel_size"]:
        raise RecipeError(f"model.expert_model_parallel_size: must divide the world size {world_size}, "
                          f"got {m['expert_model_parallel_size']}")
    per_step = t["micro_batch_size"] * world_size
    if t["global_batch_size"] % per_step:
        raise RecipeError(f"train.global_batch_size: must be a multiple of train.micro_batch_size x ranks = "
                          f"{per_step}, got {t['global_batch_size']}")


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

    def __init__(self, m: dict, make_moe):
        super().__init__()
        h = m["hidden_size"]
        self.embed = nn.Embedding(m["vocab_size"], h)
        self.pos = nn.Embedding(m["seq_length"], h)
        self.blocks = nn.ModuleList(MoEBlock(h, m["num_attention_heads"], make_moe(i)) for i in range(m["num_layers"]))
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, m["vocab_size"], bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        aux = torch.zeros((), device=tokens.device, dtype=torch.float32)
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux.float()
        return self.head(self.norm(x)).float(), aux


def build_model(r: dict, rank: int) -> nn.Module:
    """The recipe's model with DeepSpeed's MoE layers, replaced by ep_moe's when ``model.moe_layer`` is
    ``ep_moe``. Identical weights for both choices and for any EP size: replicated parameters come from
    ``rng.seed``; each expert's from ``(seed, layer, global expert id)``."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    m = r["model"]
    seed, std = r["rng"]["seed"], m["init_method_std"]
    ep_size = m["expert_model_parallel_size"]
    local = m["num_moe_experts"] // ep_size
    ep_rank = rank % ep_size  # DeepSpeed's expert groups are blocks of ep_size consecutive ranks
    h, f = m["hidden_size"], m["moe_ffn_hidden_size"]

    def make_moe(layer: int) -> nn.Module:
        expert = nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))
        moe = DeepSpeedMoE(h, expert, num_experts=m["num_moe_experts"], ep_size=ep_size, k=m["moe_router_topk"],
                           capacity_factor=m["moe_capacity_factor"],
                           eval_capacity_factor=m["moe_eval_capacity_factor"], min_capacity=m["moe_min_capacity"],
                           noisy_gate_policy=m["moe_noisy_gate_policy"], drop_tokens=m["moe_drop_tokens"],
                           use_rts=m["moe_use_rts"], top2_2nd_expert_sampling=m["moe_top2_2nd_expert_sampling"])
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
    if m["moe_layer"] == "ep_moe":
        from ep_moe.integrations.deepspeed import replace_deepspeed_moe

        model = replace_deepspeed_moe(model, backend=r["ep_moe"]["dispatcher_backend"])
    return model


# ---------------------------------------------------------------------------------------------- training
def deepspeed_config(r: dict, world_size: int) -> dict:
    """The DeepSpeed config of a recipe: a torch AdamW (``torch_adam``: nothing to compile), ZeRO stage,
    bf16, clipping, batch sizes; then ``deepspeed.config`` merged over it."""
    t, o = r["train"], r["optimizer"]
    accum = t["global_batch_size"] // (t["micro_batch_size"] * world_size)
    config = {
        "train_batch_size": t["global_batch_size"],
        "train_micro_batch_size_per_gpu": t["micro_batch_size"],
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": o["lr"], "betas": list(o["betas"]), "eps": o["eps"],
                                                   "weight_decay": o["weight_decay"], "torch_adam": True}},
        "gradient_clipping": o["clip_grad"],
        "zero_optimization": {"stage": r["deepspeed"]["zero_stage"]},
        "bf16": {"enabled": t["precision"] == "bf16"},
        "steps_per_print": 1 << 30,
    }
    return _merge(config, r["deepspeed"]["config"])


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _lr_lambda(r: dict):
    s, steps, lr = r["scheduler"], r["train"]["train_iters"], r["optimizer"]["lr"]
    warmup, floor = s["lr_warmup_iters"], s["min_lr"] / lr if lr else 0.0

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if s["lr_decay_style"] == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_dataset(r: dict):
    """The trainer's dataset (`ep_moe.train.data`): the synthetic topic corpus or a text file."""
    from ep_moe.train.data import SyntheticCorpus, TextDataset

    d, m, seed = r["dataset"], r["model"], r["rng"]["seed"]
    if d["type"] == "synthetic":
        return SyntheticCorpus(m["vocab_size"], m["seq_length"], d["num_topics"], d["order"], d["branching"],
                               d["concentration"], seed)
    return TextDataset(os.path.abspath(os.path.expanduser(d["path"])), m["seq_length"], m["vocab_size"],
                       d["tokenizer"], (d["split"][0], d["split"][1]), seed)


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)


def setup_engine(recipe: dict, device: torch.device):
    """``(engine, dataset, resolved recipe)`` on this rank of an initialized process group: the model
    built by `build_model` and wrapped by ``deepspeed.initialize`` with `deepspeed_config`."""
    import deepspeed

    from ep_moe.integrations.deepspeed import init_deepspeed_comm

    r = resolve_recipe(recipe)
    rank, world = dist.get_rank(), dist.get_world_size()
    _check_world(r, world)
    _quiet_deepspeed()
    init_deepspeed_comm()
    data = build_dataset(r)
    model = build_model(r, rank).to(device)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                           config=deepspeed_config(r, world),
                                           lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(r)))
    return engine, data, r


def train_rank(recipe: dict, device: torch.device) -> dict[str, Any]:
    """Train on this rank of an initialized process group. Returns per-step mean losses over all ranks
    (``losses``: cross-entropy; ``aux_losses``: the summed ``l_aux``), the final ``eval_loss``, the data's
    entropy ``floor`` (None for text), ``tokens_per_s``, ``seconds`` and the ``engine``."""
    from ep_moe.train.data import rank_slice

    engine, data, r = setup_engine(recipe, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    t, m = r["train"], r["model"]
    start_step = 0
    if r["checkpoint"]["load"]:
        _, client = engine.load_checkpoint(r["checkpoint"]["load"])
        start_step = int((client or {}).get("step", 0))
    torch.manual_seed(r["rng"]["seed"] + 17 * rank + start_step)  # gate sampling / RTS draw from here
    accum = engine.gradient_accumulation_steps()
    metrics = _metrics_file(r) if rank == 0 else None
    losses, aux_losses = [], []
    tokens_per_step = t["global_batch_size"] * m["seq_length"]
    started = time.perf_counter()
    for step in range(start_step, t["train_iters"]):
        batch = data.batch("train", step, t["global_batch_size"])
        step_loss = torch.zeros(2, dtype=torch.float64, device=device)  # the group may be NCCL-only
        for micro in range(accum):
            rows = rank_slice(batch, rank, world, t["micro_batch_size"], micro).to(device)
            logits, aux = engine(rows[:, :-1])
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
            engine.backward(ce + m["moe_aux_loss_coeff"] * aux)
            engine.step()
            step_loss += torch.stack([ce.detach(), aux.detach()]).to(torch.float64)
        dist.all_reduce(step_loss)
        step_loss /= accum * world
        losses.append(float(step_loss[0]))
        aux_losses.append(float(step_loss[1]))
        done = step + 1
        if metrics is not None and (done % r["logger"]["log_interval"] == 0 or done == t["train_iters"]):
            elapsed = time.perf_counter() - started
            line = {"step": done, "loss": losses[-1], "aux_loss": aux_losses[-1],
                    "lr": engine.get_lr()[0], "tokens_per_s": tokens_per_step * (done - start_step) / elapsed}
            metrics.write(json.dumps(line) + "\n")
            metrics.flush()
            print(f"step {done:5d}  loss {losses[-1]:.4f}  aux {aux_losses[-1]:.4f}  "
                  f"{line['tokens_per_s']:,.0f} tok/s", flush=True)
        if r["checkpoint"]["save"] and r["checkpoint"]["save_interval"] and done % r["checkpoint"]["save_interval"] == 0:
            engine.save_checkpoint(r["checkpoint"]["save"], tag=f"step{done}", client_state={"step": done})
    seconds = time.perf_counter() - started
    if r["checkpoint"]["save"] and (not r["checkpoint"]["save_interval"] or t["train_iters"] % r["checkpoint"]["save_interval"]):
        engine.save_checkpoint(r["checkpoint"]["save"], tag=f"step{t['train_iters']}",
                               client_state={"step": t["train_iters"]})
    eval_loss = _evaluate(engine, data, r, rank, world, device)
    if metrics is not None:
        metrics.close()
    steps_run = t["train_iters"] - start_step
    return {"losses": losses, "aux_losses": aux_losses, "eval_loss": eval_loss,
            "floor": data.entropy_floor, "seconds": seconds,
            "tokens_per_s": tokens_per_step * steps_run / seconds if steps_run else 0.0,
            "moe_layer": m["moe_layer"], "engine": engine}


def _evaluate(engine, data, r: dict, rank: int, world: int, device: torch.device) -> float | None:
    """Mean cross-entropy over ``train.eval_iters`` global batches of the validation split (None if 0)."""
    from ep_moe.train.data import rank_slice

    t = r["train"]
    if not t["eval_iters"]:
        return None
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    per_rank = t["global_batch_size"] // world
    with torch.no_grad():
        for i in range(t["eval_iters"]):
            batch = data.batch("valid", i, t["global_batch_size"])
            rows = rank_slice(batch, rank, world, per_rank, 0).to(device)
            logits, _ = engine(rows[:, :-1])
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum")
            total += torch.stack([ce.detach().to(torch.float64), ce.new_tensor(rows[:, 1:].numel(), dtype=torch.float64)])
    engine.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


def _metrics_file(r: dict):
    path = r["logger"]["metrics_path"] or os.path.join(r["checkpoint"]["save"] or "runs/deepspeed", "metrics.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handle = open(path, "w", encoding="utf-8")
    handle.write(json.dumps({"recipe": r}) + "\n")
    return handle


# ---------------------------------------------------------------------------------------------- launching
def _setup_env(device: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")


def _result(out: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in out.items() if k != "engine"}


def _spawned_rank(rank: int, world_size: int, recipe: dict, device: str) -> dict[str, Any]:
    _setup_env(device)
    from ep_moe.integrations.deepspeed import release_buffers

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    try:
        return _result(train_rank(recipe, dev))
    finally:
        release_buffers()


def _resolve_device(requested: str, nproc: int, under_torchrun: bool) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus == 0:
        raise RecipeError("train.device: 'cuda' but torch sees no GPU (use train.device=cpu)")
    if requested == "auto":
        return "cuda" if gpus and (under_torchrun or gpus >= nproc) else "cpu"
    return requested


def run(recipe: dict) -> list[dict[str, Any]]:
    """Train ``recipe`` on spawned ranks (or, under torchrun, on this rank); every rank's result."""
    from ep_moe.distributed import run_distributed

    r = resolve_recipe(recipe)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    under_torchrun = all(v is not None for v in env.values())
    device = _resolve_device(r["train"]["device"], r["train"]["nproc"], under_torchrun)
    _setup_env(device)
    if under_torchrun:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
        _check_world(r, world)
        timeout = datetime.timedelta(seconds=r["train"]["timeout_s"])
        if device == "cuda":
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
            dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=dev)
        else:
            dev = torch.device("cpu")
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        from ep_moe.integrations.deepspeed import release_buffers

        try:
            return [_result(train_rank(r, dev))]
        finally:
            release_buffers()
            dist.destroy_process_group()
    _check_world(r, r["train"]["nproc"])
    backend = "nccl" if device == "cuda" else "gloo"
    return run_distributed(_spawned_rank, r["train"]["nproc"], r, device, backend=backend,
                           timeout_s=r["train"]["timeout_s"], join_timeout_s=7 * 24 * 3600.0)


def train(recipe: dict) -> int:
    """The trainer's entry point for ``engine: deepspeed``: 0 on success, 1 when a synthetic run misses
    ``train.target_loss_gap`` or training fails, 2 for a bad recipe."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        print("ep-moe train: engine 'deepspeed' needs DeepSpeed: "
              "DS_BUILD_OPS=0 pip install torch==<your torch> deepspeed==0.19.8", file=sys.stderr)
        return 2
    try:
        r = resolve_recipe(recipe)
        results = run(r)
    except RecipeError as exc:
        print(f"ep-moe train: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"ep-moe train: {exc}", file=sys.stderr)
        return 1
    out = results[0]
    if int(os.environ.get("RANK", "0")) == 0:  # the launcher, or torchrun's rank 0
        summary = f"deepspeed recipe ({out['moe_layer']} MoE layer): {len(out['losses'])} steps"
        if out["losses"]:
            summary += f", final train loss {out['losses'][-1]:.4f}"
        if out["eval_loss"] is not None:
            summary += f", eval loss {out['eval_loss']:.4f}"
        if out["floor"] is not None:
            summary += f" (entropy floor {out['floor']:.4f})"
        summary += f", {out['tokens_per_s']:,.0f} tokens/s in {out['seconds']:.1f} s"
        print(summary, flush=True)
    gap = r["train"]["target_loss_gap"]
    if gap is not None and out["floor"] is not None and out["eval_loss"] is not None:
        if out["eval_loss"] - out["floor"] > gap:
            print(f"ep-moe train: eval loss {out['eval_loss']:.4f} is more than train.target_loss_gap={gap} "
                  f"above the floor {out['floor']:.4f}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ep_moe.train.engines.deepspeed RECIPE.yaml [key=value ...]`` (same as the
    trainer with ``engine: deepspeed``)."""
    from ep_moe.train.config import apply_overrides, read_yaml

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if args else 2
    return train(apply_overrides(read_yaml(args[0]), args[1:]))


if __name__ == "__main__":
    sys.exit(main())
