"""Native intranode kernels (CUDA, over symmetric memory) and the check of whether they can run.

The extension ``ep_moe.native._C`` exists only where ``setup.py`` was asked to build it (``EP_MOE_BUILD_EXTENSION=1``)
and found a CUDA toolkit and a CUDA build of torch; elsewhere (the default install) the same kernels compile on first
use (`ep_moe.native.jit.intranode`, chosen by `kernels_kind`); ``setup.py`` records what it decided, and why, in ``build_info.json`` beside this file
(`read_build_record`), which is what `extension_unavailable_reason` quotes. Everything here imports
without the extension. ``python -m ep_moe.native`` prints the environment report (``ep-moe env``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..memory.cuda_vmm import vmm_unavailable_reason
from .sizing import buffer_size_hint
from .symmetric import SYMMETRIC_MEMORY_ENV, agreed_symmetric_memory_provider, symmetric_memory_provider

log = logging.getLogger("ep_moe")

MAX_RANKS = 8  # the kernels address at most this many NVLink peers

BUILD_RECORD = Path(__file__).with_name("build_info.json")  # written by setup.py, shipped with the package
_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "built": (bool,), "reason": (str, type(None)), "python": (str,), "prefix": (str,), "time": (str,),
    "torch": (str, type(None)), "torch_cuda": (str, type(None)), "cuda_home": (str, type(None)),
    "cuda_arch": (str, type(None)),
}


def read_build_record(path: str | os.PathLike = BUILD_RECORD) -> dict[str, Any] | None:
    """``setup.py``'s record of the native build, or None when there is no such file.

    Fields: ``built`` (bool: the kernels compiled), ``reason`` (str, why not, when not built), ``python``
    and ``prefix`` (``sys.executable`` and ``sys.prefix`` of the interpreter that ran ``setup.py``),
    ``torch`` and ``torch_cuda`` (the torch it saw, None when it could not import one), ``cuda_home`` and
    ``cuda_arch`` (when it compiled), ``time`` (UTC, ISO 8601). Raises `ValueError` naming the file when it
    is not such a record.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"build record {path}: cannot be read ({exc})") from exc
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"build record {path}: not JSON ({exc})") from exc
    if not isinstance(record, dict):
        raise ValueError(f"build record {path}: expected a JSON object, got {type(record).__name__}")
    for field, types in _RECORD_TYPES.items():
        if field not in record:
            raise ValueError(f"build record {path}: field {field!r} is missing")
        if not isinstance(record[field], types):
            raise ValueError(f"build record {path}: field {field!r} has the wrong type "
                             f"({type(record[field]).__name__})")
    if not record["built"] and not record["reason"]:
        raise ValueError(f"build record {path}: 'built' is false but no 'reason' is given")
    return record


def _other_interpreter(record: dict[str, Any]) -> str | None:
    """Says so when ``setup.py`` ran under another interpreter or environment than this one."""
    same_binary = os.path.realpath(record["python"]) == os.path.realpath(sys.executable)
    if record["python"] == sys.executable or (same_binary and record["prefix"] == sys.prefix):
        return None
    return f"setup.py ran under {record['python']} (prefix {record['prefix']}), this is {sys.executable} " \
           f"(prefix {sys.prefix})"


def explain_missing_extension(import_error: str | None, record_path: str | os.PathLike = BUILD_RECORD) -> str:
    """Why ``ep_moe.native._C`` cannot be used, from ``setup.py``'s build record (`read_build_record`).

    ``import_error``: the error of importing a ``_C`` that exists, None when there is no ``_C`` file.
    Says whether ``setup.py`` built the kernels and why not, which interpreter (and torch) built them
    when that is not this one, and the import error.
    """
    try:
        record = read_build_record(record_path)
    except ValueError as exc:
        parts = [f"unreadable {exc}"]
    else:
        if record is None:
            parts = ["no build record: ep_moe was installed without running setup.py here"]
        elif not record["built"]:
            parts = [f"setup.py built no extension: {record['reason']}"]
        else:
            cuda = f"CUDA {record['torch_cuda']}, sm_{record['cuda_arch']}"
            parts = [f"setup.py built the kernels ({record['time']}, torch {record['torch']}, {cuda}) but "
                     + ("they do not import" if import_error else f"no compiled _C is in {Path(__file__).parent}")]
            if record["torch"] != torch.__version__:
                parts.append(f"torch here is {torch.__version__}")
        if record is not None and (other := _other_interpreter(record)):
            parts.append(other)
    if import_error:
        parts.append(f"import error: {import_error}")
    return "; ".join(parts)


