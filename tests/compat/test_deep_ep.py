"""`ep_moe.compat.deep_ep`: DeepEP's normal-mode API on ep_moe (CPU, gloo, 2 ranks; no DeepEP needed).

The distributed run follows the checks DeepEP's own intranode test makes (written anew here, scaled to a
CPU): the layout against a direct count; dispatch of constant and random BF16 rows and of FP8 pairs with
column-major scales, with and without top-k, synchronous and ``async_finish``, with and without a
``previous_event`` from ``capture()``; received row counts and per-expert counts (also without top-k);
every source's rows in the slice ``rank_prefix_matrix`` (``handle[0]``) says; ``num_worst_tokens``
padding; cached dispatch; combine returning each token times the number of ranks it went to, and the
top-k weights unchanged. Then the ``import deep_ep`` routes: `install`, the ``--shim-dir`` folder, and the
``python -m ep_moe.compat.deep_ep program.py`` launcher with spawned children.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from support.bits import bits_equal

from ep_moe.distributed import run_distributed

T, H, K, E = 48, 256, 4, 8  # tokens per rank, hidden (FP8 needs a multiple of 128), top-k, experts


def _topk_idx(source: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 + source)
    scores = torch.rand(T, E, generator=gen)
    idx = scores.topk(K, dim=1).indices
    idx[::7, -1] = -1  # some tokens with fewer experts
    idx[5] = -1        # a token with none
    return idx


def _fp8_pair(x: torch.Tensor, column_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = x.float().view(x.shape[0], -1, 128)
    scales = blocks.abs().amax(dim=-1).clamp(min=1e-4) / 448.0
    data = (blocks / scales[..., None]).to(torch.float8_e4m3fn).view(x.shape)
    return data, (scales.T.contiguous().T if column_major else scales)


def _from_fp8(pair) -> torch.Tensor:
    data, scales = pair
    return (data.float().view(data.shape[0], -1, 128) * scales[..., None]).view(data.shape).to(torch.bfloat16)


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def _call(buffer, fn, kwargs: dict, previous: bool, async_finish: bool) -> list:
    """``fn(**kwargs)`` (after an event captured now when ``previous``), waited for when ``async_finish``;
    its results without the trailing event."""
    if previous:
        kwargs = dict(kwargs, previous_event=buffer.capture())
    *results, event = fn(**kwargs)
    if async_finish:
        event.current_stream_wait()
    return results


def _compat_worker(rank: int, world: int) -> dict:
    import ep_moe.compat.deep_ep as compat

    compat.install()
    import deep_ep
    from deep_ep.utils import EventHandle, EventOverlap

    _expect(deep_ep is compat and EventOverlap is compat.EventOverlap and EventHandle is compat.EventHandle,
            "import deep_ep did not resolve to ep_moe.compat.deep_ep")
    _expect(deep_ep.topk_idx_t is torch.int64, "topk_idx_t")
    group = dist.new_group(list(range(world)))
    buffer = deep_ep.Buffer(group, int(1e6), 0, low_latency_mode=False, num_qps_per_rank=1, backend="torch")
    local = E // world

    # Layout, against a direct count.
    all_idx = [_topk_idx(s) for s in range(world)]
    topk_idx = all_idx[rank]
    per_expert = torch.stack([torch.bincount(i[i >= 0], minlength=E) for i in all_idx])  # [source, E]
    in_rank = [torch.stack([((i // local == r) & (i >= 0)).any(dim=1) for r in range(world)], dim=1) for i in all_idx]
    n_per_rank, n_per_rdma, n_per_expert, is_token_in_rank, event = buffer.get_dispatch_layout(topk_idx, E)
    _expect(n_per_rdma is None and isinstance(event, EventOverlap), "layout extras")
    _expect(torch.equal(n_per_expert, per_expert[rank].int()), "num_tokens_per_expert")
    _expect(torch.equal(is_token_in_rank, in_rank[rank]), "is_token_in_rank")
    _expect(torch.equal(n_per_rank, in_rank[rank].sum(dim=0).int()), "num_tokens_per_rank")
    recv_rows = int(sum(in_rank[s][:, rank].sum() for s in range(world)))
    recv_counts = per_expert.sum(dim=0)[rank * local:(rank + 1) * local].tolist()

    gen = torch.Generator().manual_seed(rank)
    x_const = torch.full((T, H), float(rank), dtype=torch.bfloat16)
    x_rand = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w_rand = torch.randn(T, K, generator=gen)
    config = deep_ep.Config(24, 8, 256)
    checked = 0

    def rows_by_source(recv: torch.Tensor, prefix: torch.Tensor) -> None:
        start = 0
        for source in range(world):
            end = int(prefix[source][rank])
            _expect(bool((recv[start:end].float() == source).all()), f"rows from rank {source} misplaced")
            start = end

    for previous in (False, True):
        for async_finish in (False, True):
            for name, x in (("rand", x_rand), ("const", x_const), ("fp8", _fp8_pair(x_const, column_major=True))):
                for with_topk in (False, True):
                    where = f"[{name} topk={with_topk} async={async_finish} previous={previous}]"
                    args = dict(x=x, num_tokens_per_rank=n_per_rank, is_token_in_rank=is_token_in_rank,
                                num_tokens_per_expert=n_per_expert, config=config, async_finish=async_finish)
                    if with_topk:
                        args.update(topk_idx=topk_idx, topk_weights=w_rand)
                    recv_x, recv_idx, recv_w, counts, handle = _call(buffer, buffer.dispatch, args, previous,
                                                                     async_finish)
                    recv = _from_fp8(recv_x) if isinstance(recv_x, tuple) else recv_x
                    prefix = handle[0]
                    _expect(recv.shape[0] == recv_rows, f"{where} received {recv.shape[0]} rows, not {recv_rows}")
                    _expect(counts == recv_counts, f"{where} per-expert counts {counts} != {recv_counts}")
                    _expect(tuple(prefix.shape) == (world, world) and int(prefix[-1][rank]) == recv_rows,
                            f"{where} rank_prefix_matrix")
                    if name != "rand":
                        rows_by_source(recv, prefix)
                    if with_topk:
                        _expect(bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < local))).all()),
                                f"{where} recv_topk_idx out of range")
                        _expect([int((recv_idx == e).sum()) for e in range(local)] == counts, f"{where} idx counts")
                        _expect(bool((recv_w[recv_idx == -1] == 0).all()), f"{where} non-local weights")
                        worst = dict(args, num_worst_tokens=T * world)
                        w_x, w_idx, w_w, empty, _ = _call(buffer, buffer.dispatch, worst, previous, async_finish)
                        w_data = w_x[0] if isinstance(w_x, tuple) else w_x
                        data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
                        _expect(empty == [] and w_data.shape[0] == T * world, f"{where} num_worst_tokens shape")
                        _expect(bits_equal(w_data[:recv_rows], data)
                                and torch.equal(w_idx[:recv_rows], recv_idx) and torch.equal(w_w[:recv_rows], recv_w)
                                and bool((w_idx[recv_rows:] == -1).all()), f"{where} num_worst_tokens rows")
                    else:
                        _expect(recv_idx is None and recv_w is None, f"{where} top-k outputs without top-k")
                        cached = dict(x=x, handle=handle, config=config, async_finish=async_finish)
                        again, none_idx, none_w, none_counts, none_handle = _call(buffer, buffer.dispatch, cached,
                                                                                  previous, async_finish)
                        again = _from_fp8(again) if isinstance(again, tuple) else again
                        _expect(none_idx is None and none_counts is None and none_handle is None,
                                f"{where} cached dispatch returns")
                        _expect(torch.equal(again, recv), f"{where} cached dispatch differs")
                    combine = dict(x=recv, handle=handle, config=config, async_finish=async_finish)
                    if with_topk:
                        combine.update(topk_weights=recv_w)
                    combined, combined_w = _call(buffer, buffer.combine, combine, previous, async_finish)
                    source = _from_fp8(x) if isinstance(x, tuple) else x
                    times = is_token_in_rank.sum(dim=1, keepdim=True).float()
                    _expect(torch.equal(combined.float(), (source.float() * times).to(torch.bfloat16).float()),
                            f"{where} combine != x * ranks reached")
                    if with_topk:
                        expected_w = torch.where(topk_idx >= 0, w_rand, 0.0)
                        _expect(torch.equal(combined_w, expected_w), f"{where} combined top-k weights")
                    else:
                        _expect(combined_w is None, f"{where} combined weights without top-k")
                    checked += 1

    # Configs and the static API.
    deep_ep.Buffer.set_num_sms(24)
    default = deep_ep.Buffer.get_dispatch_config(world)
    _expect(isinstance(default, deep_ep.Config) and default.num_sms == 24, "get_dispatch_config")
    _expect(deep_ep.Buffer.get_combine_config(world).num_sms == 24, "get_combine_config")
    nvl = default.get_nvl_buffer_size_hint(H * 2, world)
    _expect(isinstance(nvl, int) and nvl > 0 and default.get_rdma_buffer_size_hint(H * 2, world) == 0, "size hints")
    _expect(config.num_sms == 24 and config.num_max_nvl_chunked_send_tokens == 8
            and config.num_max_nvl_chunked_recv_tokens == 256, "Config fields")
    _expect(buffer.num_nvl_bytes == int(1e6) and buffer.group is group, "recorded constructor arguments")
    _expect(deep_ep.Buffer.is_sm90_compiled() is True, "FP8 dispatch available")
    errors = {}
    for label, fn in (("low_latency", lambda: deep_ep.Buffer(group, low_latency_mode=True)),
                      ("odd_sms", lambda: deep_ep.Config(3, 8, 256)),
                      ("set_odd_sms", lambda: deep_ep.Buffer.set_num_sms(3)),
                      ("weights_without_idx", lambda: buffer.dispatch(x_rand, num_tokens_per_rank=n_per_rank,
                                                                      is_token_in_rank=is_token_in_rank,
                                                                      num_tokens_per_expert=n_per_expert,
                                                                      topk_weights=w_rand))):
        try:
            fn()
            errors[label] = None
        except (ValueError, NotImplementedError) as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    buffer.destroy()
    compat.uninstall()
    return {"checked": checked, "errors": errors, "still_installed": "deep_ep" in sys.modules}


def test_deep_ep_surface_on_gloo():
    results = run_distributed(_compat_worker, 2, timeout_s=60, join_timeout_s=300)
    for res in results:
        assert res["checked"] == 24
        assert not res["still_installed"]
        errors = res["errors"]
        assert errors["low_latency"].startswith("NotImplementedError") and "low-latency" in errors["low_latency"]
        assert "num_sms" in errors["odd_sms"] and "new_num_sms" in errors["set_odd_sms"]
        assert "topk_weights" in errors["weights_without_idx"]


def test_config_maps_num_sms_and_warns_once_about_chunk_sizes(monkeypatch):
    import ep_moe
    import ep_moe.compat.deep_ep as compat

    monkeypatch.setattr(compat, "_chunk_fields_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the recommended configs and omitted chunk sizes warn of nothing
        recommended = compat.Buffer.get_dispatch_config(2)
        omitted = compat.Config()
        compat.Config(16, 8, 256)
    assert isinstance(recommended, ep_moe.Config) and recommended.native is None
    assert omitted.num_sms == ep_moe.config.DEFAULT_NUM_SMS and omitted.native is None
    assert (omitted.num_max_nvl_chunked_send_tokens, omitted.num_max_nvl_chunked_recv_tokens,
            omitted.num_max_rdma_chunked_send_tokens, omitted.num_max_rdma_chunked_recv_tokens) == (6, 256, 6, 256)
    with pytest.warns(UserWarning, match=r"num_max_nvl_chunked_send_tokens=6 ignored: .*ep_moe\.NativeOptions"):
        tuned = compat.Config(24, 6, 256)
    assert tuned.num_max_nvl_chunked_send_tokens == 6  # kept: callers read it back
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.Config(24, 12, 512, 8, 64)  # once per process
    # one SM default, shared with ep_moe.Buffer
    assert compat.Buffer.num_sms == ep_moe.Buffer.num_sms == ep_moe.config.DEFAULT_NUM_SMS
    monkeypatch.setattr(ep_moe.Buffer, "num_sms", ep_moe.Buffer.num_sms)  # restored afterwards
    compat.Buffer.set_num_sms(16)
    assert ep_moe.Buffer.num_sms == 16 and compat.Buffer.get_combine_config(2).num_sms == 16


def test_install_refuses_a_foreign_deep_ep(monkeypatch):
    import types

    import ep_moe.compat.deep_ep as compat

    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    with pytest.raises(RuntimeError, match="another deep_ep is already imported"):
        compat.install()


_PROGRAM = textwrap.dedent("""
    import sys
    import torch.multiprocessing as mp
    import deep_ep

    def child(index, path):
        import deep_ep
        with open(f"{path}.{index}", "w") as f:
            f.write(deep_ep.__name__ + " " + deep_ep.Buffer.__module__)

    if __name__ == "__main__":
        print("parent", deep_ep.__name__, sys.argv[1:])
        mp.spawn(child, args=(sys.argv[1],), nprocs=1)
