"""Past one machine as users launch it, on one CPU machine: two ``torchrun`` agents with c10d rendezvous (two
nodes), hybrid mode's topology from the launch, a node lost, and an elastic restart that resumes.

Every agent runs in its own process group (setsid) with its output in files; whatever a test leaves is killed (agents and
their ranks, by pid) in ``finally``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import locations
import psutil
import pytest
import torch

from ep_moe.distributed import free_port
from ep_moe.train.checkpoint import checkpoint_info, latest_checkpoint
from ep_moe.train.metrics import read_records
from ep_moe.train.rundir import RunDirLock

ROOT = str(locations.REPO)
TINY = os.path.join(ROOT, "recipes", "tiny-cpu.yaml")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# EP 4 over 2 nodes x 2 ranks, the smallest model that still routes across both nodes.
SMALL = ["logger.progress_bar=false", "train.eval_iters=0", "model.num_layers=1", "model.seq_length=32",
         "train.global_batch_size=16", "train.micro_batch_size=4", "model.expert_model_parallel_size=4"]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


class Agents:
    """``count`` torchrun agents of one job (``--nnodes count --nproc-per-node per_node``, c10d rendezvous on
    a free port, no node rank), each started with setsid, stdout/stderr in ``folder``."""

    def __init__(self, folder: str, args: list[str], count: int = 2, per_node: int = 2, max_restarts: int = 0,
                 recipe: str = TINY):
        port = free_port()
        self.folder = folder
        self.procs: list[subprocess.Popen] = []
        for i in range(count):
            cmd = [*TORCHRUN, "--nnodes", str(count), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", str(max_restarts),
                   "-m", "ep_moe.train", recipe, *args]
            with open(self.out(i), "w") as out, open(self.err(i), "w") as err:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=out, stderr=err))
            if i == 0:  # agent 0 hosts the rendezvous store: the others start once it listens
                _wait_listening(port, self.procs[0])

    def out(self, i: int) -> str:
        return os.path.join(self.folder, f"agent{i}.out")

    def err(self, i: int) -> str:
        return os.path.join(self.folder, f"agent{i}.err")

    def text(self, i: int) -> str:
        return open(self.out(i)).read() + open(self.err(i)).read()

    def ranks(self, i: int) -> list[psutil.Process]:
        """Agent ``i``'s worker processes (torchrun starts each with setsid)."""
        try:
            return psutil.Process(self.procs[i].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [p.returncode for p in self.procs]

    def kill(self, i: int) -> list[psutil.Process]:
        """SIGKILL agent ``i`` and its ranks at once (a node lost); the processes killed."""
        victims = [psutil.Process(self.procs[i].pid), *self.ranks(i)]
        for v in victims:
            try:
                v.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.procs[i].wait(timeout=10)
        return victims

    def cleanup(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill(i)


def _train_losses(folder: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_records(os.path.join(folder, "metrics.jsonl"))
            if r.get("kind") == "train"]


def _wait_for(cond, agents: Agents, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if any(p.poll() is not None for p in agents.procs):
            pytest.fail(f"an agent ended before {what}:\n" + "\n".join(agents.text(i) for i in range(2)))
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


STEPS = 40  # the hybrid and restarted runs' length; the restart test kills a rank after the first checkpoint
SAVE_EVERY = 4


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory) -> list[tuple[int, float]]:
    """The reference: one launcher spawning 4 ranks, flat (no hybrid mode), `STEPS` steps; its train losses."""
    folder = str(tmp_path_factory.mktemp("flat") / "run")
    out = subprocess.run([sys.executable, "-m", "ep_moe.train", TINY, *SMALL, f"train.train_iters={STEPS}",
                          "checkpoint.save_interval=0", "train.nproc=4", f"checkpoint.save={folder}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    assert "dispatcher backend: torch" in out.stdout
    losses = _train_losses(folder)
    assert len(losses) == STEPS
    return losses


def test_two_torchrun_agents_run_hybrid_mode_with_nodes_from_the_launch_and_the_flat_runs_losses(tmp_path, flat_run):
    """Two agents x 2 ranks, EP 4 (more than train.nproc: the launcher's world decides), hybrid mode: the EP
    group is viewed as 2 x 2 from the launch (GROUP_RANK; the host names are equal here), and the losses are the
    one-launcher 4-rank flat run's, bit for bit."""
    hybrid = str(tmp_path / "hybrid")
    agents = Agents(str(tmp_path), [*SMALL, f"train.train_iters={STEPS}", "checkpoint.save_interval=0",
                                    "ep_moe.hybrid_mode=true", f"checkpoint.save={hybrid}"])
    try:
        codes = agents.wait(timeout=150)
    finally:
        agents.cleanup()
    texts = [agents.text(i) for i in range(2)]
    assert codes == [0, 0], "\n".join(texts)
    assert not any("must divide the number of ranks" in t for t in texts)
    assert sum("dispatcher backend: hybrid (hybrid mode, 2 x 2 (launch))" in t for t in texts) == 1, texts
    got = _train_losses(hybrid)
    assert json.dumps(got) == json.dumps(flat_run), (got, flat_run)  # the repr of each float: every bit


@pytest.mark.parametrize("lost", [0, 1], ids=["the-rendezvous-host", "the-other-node"])
def test_a_lost_node_ends_the_other_nodes_ranks_in_seconds_with_one_line_each(tmp_path, lost):
    """SIGKILL one agent and its ranks mid-run: the other node's ranks exit within 30 s, each with one line
    naming the lost peer and the stage; its agent exits with status 1, no process is left, the run folder's
    lock is free and the last checkpoint loads. Agent 0 started first and hosts the rendezvous store."""
    run = str(tmp_path / "run")
    agents = Agents(str(tmp_path), [*SMALL, "train.train_iters=100000", "checkpoint.save_interval=2",
                                    "ep_moe.hybrid_mode=true", f"checkpoint.save={run}"])
    try:
        _wait_for(lambda: os.path.exists(os.path.join(run, "latest")) and len(_train_losses(run)) >= 3, agents,
                  120, "a checkpoint")
        alive = 1 - lost
        survivors = agents.ranks(alive)
        assert len(survivors) == 2
        agents.kill(lost)
        t0 = time.monotonic()
        code = agents.procs[alive].wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        agents.cleanup()
    print(f"the other node's agent exited {took:.1f} s after the node was lost")
    assert code == 1
    gone = psutil.wait_procs(survivors, timeout=5)[1]
    assert not gone, f"orphans: {gone}"
    err = open(agents.err(alive)).read()
    ours = [line for line in err.splitlines() if line.startswith("ep-moe train:")]
    assert len(ours) == 2, err
    for line in ours:
        assert " lost rank " in line and "gone)" in line and " during " in line, line
        assert any(f"during {stage}" in line for stage in ("training step", "checkpoint save", "evaluation")), line
    lock = RunDirLock(run).acquire()  # free: no live process holds it
    lock.release()
    latest = latest_checkpoint(run)
    info = checkpoint_info(latest)
    assert info["step"] >= 2 and info["step"] % 2 == 0 and info["world_size"] == 4 and info["ep_size"] == 4
    for name in ("model.pt", "optimizer.pt"):
        state = torch.load(os.path.join(latest, name), map_location="cpu", weights_only=True)
        assert state
    model = torch.load(os.path.join(latest, "model.pt"), map_location="cpu", weights_only=True)
    assert all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point())


def test_an_elastic_restart_resumes_from_the_last_checkpoint_with_the_uninterrupted_runs_loss(tmp_path, flat_run):
    """``--max-restarts 1``: one rank SIGKILLed after the first checkpoint; torchelastic restarts both agents'
    ranks, the trainer resumes from the latest checkpoint by itself, and every loss after it (the final one too)
    is the uninterrupted run's, bit for bit."""
    run = str(tmp_path / "run")
    agents = Agents(str(tmp_path), [*SMALL, f"train.train_iters={STEPS}", f"checkpoint.save_interval={SAVE_EVERY}",
                                    "ep_moe.hybrid_mode=true", f"checkpoint.save={run}"], max_restarts=1)
    try:
        _wait_for(lambda: latest_checkpoint(run) is not None, agents, 120, "the first checkpoint")
        victim = agents.ranks(1)[0]
        victim.send_signal(signal.SIGKILL)
        codes = agents.wait(timeout=150)
    finally:
        agents.cleanup()
    texts = [agents.text(i) for i in range(2)]
    assert codes == [0, 0], "\n".join(texts)
    resumed = [line for t in texts for line in t.splitlines() if line.startswith("resumed from ")]
    assert len(resumed) == 1, texts
    start = int(resumed[0].rsplit(" ", 1)[1])
    assert start % SAVE_EVERY == 0 and 0 < start < STEPS, resumed
    got = dict(_train_losses(run))  # the steps after the resume were written last
    assert max(got) == STEPS
    after = [(step, loss) for step, loss in flat_run if step > start]
    assert json.dumps([(step, got[step]) for step, _ in after]) == json.dumps(after)
    assert json.dumps(got[STEPS]) == json.dumps(flat_run[-1][1])


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_the_other_engines_run_on_two_torchrun_agents_with_the_one_launcher_runs_losses(tmp_path, engine):
    """Megatron and DeepSpeed launched as two nodes (EP 4 > train.nproc): the losses of the one-launcher 4-rank
    run, bit for bit (their MoE layers run flat: hybrid mode is the ep_moe engine's)."""
    recipe = {"megatron": "megatron-gpt-moe-ep2", "deepspeed": "deepspeed-moe-ep2"}[engine]
    args = ["train.train_iters=2", "train.device=cpu", "train.eval_iters=0", "train.target_loss_gap=null",
            "model.num_layers=1", "ep_moe.dispatcher_backend=torch", "model.expert_model_parallel_size=4",
            "train.micro_batch_size=4", "logger.log_interval=1", "logger.progress_bar=false"]
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    agents = Agents(str(tmp_path), [*args, f"checkpoint.save={two}"], recipe=recipe)
    try:
        codes = agents.wait(timeout=200)
    finally:
        agents.cleanup()
    assert codes == [0, 0], "\n".join(agents.text(i) for i in range(2))
    out = subprocess.run([sys.executable, "-m", "ep_moe.train", recipe, *args, "train.nproc=4",
                          f"checkpoint.save={one}"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr
    got, want = _train_losses(two), _train_losses(one)
    assert len(want) == 2 and json.dumps(got) == json.dumps(want), (got, want)


# ---------------------------------------------------------------------------------------------- in process
def test_under_a_launcher_its_world_decides_and_train_nproc_is_no_constraint(monkeypatch):
    from ep_moe.train.recipe_schema import RecipeError, load_recipe

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RecipeError, match=r"model.expert_model_parallel_size: must divide the number of ranks "
                                          r"\(2\), got 4"):
        load_recipe(TINY, ["model.expert_model_parallel_size=4", "train.micro_batch_size=4"])
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    recipe = load_recipe(TINY, ["model.expert_model_parallel_size=4", "train.micro_batch_size=4"])
    assert recipe.train.nproc == 2 and recipe.model.expert_model_parallel_size == 4


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_hybrid_mode_is_a_named_error_for_the_other_engines(engine):
    from ep_moe.train.recipe_schema import RecipeError, load_recipe

    name = {"megatron": "megatron-gpt-moe-ep2", "deepspeed": "deepspeed-moe-ep2"}[engine]
    for override in ("ep_moe.hybrid_mode=true", "ep_moe.num_scaleout_ranks=2"):
        with pytest.raises(RecipeError, match=rf"^{override.split('=')[0]}: engine {engine} does not support it "
                                              r"\(hybrid mode is the ep_moe engine's"):
            load_recipe(name, [override])


def test_the_nodes_come_from_the_launch_before_the_host_names(monkeypatch):
    from ep_moe.backends.hybrid.node_topology import LogicalTopology, node_key

    for key in ("GROUP_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(key, raising=False)
    assert node_key()[0] == "hosts"
    monkeypatch.setenv("SLURM_NODEID", "3")
    assert node_key() == ("launch", "SLURM_NODEID=3")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert node_key() == ("launch", "GROUP_RANK=1")  # torchrun's agent first
    view = LogicalTopology.from_hosts(["GROUP_RANK=0", "GROUP_RANK=0", "GROUP_RANK=1", "GROUP_RANK=1"], "launch")
    assert (view.num_scaleout_ranks, view.num_scaleup_ranks, view.source) == (2, 2, "launch")
