"""Benchmark inputs: random tokens and DeepEP-style random routing, in several sets that the timing
loop rotates through (so that the GPU's L2 cache does not serve them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..reference import reference_layout
from .accounting import FP8_BLOCK

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # "fp8" is the pair (x_e4m3, scales)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class InputSet:
    """One rank's inputs for one dispatch: ``x [T, H]`` (bf16/fp32), ``topk_idx [T, K]`` int64,
    ``topk_weights [T, K]`` fp32, and the reference layout (`ep_moe.reference.reference_layout`, which shares
    no code with any backend):
    ``num_tokens_per_rank [R]`` int32, ``num_tokens_per_expert [E]`` int32, ``is_token_in_rank [T, R]`` bool."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor


def num_input_sets(set_bytes: int, cache_bytes: int, min_sets: int = 2, max_sets: int = 64) -> int:
    """How many input sets to rotate so that together they are at least twice the cache: a set is
    then evicted before it is used again. At least ``min_sets``, at most ``max_sets``."""
    if set_bytes <= 0:
        return min_sets
    return max(min_sets, min(max_sets, math.ceil(2 * cache_bytes / set_bytes)))


def make_input_set(tokens: int, hidden: int, num_experts: int, num_topk: int, num_ranks: int,
                   dtype: torch.dtype, device: torch.device, seed: int) -> InputSet:
    """DeepEP's intranode test routing: scores ``|N(0,1)| + 1``, top-k unsorted; tokens ``N(0,1)``
    (never zeros); weights from the softmax of the chosen scores."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn(tokens, num_experts, generator=gen, dtype=torch.float32, device=device).abs() + 1
    top_scores, topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)
    topk_weights = torch.softmax(top_scores, dim=-1).to(torch.float32)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float32, device=device).to(dtype)
    per_rank, per_expert, in_rank = (t.to(device) for t in reference_layout(topk_idx, num_experts, num_ranks))
    return InputSet(x, topk_idx.contiguous(), topk_weights.contiguous(), per_rank, per_expert, in_rank)


def to_fp8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [T, H]`` per token and per 128 columns: ``(x_e4m3 [T, H], scales [T, H/128] fp32)``
    with ``x ≈ x_e4m3 * scales``. Row by row and deterministic: quantizing received rows gives the
    same bits as receiving quantized rows."""
    tokens, hidden = x.shape
    if hidden % FP8_BLOCK:
        raise ValueError(f"to_fp8_blocks: hidden size must be a multiple of {FP8_BLOCK}, got {hidden}")
    blocks = x.float().view(tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    scales = blocks.abs().amax(dim=-1).clamp(min=1e-4) / FP8_MAX
    data = (blocks / scales.unsqueeze(-1)).view(tokens, hidden).to(torch.float8_e4m3fn)
    return data, scales.contiguous()
