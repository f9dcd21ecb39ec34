"""ep_moe never depends on the caller's default device or default dtype (DeepEP's tests and many training scripts
call ``torch.set_default_device("cuda")``): every tensor it creates names its device and, where the default dtype
would decide it, its dtype.

On 1 and 2 gloo ranks (one spawned job of 2), with CPU inputs made beforehand, each object runs once
without and once under a default (``"cuda"`` on this CUDA-less build: any implicit creation raises; ``"meta"``: an
implicit tensor also fails the computation that reads it; the default dtype float64): `ep_moe.Buffer` (layout,
dispatch fresh, fixed-size and cached, combine), `ep_moe.ElasticBuffer` on the torch and the hybrid backend
(compact and expanded dispatch, exact and fixed size, fresh and cached, combine), its PP send/recv, AGRS
all-gather/reduce-scatter and Engram write/fetch, `ep_moe.TokenDispatcher` (forward and backward) and one step of
the trainer with ZeRO-1 (forward, backward, optimizer step, evaluation). The outputs must be equal, bit for bit:
same dtype, shape, device (CPU) and values. (Inside a ``torch.library`` custom op torch applies no default device,
so code that runs only there is checked for the default dtype alone.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile

import locations
import torch
from support.bits import bit_difference
from support.world_sizes import run_world_sizes

from ep_moe import Buffer, ElasticBuffer, TokenDispatcher

VARIANTS = ("cuda", "meta", "float64")
SCENARIOS = ("buffer", "elastic", "hybrid", "pp", "agrs", "engram", "dispatcher", "train")
MiB = 1 << 20
T, H, K = 9, 32, 2


@contextlib.contextmanager
def _defaults(variant: str | None):
    """``variant`` as the default device (or the default dtype float64); the previous defaults restored after."""
    device, dtype = torch.get_default_device(), torch.get_default_dtype()
    try:
        if variant == "float64":
            torch.set_default_dtype(torch.float64)
        elif variant is not None:
            torch.set_default_device(variant)
        yield
    finally:
        torch.set_default_device(None if device.type == "cpu" else device)
        torch.set_default_dtype(dtype)


def _leaves(obj) -> list:
    """The tensors and plain values inside ``obj`` (tuples, lists, dicts, dataclasses), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _leaves([getattr(obj, f.name) for f in dataclasses.fields(obj)])
    if isinstance(obj, tuple | list):
        return [leaf for item in obj for leaf in _leaves(item)]
    if isinstance(obj, dict):
        return [leaf for key in obj for leaf in _leaves(obj[key])]
    return [obj] if obj is None or isinstance(obj, int | float | bool | str) else []


def _same(got, want) -> str | None:
    """None where ``got`` equals ``want`` leaf by leaf (tensors on the CPU, same dtype, shape and bits)."""
    a, b = _leaves(got), _leaves(want)
    if len(a) != len(b):
        return f"{len(a)} outputs, expected {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(y, torch.Tensor):
            difference = bit_difference(x, y)
            if difference is not None:
                return f"output {i}: {difference}"
        elif x != y:
            return f"output {i}: {x!r}, expected {y!r}"
    return None


def _inputs(rank: int, num_ranks: int) -> dict:
    gen = torch.Generator().manual_seed(7 + rank)
    E = 4 * num_ranks
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    idx[::4, 1] = -1
    x = torch.randn(T, H, generator=gen)
    return {"x": x.to(torch.bfloat16), "x32": x, "idx": idx, "w": torch.rand(T, K, generator=gen), "E": E,
            "table": torch.randn(5, H, generator=gen), "sf": torch.rand(5, 3, generator=gen),
            "ids": torch.randint(0, 5 * num_ranks, (4, 3), generator=gen, dtype=torch.int32),
            "rs": torch.randn(num_ranks, 6, generator=gen)}


