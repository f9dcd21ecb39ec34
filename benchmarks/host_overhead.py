"""Host microseconds per call of ep_moe's operations beside their GPU microseconds, every timed call checked.

    python3 benchmarks/host_overhead.py [--tokens 128,4096 --hidden 7168 --experts 256 --topk 8] [--json FILE]
    torchrun --nproc-per-node N benchmarks/host_overhead.py ...      (or --nproc N: N ranks spawned here)

Per token count and operation, ``--rounds`` timed rounds (after ``--warmup`` untimed ones) of ``--calls``
back-to-back calls, nothing waited on between them:

* ``host us``: the wall time to issue the round's calls / calls (median over rounds);
* ``GPU us``: CUDA events around the same calls / calls (read after a sync). A device sleep queued before the
  start event lets the host queue the whole round first, so this is the GPU's own time, except for operations
  that wait for the device inside the call (``sync`` yes: the exact-size dispatch reads its counts): they get no
  sleep, and their GPU time includes the gaps the host leaves;
* ``host/GPU``: host-bound (``bound`` host) when above 1;
* ``floor us``: host us of one ``torch.index_select`` of the rows the operation outputs (its own row: one launch);
  ``above floor``: (host - floor) / host.

Every call is checked: one untimed reference call per input set first (itself checked against an independent
torch computation), then every call of every round (warm-up rounds included) by fingerprint against the reference
call of its input set, and the last timed call of each operation in full, bit for bit, naming the first
differing element. A mismatch marks the row ``DIFF`` and the run exits 1, naming the operation and the call.
On CPU (gloo, the torch backend, small default sizes) the GPU columns read n/a.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import importlib
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from _checked import RTOL, mismatch, report

import ep_moe


# ---------------------------------------------------------------------------------------------- resolved names
def _resolve(attr: str, *modules: str):
    """``attr`` of the first of ``modules`` that has it (the one place this script names ep_moe's internals)."""
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, attr):
            return getattr(module, attr)
    raise ImportError(f"host_overhead: none of {list(modules)} provides {attr!r}")


def _optional(attr: str, *modules: str):
    try:
        return _resolve(attr, *modules)
    except ImportError:
        return None


fingerprint = _resolve("fingerprint", "ep_moe.benchmarking.fingerprint", "ep_moe.benchmarking")
launch = _resolve("launch", "ep_moe.distributed")
run_distributed = _resolve("run_distributed", "ep_moe.distributed")
torchrun_env = _resolve("torchrun_env", "ep_moe.distributed")
free_port = _resolve("free_port", "ep_moe.distributed")
implementations_run = _optional("implementations_run", "ep_moe.permute", "ep_moe.buffer.permute")
reset_implementations_run = _optional("reset_implementations_run", "ep_moe.permute", "ep_moe.buffer.permute")
MEGATRON_MODULE = "ep_moe.integrations.megatron"

TOOL = "host_overhead"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ep_moe.__file__)))  # for short names in --profile
GPU_DEFAULTS = {"tokens": "128,4096", "hidden": 7168, "experts": 256, "topk": 8}  # DeepEP's intranode workload
CPU_DEFAULTS = {"tokens": "32,128", "hidden": 256, "experts": 16, "topk": 4}
OPS = ("layout", "dispatch", "dispatch_cached", "dispatch_fixed", "combine", "expert_dispatch", "expert_combine",
       "token_dispatcher", "token_dispatcher_fwd_bwd", "megatron_dispatcher")
CYCLES_PER_US = 2000  # torch.cuda._sleep spins SM clock cycles: ~2 GHz (a slower clock only sleeps longer)
PROBE_SLEEP_US = 20_000.0
L2_BYTES = 50 << 20
MAX_SETS = 8
SHOWN_PROBLEMS = 6
# What an operation's index_select floor gathers: the rows a rank receives (rank-major), its expert-major rows (one
# per local (token, expert) pair), or its tokens (the layout reads no rows: one launch over T rows).
FLOOR_ROWS = ("received rows", "expert rows", "tokens")


