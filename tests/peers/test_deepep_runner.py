"""The DeepEP program runner's host side (tests/peers/deepep_runner.py), on CPU.

The suite runs against a fake DeepEP checkout whose "programs" pass, fail or hang, and whose
``deep_ep/utils/envs.py`` has an ``init_dist`` written the way DeepEP's is (NCCL with ``device_id=cuda:local_rank``,
``torch.cuda.set_device(local_rank)``): the 2-process runs share the "GPU" through the adaptation, on the CPU
(``--device cpu``), in processes the programs spawn. The collectives staged under gloo are checked on 2 ranks with
FP8 tensors (which gloo cannot carry). Where ``EP_MOE_DEEP_EP_CHECKOUT`` names a DeepEP checkout, its own
``init_dist`` and reference dispatch run adapted on 2 CPU ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import deepep_runner as runner
import pytest
import torch
import torch.distributed as dist
from support.bits import assert_bits_equal

from ep_moe.distributed import run_distributed

_ENVS = textwrap.dedent("""
    # Shaped like DeepEP's deep_ep/utils/envs.py: the calls the runner's adaptation must change, and those it
    # must keep.
    import inspect
    import os

    import torch
    import torch.distributed as dist

    import deep_ep._C as _C
    from deep_ep._C import EventHandle

    _local_rank = None
    _local_seed = 0


    def init_seed(seed):
        global _local_seed
        _local_seed = seed + dist.get_rank()
        torch.manual_seed(_local_seed)


    def dist_print(s='', once_in_node=False):
        assert _local_rank is not None
        if not once_in_node or _local_rank == 0:
            print(s, flush=True)
        dist.barrier()


    def init_dist(local_rank, num_local_ranks, seed=0):
        global _local_rank
        _local_rank = local_rank
        params = dict(backend='nccl', init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                      world_size=num_local_ranks, rank=local_rank)
        if 'device_id' in inspect.signature(dist.init_process_group).parameters:
            params['device_id'] = torch.device(f'cuda:{local_rank}')
        dist.init_process_group(**params)
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device('cuda')
        torch.cuda.set_device(local_rank)
        init_seed(seed)
        return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))


    def get_rdma_gbs(nic_name='mlx5_0'):
        return 0  # what DeepEP's gives without an RDMA NIC
    """)

# A program's body: parse --num-processes, spawn that many ranks, each running `rank_body` (indented into rank()).
_PROGRAM = textwrap.dedent("""
    import argparse
    import sys
    import time

    import torch
    import torch.distributed as dist

    import deep_ep
    from deep_ep.utils.envs import dist_print, get_rdma_gbs, init_dist


    def rank(local_rank, num_local_ranks, args):
        assert deep_ep.__name__ == 'ep_moe.compat.deep_ep', deep_ep.__name__
        assert deep_ep.utils.envs.__file__.startswith(args.checkout), deep_ep.utils.envs.__file__
    {rank_body}

    if __name__ == '__main__':
        parser = argparse.ArgumentParser()
        parser.add_argument('--num-processes', type=int, default=8)
        parser.add_argument('--num-tokens', type=int, default=0)
        args, _ = parser.parse_known_args()
        args.checkout = {checkout!r}
        print('{name} started with', sys.argv[1:], flush=True)
        torch.multiprocessing.spawn(rank, args=(args.num_processes, args), nprocs=args.num_processes)
    """)

# Shared runs (more than one process): DeepEP's init_dist, adapted; checks of what it must keep and change.
_SHARED_BODY = """
    if num_local_ranks > 1:
        rank_idx, num_ranks, group = init_dist(local_rank, num_local_ranks, seed=5)
        assert dist.get_backend() == 'gloo' and (rank_idx, num_ranks) == (local_rank, num_local_ranks)
        assert torch.get_default_dtype() == torch.bfloat16 and torch.empty(1).device.type == 'cpu'
        assert group.size() == num_local_ranks and deep_ep.utils.envs._local_seed == 5 + rank_idx
        dist_print(f'rank {rank_idx} shared ok', once_in_node=True)
        dist.destroy_process_group()