def _buffer(group, rank, num_ranks, inp) -> list:
    buffer = Buffer(group, backend="torch", timeout_s=15)
    out = []
    for x in (inp["x"], inp["x32"]):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["idx"], inp["E"])
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=inp["idx"], topk_weights=inp["w"], expert_alignment=4)
        cached = buffer.dispatch(x * 2, handle=handle)[0]
        combined = buffer.combine(recv_x, handle, topk_weights=recv_w)[:2]
        worst = buffer.dispatch(x, topk_idx=inp["idx"], topk_weights=inp["w"], num_experts=inp["E"],
                                num_worst_tokens=T * num_ranks)
        out += [per_rank, per_expert, in_rank, recv_x, recv_idx, recv_w, counts, tuple(handle), cached, combined,
                worst[:4], buffer.combine(worst[0], worst[4])[:2]]
    buffer.destroy()
    return out


def _elastic(group, rank, num_ranks, inp) -> list:
    return _elastic_calls(ElasticBuffer(group, backend="torch", num_gpu_timeout_secs=15, explicitly_destroy=True),
                          inp)


def _hybrid(group, rank, num_ranks, inp) -> list:
    if num_ranks == 1:  # two nodes of one rank each: 2 ranks
        return []
    eb = ElasticBuffer(group, num_scaleout_ranks=2, num_gpu_timeout_secs=15, explicitly_destroy=True)
    assert eb.buffer.backend_name == "hybrid"
    return _elastic_calls(eb, inp)


def _elastic_calls(eb: ElasticBuffer, inp: dict) -> list:
    idx, w, E = inp["idx"], inp["w"], inp["E"]
    out = []
    for x in (inp["x"], inp["x32"]):
        recv_x, recv_idx, recv_w, h, _ = eb.dispatch(x, idx, w, num_experts=E, expert_alignment=4)
        out += [recv_x, recv_idx, recv_w, h, eb.combine(recv_x, h, topk_weights=recv_w)[:2],
                eb.dispatch(x * 2, handle=h)[:3]]
        fixed = eb.dispatch(x, idx, w, num_experts=E, num_max_tokens_per_rank=T, do_cpu_sync=False)
        out += [fixed[:4], eb.combine(fixed[0], fixed[3], topk_weights=fixed[2])[:2]]
        ex, _, ew, eh, _ = eb.dispatch(x, idx, w, num_experts=E, expert_alignment=4, do_expand=True)
        out += [ex, ew, eh, eb.combine(ex, eh, expert_weights=ew)[:2], eb.dispatch(x * 2, handle=eh)[:3]]
        ex, _, ew, eh, _ = eb.dispatch(x, idx, w, num_experts=E, do_expand=True, do_cpu_sync=False,
                                       num_max_tokens_per_rank=T)
        out += [ex, ew, eb.combine(ex, eh, expert_weights=ew)[:2]]
    eb.destroy()
    return out


def _pp(group, rank, num_ranks, inp) -> list:
    eb = ElasticBuffer(group, num_bytes=2 * MiB, explicitly_destroy=True, num_gpu_timeout_secs=15)
    eb.pp_set_config(4096, 2)
    nxt, prev = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    out = []
    for x in (inp["x"], inp["x32"], inp["idx"]):
        eb.pp_send(x, nxt)
        got = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        eb.pp_recv(got, prev)
        out.append(got)
    eb.barrier()
    eb.destroy()
    return out


def _agrs(group, rank, num_ranks, inp) -> list:
    eb = ElasticBuffer(group, num_bytes=2 * MiB, explicitly_destroy=True, num_gpu_timeout_secs=15)
    eb.agrs_set_config(64 * 1024, 8)
    out = []
    with eb.agrs_new_session():
        inplace = eb.agrs_get_inplace_tensor((3, 4), torch.float32)
        inplace.copy_(inp["x32"][:3, :4])
        gathered, handle = eb.all_gather([inp["x"], inp["idx"], inplace])
        handle()
        out += [g.clone() for g in gathered]
        for x in (inp["rs"], inp["rs"].to(torch.bfloat16)):
            shard, handle = eb.reduce_scatter(x)
            handle()
            out.append(shard.clone())
    eb.barrier()
    eb.destroy()
    return out


