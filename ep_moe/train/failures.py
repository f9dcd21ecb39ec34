"""What ``ep-moe train`` shows when spawned ranks fail: one line per distinct error, the full story in a file.

`ep_moe.distributed` hands the launcher a `RankFailures` (each rank's exception type, message and traceback;
the ranks killed by a signal). `failure_lines` turns it into the lines printed on stderr:

* each distinct error once, with the ranks that raised it (``rank 1: ValueError: ...``, ``ranks 0-1: ...``);
  errors a rank raised only because a peer went away (gloo's "connection closed by peer") are left out when
  there is a cause to show;
* each rank killed by a signal (``rank 1 died: signal 9 (SIGKILL)``);
* each line names the log file, where `write_error_log` puts every rank's traceback (``error.log`` in the
  run directory, else a file in the temporary folder).

Under ``torchrun`` every rank is its own process and there is no launcher of ours to collect the errors:
`report_rank_error` appends the rank's traceback to the same ``error.log`` (under a file lock) and prints its
one line only when no rank of the same ``torchrun`` agent has printed that error already.

A lost peer under a launcher (a node gone: its ranks' connections close, and the collective that used them
raises at once) is one line per surviving rank, `report_lost_peer`: which peer is gone and in which stage of
the run (`set_stage`, which the training loop keeps current). The peers are known from `record_peers` (every
rank's node, host and pid, gathered at start-up): a peer on this host whose process is gone is named by rank;
otherwise the ranks of the other nodes are named as the candidates.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import sys
import tempfile
import time
import traceback

from ep_moe.distributed import RankFailures, is_peer_lost, signal_text

from .rundir import ERROR_LOG

LOST_PEER_CHECKS = 10  # looks for a gone peer process on this host, 0.1 s apart
MAX_MESSAGE = 600  # characters of one error message on its line (the log has it all)


def rank_list(ranks: list[int]) -> str:
    """``[1]`` -> ``"rank 1"``, ``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return "ranks " + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` on one line (whitespace runs collapsed), cut at ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def failure_lines(exc: RankFailures, log_path: str | None) -> list[str]:
    """The lines for the user (without the ``ep-moe train:`` prefix), in rank order of first appearance."""
    where = f" [log: {log_path}]" if log_path else ""
    groups: dict[tuple[str, str], list[int]] = {}
    for f in exc.primary_failures():
        groups.setdefault((f.exc_type, one_line(f.message)), []).append(f.rank)
    lines = [f"{rank_list(ranks)}: {exc_type}: {message}{where}" for (exc_type, message), ranks in groups.items()]
    lines += [f"rank {r} died: {signal_text(s)}{where}" for r, s in exc.deaths.items()]
    by_code: dict[int, list[int]] = {}
    for r, code in exc.exit_codes.items():
        by_code.setdefault(code, []).append(r)
    lines += [f"{rank_list(ranks)} exited with status {code} without a result{where}"
              for code, ranks in by_code.items()]
    if exc.timed_out and exc.stopped:
        lines.append(f"{rank_list(exc.stopped)} gave no result within the run's time limit and were stopped{where}")
    if not lines:  # nothing structured: show the message itself
        lines.append(one_line(str(exc)) + where)
    return lines


def error_log_text(exc: RankFailures, argv: list[str]) -> str:
    """The log: when, the command, then every rank's error with its traceback and what happened to the rest."""
    out = [f"ep-moe train failed at {datetime.datetime.now().isoformat(timespec='seconds')} (launcher pid "
           f"{os.getpid()})", "command: ep-moe train " + " ".join(argv[1:]), ""]
    shown = set(exc.primary_failures())
    for f in exc.failures:
        note = "" if f in shown else " (a consequence of another rank's failure)"
        out += [f"--- rank {f.rank}: {f.exc_type}: {f.message}{note}", f.traceback.rstrip(), ""]
    for r, s in exc.deaths.items():
        out += [f"--- rank {r} died: {signal_text(s)}", ""]
    for r, code in exc.exit_codes.items():
        out += [f"--- rank {r} exited with status {code} without a result", ""]
    if exc.stopped:
        why = "the run's time limit passed" if exc.timed_out else "another rank failed"
        out += [f"--- {rank_list(exc.stopped)} stopped by the launcher ({why})", ""]
    return "\n".join(out).rstrip() + "\n"


def write_error_log(folder: str, exc: RankFailures, argv: list[str] | None = None) -> str | None:
    """Write `error_log_text` to ``<folder>/error.log`` (a temporary file when that fails); its path, or
    None when no file could be written."""
    text = error_log_text(exc, list(sys.argv if argv is None else argv))
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, ERROR_LOG)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    except OSError:
        pass
    try:
        fd, path = tempfile.mkstemp(prefix="ep-moe-train-", suffix=".error.log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- lost peers
_state: dict = {"stage": "start-up", "peers": []}


def set_stage(stage: str) -> None:
    """What this rank does now (``"training step 12"``, ``"checkpoint save at step 12"``...), for the line a
    lost peer prints."""
    _state["stage"] = stage


def current_stage() -> str:
    return _state["stage"]


def record_peers(peers: list[dict]) -> None:
    """Every rank of the job, by rank: ``{"node": <node key>, "host": <host name>, "pid": <process id>}``."""
    _state["peers"] = list(peers)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lost_peer_text(rank: int) -> str:
    """The peer(s) that ``rank`` lost, in words: the ranks of this host whose process is gone (``"rank 2 (node
    GROUP_RANK=1, pid 123, gone)"``), else the ranks of the other nodes as candidates, else ``"a peer"``."""
    peers = _state["peers"]
    if not peers or rank >= len(peers):
        return "a peer"
    me = peers[rank]
    gone: list = []
    for _ in range(LOST_PEER_CHECKS):  # the dying peer's processes may take a moment to go
        gone = [(r, p) for r, p in enumerate(peers)
                if r != rank and p["host"] == me["host"] and not _alive(int(p["pid"]))]
        if gone:
            break
        time.sleep(0.1)
    if gone:
        return ", ".join(f"rank {r} (node {p['node']}, pid {p['pid']}, gone)" for r, p in gone)
    others: dict[str, list[int]] = {}
    for r, p in enumerate(peers):
        if p["node"] != me["node"]:
            others.setdefault(str(p["node"]), []).append(r)
    if others:
        return "a rank of " + " or ".join(f"node {node} ({rank_list(ranks)}, host {peers[ranks[0]]['host']})"
                                          for node, ranks in others.items())
    return "a peer"


def report_lost_peer(folder: str, rank: int, exc: BaseException) -> str:
    """This rank's line when a peer went away under a launcher (``is_peer_lost``): it names the lost peer
    (`lost_peer_text`) and the stage (`set_stage`); the traceback goes to ``<folder>/error.log`` as in
    `report_rank_error`. Printed by every surviving rank (each says where it stopped)."""
    node = _state["peers"][rank]["node"] if rank < len(_state["peers"]) else "?"
    line = (f"rank {rank} (node {node}): lost {lost_peer_text(rank)} during {current_stage()}; stopping "
            f"({one_line(str(exc), 160)})")
    logged = report_rank_error(folder, rank, exc)
    where = logged[logged.rfind(" ["):] if logged and logged.endswith("]") else f" [log: {os.path.join(folder, ERROR_LOG)}]"
    return line + where


def report_rank_error(folder: str, rank: int, exc: BaseException) -> str | None:
    """This rank's error under ``torchrun``: append its traceback to ``<folder>/error.log`` and return the line
    to print, or None when a rank of the same ``torchrun`` agent (the parent process) already printed the same
    error, or when the error only says that a peer went away and another rank's own error is in the log."""
    agent = f"agent {os.getppid()}"
    exc_type, message = type(exc).__name__, one_line(str(exc))
    header = f"--- {agent} rank {rank}: {exc_type}: {message}"
    body = "".join(traceback.format_exception(exc)).rstrip()
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, ERROR_LOG)
        with open(path, "a+", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # ranks append one at a time, and decide against what is there
            f.seek(0)
            earlier = [line for line in f.read().splitlines() if line.startswith(f"--- {agent} rank ")]
            f.seek(0, os.SEEK_END)
            f.write(f"{header}\n{body}\n\n")
            f.flush()
    except OSError:
        return f"rank {rank}: {exc_type}: {message} [no log: {folder} is not writable]"
    shown = {line.split(": ", 1)[1] for line in earlier}
    if f"{exc_type}: {message}" in shown:
        return None
    if is_peer_lost(message) and any(not is_peer_lost(line) for line in shown):
        return None
    return f"rank {rank}: {exc_type}: {message} [log: {path}]"
