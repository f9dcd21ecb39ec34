"""The native backend's host side of the rank-disagreement check, on CPU: a one-rank `NativeBackend` whose
kernels module is a fake that plays the kernels' part (it compares the header it is given with the one it "sees",
as the kernels do, and writes what they write), so the Python paths run without a GPU: an exact-size dispatch
closes its notify's epoch and raises at once; a call without a host wait leaves a record that only a host wait
raises (the end of the next exact-size dispatch, after its kernels are queued, or ``barrier()``), never a
call's start; a call about to fall back to the torch backend or to grow the buffer exchanges its header first.
The fake also checks the argument counts of the launch functions it stands in for (`ep_moe.native.jit.intranode`'s)."""

from __future__ import annotations

import pytest
import torch
from support.native_backend_fakes import ERROR_WORDS, FakeData, fake_native_backend

from ep_moe.backends import agreement
from ep_moe.backends import native_backend as nb
from ep_moe.config import Config

HIDDEN, TOKENS, TOPK, EXPERTS = 64, 5, 2, 4


class FakeExtension:
    """The binding's functions as the kernels would behave at one rank; ``seen`` (slot, value added) changes the
    header the "kernels" see, as `NativeBackend.test_header_perturbation` does."""

    MAX_RANKS, HEADER_LEN, HEADER_WORDS, MISMATCH_WORDS = 8, 8, 10, nb.MISMATCH_WORDS
    ERROR_WORDS, MAX_NOTIFY_EXPERTS, TRACE_SLOTS, COPY_ENGINE_TRACE_SLOTS = ERROR_WORDS, 1024, 6, 129

    def __init__(self, backend: nb.NativeBackend) -> None:
        self.backend = backend
        self.seen: tuple[int, int] | None = None
        self.calls: list[str] = []
        self.device: DeviceModel | None = None  # None: kernels have no timing (the tests above)

    def _launch(self, kernel: str) -> None:
        self.calls.append(kernel)
        if self.device is not None:
            self.device.launch(kernel)

    def _check(self, header: list[int], digest: int = 0) -> tuple[bool, list[int], list[int]]:
        assert len(header) == nb.HEADER_WORDS and all(isinstance(v, int) for v in header)
        own = list(header[:nb.HEADER_LEN])
        if digest:
            own[7] = digest
        seen = own + list(header[nb.HEADER_LEN:])
        if self.seen is not None:
            seen[self.seen[0]] += self.seen[1]
        return seen[:nb.HEADER_LEN] != own, own, seen

    def _host_check(self, host_counts: torch.Tensor, header: list[int], digest: int = 0) -> bool:
        disagree, own, seen = self._check(header, digest)
        host_counts[2:2 + nb.HEADER_WORDS + nb.HEADER_LEN + 1] = torch.tensor(seen + own + [int(disagree)])
        return disagree

    def _record(self, header: list[int], digest: int = 0) -> None:
        disagree, own, seen = self._check(header, digest)
        rec = self.backend._error[ERROR_WORDS:]
        if disagree and int(rec[0]) == 0:
            words = [own[0], 0, 1, *own, *seen[:nb.HEADER_LEN]]
            rec[:len(words)] = torch.tensor(words)

    def notify(self, *args, bind: bool = False) -> None:
        assert len(args) == 15, len(args)
        host_counts, worst, header = args[6], args[7], args[13]
        host_counts[0], host_counts[1] = TOKENS, TOKENS  # rows 0 sends 0, tokens of rank 0
        disagree = self._host_check(host_counts, header)
        if disagree and worst:
            self._record(header)
        self._launch("notify")

    def dispatch(self, *args, bind: bool = False) -> None:
        assert len(args) == 35, len(args)  # ..., header, test_perturb, rows_in_place
        write_arrival, header = args[20], args[32]
        if write_arrival:  # cached: the kernel checks, with the handle's digest
            self._record(header, digest=12345)
        self._launch("dispatch")

    def combine(self, *args, bind: bool = False) -> None:
        assert len(args) == 30, len(args)  # ..., test_perturb, expert_y, expert_weights, sorted_slots, order
        self._record(args[24], digest=12345)
        self._launch("combine")

    def exchange(self, env, header, prefix, host_counts, perturb) -> None:
        self._host_check(host_counts, header, 12345 if prefix is not None else 0)
        self._launch("exchange")

    def close_epoch(self, env) -> None:
        self._launch("close_epoch")

    def barrier(self, env) -> None:
        self._launch("barrier")


