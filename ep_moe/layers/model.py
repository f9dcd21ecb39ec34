"""`MoETransformer`: a small decoder-only language model with MoE FFNs (torchtitan-style plain PyTorch).

Pre-norm blocks ``x + attn(norm(x))``, ``x + ffn(norm(x))``; RMSNorm; RoPE (rotate-half) attention through
``F.scaled_dot_product_attention(is_causal=True)``; the FFN of layer ``i`` is a `MoELayer` when
``i % moe_layer_freq == 0`` and a dense SwiGLU otherwise. Embeddings are tied to the output layer by
default (Megatron's default; fewer parameters for a small model); set
``untie_embeddings_and_output_weights`` for a separate output matrix.

Initialisation does not depend on the EP size or on the global RNG: every parameter is drawn from a
generator seeded by ``(seed, module name)``, and every expert by ``(seed, module name, global expert id)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..buffer.buffer_v1 import Buffer
from .experts import GroupedExperts, SwiGLU, derive_seed, is_expert_param, scaled_output_std
from .model_config import ModelConfig
from .moe import MoELayer
from .router import TopKRouter


@dataclass
class ModelOutput:
    logits: Tensor             # [B, S, V], the parameters' dtype
    loss: Tensor | None        # 0-dim fp32 mean token cross-entropy over labels != -100, or None
    aux_loss: Tensor           # 0-dim fp32: sum of all MoE aux + z losses, coefficient-scaled (0 if none)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, returned in the input dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device="cpu"))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def rotary_tables(seq_length: int, head_dim: int, base: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """``cos, sin`` ``[S, head_dim]`` fp32 for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float64, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on ``x [B, heads, S, D]`` (fp32 math, ``x``'s dtype out)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE; ``wqkv [3H, H]``, ``wo [H, H]``, no biases."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, dtype = config.hidden_size, config.torch_dtype
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.init_method_std = config.init_method_std
        self.output_init_std = scaled_output_std(config.init_method_std, config.num_layers)
        self.wqkv = nn.Parameter(torch.empty(3 * h, h, dtype=dtype, device="cpu"))
        self.wo = nn.Parameter(torch.empty(h, h, dtype=dtype, device="cpu"))
        self.dropout = config.attention_dropout

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        for w, std in ((self.wqkv, self.init_method_std), (self.wo, self.output_init_std)):
            w.copy_(torch.empty(w.shape, dtype=torch.float32, device="cpu").normal_(0.0, std,
                                                                                    generator=generator))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = F.linear(x, self.wqkv).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return F.linear(out.transpose(1, 2).reshape(b, s, h), self.wo)


class TransformerBlock(nn.Module):
    """Pre-norm block; the FFN is ``self.moe`` (a `MoELayer`) or ``self.mlp`` (a dense SwiGLU)."""

    def __init__(self, config: ModelConfig, layer: int, buffer: Buffer | None, dp_group, num_sms: int,
                 num_worst_tokens: int = 0) -> None:
        super().__init__()
        dtype = config.torch_dtype
        self.hidden_dropout = config.hidden_dropout
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_epsilon, dtype)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_epsilon, dtype)
        self.moe: MoELayer | None = None
        self.mlp: SwiGLU | None = None
        if config.is_moe_layer(layer):
            impl = "auto" if config.moe_grouped_gemm else "loop"
            self.moe = MoELayer(config, buffer, dp_group, num_sms, expert_impl=impl, num_worst_tokens=num_worst_tokens)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.ffn_hidden_size, dtype, config.init_method_std,
                              scaled_output_std(config.init_method_std, config.num_layers))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + F.dropout(self.attn(self.attn_norm(x), cos, sin), self.hidden_dropout, self.training)
        ffn = self.moe if self.moe is not None else self.mlp
        return x + F.dropout(ffn(self.ffn_norm(x)), self.hidden_dropout, self.training)


