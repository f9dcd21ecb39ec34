"""Two-stage pipeline training of the MoE transformer (``train.pp_size: 2``), CPU and GPU.

Ranks: ``W`` ranks, ``D = W / 2`` data-parallel ranks per stage. Ranks ``[0, D)`` are stage 0 (the embedding and
layers ``[0, L/2)``), ranks ``[D, W)`` stage 1 (layers ``[L/2, L)``, the final norm, the output layer and the
loss). Rank ``j`` and rank ``j + D`` form a pipeline; they share an `ep_moe.ElasticBuffer` over their pair group,
whose `pp_send` / `pp_recv` carry the activations forward and their gradients back (fp32, ``[m, S, H]``). Every
rank builds the whole model from the same seed and keeps (and optimizes) only its stage's parameters.

Schedule, per optimizer step (GPipe: all forwards, then all backwards): stage 0 sends each of its ``accum``
micro-batches' activations, stage 1 runs the rest forward and backward and sends each input's gradient back,
and stage 0 back-propagates them. Gradients are then summed per stage over its data-parallel group, clipped by
the global norm over both stages, and AdamW steps. `stage0_forward` / `stage1_forward` mirror
`ep_moe.layers.model.MoETransformer.forward` split at ``L/2`` (`split_layer`).

The loop itself (resume, Ctrl-C at a step boundary, evaluation, checkpoints, metrics) is the default trainer's
(`ep_moe.train.loop.run_training`); this module provides its steps (`PipelineSteps`). Checkpoints have the default
trainer's format (loadable with ``pp_size`` 1 or 2). Expert parallelism works inside each stage
(`build_pipeline_state`).

The full description (tied embeddings, dropout, what is not provided): docs/training.md, section "Pipeline
parallel: `train.pp_size: 2`"; the recipe key: docs/configuration.md, section "Training recipes".
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..elastic.elastic_buffer import ElasticBuffer
from ..layers.model import rotary_tables
from . import checkpoint as ckpt
from .data import build_dataset, rank_slice
from .loop import StepOutcome, batch_line, build_model, build_optimizer, row_order_mean
from .parallel import ParallelState, all_reduce_sum, build_parallel_state, sync_gradients
from .recipe_schema import Recipe
from .schedule import begin_step


@dataclass
class PipelineState:
    rank: int
    world_size: int
    stage: int                        # 0 or 1
    dp_rank: int                      # rank inside the stage
    dp_size: int                      # D = W / 2
    dp_group: dist.ProcessGroup       # the ranks of this stage
    pair_group: dist.ProcessGroup     # [j, j + D]: this rank's pipeline (stage s is rank index s in it)
    device: torch.device
    deterministic: bool
    inside: ParallelState             # the stage's own EP / expert-data-parallel groups (rank = dp_rank)

    @property
    def peer(self) -> int:
        """The other stage's rank index in the pair group."""
        return 1 - self.stage

    @property
    def ep_size(self) -> int:
        """Expert parallelism inside each stage (EP groups of contiguous ranks of the stage)."""
        return self.inside.ep_size


def build_pipeline_state(ep_size: int, device: torch.device, deterministic: bool) -> PipelineState:
    """The pair groups, then the stage and EP groups inside each stage (every rank creates every group, in the
    same order). Rank ``j`` of stage 0 and rank ``j`` of stage 1 have the same EP rank, so a pair holds the same
    experts of their layers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d = world // 2
    pair_group, _ = dist.new_subgroups_by_enumeration([[j, j + d] for j in range(d)])
    inside = build_parallel_state(ep_size, device, deterministic, stages=2)
    return PipelineState(rank, world, rank // d, rank % d, d, inside.dp_group, pair_group, device, deterministic,
                         inside)


def split_layer(num_layers: int) -> int:
    """Stage 0 runs layers ``[0, split)``, stage 1 ``[split, L)``."""
    return num_layers // 2


def stage_parameters(model, stage: int) -> list[torch.nn.Parameter]:
    """The parameters stage ``stage`` uses (the tied embedding on both)."""
    k = split_layer(model.config.num_layers)
    if stage == 0:
        params = [model.embedding] + [p for layer in model.layers[:k] for p in layer.parameters()]
    else:
        params = [p for layer in model.layers[k:] for p in layer.parameters()] + list(model.final_norm.parameters())
        params.append(model.output_weight if model.output_weight is not None else model.embedding)
    return [p for p in params if p.requires_grad]


def _layers(model, x: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    c = model.config
    cos, sin = rotary_tables(x.shape[1], c.head_dim, c.rotary_base, x.device)
    aux = torch.zeros((), dtype=torch.float32, device=x.device)
    for layer in layers:
        x = layer(x, cos, sin)
        if layer.moe is not None:
            aux = aux + layer.moe.aux_loss
    return x, aux


def stage0_forward(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding and the first half of the layers: ``(activation [B, S, H], aux loss of these layers)``."""
    x = F.embedding(input_ids, model.embedding)
    return _layers(model, x, model.layers[: split_layer(model.config.num_layers)])


