"""Sharing file descriptors between the ranks of one node: ``(pid, fd)`` pairs go over the process group, and
each rank takes a duplicate of a peer's descriptor with ``pidfd_open`` + ``pidfd_getfd`` (Linux >= 5.6).

``pidfd_getfd`` needs ptrace-attach rights over the peer: the same user and, where the Yama module restricts
ptrace (``/proc/sys/kernel/yama/ptrace_scope`` = 1), the peer's consent, which `allow_peer_access` gives
(``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``). Scope 2 or 3, or a seccomp filter that blocks the call (some
container runtimes), make it fail with EPERM. Then (``method="auto"``) the ranks of the node pass the descriptors
over Unix sockets instead (``SCM_RIGHTS``, abstract names, one listening socket per rank), which needs no ptrace
rights; `PeerFdError` says why when neither works.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import secrets
import socket
import threading

import torch.distributed as dist

# pidfd_getfd is one of the syscalls numbered alike on every architecture (asm-generic, since Linux 5.6):
# 438 on x86_64 and on aarch64.
SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438, "arm64": 438}
PR_SET_PTRACER = 0x59616D61  # "Yama"
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"

log = logging.getLogger("ep_moe")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


SOCKET_TIMEOUT_S = 60.0
"""The deadline of each step of the socket exchange (accept, connect, receive)."""


class PeerFdError(RuntimeError):
    """A peer's file descriptor could not be imported (permissions, an old kernel, a peer gone). ``denied``: the
    ``pidfd_getfd`` route is closed on this host (no rights, no syscall), where the socket route may still work."""

    def __init__(self, message: str, denied: bool = False) -> None:
        super().__init__(message)
        self.denied = denied


def node_id() -> str:
    """One string per host and PID namespace (host name, the kernel's boot id, the PID namespace's inode): ranks
    with the same id can take each other's descriptors by pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = 0
    return f"{socket.gethostname()}/{boot}/{pid_ns}"


def allow_peer_access() -> None:
    """Let processes of this user take this process's descriptors (Yama's per-process exception). Without Yama
    the call fails with EINVAL and nothing is needed."""
    _libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)