class MoETransformer(nn.Module):
    """Decoder-only MoE language model.

    Parallelism is applied from outside: the caller makes the expert-parallel `Buffer` (one per EP group,
    shared by every MoE layer; see `ep_moe.train.parallel.build_ep_buffer`) and the SM count of each MoE
    layer, and passes them in.

    Args:
        config: the `ModelConfig`.
        buffer: the EP group's `Buffer` (experts split over its ranks); None = all experts in this process,
            no communication.
        expert_dp_group: the ranks holding the same experts (kept as ``self.expert_dp_group`` for the
            trainer's gradient reduction; the model itself never uses it).
        dp_group: the ranks that see different tokens (the whole data-parallel world, EP ranks included):
            the global aux loss and the expert-bias update sum token counts over it.
        num_sms: SMs of each MoE layer's dispatch/combine: one count for all, or one per MoE layer (in layer
            order); 0 = decided by the layer's `TokenDispatcher` on its first call.
        seed: initialisation seed (the same model for every EP size).
        num_worst_tokens: fixed-size dispatch in every MoE layer (see `MoELayer`); 0 = exact sizes.

    Gradient reduction the trainer must do (each rank's loss is the mean over its own tokens): non-expert
    gradients: sum over ``dp_group`` / its size; expert gradients (`expert_parameters`): sum over
    ``expert_dp_group`` / the size of ``dp_group`` -- expert weights already received the gradient of every
    EP rank's loss through the dispatcher's backward, so they are divided by the same total.
    """

    def __init__(self, config: ModelConfig, *, buffer: Buffer | None = None,
                 expert_dp_group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None,
                 num_sms: int | Sequence[int] = 0, seed: int = 0, num_worst_tokens: int = 0) -> None:
        super().__init__()
        self.config = config
        self.buffer = buffer
        self.ep_group = buffer.group if buffer is not None else None
        self.expert_dp_group, self.dp_group = expert_dp_group, dp_group
        self.seed = seed
        moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
        if isinstance(num_sms, int):
            layer_sms = [num_sms] * len(moe_layers)
        else:
            layer_sms = list(num_sms)
            if len(layer_sms) != len(moe_layers):
                raise ValueError(f"MoETransformer: argument 'num_sms' must be an int or one count per MoE layer "
                                 f"({len(moe_layers)}), got {len(layer_sms)} counts")
        sms_of_layer = dict(zip(moe_layers, layer_sms))
        dtype = config.torch_dtype
        # Submodules draw a throwaway init from the global RNG; keep the caller's RNG state untouched.
        with torch.random.fork_rng(devices=[]):
            self.embedding = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype,
                                                       device="cpu"))
            self.layers = nn.ModuleList(TransformerBlock(config, i, buffer, dp_group, sms_of_layer.get(i, 0),
                                                         num_worst_tokens) for i in range(config.num_layers))
            self.final_norm = RMSNorm(config.hidden_size, config.norm_epsilon, dtype)
            self.output_weight: nn.Parameter | None = None
            if config.untie_embeddings_and_output_weights:
                self.output_weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype,
                                                               device="cpu"))
        self.reset_parameters(seed)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [layer.moe for layer in self.layers if layer.moe is not None]

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise every parameter from generators seeded by ``(seed, name)`` (see the module docstring)."""
        std = self.config.init_method_std
        for name in ("embedding", "output_weight"):
            w = getattr(self, name)
            if w is not None:
                gen = torch.Generator().manual_seed(derive_seed(seed, name))
                w.copy_(torch.empty(w.shape, dtype=torch.float32, device="cpu").normal_(0.0, std,
                                                                                        generator=gen))
        for name, module in self.named_modules():
            if isinstance(module, GroupedExperts):
                module.reset_parameters(derive_seed(seed, name))
            elif isinstance(module, SwiGLU | TopKRouter | Attention | RMSNorm | MoELayer):
                module.reset_parameters(torch.Generator().manual_seed(derive_seed(seed, name)))

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> ModelOutput:
        """``input_ids [B, S]`` int64 -> `ModelOutput`. ``labels [B, S]`` int64: the target of each position
        (already shifted by the caller), ``-100`` = ignored."""
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"MoETransformer: argument 'input_ids' must be a [B, S] integer tensor, "
                             f"got {tuple(input_ids.shape)} {input_ids.dtype}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"MoETransformer: argument 'labels' must have input_ids' shape "
                             f"{tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        c = self.config
        seq_length = input_ids.shape[1]
        x = F.embedding(input_ids, self.embedding)
        cos, sin = rotary_tables(seq_length, c.head_dim, c.rotary_base, x.device)
        aux_loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
            if layer.moe is not None:
                aux_loss = aux_loss + layer.moe.aux_loss
        x = self.final_norm(x)
        output_weight = self.output_weight if self.output_weight is not None else self.embedding
        logits = F.linear(x, output_weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return ModelOutput(logits, loss, aux_loss)

    # ------------------------------------------------------------------ what the trainer calls
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing: update every router's expert bias from the token counts of the
        micro-batches since the last call. Once per optimizer step, on every rank (collective over
        ``dp_group``). No-op unless ``moe_router_enable_expert_bias``."""
        for moe in self.moe_layers:
            moe.router.update_expert_bias()

    def moe_stats(self) -> dict[str, float]:
        """Routing statistics since the last call, identical on every EP rank (collective over ``ep_group``).

        Keys: ``aux_loss`` and ``z_loss`` (raw, without coefficients, mean over MoE layers, forwards and EP
        ranks; ``aux_loss`` is 1.0 for perfectly balanced uniform routing), ``load_imbalance`` (max / mean
        tokens per expert over the EP group's tokens, mean over MoE layers; 1.0 = balanced),
        ``load_imbalance_max`` (the worst layer) and ``load_imbalance_layers`` (one per MoE layer). Empty dict
        when nothing ran since the last call.
        """
        layers = self.moe_layers
        if not layers or layers[0].router.stats()[3] == 0:
            return {}
        rows = []
        for moe in layers:
            counts, aux, z, calls = moe.router.stats()
            rows.append(torch.cat([counts, (aux / calls).view(1), (z / calls).view(1)]))
            moe.router.reset_stats()
        table = torch.stack(rows).to(self.embedding.device if self.buffer is None else self.buffer.device)
        ep_size = 1
        if self.ep_group is not None:
            dist.all_reduce(table, group=self.ep_group)
            ep_size = dist.get_world_size(self.ep_group)
        table = table.double().cpu()
        counts = table[:, :-2]
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)
        return {"aux_loss": float(table[:, -2].mean()) / ep_size, "z_loss": float(table[:, -1].mean()) / ep_size,
                "load_imbalance": float(imbalance.mean()), "load_imbalance_max": float(imbalance.max()),
                "load_imbalance_layers": [float(v) for v in imbalance]}

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters split over the EP group (gradients reduced over ``expert_dp_group``)."""
        return [p for p in self.parameters() if is_expert_param(p)]

    def non_expert_parameters(self) -> list[nn.Parameter]:
        """Parameters replicated on every rank (gradients reduced over ``dp_group``)."""
        return [p for p in self.parameters() if not is_expert_param(p)]

    def num_parameters(self, global_experts: bool = True) -> int:
        """Parameter count; with ``global_experts`` the experts of every EP rank are counted."""
        experts = sum(p.numel() for p in self.expert_parameters())
        ep_size = self.buffer.group_size if self.buffer is not None else 1
        return sum(p.numel() for p in self.non_expert_parameters()) + experts * (ep_size if global_experts else 1)
