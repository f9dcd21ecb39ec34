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
datasets (`ep_moe.train.data`), so the synthetic corpus' entropy floor is known.

What a user sees and gets is the trainer's, as for ``engine: ep_moe``: progress lines, the metrics records
(`ep_moe.train.metrics`, ``<checkpoint.save or runs/<recipe name>>/metrics.jsonl``), TensorBoard scalars
(``logger.tensorboard_dir``), the loss plot, the summary and exit status, checkpoints in
``<checkpoint.save>/step_<NNNNNNN>/`` (here one file per rank with its model and optimizer ``state_dict``;
they load at the same world and EP size), ``--resume`` / ``checkpoint.load``, and Ctrl-C (finish the step,
save, exit 130).
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
def train_rank(recipe: MegatronRecipe, device: torch.device) -> dict[str, Any]:
    """Train on this rank of an initialised process group; returns the run's summary (same on all ranks but
    ``exit_code``, which rank 0 decides). Progress lines, metrics records, TensorBoard scalars, checkpoints,
    resume, the loss plot and the summary are the trainer's (`ep_moe.train.metrics`, `ep_moe.train.checkpoint`)."""
    _quiet_megatron()
    from megatron.core import parallel_state

    from ep_moe.integrations.megatron import destroy_ep_buffers
    from ep_moe.train import checkpoint as ckpt
    from ep_moe.train.data import build_dataset, rank_slice
    from ep_moe.train.loop import INTERRUPTED_EXIT_CODE, StopRequest
    from ep_moe.train.metrics import (
        Throughput,
        finish,
        imbalance_stats,
        report_eval,
        report_step,
        start_engine_run,
    )
    from ep_moe.train.schedule import recipe_lr

    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    m, t, o, c = recipe.model, recipe.train, recipe.optimizer, recipe.checkpoint
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
    floor = getattr(dataset, "entropy_floor", None)
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

    start_step, loaded_from = 0, find_checkpoint(recipe)
    if loaded_from is not None:
        start_step = load_checkpoint(loaded_from, recipe, model, optimizer, rank, world)
    is_main = rank == 0
    banner = (f"ep-moe train (engine megatron): megatron-core GPTModel, {m.num_layers} MoE layers x "
              f"{m.num_moe_experts} experts (top-{m.moe_router_topk}), dispatcher {m.moe_token_dispatcher}, "
              f"{world} rank(s) on {device.type}, EP {m.expert_model_parallel_size}, global batch "
              f"{t.global_batch_size} x {m.seq_length} tokens (micro {t.micro_batch_size}, accumulation "
              f"{accum}), {t.train_iters} steps; {dataset.describe()}")
    log, progress = start_engine_run(recipe, start_step, loaded_from, world, floor, banner, is_main)
    summary: dict[str, Any] = {"losses": [], "evals": [], "final_loss": float("nan"), "eval_loss": None,
                               "entropy_floor": floor, "tokens_per_s": 0.0, "train_time_s": 0.0,
                               "total_time_s": 0.0, "dispatcher": m.moe_token_dispatcher, "device": device.type,
                               "world": world, "exit_code": 0, "last_step": start_step, "checkpoint": None}
    if start_step >= t.train_iters:
        progress.close()
        if log is not None:
            log.close()
            print(f"nothing to train: the checkpoint is at step {start_step} >= train.train_iters={t.train_iters} "
                  "(raise train.train_iters to continue)", flush=True)
        destroy_ep_buffers()
        return summary

    counts = _RoutingCounts(model)
    coeff = m.moe_aux_loss_coeff if m.moe_router_load_balancing_type != "none" else 0.0
    throughput = Throughput(recipe.tokens_per_step)
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    train_time, interrupted, step = 0.0, False, start_step
    stop = StopRequest()
    model.train()
    try:
        while step < t.train_iters:
            step_started = time.perf_counter()
            lr = recipe_lr(recipe, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            _router_losses()
            counts.take()  # only this step's training forwards count
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
            # Router losses (raw, mean over micro-batches and MoE layers), this step's loss and the stop flag:
            # one all-reduce over the world.
            router = _router_losses()
            aux_raw = sum((v for k, v in router.items() if "load_balancing_loss" in k), torch.zeros(m.num_layers))
            z_raw = router.get("z_loss", torch.zeros(m.num_layers))
            flag = 1.0 if stop.requested else 0.0
            reduced = torch.cat([step_loss.view(1).cpu(), aux_raw / accum, z_raw / accum,
                                 torch.tensor([flag], dtype=torch.float64)]).to(device)
            dist.all_reduce(reduced)
            reduced = reduced.cpu()
            losses.append(float(reduced[0]) / (accum * world))
            aux_layers = reduced[1:1 + m.num_layers] / world
            z_layers = reduced[1 + m.num_layers:1 + 2 * m.num_layers] / world
            stop_now = bool(reduced[-1] > 0)
            layer_counts = counts.take()
            stats: dict[str, Any] = {}
            if layer_counts is not None:
                summed = layer_counts.to(device)
                dist.all_reduce(summed, group=ep_group)
                stats = imbalance_stats(summed.cpu())
            if router:
                stats.update(aux_loss=float(aux_layers.mean()), z_loss=float(z_layers.mean()) if "z_loss" in router
                             else None)
            aux_loss = coeff * float(aux_layers.sum()) if router else None
            step += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - step_started
            train_time += step_time
            tokens_per_s = throughput.add(step_time)
            report_step(recipe, progress, log, step, losses[-1], aux_loss, lr, grad_norm, tokens_per_s,
                        time.perf_counter() - started, stats)
            last = step == t.train_iters
            if t.eval_iters and ((t.eval_interval and step % t.eval_interval == 0) or last) and not stop_now:
                evals.append((step, evaluate()))
                report_eval(progress, log, step, evals[-1][1], floor, time.perf_counter() - started)
            if ckpt.save_due(c, step, last, stop_now):
                summary["checkpoint"] = save_checkpoint(recipe, model, optimizer, step, rank, world)
            if stop_now:
                interrupted = True
                break
    finally:
        progress.close()
        stop.restore()
        counts.remove()
        if log is not None:
            log.close()
    summary.update(losses=losses, evals=evals, final_loss=losses[-1] if losses else float("nan"),
                   eval_loss=evals[-1][1] if evals else None, last_step=step, train_time_s=train_time,
                   tokens_per_s=recipe.tokens_per_step * len(losses) / max(train_time, 1e-9),
                   total_time_s=time.perf_counter() - started)
    if interrupted:
        summary["exit_code"] = INTERRUPTED_EXIT_CODE
        if is_main:
            where = (f"checkpoint {summary['checkpoint']}; continue with --resume" if summary["checkpoint"]
                     else "no checkpoint (set checkpoint.save to keep one)")
            print(f"interrupted ({stop.signal_name}) after step {step}: {where}", flush=True)
    elif is_main:
        _, summary["exit_code"] = finish(
            recipe, recipe.metrics_path(), steps=step, final_loss=summary["final_loss"],
            eval_loss=summary["eval_loss"], floor=floor, tokens_per_s=summary["tokens_per_s"],
            train_time_s=train_time, total_time_s=summary["total_time_s"],
            title=f"{recipe.name}: megatron, dispatcher {m.moe_token_dispatcher}, EP {m.expert_model_parallel_size}")
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
                  timeout_s=recipe.train.timeout_s, forward_signals=True)


def train(recipe: MegatronRecipe, device_type: str) -> int:
    """The trainer's entry point for ``engine: megatron``; the trainer's exit status: 0, 1 when the target was
    missed and ``train.fail_on_target_miss`` is set, 130 when stopped by SIGINT/SIGTERM (after a checkpoint)."""
    from ep_moe.train.launch import require_package

    require_package("megatron", "megatron.core", "pip install 'ep_moe[megatron]'")
    return max(int(r["exit_code"]) for r in run(recipe, device_type))
