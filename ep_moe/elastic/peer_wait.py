"""Waiting for a torch.distributed work item of PP, AGRS or Engram with a deadline whose error names the rank
and the stage (a peer that never posts its side ends in an error, never a hang on CPU)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def wait_work(work: dist.Work | None, device: torch.device, timeout_s: float, error: type[Exception], op: str,
              rank: int, num_ranks: int, stage: str) -> None:
    """Wait for ``work``. On CPU (gloo) with a deadline: a peer that never posts its side raises ``error``
    naming this rank and ``stage`` (another failure, e.g. a peer that died: a RuntimeError of the same
    wording; gloo then closes the pair: the group is unusable afterwards). On a GPU
    the current stream waits on the work; a missing peer is caught by the process group's watchdog."""
    if work is None:
        return
    if device.type != "cpu":
        work.wait()
        return
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        timed_out = "timeout" in str(exc).lower() or "timed out" in str(exc).lower()
        what = "timed out" if timed_out else "failed"
        raise (error if timed_out else RuntimeError)(f"ep_moe.ElasticBuffer.{op}: rank {rank} of {num_ranks} {what} in stage '{stage}' after "
                    f"waiting up to {timeout_s:g} s for its peer(s) ({exc})") from exc


__all__ = ["wait_work"]