""")


def test_launcher_and_shim_dir(tmp_path, monkeypatch, capsys):
    env = dict(os.environ, EP_MOE_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PYTHONPATH", None)
    program = tmp_path / "program.py"
    program.write_text(_PROGRAM)
    marker = tmp_path / "marker"
    run = subprocess.run([sys.executable, "-m", "ep_moe.compat.deep_ep", str(program), str(marker)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert f"parent ep_moe.compat.deep_ep ['{marker}']" in run.stdout
    for index in range(1):  # a spawned child resolves deep_ep through the shim too
        assert (tmp_path / f"marker.{index}").read_text() == "ep_moe.compat.deep_ep ep_moe.compat.deep_ep"

    import ep_moe.compat.deep_ep as compat

    monkeypatch.setenv("EP_MOE_CACHE_DIR", env["EP_MOE_CACHE_DIR"])
    assert compat.main(["--shim-dir"]) == 0
    folder = capsys.readouterr().out.strip()
    assert folder == compat.shim_dir() and os.path.isfile(os.path.join(folder, "deep_ep.py"))
    probe = subprocess.run([sys.executable, "-c", "import deep_ep, deep_ep.utils; "
                            "print(deep_ep.__name__, deep_ep.utils.EventOverlap.__module__)"],
                           env=dict(env, PYTHONPATH=folder), capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["ep_moe.compat.deep_ep"] * 2, probe.stderr