class DeviceModel:
    """The epoch bookkeeping of one rank's device, with streams (kernels/intranode_kernels.cuh): every collective kernel
    takes its epoch as the rank's ``seq + 1`` when it starts; a notify leaves the epoch open, every other kernel
    (dispatch, combine, barrier, exchange, close_epoch) closes it (``seq = epoch``). Kernels queued on one
    stream run in order; kernels on different streams that nothing orders may run side by side, and this model
    runs them so (the adversarial schedule, as on a GPU time-sliced between the ranks' processes): each takes
    its epoch before any of them closes one. ``ran``: (kernel, epoch) in the order they ran."""

    OPENS_ONLY = ("notify",)

    def __init__(self) -> None:
        self.stream = "compute"  # torch.cuda.current_stream()
        self.pending: dict[str, list[str]] = {}
        self.seq = 0
        self.ran: list[tuple[str, int]] = []

    def launch(self, kernel: str) -> None:
        self.pending.setdefault(self.stream, []).append(kernel)

    def _run_wave(self, streams: list[str]) -> None:
        heads = [self.pending[s].pop(0) for s in streams if self.pending.get(s)]
        epoch = self.seq + 1  # every head starts before any closes its epoch
        for kernel in heads:
            self.ran.append((kernel, epoch))
            if kernel not in self.OPENS_ONLY:
                self.seq = max(self.seq, epoch)

    def run_stream(self, stream: str) -> None:
        """A host wait on ``stream`` (an event recorded there): its kernels ran, the others' may not have."""
        while self.pending.get(stream):
            self._run_wave([stream])

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``: every stream's kernels ran, unordered ones side by side."""
        while any(self.pending.values()):
            self._run_wave(list(self.pending))

    def closed_epochs(self) -> list[int]:
        return [epoch for kernel, epoch in self.ran if kernel not in self.OPENS_ONLY]


class _Fallback:
    def __init__(self) -> None:
        self.calls = 0

    def dispatch(self, *args):
        self.calls += 1
        return "fallback"


@pytest.fixture
def backend(monkeypatch):
    b = fake_native_backend(0, 1, _Fallback(), 64 << 20)
    fake = FakeExtension(b)
    monkeypatch.setattr(nb, "_c", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return b, fake


def _inputs():
    x = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)
    idx = torch.zeros(TOKENS, TOPK, dtype=torch.int64)
    idx[:, 1] = 1
    w = torch.ones(TOKENS, TOPK)
    in_rank = torch.ones(TOKENS, 1, dtype=torch.bool)
    per_rank = torch.tensor([TOKENS], dtype=torch.int32)
    return x, idx, w, in_rank, per_rank


def _dispatch(b, worst: int = 0, hidden: int = HIDDEN):
    x, idx, w, in_rank, per_rank = _inputs()
    x = torch.ones(TOKENS, hidden, dtype=torch.bfloat16)
    return b.dispatch(x, None, idx, w, in_rank, per_rank, None, EXPERTS, 1, worst, Config())


def test_exact_dispatch_raises_at_its_wait_and_closes_the_epoch(backend) -> None:
    b, fake = backend
    fake.seen = (1, 3)  # the hidden size as the kernels see it
    with pytest.raises(ValueError, match=r"^ep_moe\.dispatch: ranks disagree on the hidden size: rank 0's own "
                                         r"call has 64, rank 0 as seen by rank 0's kernel has 67$"):
        _dispatch(b)
    assert fake.calls == ["notify", "close_epoch"]  # no dispatch kernel, the epoch closed
    fake.seen = None
    out = _dispatch(b)
    assert fake.calls[-2:] == ["notify", "dispatch"] and out.recv_x.shape == (TOKENS, HIDDEN)


def test_fixed_size_dispatch_records_and_only_a_host_wait_raises(backend) -> None:
    b, fake = backend
    fake.seen = (5, 8)  # num_experts
    result = _dispatch(b, worst=3 * TOKENS)  # no host wait: returns
    assert fake.calls == ["notify", "dispatch"] and result.recv_x.shape[0] == 3 * TOKENS
    fake.seen = None
    b._raise_if_failed()  # a call's start never raises it (ranks could see it at different calls)
    with pytest.raises(ValueError, match="ranks disagree on num_experts: rank 0's own call has 4"):
        b.barrier()
    b.barrier()  # raised once: the record is cleared


def test_a_pending_record_is_raised_after_the_next_exact_dispatch_is_queued(backend) -> None:
    b, fake = backend
    handle = _dispatch(b).handle
    y = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)
    fake.seen = (4, 1)  # the combine's weights width
    b.combine(y, handle, torch.ones(TOKENS, TOPK), (None, None), Config())
    fake.seen = None
    with pytest.raises(ValueError, match=r"^ep_moe\.combine: ranks disagree on topk_weights"):
        _dispatch(b)
    assert fake.calls[-3:] == ["combine", "notify", "dispatch"]  # this dispatch's kernels were queued first
    _dispatch(b)


