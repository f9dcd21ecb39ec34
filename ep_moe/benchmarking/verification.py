"""Checking every call the benchmark makes, by fingerprint (`ep_moe.benchmarking.fingerprint`).

Each call's outputs are named (`named_outputs`). The checked, untimed call of an operation on an input set is
fingerprinted and kept (`CheckedCalls`); every timed call is fingerprinted after its end mark and compared with
the checked call of its input set once the loop is over (`CallCheck`, the ``check`` of `timing.time_runs`); and
the checked calls of every backend are compared with those of the first one (torch) on every input set: set 0
in full, with the first differing element shown, the others by fingerprint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .checks import compare
from .fingerprint import fingerprint_outputs

# What each operation returns, by name (an FP8 pair is `recv_x` and `recv_scales`; the count list is host data).
DISPATCH_OUTPUTS = ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert_list",
                    "rank_prefix_matrix", "recv_src_idx", "recv_src_rank")
EXPERT_OUTPUTS = ("expert_x", "expert_weights", "tokens_per_expert", "pairs_per_expert", "tokens_per_expert_list")
OUTPUTS = {
    "layout": ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"),
    "dispatch": DISPATCH_OUTPUTS,
    "dispatch_cached": ("recv_x", "recv_scales"),
    "dispatch_fixed": DISPATCH_OUTPUTS,
    "combine": ("combined_x",),
    "expert_dispatch": EXPERT_OUTPUTS + ("expert_scales",),  # expert_scales: FP8 only
    "expert_dispatch_fixed": EXPERT_OUTPUTS + ("expert_scales",),
    "expert_combine": ("combined_x",),
}

Outputs = dict[str, object]  # name -> tensor (compared by fingerprint / bits) or host value (compared by ==)


def named_outputs(op: str, result) -> Outputs:
    """The outputs of one `ep_moe.Buffer` call of ``op`` (a key of `OUTPUTS`) by name, from what the call
    returned; ``recv_scales`` / ``expert_scales`` only for an FP8 pair."""
    if op not in OUTPUTS:
        raise ValueError(f"named_outputs: argument 'op' must be one of {sorted(OUTPUTS)}, got {op!r}")
    if op == "layout":
        per_rank, _, per_expert, in_rank, _ = result
        return {"num_tokens_per_rank": per_rank, "num_tokens_per_expert": per_expert, "is_token_in_rank": in_rank}
    if op == "combine":
        return {"combined_x": result[0]}
    if op == "expert_combine":
        return {"combined_x": result}
    if op in ("expert_dispatch", "expert_dispatch_fixed"):
        named = {name: getattr(result, name) for name in EXPERT_OUTPUTS}
        if isinstance(named["expert_x"], tuple | list):  # the FP8 pair
            named["expert_x"], named["expert_scales"] = named["expert_x"]
        return named
    recv_x = result[0]
    named: Outputs = ({"recv_x": recv_x[0], "recv_scales": recv_x[1]} if isinstance(recv_x, tuple | list)
                      else {"recv_x": recv_x})
    if op == "dispatch_cached":
        return named
    _, recv_idx, recv_weights, counts, handle, _ = result
    return named | {"recv_topk_idx": recv_idx, "recv_topk_weights": recv_weights,
                    "num_recv_tokens_per_expert_list": list(counts), "rank_prefix_matrix": handle.rank_prefix_matrix,
                    "recv_src_idx": handle.recv_src_idx, "recv_src_rank": handle.recv_src_rank}


class Fingerprints:
    """The fingerprints of named outputs: queued on ``device`` when made (no host sync), read by `read`."""

    def __init__(self, outputs: Outputs, device: torch.device) -> None:
        self._tensor_names, host_names, self._device, host = fingerprint_outputs(outputs, device)
        self._host = dict(zip(host_names, host))

    def read(self) -> Outputs:
        """Name -> fingerprint (tensors) or value (host data); waits for the device."""
        return dict(zip(self._tensor_names, self._device.tolist())) | self._host


def differing(got: Outputs, want: Outputs) -> list[str]:
    """The names in ``want`` whose values in ``got`` differ (or are missing), in ``want``'s order."""
    missing = object()
    return [name for name, value in want.items() if got.get(name, missing) != value]