"""

_BODIES = {
    "legacy/test_intranode.py": _SHARED_BODY,
    "elastic/test_ep.py": "    pass\n",
    "elastic/test_agrs.py": "    raise AssertionError('boom from agrs')\n",
    "elastic/test_engram.py": "    if num_local_ranks > 1:\n        time.sleep(600)\n",
    "elastic/test_pp.py": _SHARED_BODY + "    assert get_rdma_gbs() == 50.0, get_rdma_gbs()\n",
    "elastic/test_barrier.py": "    pass\n",
}


def write_checkout(root: Path) -> Path:
    """A fake DeepEP checkout at ``root``: utils (`_ENVS`) and one fake program per runner program."""
    utils = root / "deep_ep" / "utils"
    utils.mkdir(parents=True)
    (root / "deep_ep" / "__init__.py").write_text("raise ImportError('the checkout\\'s deep_ep was imported')\n")
    (utils / "__init__.py").write_text("")
    (utils / "envs.py").write_text(_ENVS)
    for rel, body in _BODIES.items():
        path = root / "tests" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_PROGRAM.format(rank_body=textwrap.indent(textwrap.dedent(body), "    "),
                                        checkout=str(root), name=rel))
    return root


def test_plan():
    runs = runner.plan("/d", runner.PROGRAMS, (1, 2), gpus=1, python="py")
    by = {(r.program.name, r.processes): r for r in runs}
    assert len(runs) == 2 * len(runner.PROGRAMS)
    plain = by["elastic/test_ep.py", 1]
    assert plain.command[:5] == ("py", "-m", "ep_moe.compat.deep_ep", "--deep-ep", "/d")
    assert plain.command[5] == plain.script == "/d/tests/elastic/test_ep.py"
    assert plain.command[-2:] == ("--num-processes", "1") and "--skip-perf-test" in plain.command
    assert "EP_MOE_SYMMETRIC_MEMORY" not in plain.env and not plain.via_launch
    shared = by["elastic/test_ep.py", 2]
    assert shared.command[2:6] == ("launch", "--deep-ep", "/d", "--share-gpu")
    assert shared.env["EP_MOE_SYMMETRIC_MEMORY"] == "vmm" and shared.via_launch
    assert by["elastic/test_pp.py", 1].skip and not by["elastic/test_pp.py", 2].skip
    assert "--rdma-gbs" in by["elastic/test_pp.py", 2].command
    assert by["elastic/test_engram.py", 1].env["EP_USE_NVIDIA_TOOLS"] == "1"
    assert "--use-fp8" in by["elastic/test_engram.py --use-fp8", 2].command
    # As many GPUs as processes: nothing shared, DeepEP's init_dist untouched.
    two = runner.plan("/d", runner.PROGRAMS[:1], (2,), gpus=2, python="py")[0]
    assert two.command[1] == "-m" and "EP_MOE_SYMMETRIC_MEMORY" not in two.env


@pytest.mark.slow
def test_suite_on_fake_checkout(tmp_path: Path, capsys):
    checkout = write_checkout(tmp_path / "DeepEP")
    code = runner.suite(["--deep-ep", str(checkout), "--processes", "1,2", "--timeout", "30", "--device", "cpu",
                         "--gpus", "0", "--log-dir", str(tmp_path / "logs"), "--only", "intranode,agrs,pp,use-fp8"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert code == 1, out
    assert "revision unknown" in lines[0]

    def line(status: str, title: str) -> str:
        found = [x for x in lines if x.startswith(f"{status}  {title}")]
        assert found, f"no {status} line for {title}:\n{out}"
        return found[0]

    line("PASS", "legacy/test_intranode.py [1 proc]")
    line("PASS", "legacy/test_intranode.py [2 procs]")
    assert "exit status 1" in line("FAIL", "elastic/test_agrs.py [1 proc]")  # a rank failed
    assert "    | AssertionError: boom from agrs" in out  # the failure's last lines
    line("PASS", "elastic/test_engram.py --use-fp8 [1 proc]")
    assert "TIMEOUT after 30 s" in line("FAIL", "elastic/test_engram.py --use-fp8 [2 procs]")
    line("SKIP", "elastic/test_pp.py [1 proc]")
    line("PASS", "elastic/test_pp.py [2 procs]")
    assert lines[-1] == "Summary: 4 passed, 3 failed, 1 skipped (of 8 runs)"
    # A run through `launch` that hangs prints its processes' stacks before it is killed.
    hung = (tmp_path / "logs" / "elastic_test_engram.py_use_fp8-2p.log").read_text()
    assert "time.sleep(600)" in hung or "in rank" in hung, hung
    shared = (tmp_path / "logs" / "legacy_test_intranode.py-2p.log").read_text()
    assert "rank 0 shared ok" in shared


def test_shell_script(tmp_path: Path):
    script = Path(runner.HERE, "deepep.sh")
    subprocess.run(["bash", "-n", str(script)], check=True)
    missing = subprocess.run(["bash", str(script), str(tmp_path / "nowhere")], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2
    assert "git clone https://github.com/deepseek-ai/DeepEP" in missing.stderr and "dd758caf" in missing.stderr
    checkout = write_checkout(tmp_path / "DeepEP")
    dry = subprocess.run(["bash", str(script), "--dry-run", "--only", "test_pp"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, DEEP_EP_DIR=str(checkout), PYTHON=sys.executable))
    assert dry.returncode == 0, dry.stderr
    assert "elastic/test_pp.py [1 proc]: SKIP" in dry.stdout and "--rdma-gbs" in dry.stdout


@pytest.mark.parametrize("shape,dtype", [((5, 4), torch.float8_e4m3fn), ((7,), torch.float8_e5m2), ((), torch.uint16),
                                         ((0, 3), torch.float8_e4m3fn), ((3, 2, 2), torch.bfloat16)])
def test_host_round_trip(shape, dtype):
    t = torch.randn(shape).to(dtype) if dtype != torch.uint16 else torch.tensor(513, dtype=dtype)
    host = runner.to_host(t)
    assert host.dtype in runner.GLOO_DTYPES and host.dim() == 2 and host.shape[0] == (t.shape[0] if t.dim() else 1)
    assert runner.host_empty(t).shape == host.shape and runner.host_empty(t).dtype == host.dtype
    back = torch.empty_like(t)
    runner.from_host(host, back)
    assert_bits_equal(back, t, "round trip")


def _collectives_worker(rank: int, world: int) -> bool:
    for name, fn in runner.staged_collectives().items():
        setattr(dist, name, fn)
    fp8 = torch.float8_e4m3fn
    # all_to_all_single with uneven splits along dim 0 (rank r sends r + 1 + d rows to rank d).
    send = [torch.full((rank + 1 + d, 3), float(10 * rank + d)) for d in range(world)]
    out = torch.empty((sum(s + 1 + rank for s in range(world)), 3), dtype=fp8)
    dist.all_to_all_single(out, torch.cat(send).to(fp8), [s + 1 + rank for s in range(world)],
                           [rank + 1 + d for d in range(world)])
    want = torch.cat([torch.full((s + 1 + rank, 3), float(10 * s + rank)) for s in range(world)])
    assert torch.equal(out.float(), want.to(fp8).float())
    # all_gather of a list, and into one tensor (flat and stacked outputs), asynchronously too.
    mine = torch.full((2, 2), float(rank + 1)).to(fp8)
    parts = [torch.empty((2, 2), dtype=fp8) for _ in range(world)]
    work = dist.all_gather(parts, mine, async_op=True)
    assert work.wait() and [p.float()[0, 0].item() for p in parts] == [r + 1.0 for r in range(world)]
    flat, stacked = torch.empty((2 * world, 2), dtype=fp8), torch.empty((world, 2, 2), dtype=fp8)
    dist.all_gather_into_tensor(flat, mine)
    dist.all_gather_into_tensor(stacked, mine)
    assert torch.equal(flat.float(), stacked.float().reshape(-1, 2))
    assert flat.float()[::2, 0].tolist() == [r + 1.0 for r in range(world)]
    # A type gloo carries goes to torch's own collective.
    ints = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(ints, torch.full((world,), rank, dtype=torch.int64))
    assert ints.tolist() == list(range(world))
    return True


def test_staged_collectives_two_ranks():
    assert run_distributed(_collectives_worker, 2) == [True, True]


_REAL = textwrap.dedent("""
    import argparse

    import torch
    import torch.distributed as dist

    from deep_ep.utils.envs import dist_print, init_dist
    from deep_ep.utils.refs import dispatch as ref_dispatch


    def rank(local_rank, num_local_ranks, args):
        rank_idx, num_ranks, group = init_dist(local_rank, num_local_ranks, seed=1)
        assert dist.get_backend() == 'gloo' and torch.empty(1).device.type == 'cpu'
        x = torch.randn(6, 256)
        x = (x.to(torch.float8_e4m3fn), torch.rand(6, 2, dtype=torch.float32))
        topk_idx = torch.tensor([[0, 3]] * 6)  # experts 0 (rank 0) and 3 (rank 1)
        recv = ref_dispatch(x, topk_idx, torch.ones(6, 2, dtype=torch.float32), 8, 4)
        assert recv[0][0].dtype == torch.float8_e4m3fn and recv[0][0].shape == (6 * num_ranks, 256)
        assert recv[4].tolist() == [6] * num_ranks
        dist_print(f'real utils ok on {num_ranks} ranks', once_in_node=True)
        dist.destroy_process_group()


    if __name__ == '__main__':
        parser = argparse.ArgumentParser()
        parser.add_argument('--num-processes', type=int, default=2)
        args = parser.parse_args()
        torch.multiprocessing.spawn(rank, args=(args.num_processes, args), nprocs=args.num_processes)
    """)


@pytest.mark.skipif(not os.path.isdir(os.environ.get("EP_MOE_DEEP_EP_CHECKOUT", "")),
                    reason="EP_MOE_DEEP_EP_CHECKOUT does not name a DeepEP checkout")
def test_deepep_init_dist_and_refs_adapted(tmp_path: Path):
    program = tmp_path / "program.py"
    program.write_text(_REAL)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(runner.free_port()))
    run = subprocess.run([sys.executable, str(Path(runner.__file__)), "launch", "--deep-ep",
                          os.environ["EP_MOE_DEEP_EP_CHECKOUT"], "--share-gpu", "--device", "cpu", str(program),
                          "--num-processes", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "real utils ok on 2 ranks" in run.stdout
