"""Fake (meta) implementations of the extension's torch ops (``ep_moe_native::*``, defined in
``csrc/expert_major_ops.cpp``), so that ``torch.compile`` traces through them. Imported by this package once
the extension has loaded."""

from __future__ import annotations

import torch


@torch.library.register_fake("ep_moe_native::expert_layout")
def _(topk_idx, num_experts, alignment, num_slots, capacity=0):
    rows, topk = topk_idx.shape
    exact = num_slots < 0 and capacity == 0
    if capacity:
        num_slots = num_experts * capacity
    elif exact:
        num_slots = torch.library.get_ctx().new_dynamic_size()
    longs = dict(dtype=torch.int64, device=topk_idx.device)
    host = torch.empty(num_experts if exact or capacity else 0, dtype=torch.int64, device="cpu")
    return (torch.empty(num_slots, **longs), torch.empty(rows, topk, **longs), torch.empty(rows, topk, **longs),
            torch.empty(num_experts, **longs), torch.empty(num_experts, **longs), host)


@torch.library.register_fake("ep_moe_native::permute_rows")
def _(x, pair_of_slot, num_topk, values):
    slots = pair_of_slot.shape[0]
    return x.new_empty(slots, x.shape[1]), x.new_empty(slots if values is not None else 0, dtype=torch.float32)


@torch.library.register_fake("ep_moe_native::permute_received_rows")
def _(rows, num_rows, own_x, own_tokens, rank_prefix_matrix, rank, pair_of_slot, num_topk, values):
    slots = pair_of_slot.shape[0]
    return rows.new_empty(slots, rows.shape[1]), rows.new_empty(slots if values is not None else 0, dtype=torch.float32)


@torch.library.register_fake("ep_moe_native::unpermute_sum")
def _(y, weights, sorted_slots, slot_values, slot_of_pair):
    pairs = sorted_slots.shape if slot_values is not None else (0,)
    return y.new_empty(sorted_slots.shape[0], y.shape[1]), y.new_empty(pairs, dtype=torch.float32)


@torch.library.register_fake("ep_moe_native::unpermute_own_rows")
def _(y, weights, sorted_slots, rank_prefix_matrix, rank):
    return y.new_empty(sorted_slots.shape[0], y.shape[1])


@torch.library.register_fake("ep_moe_native::unpermute_sum_backward")
def _(grad_out, y, weights, pair_of_slot, num_topk, need_grad_y, need_grad_weights):
    slots = pair_of_slot.shape[0]
    return (y.new_empty((slots, y.shape[1]) if need_grad_y else (0,)),
            y.new_empty(slots if need_grad_weights else 0, dtype=torch.float32))


@torch.library.register_fake("ep_moe_native::routing_map_to_topk")
def _(routing_map, probs, num_topk):
    tokens = routing_map.shape[0]
    return (routing_map.new_empty(tokens, num_topk, dtype=torch.int64),
            routing_map.new_empty(tokens, num_topk, dtype=torch.float32))


@torch.library.register_fake("ep_moe_native::routing_map_to_topk_backward")
def _(grad_weights, topk_idx, num_experts, dtype):
    return grad_weights.new_empty(topk_idx.shape[0], num_experts, dtype=dtype)
