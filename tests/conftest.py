"""Shared pytest hooks: tests marked ``gpu`` are skipped, with the reason, where no CUDA GPU exists;
one intra-op thread per test; the ``solo_group`` fixture (a world-size-1 gloo group in the test process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ep_moe.distributed import free_port


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests use tiny tensors: intra-op threads only add contention on a small shared CPU (spawned ranks
    run one thread too, see `ep_moe.distributed`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def solo_group():
    """A world-size-1 gloo group in this process for single-process checks, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this test process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