try:  # the compiled kernels, when they were built
    from . import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # reported when someone asks for the backend or runs ep-moe env
    _C = None
    _found = importlib.util.find_spec(f"{__name__}._C") is not None
    _IMPORT_ERROR = explain_missing_extension((str(exc) or type(exc).__name__) if _found else None)


if _C is not None:
    from . import torch_ops  # noqa: F401  (the fake implementations of its torch ops)


def extension_available() -> bool:
    """True when the CUDA extension was built and imports."""
    return _C is not None


def extension_unavailable_reason() -> str | None:
    """Why the CUDA extension cannot be used here (`explain_missing_extension`), None when it imports."""
    return _IMPORT_ERROR


_choices: dict[str | None, tuple[str | None, str | None]] = {}  # by the value of EP_MOE_JIT (once per process)


def _kernels_choice() -> tuple[str | None, str | None]:
    """``(kind, None)`` with kind ``"aot"`` (the extension) or ``"jit"`` (`ep_moe.native.jit.intranode`), or
    ``(None, why neither)``. ``EP_MOE_JIT=1``: the JIT module; ``0``: the extension; unset: the extension where it
    is built, else the JIT module where JIT kernels can run (a CUDA GPU and a compiler, or a warm cache)."""
    value = os.environ.get("EP_MOE_JIT")
    found = _choices.get(value)
    if found is None:
        found = _choices[value] = _decide_kernels()
    return found


def _decide_kernels() -> tuple[str | None, str | None]:
    from . import jit

    try:
        mode = jit.mode()
    except ValueError as exc:
        return None, str(exc)
    if mode == "force":
        why = jit.unavailable_reason()
        return ("jit", None) if why is None else (None, f"EP_MOE_JIT=1 asks for the JIT kernels, which cannot run "
                                                        f"here ({why})")
    if _C is not None:
        return "aot", None
    missing = f"the CUDA extension ep_moe.native._C is unavailable ({_IMPORT_ERROR})"
    if mode == "off":
        return None, f"{missing}, and EP_MOE_JIT=0 turns the JIT kernels off"
    why = jit.unavailable_reason()
    return ("jit", None) if why is None else (None, f"{missing}, and the JIT kernels cannot run here ({why})")


def kernels_kind() -> str | None:
    """Which build of the intranode kernels the native backend uses in this process: ``"aot"`` (the
    extension), ``"jit"`` (compiled on first use, `ep_moe.native.jit.intranode`), or None (neither can run:
    `kernels_unavailable_reason`)."""
    return _kernels_choice()[0]


def kernels_unavailable_reason() -> str | None:
    """Why neither build of the intranode kernels can run here (one line), None when one can."""
    return _kernels_choice()[1]


def intranode_kernels():
    """The intranode kernels' module (`kernels_kind`): ``ep_moe.native._C`` or ``ep_moe.native.jit.intranode``,
    which have the same functions (``Env``, ``layout``, ``notify``, ``dispatch``, ``combine``, ``barrier``) and
    constants; the JIT one has ``KIND == "jit"``. Raises `RuntimeError` saying why
    when neither can run."""
    kind, why = _kernels_choice()
    if kind is None:
        raise RuntimeError(f"ep_moe.native: no intranode kernels: {why}")
    if kind == "aot":
        return _C
    return _jit_intranode or _import_jit_intranode()


_jit_intranode = None  # ep_moe.native.jit.intranode once imported: no import statement per call (every operation)


def _import_jit_intranode():
    global _jit_intranode
    from .jit import intranode

    _jit_intranode = intranode
    return intranode