def _ptrace_scope() -> str:
    try:
        with open(YAMA_PTRACE_SCOPE, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "absent"


def pidfd_getfd(pid: int, fd: int) -> int:
    """A new descriptor in this process for descriptor ``fd`` of process ``pid``. Raises `PeerFdError`."""
    machine = platform.machine()
    if machine not in SYS_PIDFD_GETFD or not hasattr(os, "pidfd_open"):
        raise PeerFdError(f"ep_moe.elastic.memory: pidfd_getfd is not available on {machine} / this Python", denied=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        raise PeerFdError(f"ep_moe.elastic.memory: pidfd_open({pid}) failed: {exc} (has the peer exited?)") from exc
    try:
        new_fd = _libc.syscall(ctypes.c_long(SYS_PIDFD_GETFD[machine]), ctypes.c_int(pidfd), ctypes.c_int(fd),
                               ctypes.c_uint(0))
        if new_fd < 0:
            err = ctypes.get_errno()
            hint = ""
            if err == errno.EPERM:
                hint = (f"; ptrace-attach rights over pid {pid} are needed: the same user, Yama ptrace_scope "
                        f"<= 1 (here: {_ptrace_scope()}), no seccomp filter blocking pidfd_getfd (containers: "
                        f"CAP_SYS_PTRACE or a profile that allows it)")
            elif err == errno.ENOSYS:
                hint = "; the kernel is older than 5.6"
            raise PeerFdError(f"ep_moe.elastic.memory: pidfd_getfd(pid={pid}, fd={fd}) failed: {os.strerror(err)}{hint}",
                              denied=err in (errno.EPERM, errno.ENOSYS))
        return new_fd
    finally:
        os.close(pidfd)


def exchange_fds(group: dist.ProcessGroup, fd: int, failure: str | None = None, method: str = "auto",
                 what: str = "host segments") -> tuple[list[int], list[int | None]]:
    """Collective over ``group``: share this rank's descriptor ``fd`` with the ranks of its node.

    Returns ``(local_ranks, fds)``: the group ranks on this node in order, and for each group rank a descriptor
    of this process (this rank's own: ``fd`` itself; a peer's on this node: a new duplicate the caller closes;
    another node's: None). ``failure``: this rank could not make its descriptor (the reason; ``fd`` is then
    ignored). ``method``: ``"pidfd"`` (``pidfd_getfd``), ``"socket"`` (``SCM_RIGHTS``), or ``"auto"`` (pidfd, and
    sockets where every failure was a denied ``pidfd_getfd``; the same choice on every rank). Every rank raises
    if any rank failed (`PeerFdError` naming the ranks and ``what`` was shared), so none is left waiting. The
    exporters keep ``fd`` open until every import is done.
    """
    if method not in ("auto", "pidfd", "socket"):
        raise ValueError(f"ep_moe.elastic.memory: method must be 'auto', 'pidfd' or 'socket', got {method!r}")
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    allow_peer_access()
    entries: list = [None] * num_ranks
    dist.all_gather_object(entries, (node_id(), os.getpid(), fd, failure, secrets.token_hex(8)), group=group)
    failed = [f"rank {r}: {e[3]}" for r, e in enumerate(entries) if e[3] is not None]
    if failed:
        raise PeerFdError(f"ep_moe.elastic.memory: creating {what} failed: " + "; ".join(failed))
    here = entries[rank][0]
    local_ranks = [r for r, e in enumerate(entries) if e[0] == here]
    fds: list[int | None] = [None] * num_ranks
    fds[rank] = fd
    if method != "socket":
        error = None
        for r in local_ranks:
            if r == rank:
                continue
            try:
                fds[r] = pidfd_getfd(entries[r][1], entries[r][2])
            except PeerFdError as exc:
                error = (f"rank {rank} importing rank {r}'s segment: {exc}", exc.denied)
                break
        errors: list = [None] * num_ranks
        dist.all_gather_object(errors, error, group=group)  # also: every import is done before exporters close
        failed = [e for e in errors if e is not None]
        if not failed:
            return local_ranks, fds
        _close_peers(fds, rank)
        if method == "pidfd" or not all(denied for _, denied in failed):
            raise PeerFdError(f"ep_moe.elastic.memory: sharing {what} failed: " + "; ".join(m for m, _ in failed))
        log.info("ep_moe.elastic.memory: pidfd_getfd is denied here (%s); passing the descriptors over Unix sockets",
                 failed[0][0])
    token = entries[local_ranks[0]][4]  # one name space per exchange and node
    error = None
    try:
        _exchange_by_socket(group, rank, local_ranks, fd, token, fds)
    except OSError as exc:
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    errors = [None] * num_ranks
    dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e is not None]
    if failed:
        _close_peers(fds, rank)
        raise PeerFdError(f"ep_moe.elastic.memory: passing {what} over Unix sockets failed: " + "; ".join(failed))
    return local_ranks, fds


def _close_peers(fds: list[int | None], rank: int) -> None:
    for r, other in enumerate(fds):
        if other is not None and r != rank:
            os.close(other)
            fds[r] = None


def _socket_name(token: str, rank: int) -> bytes:
    return f"\0ep_moe_fd_{token}_{rank}".encode()


def _exchange_by_socket(group: dist.ProcessGroup, rank: int, local_ranks: list[int], fd: int, token: str,
                        fds: list[int | None]) -> None:
    """Every rank of the node listens on an abstract Unix socket and sends ``fd`` (``SCM_RIGHTS``) to each peer
    that connects, while it connects to each peer in turn and receives theirs into ``fds``."""
    peers = [r for r in local_ranks if r != rank]
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(_socket_name(token, rank))
        server.listen(max(len(peers), 1))
        server.settimeout(SOCKET_TIMEOUT_S)
        ready: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(ready, True, group=group)  # every rank listens before any connects
        served: list[BaseException] = []

        def serve() -> None:
            try:
                for _ in peers:
                    conn, _ = server.accept()
                    with conn:
                        socket.send_fds(conn, [b"f"], [fd])
            except OSError as exc:
                served.append(exc)

        thread = threading.Thread(target=serve, name="ep_moe-fd-server", daemon=True)
        thread.start()
        for r in peers:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(SOCKET_TIMEOUT_S)
                client.connect(_socket_name(token, r))
                _, received, _, _ = socket.recv_fds(client, 1, 1)
                if len(received) != 1:
                    raise OSError(f"rank {r} sent {len(received)} descriptors, not 1")
                fds[r] = received[0]
        thread.join(SOCKET_TIMEOUT_S * (len(peers) + 1))
        if thread.is_alive():
            raise OSError(f"peers did not take rank {rank}'s descriptor within {SOCKET_TIMEOUT_S:g} s each")
        if served:
            raise served[0]
    finally:
        server.close()


def ranks_by_node(group: dist.ProcessGroup) -> list[list[int]]:
    """Collective: the group's ranks by node (each node's ranks in order; nodes by their lowest rank)."""
    entries: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, node_id(), group=group)
    nodes: dict[str, list[int]] = {}
    for r, e in enumerate(entries):
        nodes.setdefault(e, []).append(r)
    return list(nodes.values())


__all__ = ["PeerFdError", "allow_peer_access", "exchange_fds", "node_id", "pidfd_getfd", "ranks_by_node"]