def stage1_forward(model, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half of the layers, the final norm, the output layer and the mean cross-entropy:
    ``(loss, aux loss of these layers)``."""
    x, aux = _layers(model, x, model.layers[split_layer(model.config.num_layers):])
    x = model.final_norm(x)
    weight = model.output_weight if model.output_weight is not None else model.embedding
    logits = F.linear(x, weight)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, aux


class StageRunner:
    """One rank's stage: the model, its pipeline buffer, and forward/backward of a list of micro-batches."""

    def __init__(self, recipe: Recipe, ps: PipelineState, model, accum: int) -> None:
        self.recipe, self.ps, self.model, self.accum = recipe, ps, model, accum
        m, s, h = recipe.train.micro_batch_size, recipe.model.seq_length, recipe.model.hidden_size
        self.act_shape = (m, s, h)
        slot = m * s * h * 4
        slots = max(accum, recipe.train.eval_iters * accum, 1)
        num_bytes = ElasticBuffer.get_pp_buffer_size_hint(slot, slots)
        self.buffer = ElasticBuffer(ps.pair_group, num_bytes=num_bytes, backend="torch",
                                    num_gpu_timeout_secs=recipe.train.timeout_s, explicitly_destroy=True)
        self.buffer.pp_set_config(slot, slots)

    def _autocast(self):
        if self.recipe.train.precision == "bf16":
            return torch.autocast(device_type=self.ps.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def run(self, micro_batches: list[torch.Tensor], scale: float, train: bool) -> torch.Tensor:
        """Forward (and with ``train`` backward) every micro-batch through both stages. Returns ``[n, 2]``
        float64: stage 1's ``(cross-entropy, its aux loss)``, stage 0's ``(0, its aux loss)`` per micro-batch."""
        ps, buf, peer = self.ps, self.buffer, self.ps.peer
        out = torch.zeros(len(micro_batches), 2, dtype=torch.float64, device="cpu")
        grad_ctx = nullcontext() if train else torch.no_grad()
        if ps.stage == 0:
            kept = []
            for i, mb in enumerate(micro_batches):
                with grad_ctx, self._autocast():
                    x, aux = stage0_forward(self.model, mb[:, :-1].to(ps.device))
                buf.pp_send(x.detach().float(), peer)
                out[i, 1] = aux.detach().double().item()
                if train:
                    kept.append((x, aux))
            for x, aux in kept:
                grad = torch.empty(self.act_shape, dtype=torch.float32, device=ps.device)
                buf.pp_recv(grad, peer)
                tensors, grads = [x], [grad.to(x.dtype)]
                if aux.requires_grad:
                    tensors.append(aux * scale)
                    grads.append(None)
                torch.autograd.backward(tensors, grads)
            return out
        for i, mb in enumerate(micro_batches):
            x = torch.empty(self.act_shape, dtype=torch.float32, device=ps.device)
            buf.pp_recv(x, peer)
            x = x.to(self.model.embedding.dtype)
            with grad_ctx, self._autocast():
                if train:
                    x.requires_grad_(True)
                loss, aux = stage1_forward(self.model, x, mb[:, 1:].to(ps.device))
            if train:
                ((loss + aux) * scale).backward()
                buf.pp_send(x.grad.float(), peer)
            out[i, 0] = loss.detach().double().item()
            out[i, 1] = aux.detach().double().item()
        return out

    def close(self) -> None:
        self.buffer.destroy()


def _step_table(per_micro: torch.Tensor, ps: PipelineState, extra: list[float]) -> torch.Tensor:
    """Every rank's ``[n, 2]`` in one ``[n, D, 2]`` float64 table summed over the world (stage 0 adds its aux,
    stage 1 its cross-entropy and aux), plus ``extra`` summed."""
    n = per_micro.shape[0]
    table = torch.zeros(n, ps.dp_size, 2, dtype=torch.float64, device="cpu")
    table[:, ps.dp_rank] = per_micro
    flat = torch.cat([table.flatten(), torch.tensor(extra, dtype=torch.float64, device="cpu")]).to(ps.device)
    dist.all_reduce(flat)
    return flat.cpu()


def _clip(non_expert: list[torch.nn.Parameter], expert: list[torch.nn.Parameter], shared: torch.nn.Parameter | None,
          max_norm: float, ps: PipelineState) -> float:
    """Clip by the global L2 norm over both stages (a tied embedding counted once, on stage 0), each stage's part
    as `ep_moe.train.parallel.clip_grad_norm` forms it (its experts' squares summed over the stage's EP group)."""
    def squares(params) -> torch.Tensor:  # fp32 sums per tensor, added in fp64
        grads = [p.grad.float() for p in params if p.grad is not None and not (ps.stage == 1 and p is shared)]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=ps.device)
        return torch.stack([g.pow(2).sum() for g in grads]).double().sum()

    expert_sq = squares(expert).reshape(1)
    all_reduce_sum(expert_sq, ps.inside.ep_group, ps.deterministic)
    sq = (squares(non_expert) + expert_sq[0]).reshape(1)
    all_reduce_sum(sq, ps.pair_group, ps.deterministic)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in list(non_expert) + list(expert):
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def stage_state_names(model, stage: int) -> set[str]:
    """The ``model.state_dict()`` entries stage ``stage`` trains (the tied embedding on both)."""
    k = split_layer(model.config.num_layers)
    tied = model.output_weight is None
    names = set()
    for name in model.state_dict():
        if name.startswith("layers."):
            index = int(name.split(".")[1])
            if (index < k) == (stage == 0):
                names.add(name)
        elif name == "embedding":
            if stage == 0 or tied:
                names.add(name)
        elif stage == 1:  # the final norm and the untied output layer
            names.add(name)
    return names


class PipelineSteps:
    """The two-stage pipeline as the shared loop's `ep_moe.train.loop.TrainSteps` (see the module docstring)."""

    def __init__(self, recipe: Recipe, device: torch.device) -> None:
        t = recipe.train
        self.recipe, self.device = recipe, device
        self.ps = ps = build_pipeline_state(recipe.model.expert_model_parallel_size, device, t.deterministic)
        self.rank, self.world_size, self.ep_size = ps.rank, ps.world_size, ps.ep_size
        self.accum = t.global_batch_size // (t.micro_batch_size * ps.dp_size)
        self.dataset = build_dataset(recipe)
        # the whole model on every rank (its EP shard of every layer), with the stage's EP buffer; only this
        # stage's part is used and optimized
        self.model = model = build_model(recipe, ps.inside)
        config = model.config
        self.params = stage_parameters(model, ps.stage)
        self.shared = model.embedding if model.output_weight is None else None
        self.optimizer = build_optimizer(model, recipe, device, self.params)
        self.own = {id(p) for p in self.params}
        expert_ids = {id(p) for p in model.expert_parameters()}
        self.non_expert = [p for p in self.params if id(p) not in expert_ids]
        self.expert = [p for p in self.params if id(p) in expert_ids]
        k = split_layer(config.num_layers)
        self.own_moe = [layer.moe for layer in (model.layers[:k] if ps.stage == 0 else model.layers[k:])
                        if layer.moe is not None]
        self.runner = StageRunner(recipe, ps, model, self.accum)
        self.scale = 1.0 / (self.accum * ps.dp_size)
        model.train()

    def opening_lines(self) -> list[str]:
        ps, k = self.ps, split_layer(self.model.config.num_layers)
        return [f"ep-moe train: {ps.world_size} rank(s) on {self.device.type}, pipeline 2 stages x DP {ps.dp_size} "
                f"(layers [0, {k}) | [{k}, {self.model.config.num_layers})), EP {ps.ep_size} in each stage, "
                f"{batch_line(self.recipe, self.accum, self.dataset)}"]

    def title(self) -> str:
        return f"{self.recipe.name}: PP 2 x DP {self.ps.dp_size}"

    def find_checkpoint(self) -> str | None:
        return ckpt.find_checkpoint_to_load(self.recipe)

    def begin(self, step: int) -> tuple[float, torch.Tensor]:
        return begin_step(self.recipe, self.optimizer, self.dataset, step)

    def step(self, batch: torch.Tensor, stop_requested: bool) -> StepOutcome:
        per_micro, grad_norm = self._train_step(batch)
        loss, aux, stop = self._step_losses(per_micro, stop_requested)
        return StepOutcome(loss, aux, grad_norm, {}, stop)

    def _train_step(self, batch: torch.Tensor) -> tuple[torch.Tensor, float]:
        t, ps, shared = self.recipe.train, self.ps, self.shared
        for p in self.model.parameters():
            if id(p) not in self.own:
                p.grad = None
        mbs = [rank_slice(batch, ps.dp_rank, ps.dp_size, t.micro_batch_size, i) for i in range(self.accum)]
        per_micro = self.runner.run(mbs, self.scale, train=True)
        sync_gradients(self.non_expert, self.expert, ps.inside)
        if shared is not None:  # the tied embedding: stage 0's lookup + stage 1's output layer
            if shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            all_reduce_sum(shared.grad, ps.pair_group, ps.deterministic)
        grad_norm = _clip(self.non_expert, self.expert, shared, self.recipe.optimizer.clip_grad, ps)
        self.optimizer.step()
        for moe in self.own_moe:
            moe.router.update_expert_bias()
            moe.router.reset_stats()
        return per_micro, grad_norm

    def _step_losses(self, per_micro: torch.Tensor, stop: bool) -> tuple[float, float, bool]:
        n = self.accum * self.ps.dp_size
        table = _step_table(per_micro, self.ps, [1.0 if stop else 0.0])
        by_micro = table[: n * 2].view(n, 2)
        return row_order_mean(by_micro[:, 0]), row_order_mean(by_micro[:, 1]), bool(table[n * 2] > 0)

    def evaluate(self) -> float:
        return _evaluate(self.runner, self.dataset, self.recipe, self.ps, self.accum, self.own_moe)

    def _take_other_stage(self) -> dict:
        """Collective over the pair: this rank's model copy gets the other stage's current values, and the
        result is every parameter's optimizer state (this stage's own, the other stage's received), as one
        process training the whole model would hold them."""
        model, ps = self.model, self.ps
        values = model.state_dict()
        names = stage_state_names(model, ps.stage)
        params = dict(model.named_parameters())
        mine = {name: values[name].detach().cpu() for name in names}
        state = {name: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                        for k, v in self.optimizer.state[p].items()}
                 for name, p in params.items() if id(p) in self.own and p in self.optimizer.state}
        parts: list = [None, None]
        dist.all_gather_object(parts, (mine, state), group=ps.pair_group)
        other_values, other_state = parts[ps.peer]
        full = dict(self.optimizer.state)
        with torch.no_grad():
            for name, value in other_values.items():
                if name not in names:  # (a tied embedding is equal on both stages)
                    values[name].copy_(value)
        for name, entry in other_state.items():
            p = params[name]
            if id(p) not in self.own:
                full[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) and v.ndim else v for k, v in entry.items()}
        return full

    def save(self, step: int) -> str:
        return ckpt.save_checkpoint(self.recipe, self.model, self._take_other_stage(), self.ps, step)

    def load(self, path: str) -> int:
        return ckpt.load_checkpoint(path, self.model, self.optimizer, self.ps)

    def close(self) -> None:
        self.runner.close()


@torch.no_grad()
def _evaluate(runner: StageRunner, dataset, recipe: Recipe, ps: PipelineState, accum: int, own_moe) -> float:
    """Mean cross-entropy over ``eval_iters`` validation global batches, through the pipeline."""
    t = recipe.train
    runner.model.eval()
    mbs = [rank_slice(dataset.batch("valid", j, t.global_batch_size), ps.dp_rank, ps.dp_size, t.micro_batch_size, i)
           for j in range(t.eval_iters) for i in range(accum)]
    per_micro = runner.run(mbs, 1.0, train=False)
    runner.model.train()
    for moe in own_moe:  # drop the evaluation forwards' routing statistics
        moe.router.reset_stats()
    table = _step_table(per_micro, ps, [])
    n = len(mbs) * ps.dp_size
    return row_order_mean(table[: n * 2].view(n, 2)[:, 0])
