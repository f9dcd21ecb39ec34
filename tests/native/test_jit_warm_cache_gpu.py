"""The JIT cache as the one ahead-of-time build, on one GPU: (a) a fresh process loads every kernel a one-rank
native dispatch / combine and the expert-major ops use from the disk cache, compiling none, with the same bits;
(b) ``ep-moe jit warmup`` for a shape, then a process with no compiler at all (nvcc off PATH, no CUDA_HOME, the
compiler search answering none, the compilers' compile refusing) runs the same work from that cache.

Each child process prints what it built or loaded (`ep_moe.native.jit.history`), how many builds its cache ran,
and a digest of its outputs; inside, it checks the native backend against the torch backend and the expert-major
kernels against the torch definitions bit for bit.
Needs one GPU and a CUDA compiler: ``pytest -m gpu tests/native/test_jit_warm_cache_gpu.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import locations
import pytest
import torch
from support_jit import GPU_JIT_MARKS

pytestmark = GPU_JIT_MARKS

H, K, E, T = 1024, 4, 8, 100  # the work's shape: hidden, top-k, experts (all local at EP 1), tokens

_CHILD = textwrap.dedent(f"""
    import hashlib, json, sys
    import torch
    import torch.distributed as dist
    from ep_moe.native import jit
    if "--no-compiler" in sys.argv:
        from ep_moe.native.jit import compilers
        jit.compiler = lambda: (None, "hidden by the test")

        def refuse(self, *args, **kwargs):
            raise AssertionError("a compiler ran")

        compilers.NvrtcCompiler.compile = compilers.NvccCompiler.compile = refuse
    from ep_moe import Buffer, native
    from ep_moe import permute as P
    from ep_moe.native.jit import expert_major_exchange
    from support.bits import assert_bits_equal, bits

    assert native.kernels_unavailable_reason() is None, native.kernels_unavailable_reason()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    H, K, E, T = {H}, {K}, {E}, {T}
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g, device=dev)
    outs = {{}}
    for backend in ("native", "torch"):
        buf = Buffer(backend=backend, timeout_s=30.0)
        assert buf.backend_name == backend, buf.backend_name
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w)
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        outs[backend] = [per_rank, per_expert, in_rank, recv_x, recv_idx, recv_w, combined, combined_w]
        buf.destroy()

    for i, (a, b) in enumerate(zip(outs["native"], outs["torch"])):
        assert_bits_equal(a, b, f"native output {{i}} against the torch backend's")
    # the expert-major ops of the shape: the layout, the permute with values, the weighted reduce, the own rows
    P.reset_implementations_run()
    layout = P.expert_layout(idx, E, 16)
    rows, slot_w = P.permute_rows_and_values(x, w, layout)
    out = P.unpermute_sum(rows, layout, slot_w)
    prefix = torch.tensor([[T]], dtype=torch.int32, device=dev)
    own = expert_major_exchange.unpermute_own_rows(rows, slot_w, layout.sorted_slots, prefix, 0)
    assert P.implementations_run() == ("jit",), P.implementations_run()
    ref = P.expert_layout(idx.cpu(), E, 16)
    ref_rows, ref_w = P.permute_rows_and_values(x.cpu(), w.cpu(), ref)
    ref_out = P.unpermute_sum(ref_rows, ref, ref_w)
    for name, a, b in (("layout", layout.pair_of_slot, ref.pair_of_slot), ("rows", rows, ref_rows),
                       ("slot weights", slot_w, ref_w), ("reduce", out, ref_out), ("own rows", own, ref_out)):
        assert_bits_equal(a.cpu(), b, name)
    torch.cuda.synchronize()
    digest = hashlib.sha256()
    for t in outs["native"] + [layout.pair_of_slot, rows, slot_w, out, own]:
        digest.update(bits(t).cpu().numpy().tobytes())
    dist.destroy_process_group()
    print(json.dumps({{"history": [list(e) for e in jit.history()], "builds": jit.process_cache().builds,
                      "digest": digest.hexdigest()}}))
""")


def _env(cache: str, compiler: bool = True) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(locations.REPO), str(locations.REPO / "tests"),
                                       os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, EP_MOE_CACHE_DIR=cache, PYTHONPATH=path)
    if not compiler:  # no nvcc to find: PATH without it, no toolkit named
        for name in ("CUDA_HOME", "CUDA_PATH", "EP_MOE_JIT_COMPILER"):
            env.pop(name, None)
        env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                      if d and not os.path.exists(os.path.join(d, "nvcc")))
    return env


def _child(env: dict[str, str], *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loads(run: dict) -> dict[str, str]:
    """Label -> how, for every kernel the run built or loaded (its in-memory hits left out)."""
    return {label: how for label, how, _ in run["history"] if how != "memory"}


def test_a_fresh_process_loads_every_kernel_from_the_disk_cache(tmp_path):
    env = _env(str(tmp_path / "cache"))
    first, second = _child(env), _child(env)
    assert first["builds"] > 0 and "compiled" in _loads(first).values(), first
    assert any(label.startswith("intranode") for label in _loads(first)), _loads(first)
    assert any(label.startswith("expert_major_exchange") for label in _loads(first)), _loads(first)
    assert second["builds"] == 0, second
    assert set(_loads(second).values()) == {"disk"}, _loads(second)
    assert set(_loads(second)) == set(_loads(first)), "every kernel of the first process is loaded by the second"
    assert second["digest"] == first["digest"]


def test_warmup_then_a_process_without_a_compiler_runs_from_the_cache(tmp_path):
    cache = str(tmp_path / "cache")
    env = _env(cache)
    warm = subprocess.run([sys.executable, "-m", "ep_moe.cli", "jit", "warmup", "--cache-dir",
                           os.path.join(cache, "jit"), "--shapes", f"hidden={H},topk={K},experts={E}"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert warm.returncode == 0, warm.stdout[-4000:] + warm.stderr[-4000:]
    run = _child(_env(cache, compiler=False), "--no-compiler")
    assert run["builds"] == 0, run
    loads = _loads(run)
    assert loads and set(loads.values()) == {"disk"}, loads
    assert any(label.startswith("intranode") for label in loads), loads
    with_compiler = _child(env)
    assert with_compiler["digest"] == run["digest"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_process_without_a_compiler_or_a_cache_has_no_native_kernels(tmp_path):
    code = textwrap.dedent("""
        from ep_moe.native import jit
        jit.compiler = lambda: (None, "hidden by the test")
        from ep_moe import native
        print(native.kernels_unavailable_reason())
    """)
    out = subprocess.run([sys.executable, "-c", code], env=_env(str(tmp_path / "empty"), compiler=False),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no CUDA compiler (hidden by the test)" in out.stdout and "ep-moe jit warmup" in out.stdout, out.stdout