# ---------------------------------------------------------------------------------------------- inputs
@dataclass
class InputSet:
    """One rank's inputs: ``x [T, H]`` (bf16/fp32, N(0,1)), ``topk_idx [T, K]`` int64 (DeepEP's routing: top-k of
    scores |N(0,1)| + 1), ``topk_weights [T, K]`` fp32 (softmax of the chosen scores), ``grad [T, H]`` (the output
    gradient of the backward rows) and the layout computed here: ``per_rank [R]``, ``per_expert [E]`` int32,
    ``in_rank [T, R]`` bool."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    grad: torch.Tensor
    per_rank: torch.Tensor
    per_expert: torch.Tensor
    in_rank: torch.Tensor


def reference_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(per_rank [R] int32, per_expert [E] int32, in_rank [T, R] bool)`` of ``topk_idx [T, K]`` (-1: none), by the
    definitions of docs/semantics.md (one-hot sums, no code shared with a backend)."""
    local = num_experts // num_ranks
    valid = topk_idx >= 0
    experts = torch.nn.functional.one_hot(topk_idx.clamp(min=0), num_experts) * valid.unsqueeze(-1)  # [T, K, E]
    per_expert = experts.sum(dim=(0, 1)).to(torch.int32)
    ranks = torch.nn.functional.one_hot(topk_idx.clamp(min=0) // local, num_ranks) * valid.unsqueeze(-1)
    in_rank = ranks.sum(dim=1) > 0
    return in_rank.sum(dim=0).to(torch.int32), per_expert, in_rank


def make_input_set(tokens: int, hidden: int, experts: int, topk: int, ranks: int, dtype: torch.dtype,
                   device: torch.device, seed: int) -> InputSet:
    """One rank's `InputSet` of ``tokens`` x ``hidden`` in ``dtype`` on ``device``, top-``topk`` of ``experts`` over
    ``ranks`` ranks, drawn on the CPU from ``seed`` (the same on every device)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.randn(tokens, experts, generator=gen).abs() + 1
    top, idx = torch.topk(scores, topk, dim=-1, sorted=False)
    weights = torch.softmax(top, dim=-1)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    grad = torch.randn(tokens, hidden, generator=gen).to(dtype)
    per_rank, per_expert, in_rank = reference_layout(idx, experts, ranks)
    return InputSet(*(t.to(device).contiguous() for t in (x, idx, weights, grad, per_rank, per_expert, in_rank)))


# ---------------------------------------------------------------------------------------------- operations
Outputs = dict[str, object]  # name -> tensor on the device (fingerprinted), or host data (compared by ==)


@dataclass
class Op:
    """One row: ``call(i)`` makes one call on input set ``i`` and returns what it returned; ``outputs`` names the
    parts of that to check; ``semantics(i, outputs)`` checks the untimed reference call on set ``i`` against an
    independent computation (a list of mismatches); ``floor``: which rows it moves (a key of `FLOOR_ROWS`, for its
    index_select floor); ``expert``: the expert-major permute runs in it."""

    name: str
    call: Callable[[int], object]
    outputs: Callable[[object], Outputs]
    semantics: Callable[[int, Outputs], list[str]] | None = None
    floor: str | None = None
    expert: bool = False


@dataclass
class Row:
    op: str
    tokens: int
    host_us: float | None = None
    gpu_us: float | None = None
    host_p10_us: float | None = None
    host_p90_us: float | None = None
    gpu_p10_us: float | None = None
    gpu_p90_us: float | None = None
    floor_us: float | None = None
    sync: bool | None = None
    check: str = "ok"
    kernels: str = ""
    note: str = ""
    gpu_rounds: int = 0
    profile: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.host_us / self.gpu_us if self.host_us and self.gpu_us else None

    @property
    def above_floor(self) -> float | None:
        if self.host_us is None or self.floor_us is None or self.op.startswith("index_select"):
            return None
        return (self.host_us - self.floor_us) / self.host_us

    def to_json(self) -> dict:
        ratio = self.ratio
        return {"op": self.op, "tokens": self.tokens, "host_us": self.host_us, "gpu_us": self.gpu_us,
                "host_per_gpu": ratio, "bound": None if ratio is None else ("host" if ratio > 1 else "gpu"),
                "host_p10_us": self.host_p10_us, "host_p90_us": self.host_p90_us, "gpu_p10_us": self.gpu_p10_us,
                "gpu_p90_us": self.gpu_p90_us, "gpu_rounds": self.gpu_rounds, "floor_us": self.floor_us,
                "above_floor": self.above_floor, "sync": self.sync, "check": self.check, "kernels": self.kernels,
                "note": self.note, "profile": self.profile, "problems": self.problems}


def _bits(what: str, got, want) -> list[str]:
    found = mismatch(what, got, want, None)
    return [found] if found else []


def _close(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """Within the tolerance of a result computed another way (`_checked.RTOL` of ``dtype``, at least 1e-4: sums
    over the hidden size in fp32)."""
    found = mismatch(what, got, want.to(got.dtype) if got.dtype != want.dtype else want, max(RTOL[dtype], 1e-4))
    return [found] if found else []


class Workload:
    """The operations of one token count on one rank, over ``buffer``."""

    def __init__(self, args: argparse.Namespace, buffer, rank: int, world: int, tokens: int, device: torch.device,
                 megatron: object | None):
        self.args, self.buffer, self.rank, self.world, self.tokens = args, buffer, rank, world, tokens
        self.device, self.megatron = device, megatron
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        self.local = args.experts // world
        set_bytes = tokens * args.hidden * self.dtype.itemsize * (1 + min(world, args.topk))
        self.num_sets = args.sets or max(2, min(MAX_SETS, math.ceil(2 * L2_BYTES / set_bytes)))
        self.sets = [make_input_set(tokens, args.hidden, args.experts, args.topk, world, self.dtype, device,
                                    seed=args.seed * 1_000_003 + tokens * 1009 + i * 101 + rank)
                     for i in range(self.num_sets)]
        self._exact: list | None = None
        self._expert: list | None = None
        self._dispatcher = None
        self._grad_inputs: list | None = None

    # ------------------------------------------------------------------ untimed inputs of the later operations
    def exact(self, i: int):
        """The untimed exact-size dispatch of set ``i`` (its handle and rows feed cached dispatch and combine)."""
        if self._exact is None:
            self._exact = [self.dispatch(j) for j in range(self.num_sets)]
        return self._exact[i]

    def expert_out(self, i: int):
        if self._expert is None:
            self._expert = [self.expert_dispatch(j) for j in range(self.num_sets)]
        return self._expert[i]

    def dispatcher(self):
        if self._dispatcher is None:
            self._dispatcher = ep_moe.TokenDispatcher(self.buffer, self.args.experts)
        return self._dispatcher

    # ------------------------------------------------------------------ the calls
    def dispatch(self, i: int, num_worst_tokens: int = 0):
        s = self.sets[i]
        return self.buffer.dispatch(s.x, num_tokens_per_rank=s.per_rank, is_token_in_rank=s.in_rank,
                                    num_tokens_per_expert=s.per_expert, topk_idx=s.topk_idx,
                                    topk_weights=s.topk_weights, num_worst_tokens=num_worst_tokens)

    def expert_dispatch(self, i: int):
        s = self.sets[i]
        return ep_moe.expert_dispatch(self.buffer, s.x, s.topk_idx, s.topk_weights, self.args.experts)

    def dispatcher_forward(self, i: int):
        s, d = self.sets[i], self.dispatcher()
        rows, probs, per_expert, ctx = d.dispatch(s.x, s.topk_idx, s.topk_weights)
        return rows, probs, per_expert, d.combine(rows, ctx, probs)

    def dispatcher_forward_backward(self, i: int):
        x, w = self._grad_inputs[i]
        d = self.dispatcher()
        rows, probs, _, ctx = d.dispatch(x, self.sets[i].topk_idx, w)
        out = d.combine(rows, ctx, probs)
        grad_x, grad_w = torch.autograd.grad(out, (x, w), self.sets[i].grad)
        return out.detach(), grad_x, grad_w

    def megatron_forward(self, i: int):
        d, (routing_map, probs) = self.megatron, self._routing[i]
        s = self.sets[i]
        hidden, topk_probs = d.dispatch_preprocess(s.x.view(self.tokens, 1, -1), routing_map, probs)
        rows, row_probs = d.token_dispatch(hidden, topk_probs)
        rows, per_expert, row_probs = d.dispatch_postprocess(rows, row_probs)
        out = d.combine_postprocess(d.token_combine(d.combine_preprocess(rows)))
        return rows, per_expert, row_probs, out

    # ------------------------------------------------------------------ independent references
    def _local_pairs(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (token, k) pairs in expert-major order (expert, then token, then k): flat pair indices
        ``t * K + k`` [P] int64 and their local expert ids [P]."""
        idx = self.sets[i].topk_idx.reshape(-1)
        local = torch.where((idx >= 0) & (idx // self.local == self.rank), idx - self.rank * self.local, -1)
        pairs = (local >= 0).nonzero().squeeze(1)
        order = torch.sort(local[pairs] * pairs.numel() + torch.arange(pairs.numel(), device=idx.device)).indices
        return pairs[order], local[pairs[order]]

    def _weighted_sum(self, i: int) -> torch.Tensor:
        """``sum_k w[t, k] * x[t]`` over the token's experts (identity experts), float64."""
        s = self.sets[i]
        return s.x.double() * (s.topk_weights.double() * (s.topk_idx >= 0)).sum(dim=1, keepdim=True)

    def _check_layout(self, i: int, out: Outputs) -> list[str]:
        s = self.sets[i]
        return [p for name, want in (("num_tokens_per_rank", s.per_rank), ("num_tokens_per_expert", s.per_expert),
                                     ("is_token_in_rank", s.in_rank))
                for p in _bits(f"{name} vs the one-hot reference", out[name].to(want.dtype), want)]

    def _check_dispatch(self, i: int, out: Outputs, rows: int | None = None) -> list[str]:
        if self.world != 1:  # the rows of other ranks: checked by the round trip of combine
            return []
        s = self.sets[i]
        got = out["recv_x"] if rows is None else out["recv_x"][:rows]
        problems = _bits("recv_x vs x[is_token_in_rank]", got, s.x[s.in_rank[:, 0]])
        if rows is None:  # one rank: every expert is local, every token received once
            problems += _bits("recv_topk_idx vs topk_idx", out["recv_topk_idx"], s.topk_idx[s.in_rank[:, 0]])
            problems += _bits("recv_topk_weights vs topk_weights", out["recv_topk_weights"],
                              (s.topk_weights * (s.topk_idx >= 0))[s.in_rank[:, 0]])
        counts = torch.bincount(s.topk_idx[s.topk_idx >= 0], minlength=self.args.experts).tolist()
        if rows is None and out["num_recv_tokens_per_expert_list"] != counts:
            problems.append(f"num_recv_tokens_per_expert_list {out['num_recv_tokens_per_expert_list']} "
                            f"!= the routing's {counts}")
        return problems

    def _check_fixed(self, i: int, out: Outputs) -> list[str]:
        exact = self.exact(i)
        rows = exact[0].shape[0]
        problems = self._check_dispatch(i, out, rows)
        for name, want, pad in (("recv_x", exact[0], 0), ("recv_topk_idx", exact[1], -1),
                                ("recv_topk_weights", exact[2], 0)):
            problems += _bits(f"fixed-size {name}[:{rows}] vs the exact-size dispatch", out[name][:rows], want)
            if bool((out[name][rows:] != pad).any()):
                problems.append(f"fixed-size {name}: padding rows after row {rows} are not {pad}")
        return problems

    def _check_expert_dispatch(self, i: int, out: Outputs) -> list[str]:
        if self.world != 1:
            return []
        s, K = self.sets[i], self.args.topk
        pairs, experts = self._local_pairs(i)
        problems = _bits("expert_x vs x of each (expert, token, k)", out["expert_x"], s.x[pairs // K])
        problems += _bits("expert_weights vs each pair's weight", out["expert_weights"],
                          s.topk_weights.reshape(-1)[pairs])
        problems += _bits("tokens_per_expert vs the routing", out["tokens_per_expert"],
                          torch.bincount(experts, minlength=self.local).to(out["tokens_per_expert"].dtype))
        return problems

    def _check_forward_backward(self, i: int, out: Outputs) -> list[str]:
        s = self.sets[i]
        valid = s.topk_idx >= 0
        grad_x = s.grad.double() * (s.topk_weights.double() * valid).sum(dim=1, keepdim=True)
        grad_w = (s.grad.double() * s.x.double()).sum(dim=1, keepdim=True) * valid
        return (_close("combined vs sum_k w x", out["combined"], self._weighted_sum(i), self.dtype)
                + _close("grad_x vs grad * sum_k w", out["grad_x"], grad_x, self.dtype)
                + _close("grad_weights vs <grad, x>", out["grad_weights"], grad_w, self.dtype))

    def _check_megatron(self, i: int, out: Outputs) -> list[str]:
        s = self.sets[i]
        copies = (s.topk_idx >= 0).sum(dim=1, keepdim=True).double()
        problems = _close("output vs x * experts of the token", out["output"].view(self.tokens, -1),
                          s.x.double() * copies, self.dtype)
        if self.world == 1:
            counts = torch.bincount(s.topk_idx[s.topk_idx >= 0], minlength=self.args.experts).tolist()
            if out["tokens_per_expert"] != counts:
                problems.append(f"tokens_per_expert {out['tokens_per_expert']} != the routing's {counts}")
        return problems

    # ------------------------------------------------------------------ the rows
    def floor_index(self, kind: str, i: int) -> torch.Tensor:
        """The rows of ``x`` one index_select of the ``kind`` floor (`FLOOR_ROWS`) gathers on set ``i``: at one rank
        the token of each output row, in the operation's order; at more ranks as many rows (``arange % T``)."""
        if kind == "tokens":
            return torch.arange(self.tokens, device=self.device)
        if self.world == 1:
            if kind == "received rows":
                return self.sets[i].in_rank[:, 0].nonzero().squeeze(1)
            return self._local_pairs(i)[0] // self.args.topk
        count = self.exact(i)[0].shape[0] if kind == "received rows" else self.expert_out(i).expert_x.shape[0]
        return torch.arange(count, device=self.device) % self.tokens

    def ops(self, names: tuple[str, ...]) -> list[Op]:
        worst = self.tokens * self.world
        rank_rows, pair_rows, token_rows = FLOOR_ROWS

        def dispatch_outputs(r) -> Outputs:
            recv_x, recv_idx, recv_w, counts, handle, _ = r
            return {"recv_x": recv_x, "recv_topk_idx": recv_idx, "recv_topk_weights": recv_w,
                    "num_recv_tokens_per_expert_list": list(counts), "rank_prefix_matrix": handle.rank_prefix_matrix}

        def expert_outputs(r) -> Outputs:
            return {"expert_x": r.expert_x, "expert_weights": r.expert_weights,
                    "tokens_per_expert": r.tokens_per_expert, "pairs_per_expert": r.pairs_per_expert}

        def combine_check(i, out):
            s = self.sets[i]  # each token once per rank it went to, summed in fp32: x * copies exactly
            want = (s.x.float() * s.in_rank.sum(dim=1, keepdim=True)).to(s.x.dtype)
            return _bits("combined_x vs x * ranks of the token", out["combined_x"], want)

        all_ops = {
            "layout": Op("layout", lambda i: self.buffer.get_dispatch_layout(self.sets[i].topk_idx, self.args.experts),
                         lambda r: {"num_tokens_per_rank": r[0], "num_tokens_per_expert": r[2],
                                    "is_token_in_rank": r[3]}, self._check_layout, token_rows),
            "dispatch": Op("dispatch", self.dispatch, dispatch_outputs, self._check_dispatch, rank_rows),
            "dispatch_cached": Op(
                "dispatch_cached", lambda i: self.buffer.dispatch(self.sets[i].x, handle=self.exact(i)[4]),
                lambda r: {"recv_x": r[0]},
                lambda i, out: _bits("recv_x vs the exact-size dispatch", out["recv_x"], self.exact(i)[0]), rank_rows),
            "dispatch_fixed": Op("dispatch_fixed", lambda i: self.dispatch(i, worst), dispatch_outputs,
                                 self._check_fixed, rank_rows),
            "combine": Op("combine", lambda i: self.buffer.combine(self.exact(i)[0], self.exact(i)[4]),
                          lambda r: {"combined_x": r[0]}, combine_check, rank_rows),
            "expert_dispatch": Op("expert_dispatch", self.expert_dispatch, expert_outputs,
                                  self._check_expert_dispatch, pair_rows, expert=True),
            "expert_combine": Op(
                "expert_combine", lambda i: ep_moe.expert_combine(self.buffer, self.expert_out(i).expert_x,
                                                                  self.expert_out(i).handle,
                                                                  self.expert_out(i).expert_weights),
                lambda r: {"combined_x": r},
                lambda i, out: _close("combined_x vs sum_k w x", out["combined_x"], self._weighted_sum(i),
                                      self.dtype), pair_rows, expert=True),
            "token_dispatcher": Op(
                "token_dispatcher", self.dispatcher_forward,
                lambda r: {"expert_x": r[0], "expert_probs": r[1], "tokens_per_expert": r[2], "combined": r[3]},
                lambda i, out: _close("combined vs sum_k w x", out["combined"], self._weighted_sum(i), self.dtype),
                pair_rows, expert=True),
            "token_dispatcher_fwd_bwd": Op(
                "token_dispatcher_fwd_bwd", self.dispatcher_forward_backward,
                lambda r: {"combined": r[0], "grad_x": r[1], "grad_weights": r[2]}, self._check_forward_backward,
                pair_rows, expert=True),
            "megatron_dispatcher": Op(
                "megatron_dispatcher", self.megatron_forward,
                lambda r: {"expert_input": r[0], "tokens_per_expert": r[1].tolist(), "permuted_probs": r[2],
                           "output": r[3]}, self._check_megatron, pair_rows, expert=True),
        }
        if "token_dispatcher_fwd_bwd" in names:
            self._grad_inputs = [(s.x.clone().requires_grad_(True), s.topk_weights.clone().requires_grad_(True))
                                 for s in self.sets]
        if "megatron_dispatcher" in names and self.megatron is not None:
            E = self.args.experts
            self._routing = []
            for s in self.sets:
                valid = s.topk_idx >= 0
                routing_map = torch.zeros(self.tokens, E, dtype=torch.bool, device=self.device).scatter(
                    1, s.topk_idx.clamp(min=0), valid)
                probs = torch.zeros(self.tokens, E, device=self.device).scatter(
                    1, s.topk_idx.clamp(min=0), s.topk_weights * valid)
                self._routing.append((routing_map, probs))
        return [all_ops[n] for n in names if n != "megatron_dispatcher" or self.megatron is not None]


# ---------------------------------------------------------------------------------------------- measurement
def _prints(outputs: Outputs, device: torch.device) -> tuple[list[str], torch.Tensor, dict]:
    """Queue the fingerprints of ``outputs``' tensors on ``device`` (no host sync); the rest is host data."""
    names = [n for n, v in outputs.items() if isinstance(v, torch.Tensor) and v.device == device]
    host = {n: (v.tolist() if isinstance(v, torch.Tensor) else v) for n, v in outputs.items() if n not in names}
    values = fingerprint(*(outputs[n] for n in names)) if names else torch.zeros(0, dtype=torch.int64)
    return names, values, host


def _read(prints: tuple[list[str], torch.Tensor, dict]) -> dict:
    names, values, host = prints
    return dict(zip(names, values.tolist())) | host


class Measurer:
    """Times and checks the operations of this rank (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, world: int):
        self.args, self.device, self.world = args, device, world
        self.cuda = device.type == "cuda"
        self.sleep = getattr(torch.cuda, "_sleep", None) if self.cuda else None

    def gate(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.world > 1:
            dist.barrier()

    def syncs(self, op: Op, check: Callable) -> bool | None:
        """Whether ``op`` waits for the device inside the call: after a long device sleep, a call that returns
        only once the sleep is over. None where that cannot be told (CPU, no device sleep)."""
        if self.sleep is None:
            return None
        self.gate()
        self.sleep(int(PROBE_SLEEP_US * CYCLES_PER_US))
        start = time.perf_counter()
        result = op.call(0)
        waited = (time.perf_counter() - start) * 1e6 > PROBE_SLEEP_US / 2
        check("probe call", 0, result)
        return waited

    def measure(self, op: Op, num_sets: int, tokens: int) -> tuple[Row, list[float], list[float]]:
        """One row of this rank (its per-round host and GPU microseconds per call returned beside it)."""
        args, row = self.args, Row(op.name, tokens)
        reference = [op.outputs(op.call(i)) for i in range(num_sets)]
        if op.semantics is not None:
            row.problems += [f"reference call (set {i}): {p}" for i in range(num_sets)
                             for p in op.semantics(i, reference[i])]
        want = [_read(_prints(r, self.device)) for r in reference]
        pending: list[tuple[str, int, tuple]] = []

        def check(label: str, i: int, result) -> None:
            pending.append((label, i, _prints(op.outputs(result), self.device)))

        def settle() -> None:
            for label, i, prints in pending:
                got = _read(prints)
                row.problems += [f"{label} (set {i}): {name} differs from the reference call"
                                 for name, value in want[i].items() if got.get(name) != value]
            pending.clear()

        if reset_implementations_run is not None:
            reset_implementations_run()
        row.sync = self.syncs(op, check)
        head_start_us, calls, host, gpu, n = 1000.0, args.calls, [], [], 0
        last = None
        for r in range(args.warmup + args.rounds):
            timed = r >= args.warmup
            sets = [(n + j) % num_sets for j in range(calls)]
            n += calls
            self.gate()
            if self.cuda:
                if self.sleep is not None and not row.sync:
                    self.sleep(int(head_start_us * CYCLES_PER_US))
                ready, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                ready.record()
                start.record()
            t0 = time.perf_counter()
            results = [op.call(i) for i in sets]
            t1 = time.perf_counter()
            if self.cuda:
                caught_up = ready.query()  # the GPU was done sleeping before the host had queued the round
                end.record()
            for j, (i, result) in enumerate(zip(sets, results)):
                check(f"{'round' if timed else 'warm-up round'} {r - args.warmup + 1 if timed else r + 1} "
                      f"call {j + 1}", i, result)
            if r == args.warmup + args.rounds - 1:
                last = (sets[-1], op.outputs(results[-1]))
            del results
            settle()
            host_us = (t1 - t0) * 1e6
            if timed:
                host.append(host_us / calls)
            if self.cuda:
                end.synchronize()
                if timed and (row.sync or self.sleep is None or not caught_up):
                    gpu.append(start.elapsed_time(end) * 1e3 / calls)
                head_start_us = max(head_start_us, 2 * host_us + 500) * (2 if caught_up and not row.sync else 1)
        i, outputs = last
        row.problems += [f"last timed call (set {i}): {p}" for name, value in reference[i].items()
                         for p in _bits(name, outputs.get(name), value)]
        if args.profile:
            row.profile = self.profile(op, num_sets, check, settle)
        row.gpu_rounds = len(gpu)
        if self.cuda and not gpu:
            row.note = "the GPU caught up with the host in every round: no GPU time"
        if implementations_run is not None and op.expert:
            row.kernels = "permute " + ("+".join(implementations_run()) or "none")
        return row, host, gpu


    def profile(self, op: Op, num_sets: int, check: Callable, settle: Callable) -> str:
        """The ``--profile`` functions with the most own time over ``--rounds`` more rounds of ``op`` under cProfile
        (untimed, every call checked). cProfile's own cost inflates each function's time about alike, so the
        shares are what to read, not the microseconds."""
        profiler, calls = cProfile.Profile(), 0
        for r in range(self.args.rounds):  # a round at a time: outputs are checked and freed between rounds
            sets = [(r * self.args.calls + j) % num_sets for j in range(self.args.calls)]
            self.gate()
            profiler.enable()
            results = [op.call(i) for i in sets]
            profiler.disable()
            for j, (i, result) in enumerate(zip(sets, results)):
                check(f"profiled round {r + 1} call {j + 1}", i, result)
            calls += len(sets)
            del results
            settle()
        stats = pstats.Stats(profiler).stats  # (file, line, function) -> (primitive calls, calls, own s, cum s, ..)
        top = sorted(stats.items(), key=lambda item: -item[1][2])[:self.args.profile]
        per_call = 1e6 / calls
        lines = [f"{calls} calls, under cProfile; per call: own us, cumulative us, calls, function"]
        for (path, line, function), (_, ncalls, own, cumulative, _) in top:
            where = (f"{os.path.relpath(path, ROOT)}:{line}" if path.startswith(ROOT) else
                     "built-in" if path == "~" else f"{path}:{line}")
            lines.append(f"{own * per_call:9.1f} {cumulative * per_call:9.1f} {ncalls / calls:6.1f}  "
                         f"{function} ({where})")
        return "\n".join(lines)


def _percentiles(values: list[float]) -> tuple[float | None, float | None, float | None]:
    if not values:
        return None, None, None
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), q[0], q[-1]


def _megatron_dispatcher(args: argparse.Namespace, buffer, world: int):
    """``(dispatcher, note, failed)``: ep_moe's Megatron-core dispatcher over ``buffer``, or None with the reason:
    megatron-core not importable (a skipped row), or the dispatcher could not be made (``failed``: an error row)."""
    try:
        import warnings

        warnings.filterwarnings("ignore", module="megatron")
        integ = importlib.import_module(MEGATRON_MODULE)
        from megatron.core import parallel_state
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        return None, f"megatron-core does not import ({exc})", False
    try:
        return _make_megatron_dispatcher(args, buffer, world, integ, parallel_state, TransformerConfig)
    except Exception as exc:  # the row says so; the other rows still run
        traceback.print_exc()
        return None, f"EpMoETokenDispatcher could not be made ({type(exc).__name__}: {exc})", True


def _make_megatron_dispatcher(args, buffer, world, integ, parallel_state, TransformerConfig):
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=1, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=world,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.bfloat16 if args.dtype == "bf16"
        else torch.float32, bf16=args.dtype == "bf16")
    rank, local = dist.get_rank(), args.experts // world
    dispatcher = integ.EpMoETokenDispatcher(local, list(range(rank * local, (rank + 1) * local)), config,
                                            buffer=buffer)
    return dispatcher, f"megatron-core {integ.MEGATRON_CORE_VERSION}, EpMoETokenDispatcher", False


def run_rank(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    """Every row, on rank ``rank`` of an initialized process group of ``world`` ranks (collective).

    Args:
        args: from `parse_args`.

    Returns:
        On rank 0 ``{"header": dict, "rows": [dict]}`` (the JSON written by ``--json``), elsewhere None.
    """
    if args.device == "cuda" and "gloo" in str(dist.get_backend()).lower():  # ranks sharing GPUs (`main`)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    tokens = [int(t) for t in args.tokens.split(",")]
    nvl_bytes = ep_moe.Buffer.get_buffer_size_hint(max(tokens), args.hidden, world, args.topk,
                                                   dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    buffer = ep_moe.Buffer(backend=args.backend, num_nvl_bytes=nvl_bytes if args.backend != "torch" else 0,
                           check_inputs=args.check_inputs)
    names = tuple(args.ops.split(","))
    megatron, megatron_note, megatron_failed = (None, "not asked for", False)
    if "megatron_dispatcher" in names:
        megatron, megatron_note, megatron_failed = _megatron_dispatcher(args, buffer, world)
    measurer = Measurer(args, device, world)
    rows: list[Row] = []
    sets: dict[int, int] = {}
    for count in tokens:
        work = Workload(args, buffer, rank, world, count, device, megatron)
        sets[count] = work.num_sets
        floors: dict[str, Row] = {}
        for op in work.ops(names):
            row, _, _ = _measure_checked(measurer, op, work.num_sets, count)
            if op.floor is not None and row.check != "error":
                if op.floor not in floors:
                    floors[op.floor] = _measure_floor(measurer, work, op.floor)
                    rows.append(floors[op.floor])
                row.floor_us = floors[op.floor].host_us
            row.kernels = ", ".join(filter(None, [buffer.backend_name, row.kernels]))
            rows.append(row)
        if "megatron_dispatcher" in names and megatron is None:
            rows.append(Row("megatron_dispatcher", count, check="error" if megatron_failed else "skip",
                            note=megatron_note, problems=[megatron_note] if megatron_failed else []))
        del work
        if device.type == "cuda":
            torch.cuda.empty_cache()
    header = {
        "command": " ".join(["python3 benchmarks/host_overhead.py"] + list(args.argv)),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "ranks": world, "gpus_shared": device.type == "cuda" and world > torch.cuda.device_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "ep_moe": ep_moe.__version__,
        "ep_moe_commit": _commit(), "buffer_backend": buffer.backend_name,
        "backend_reason": getattr(buffer, "backend_reason", None), "check_inputs": args.check_inputs,
        "tokens": tokens, "hidden": args.hidden, "experts": args.experts, "topk": args.topk, "dtype": args.dtype,
        "calls": args.calls, "rounds": args.rounds, "warmup": args.warmup, "input_sets": sets,
        "megatron": megatron_note,
        "timers": "host: time.perf_counter; GPU: " + ("CUDA events" if device.type == "cuda" else "n/a (CPU)"),
    }
    if megatron is not None:
        importlib.import_module("megatron.core.parallel_state").destroy_model_parallel()
    buffer.destroy()
    return {"header": header, "rows": [r.to_json() for r in rows]} if rank == 0 else None


def _measure_floor(measurer: Measurer, work: Workload, kind: str) -> Row:
    """The row of one ``torch.index_select`` of ``x`` over the ``kind`` rows (`Workload.floor_index`), checked."""
    index = [work.floor_index(kind, i) for i in range(work.num_sets)]
    floor = Op(f"index_select[{kind}]", lambda i: torch.index_select(work.sets[i].x, 0, index[i]),
               lambda r: {"rows": r},
               lambda i, out: _bits("rows vs x[index]", out["rows"], work.sets[i].x[index[i]]))
    row = _measure_checked(measurer, floor, work.num_sets, work.tokens)[0]
    row.kernels, row.note = "torch", f"{index[0].numel()} rows"
    return row


def _measure_checked(measurer: Measurer, op: Op, num_sets: int, tokens: int) -> tuple[Row, list, list]:
    """`Measurer.measure` on every rank, then the slowest rank's medians and every rank's problems (collective)."""
    try:
        row, host, gpu = measurer.measure(op, num_sets, tokens)
        error = None
    except Exception as exc:  # the row says so; the other rows still run
        row, host, gpu, error = Row(op.name, tokens), [], [], f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    everyone: list = [None] * measurer.world
    dist.all_gather_object(everyone, (host, gpu, row.problems, error, row.sync))
    problems = ([f"rank {r}: {p}" for r, (_, _, ps, _, _) in enumerate(everyone) for p in ps] if measurer.world > 1
                else row.problems)
    errors = [f"rank {r}: {e}" for r, (_, _, _, e, _) in enumerate(everyone) if e]
    stats_host = [_percentiles(h) for h, *_ in everyone if h]
    stats_gpu = [_percentiles(g) for _, g, *_ in everyone if g]
    if stats_host:  # the slowest rank's
        row.host_us, row.host_p10_us, row.host_p90_us = max(stats_host)
    if stats_gpu:
        row.gpu_us, row.gpu_p10_us, row.gpu_p90_us = max(stats_gpu)
    row.sync = any(s for *_, s in everyone) if row.sync is not None else None
    row.problems = errors + problems
    row.check = "error" if errors else ("DIFF" if problems else "ok")
    return row, host, gpu


def _commit() -> str:
    """The ep_moe checkout's commit (with ``+dirty`` when ep_moe/ has changes), or ``unknown``."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "ep_moe"], capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# ---------------------------------------------------------------------------------------------- report
def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(result: dict) -> str:
    """The printed table of ``result`` (`run_rank`'s): a header line, then one line per row."""
    h = result["header"]
    shared = " sharing the GPUs (GPU times overlap)" if h.get("gpus_shared") else ""
    lines = [f"{TOOL}: {h['device']}, {h['ranks']} rank(s){shared}, backend {h['buffer_backend']}, torch {h['torch']}, "
             f"ep_moe {h['ep_moe_commit']}, hidden {h['hidden']}, top-{h['topk']} of {h['experts']}, {h['dtype']}, "
             f"{h['rounds']} rounds x {h['calls']} calls (median); megatron: {h['megatron']}",
             f"{'op':<28}{'tokens':>7}{'host us':>10}{'GPU us':>10}{'host/GPU':>9}{'bound':>6}{'floor us':>9}"
             f"{'above floor':>12}{'sync':>5}  {'check':<6}kernels"]
    for r in result["rows"]:
        sync = "n/a" if r["sync"] is None else ("yes" if r["sync"] else "no")
        lines.append(f"{r['op']:<28}{r['tokens']:>7}{_fmt(r['host_us']):>10}{_fmt(r['gpu_us']):>10}"
                     f"{_fmt(r['host_per_gpu'], '.2f'):>9}{r['bound'] or 'n/a':>6}{_fmt(r['floor_us']):>9}"
                     f"{_fmt(r['above_floor'], '.0%'):>12}{sync:>5}  {r['check']:<6}{r['kernels']}"
                     + (f"  ({r['note']})" if r["note"] else ""))
    return "\n".join(lines)


def problems_of(result: dict) -> list[str]:
    """One line per problem, naming the row (the first few of each row, then a count)."""
    lines = []
    for r in result["rows"]:
        shown = r["problems"][:SHOWN_PROBLEMS]
        lines += [f"{r['op']} at {r['tokens']} tokens: {p}" for p in shown]
        if len(r["problems"]) > len(shown):
            lines.append(f"{r['op']} at {r['tokens']} tokens: {len(r['problems']) - len(shown)} more problem(s)")
    return lines


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=None, help="token counts per rank, comma separated "
                   f"(default {GPU_DEFAULTS['tokens']} on GPU, {CPU_DEFAULTS['tokens']} on CPU)")
    p.add_argument("--hidden", type=int, default=None, help=f"default {GPU_DEFAULTS['hidden']} (CPU "
                   f"{CPU_DEFAULTS['hidden']})")
    p.add_argument("--experts", type=int, default=None, help=f"default {GPU_DEFAULTS['experts']} (CPU "
                   f"{CPU_DEFAULTS['experts']})")
    p.add_argument("--topk", type=int, default=None, help=f"default {GPU_DEFAULTS['topk']} (CPU {CPU_DEFAULTS['topk']})")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--ops", default=",".join(OPS), help=f"rows to run, comma separated, of {','.join(OPS)}")
    p.add_argument("--backend", choices=("auto", "native", "torch"), default="auto", help="the Buffer's backend")
    p.add_argument("--check-inputs", action="store_true",
                   help="Buffer(check_inputs=True): value checks of the routing (a host sync on GPU)")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per round")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (checked too)")
    p.add_argument("--sets", type=int, default=0, help="input sets rotated over (0: enough to fill twice the L2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn when not under torchrun")
    p.add_argument("--json", default=None, metavar="FILE", help="write the header and one object per row here")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each row, N functions with the most own time over --rounds more rounds under "
                        "cProfile (printed after the table, in the JSON as 'profile')")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, with the device's default sizes filled in; exits (argparse's error, naming the option) on bad
    values."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    defaults = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    unknown = [n for n in args.ops.split(",") if n not in OPS]
    if unknown:
        parser.error(f"--ops: unknown {unknown}; choose from {','.join(OPS)}")
    for name, value, low in (("tokens", min(tokens), 1), ("hidden", args.hidden, 1), ("topk", args.topk, 1),
                             ("calls", args.calls, 1), ("rounds", args.rounds, 1), ("warmup", args.warmup, 0),
                             ("sets", args.sets, 0), ("nproc", args.nproc, 1), ("profile", args.profile, 0)):
        if value < low:
            parser.error(f"--{name} must be >= {low}, got {value}")
    if args.topk > args.experts:
        parser.error(f"--topk ({args.topk}) must be at most --experts ({args.experts})")
    return args


def _run_sharing_gpus(args: argparse.Namespace) -> dict | None:
    """More ranks than GPUs: NCCL refuses two ranks on one GPU, so the ranks join a gloo group and share the
    GPUs (rank r on GPU r % count), the native backend's symmetric memory over VMM (the host times are each
    rank's own; the GPU times overlap)."""
    provider = os.environ.setdefault("EP_MOE_SYMMETRIC_MEMORY", "vmm")  # read by the spawned ranks
    if provider != "vmm":
        raise SystemExit(f"{TOOL}: --nproc {args.nproc} ranks on {torch.cuda.device_count()} GPU(s) share GPUs, "
                         f"which needs EP_MOE_SYMMETRIC_MEMORY=vmm, got {provider!r}")
    return run_distributed(run_rank, args.nproc, args, backend="gloo", timeout_s=300.0)[0]


def main(argv: list[str] | None = None) -> int:
    """Run, print the table (and write ``--json``); returns the exit status: 1 when a check failed or a row
    raised, else 0."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if torchrun_env() is not None or args.nproc > 1:
        if args.experts % (torchrun_env().world_size if torchrun_env() else args.nproc):
            raise SystemExit(f"{TOOL}: --experts ({args.experts}) must be divisible by the number of ranks")
        if torchrun_env() is None and args.device == "cuda" and args.nproc > torch.cuda.device_count():
            result = _run_sharing_gpus(args)
        else:
            result = launch(run_rank, args.nproc, args, device_type=args.device)[0]
    else:  # one rank: a group of one in this process
        backend = "nccl" if args.device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:
            result = run_rank(0, 1, args)
        finally:
            dist.destroy_process_group()
    if result is None:  # a rank of torchrun other than 0
        return 0
    print(table(result), flush=True)
    for row in result["rows"]:
        if row["profile"]:
            print(f"\n--- profile: {row['op']}, {row['tokens']} tokens\n{row['profile']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return report(TOOL, problems_of(result))


if __name__ == "__main__":
    sys.exit(main())
