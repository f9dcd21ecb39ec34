"""benchmarks/megatron_layer_bench.py's ``no dispatcher`` floor on the CPU (one gloo rank, megatron-core's
allgather layer with ep_moe's dispatcher installed): the floor's experts get the very rows, expert counts and
routed probs that the dispatcher gives them, and its step back-propagates into the router and the rows."""

from __future__ import annotations

import os
import subprocess
import sys

import locations
import pytest
from megatron_cpu_layer import SCRIPT_HEAD

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

SCRIPT = SCRIPT_HEAD + r'''
layer = bench._build(spec, config=config)
integ.use_portable_routers(layer)
integ.install_ep_moe_dispatcher(layer, backend="torch")
torch.manual_seed(5)
x = torch.randn(20, 1, 32).requires_grad_(True)
seen = []
experts_forward = layer.experts.forward
def spy(hidden, tokens_per_expert, probs):
    seen.append((hidden.detach().clone(), torch.as_tensor(tokens_per_expert).clone(), probs.detach().float()))
    return experts_forward(hidden, tokens_per_expert, probs)
layer.experts.forward = spy
out, _ = layer(x)
floor = bench.NoDispatcher(layer, [x])
layer.router.weight.grad = None
floor(x, torch.randn_like(x))
(h1, t1, p1), (h2, t2, p2) = seen
assert torch.equal(h1, h2) and torch.equal(t1, t2) and torch.equal(p1, p2), (t1, t2)
assert int(t1.sum()) == 40, t1
rows = floor.prepared[id(x)][0]
assert rows.grad is not None and rows.grad.shape == (40, 32)
assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
print("floor ok")
'''


def test_no_dispatcher_floor_feeds_the_experts_what_the_dispatcher_does() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        filter(None, [str(locations.REPO / "benchmarks"), str(locations.REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=locations.REPO, env=env, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0 and "floor ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