def _detail(got, want) -> str:
    """Host data (the count list) is shown; a tensor is known by its fingerprint only (an int)."""
    return f"{got!r} vs expected {want!r}" if isinstance(want, list) else "fingerprint"


class CheckedCalls:
    """One backend's checked (untimed) calls for one workload (token count and dtype): per operation and
    input set, the read fingerprints of the outputs; with ``keep_set0``, the outputs of set 0 themselves, for
    a comparison with the first differing element shown."""

    def __init__(self, backend: str, device: torch.device, keep_set0: bool) -> None:
        self.backend, self.device, self.keep_set0 = backend, device, keep_set0
        self.prints: dict[str, list[Outputs]] = {}
        self.set0: dict[str, Outputs] = {}

    def record(self, op: str, set_index: int, outputs: Outputs) -> Outputs:
        """Keep the fingerprints of the checked call of ``op`` on input set ``set_index`` (sets in order, from
        0) and return them."""
        kept = self.prints.setdefault(op, [])
        if set_index != len(kept):
            raise ValueError(f"CheckedCalls.record: argument 'set_index' must be {len(kept)} (the next set of "
                             f"{op!r}), got {set_index}")
        kept.append(Fingerprints(outputs, self.device).read())
        if set_index == 0 and self.keep_set0:
            self.set0[op] = outputs
        return kept[-1]

    def expected(self, op: str) -> list[Outputs]:
        """Per input set, the fingerprints every later call of ``op`` on that set must give."""
        return self.prints[op]

    def differences(self, op: str, set_index: int, outputs: Outputs, prints: Outputs, *, mine: str | None = None,
                    what: str | None = None) -> list[str]:
        """How another backend's call on ``set_index`` (its ``outputs`` and their ``prints``) differs from this
        backend's checked call of ``mine`` (default ``op``), bit for bit, over this backend's output names: set 0
        in full (kept by ``keep_set0``), other sets by fingerprint. ``what``: how the lines name this side."""
        mine = mine or op
        what = what or f"vs backend {self.backend}"
        if set_index == 0:
            want = self.set0[mine]
            return [m for name, value in want.items() for m in compare(f"{name} {what}", outputs.get(name), value)]
        want = self.prints[mine][set_index]
        return [f"{name} {what}: differs ({_detail(prints.get(name), want[name])})" for name in differing(prints, want)]


class CallCheck:
    """The ``check`` of `timing.time_runs` for one operation: fingerprints the outputs of every call of the
    loop (queued after the call's end mark), and `problems` compares them with the checked call of the same
    input set. Reports number the calls as `time_runs` documents: ``warm-up call k`` (from 1), then ``run j``
    (from 1, the timed runs)."""

    def __init__(self, op: str, expected: Sequence[Outputs], warmup: int, device: torch.device) -> None:
        if op not in OUTPUTS:
            raise ValueError(f"CallCheck: argument 'op' must be one of {sorted(OUTPUTS)}, got {op!r}")
        self.op, self.expected, self.warmup, self.device = op, expected, warmup, device
        self._calls: list[tuple[int, int, Fingerprints]] = []

    def __call__(self, call: int, set_index: int, result) -> None:
        self._calls.append((call, set_index, Fingerprints(named_outputs(self.op, result), self.device)))

    def label(self, call: int) -> str:
        return f"warm-up call {call + 1}" if call < self.warmup else f"run {call - self.warmup + 1}"

    def problems(self) -> list[str]:
        """One line per differing output of each call, e.g. ``run 3 (set 1): recv_x differs from the checked
        call``; waits for the device."""
        return [f"{self.label(call)} (set {set_index}): {name} differs from the checked call"
                for call, set_index, prints in self._calls
                for name in differing(prints.read(), self.expected[set_index])]