def _engram(group, rank, num_ranks, inp) -> list:
    out = []
    for hybrid in (True, False):
        eb = ElasticBuffer(group, num_bytes=2 * MiB, num_cpu_bytes=2 * MiB, allow_hybrid_mode=hybrid,
                           backend="torch", explicitly_destroy=True, num_cpu_timeout_secs=15)
        for table, sf in ((inp["table"], inp["sf"]), (inp["table"].to(torch.bfloat16), None)):
            eb.engram_write(table, sf)
            out.append(eb.engram_fetch(inp["ids"])())
        eb.barrier()
        eb.destroy()
    return out


def _dispatcher(group, rank, num_ranks, inp) -> list:
    buffer = Buffer(group, backend="torch", timeout_s=15)
    out = []
    for alignment, worst in ((1, 0), (4, 0), (4, T * num_ranks)):
        x = inp["x32"].clone().requires_grad_()
        w = inp["w"].clone().requires_grad_()
        d = TokenDispatcher(buffer, inp["E"], expert_alignment=alignment, num_worst_tokens=worst)
        expert_x, probs, counts, ctx = d.dispatch(x, inp["idx"], w)
        y = d.combine(expert_x * 3, ctx, probs)
        y.square().sum().backward()
        out += [expert_x, probs, counts, ctx.tokens_per_expert_host, y, x.grad, w.grad]
    buffer.destroy()
    return out


def _train(group, rank, num_ranks, inp) -> list:
    if group is not None:  # the trainer runs on the default group
        return []
    from ep_moe.train.loop import DataParallelSteps
    from ep_moe.train.recipe_schema import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(str(locations.RECIPES / "tiny-cpu.yaml"), [
            "model.vocab_size=32", "model.seq_length=16", "model.hidden_size=32", "model.ffn_hidden_size=32",
            "model.moe_ffn_hidden_size=16", "model.moe_router_enable_expert_bias=true", "train.global_batch_size=4",
            f"model.expert_model_parallel_size={num_ranks}",
            "train.micro_batch_size=1", "train.eval_iters=1", "train.zero_stage=1", "logger.progress_bar=false",
            f"checkpoint.save={os.path.join(tmp, 'run')}"])
        steps = DataParallelSteps(recipe, torch.device("cpu"))
        try:
            _, batch = steps.begin(0)
            outcome = steps.step(batch, False)
            out = [outcome.loss, outcome.aux_loss, outcome.grad_norm, steps.evaluate(),
                   [p.detach() for p in steps.model.parameters()]]
        finally:
            steps.close()
    return out


def _worker(rank: int, num_ranks: int, group) -> dict[str, int]:
    """Every scenario without a default, then under each default; raises at the first difference (naming the
    scenario and the default; the peers then fail fast). Returns the number of outputs compared per scenario."""
    compared = {}
    inp = _inputs(rank, num_ranks)
    for name in SCENARIOS:
        fn = globals()[f"_{name}"]
        want = fn(group, rank, num_ranks, inp)
        for variant in VARIANTS:
            where = f"{name} under {variant} at R={num_ranks}, rank {rank}"
            try:
                with _defaults(variant):
                    got = fn(group, rank, num_ranks, inp)
            except Exception as exc:
                raise AssertionError(f"{where}: {exc}") from exc
            problem = _same(got, want)
            assert problem is None, f"{where}: {problem}"
        compared[name] = len(_leaves(want))
    return compared


def test_outputs_do_not_depend_on_the_default_device_or_dtype():
    by_size = run_world_sizes(_worker, (1, 2), timeout_s=60, join_timeout_s=300)
    for num_ranks, compared in by_size.items():
        for name in SCENARIOS:  # the trainer (the default group) and the hybrid backend (2 nodes): 2 ranks only
            assert all(c[name] > 0 for c in compared) or (name in ("train", "hybrid") and num_ranks == 1), name


def test_defaults_restored():
    with _defaults("meta"):
        assert torch.empty(0).device.type == "meta"
    assert torch.empty(0).device.type == "cpu" and torch.get_default_dtype() == torch.float32