def kinds_disagree(kinds: list[str]) -> str | None:
    """Why a group whose ranks use these builds (`kernels_kind` of rank r at ``kinds[r]``) cannot run the native
    backend, or None when they are all alike."""
    if len(set(kinds)) == 1:
        return None
    return ("the ranks use different builds of the native kernels (" + ", ".join(
        f"rank {r}: {'extension' if k == 'aot' else 'JIT'}" for r, k in enumerate(kinds)) +
        "); set EP_MOE_JIT alike on every rank")


def unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the native backend cannot serve ``group`` on ``device``, or None when it can.

    Collective: every rank of ``group`` must call it (it gathers each rank's ``EP_MOE_SYMMETRIC_MEMORY``, host,
    device, what it can map and which build of the kernels it uses: ranks must agree, so that every rank runs the
    same code). Raises `ValueError` on every rank when the ranks name different symmetric memory providers
    (`symmetric.agreed_symmetric_memory_provider`). With the ``torch`` provider every rank needs a GPU of its own;
    with ``vmm`` ranks may share one. Ranks on distinct GPUs need peer access to each other.
    """
    kind, why = _kernels_choice()
    if kind is None:
        return why
    provider = agreed_symmetric_memory_provider(group)
    if device.type != "cuda":
        return f"the group runs on {device.type}, not CUDA"
    num_ranks = dist.get_world_size(group)
    if num_ranks > MAX_RANKS:
        return f"the group has {num_ranks} ranks (native kernels serve at most {MAX_RANKS})"
    memory_reason = None
    if provider == "torch":
        try:  # (an import statement here would make `torch` a local name of this function)
            importlib.import_module("torch.distributed._symmetric_memory")
        except ImportError as exc:
            memory_reason = f"torch.distributed._symmetric_memory is unavailable ({exc})"
    else:
        reason = vmm_unavailable_reason(device, exportable=True, host=False)
        if reason is not None:
            memory_reason = f"{SYMMETRIC_MEMORY_ENV}=vmm, but the CUDA VMM calls cannot serve it: {reason}"
    here = (socket.gethostname(), torch.cuda.current_device(), memory_reason, kind)
    everyone: list = [None] * num_ranks
    dist.all_gather_object(everyone, here, group=group)  # every rank decides from the same facts
    failed = [f"rank {r}: {why}" for r, (_, _, why, _) in enumerate(everyone) if why is not None]
    if failed:
        return "; ".join(failed)
    if len({host for host, *_ in everyone}) != 1:
        return "the group spans several hosts (native kernels are intranode only)"
    if (mixed := kinds_disagree([k for *_, k in everyone])) is not None:
        return mixed
    devices = [dev for _, dev, *_ in everyone]
    if provider == "torch" and len(set(devices)) != num_ranks:
        shared = next(dev for dev in devices if devices.count(dev) > 1)
        ranks = [r for r, dev in enumerate(devices) if dev == shared]
        return (f"ranks {', '.join(map(str, ranks))} share GPU {shared}, which torch symmetric memory cannot serve "
                f"(set {SYMMETRIC_MEMORY_ENV}=vmm on every rank)")
    for dev in set(devices):
        if dev != here[1] and not torch.cuda.can_device_access_peer(here[1], dev):
            return f"GPU {here[1]} cannot access GPU {dev} as a peer (no NVLink/P2P)"
    return None


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout kernel: same outputs as `ep_moe.layout.dispatch_layout` (``[R]`` int32 tokens per
    rank, ``[E]`` int32 tokens per expert, ``[T, R]`` bool), on the current CUDA stream."""
    per_rank, per_expert, in_rank = intranode_kernels().layout(topk_idx.contiguous(), num_experts, num_ranks)
    return per_rank, per_expert, in_rank


__all__ = ["BUILD_RECORD", "MAX_RANKS", "SYMMETRIC_MEMORY_ENV", "agreed_symmetric_memory_provider",
           "buffer_size_hint", "dispatch_layout", "explain_missing_extension", "extension_available",
           "extension_unavailable_reason", "intranode_kernels", "kernels_kind", "kernels_unavailable_reason",
           "read_build_record", "symmetric_memory_provider", "unavailable_reason"]