def test_cached_dispatch_header_and_record(backend) -> None:
    b, fake = backend
    handle = _dispatch(b).handle
    fake.seen = (7, 1)  # the layout digest
    x = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)
    b.dispatch(x, None, None, None, handle.is_token_in_rank, None, handle, 0, 1, 0, Config())
    with pytest.raises(ValueError, match=r"the handle \(the layout of the dispatch that made it\): rank 0's own "
                                         r"call has layout 0x00003039"):
        b.barrier()


def test_exchange_before_the_fallback_and_before_growth(backend) -> None:
    b, fake = backend
    fake.seen = (1, 1)
    with pytest.raises(ValueError, match="the hidden size"):
        _dispatch(b, hidden=60)  # 120-byte rows: the torch fallback, after an exchange
    assert fake.calls == ["exchange"] and b._fallback.calls == 0
    fake.seen = None
    assert _dispatch(b, hidden=60) == "fallback" and fake.calls == ["exchange", "exchange"]
    b._data = FakeData(2 << 20)  # too small for the fixed size below: it grows, after an exchange
    fake.seen = (6, 1)
    with pytest.raises(ValueError, match="num_worst_tokens"):
        _dispatch(b, worst=100_000)
    assert fake.calls[-1] == "exchange" and not b._retired  # raised before growing


def test_exact_dispatch_takes_the_largest_copy_engine_number(backend) -> None:
    b, fake = backend
    fake.seen = (nb._LAST_SEQ, 41)  # another rank's last copy-engine number (not compared)
    _dispatch(b)
    assert b._copy_seq == 41


def test_headers_hold_agreements_values(backend) -> None:
    b, _ = backend
    assert b._header(agreement.OP_DISPATCH, 7168, torch.bfloat16, 0, 8, 256, 0, last_seq=3) == \
        [agreement.OP_DISPATCH, 7168, agreement.dtype_code(torch.bfloat16), 0, 8, 256, 0, 0, 0, 3]


@pytest.fixture
def device(backend, monkeypatch):
    """``backend`` with a `DeviceModel` behind its fake kernels and torch.cuda's stream calls."""
    b, fake = backend
    model = fake.device = DeviceModel()
    b._wait_for_stream = lambda: model.run_stream(model.stream)  # the host waits for the current stream
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: model.stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: model.synchronize())
    return b, fake, model


def test_a_barrier_after_an_exact_dispatch_raised_takes_the_next_epoch(device) -> None:
    """The failing GPU sequence (tests/native/test_native_mismatch_gpu.py, ranks sharing a GPU): an exact-size
    dispatch that disagrees raises at its host wait after queuing close_epoch on its stream (the Buffer's
    communication stream, which the current stream then does not wait for: the call raised); the barrier every
    rank makes next runs on the current stream. Were it to run beside close_epoch, both would take the same
    epoch and this rank would be one operation behind its peers from then on (its next dispatch meeting their
    barrier: "ranks disagree on the operation: rank 0 has barrier, rank 1 has dispatch")."""
    b, fake, model = device
    model.stream = "comm"
    fake.seen = (1, 3)
    with pytest.raises(ValueError, match="the hidden size"):
        _dispatch(b)
    fake.seen = None
    model.stream = "compute"
    b.barrier()
    model.stream = "comm"
    _dispatch(b)
    model.stream = "compute"
    b.barrier()
    assert model.ran == [("notify", 1), ("close_epoch", 1), ("barrier", 2), ("notify", 3), ("dispatch", 3),
                         ("barrier", 4)]


def test_a_barrier_after_a_dispatch_raised_an_earlier_record_takes_the_next_epoch(device) -> None:
    """The other raise after queued kernels: an exact-size dispatch raises an earlier call's record once its own
    kernels are queued (they run, on its stream, after the call raised)."""
    b, fake, model = device
    model.stream = "comm"
    handle = _dispatch(b).handle
    fake.seen = (4, 1)
    b.combine(torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16), handle, torch.ones(TOKENS, TOPK), (None, None),
              Config())
    fake.seen = None
    with pytest.raises(ValueError, match="topk_weights"):
        _dispatch(b)
    model.stream = "compute"
    b.barrier()
    assert model.closed_epochs() == [1, 2, 3, 4]


def test_an_error_record_written_by_a_kernel_is_raised_at_the_next_call(backend):
    """The error code is read in place at every call's start: a timeout record (code 1; rank, stage, channel,
    peer, chunk, then the waited ns in two words) raises NativeTimeoutError naming them, and the buffer stays
    unusable after it."""
    backend, _ = backend
    backend._raise_if_failed()  # a zero record: nothing
    backend._error[:8] = torch.tensor([1, 0, 0, 3, 1, 7, 2_000_000_000, 0], dtype=torch.int32)
    with pytest.raises(nb.NativeTimeoutError, match=r"rank 0 of 1 timed out after 2 s in stage .*channel 3, "
                                                    r"waiting for rank 1 \(chunk 7\)"):
        backend._raise_if_failed()
    backend._error.zero_()
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        backend._raise_if_failed()
