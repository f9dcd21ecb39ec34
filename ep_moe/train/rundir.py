"""The run directory of ``ep-moe train``: checked before the ranks start, held by one run at a time, never
silently reused.

The run directory is ``checkpoint.save``, else ``runs/<recipe name>`` (`RecipeBase.output_dir`): checkpoints,
``metrics.jsonl``, the loss plot and, when ranks fail, ``error.log`` go there.

* `check_outputs`: the run directory (and the metrics and plot files' folders) is a folder that exists or can
  be created, and is writable; a `RecipeError` naming the key otherwise.
* `RunDirLock`: the file ``ep-moe.lock`` in the run directory names its holder (pid, host, since when); the
  launcher takes it before any rank starts and gives it back when it exits (errors and Ctrl-C included).
  A second run on the same directory fails at once, naming the holder. A lock whose holder is gone (its pid
  no longer runs on this host, e.g. after ``kill -9``) is stale and is taken over with a note. The holder
  also keeps an exclusive ``flock`` on the file while it runs, so two runs starting at the same moment cannot
  both take it (where the filesystem has no locks, the pid check alone decides).
* `earlier_run` / `clear_earlier_run`: a new run into a directory that holds an earlier run's metrics or
  checkpoints is refused unless it resumes (``--resume``) or starts over (``--overwrite``, which removes
  what the trainer wrote there before: metrics, plot, error log, and the ep_moe engine's checkpoints).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import socket
import sys
import time

from .recipe_schema import AnyRecipe, RecipeError

LOCK_NAME = "ep-moe.lock"
ERROR_LOG = "error.log"
WANDB_RUN_ID = "wandb-run-id"  # the W&B run a --resume continues (ep_moe.train.metrics.WandbLog)
# Files of the run directory that do not make it "hold a run".
_BOOKKEEPING = (LOCK_NAME, ERROR_LOG, WANDB_RUN_ID)

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover (Windows: the pid check alone)
    fcntl = None  # type: ignore[assignment]


class RunDirError(Exception):
    """The run directory cannot be used by this run (held by another run, or holding an earlier one); the
    message is one line for the user."""


def run_dir(recipe: AnyRecipe) -> str:
    """The run directory (as the recipe spells it): ``checkpoint.save``, else ``runs/<recipe name>``."""
    return recipe.output_dir()


def _run_dir_key(recipe: AnyRecipe) -> str:
    return "checkpoint.save" if recipe.checkpoint.save else f"the run folder {run_dir(recipe)}"


# ---------------------------------------------------------------------------------------------- checks
def _check_folder(folder: str, key: str) -> None:
    """``folder`` is a writable folder, or can be created (it is not created here)."""
    if os.path.exists(folder):
        if not os.path.isdir(folder):
            raise RecipeError(f"{key}: {folder} is a file, not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise RecipeError(f"{key}: the folder {folder} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(folder))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise RecipeError(f"{key}: cannot create the folder {folder}: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RecipeError(f"{key}: cannot create the folder {folder}: {parent} is not writable")


def check_outputs(recipe: AnyRecipe) -> None:
    """Where the run writes is usable (before any rank starts): the run directory, and the folders of
    ``logger.metrics_path`` and ``logger.plot_path`` when they are set; `RecipeError` naming the key."""
    _check_folder(run_dir(recipe), _run_dir_key(recipe))
    for key, path in (("logger.metrics_path", recipe.logger.metrics_path), ("logger.plot_path",
                                                                           recipe.logger.plot_path)):
        if path is None:
            continue
        if os.path.isdir(path):
            raise RecipeError(f"{key}: {path} is a folder, not a file")
        _check_folder(os.path.dirname(os.path.abspath(path)), key)


# ---------------------------------------------------------------------------------------------- the lock
def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, Linux), to tell it from a later one that got
    the same pid; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
    return fields[19] if len(fields) > 19 else None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether ``pid`` runs on this host (and, when ``start`` is given and known, is the process that started
    then)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    if start is not None:
        now = _process_start(pid)
        if now is not None and now != start:
            return False
    try:  # a zombie has finished
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            stat = f.read()
        if stat[stat.rfind(")") + 2:].startswith("Z"):
            return False
    except OSError:
        pass
    return True


def _describe_holder(record: dict) -> str:
    return f"pid {record.get('pid', '?')} (host {record.get('host', '?')}) since {record.get('since', '?')}"


class RunDirLock:
    """``<folder>/ep-moe.lock`` for one run: `acquire` before the ranks start, `release` at exit."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self.fd: int | None = None
        self.note: str | None = None        # the stale lock taken over, for the user
        self._created: list[str] = []        # folders this lock created (removed again when left empty)

    def _make_folder(self) -> None:
        missing = []
        folder = os.path.abspath(self.folder)
        while not os.path.exists(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        os.makedirs(self.folder, exist_ok=True)
        self._created = missing  # innermost first

    def _read(self, fd: int) -> dict | None:
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        if not data.strip():
            return None
        try:
            record = json.loads(data)
        except ValueError:
            return {"pid": 0, "host": "?", "since": "?"}  # torn by a killed writer: nobody holds it
        return record if isinstance(record, dict) else {"pid": 0, "host": "?", "since": "?"}

    def acquire(self) -> RunDirLock:
        """Take the lock; `RunDirError` (one line, naming the holder) when another live run holds it."""
        self._make_folder()
        host = socket.gethostname()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            locked = False
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                except BlockingIOError:  # a live process holds it (on any host that shares the filesystem)
                    record = self._read(fd)
                    for _ in range(20):  # the holder may be writing its record right now
                        if record is not None:
                            break
                        time.sleep(0.05)
                        record = self._read(fd)
                    record = record or {}
                    os.close(fd)
                    raise RunDirError(f"{self.folder} is in use by {_describe_holder(record)}") from None
                except OSError as exc:  # a filesystem without locks: the pid check below decides alone
                    if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        os.close(fd)
                        raise
            try:  # the file may have been removed (a holder releasing) between open and flock: retry
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        record = self._read(fd)
        if record is not None and record.get("pid") != os.getpid():
            mine = record.get("host") == host
            if not mine or pid_alive(int(record.get("pid") or 0), record.get("start")):
                os.close(fd)
                hint = "" if mine else (f" (a process on another host cannot be checked from here: if that run is "
                                        f"gone, remove {self.path})")
                raise RunDirError(f"{self.folder} is in use by {_describe_holder(record)}{hint}")
            self.note = (f"{self.folder}: took over the lock of {_describe_holder(record)}, which no longer runs"
                         + ("" if locked else " (no file locks on this filesystem: checked by pid)"))
        me = {"pid": os.getpid(), "host": host, "since": datetime.datetime.now().isoformat(timespec="seconds"),
              "start": _process_start(os.getpid()), "command": " ".join(["ep-moe train", *sys.argv[1:]])}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        """Give the lock back: remove the file (ours only), and the folders `acquire` created if they are
        empty now."""
        if self.fd is None:
            return
        try:
            record = self._read(self.fd)
            if record is not None and record.get("pid") == os.getpid():
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(self.fd)  # drops the flock
            self.fd = None
        for folder in self._created:
            try:
                os.rmdir(folder)
            except OSError:  # not empty (the run wrote there) or gone
                break

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------- earlier runs
def _checkpoint_entry(name: str) -> bool:
    """A name the ep_moe trainer's checkpoints use in ``checkpoint.save`` (`ep_moe.train.checkpoint`)."""
    return (name in ("latest", ".latest.tmp") or (name.startswith("step_") and name[5:].isdigit())
            or name.startswith(".tmp_step_"))


def earlier_run(recipe: AnyRecipe) -> list[str]:
    """What an earlier run left where this one would write: the metrics and plot files, and every entry of
    the run directory but the lock and the error log. Empty when there is nothing."""
    found = []
    folder = run_dir(recipe)
    if os.path.isdir(folder):
        found += sorted(os.path.join(folder, n) for n in os.listdir(folder) if n not in _BOOKKEEPING)
    seen = {os.path.abspath(p) for p in found}
    for path in (recipe.metrics_path(), recipe.plot_path()):
        if os.path.isfile(path) and os.path.getsize(path) > 0 and os.path.abspath(path) not in seen:
            found.append(path)
    return found


def refuse_earlier_run(recipe: AnyRecipe) -> None:
    """`RunDirError` (one line) when an earlier run's outputs are where this fresh run would write."""
    found = earlier_run(recipe)
    if found:
        names = ", ".join(os.path.basename(p) for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise RunDirError(f"{run_dir(recipe)} holds an earlier run ({names}): continue it with --resume, or start "
                          "over with --overwrite (or choose another checkpoint.save)")


def clear_earlier_run(recipe: AnyRecipe) -> list[str]:
    """``--overwrite``: remove what the trainer wrote before (metrics, plot, error log, and the ep_moe
    engine's checkpoints in ``checkpoint.save``); other files stay. Returns the paths removed."""
    folder = run_dir(recipe)
    load = recipe.checkpoint.load if recipe.engine == "ep_moe" else None
    if load is not None:
        inside = os.path.abspath(load)  # as the ranks read it (ep_moe.train.checkpoint)
        if inside == os.path.abspath(folder) or inside.startswith(os.path.abspath(folder) + os.sep):
            raise RunDirError(f"checkpoint.load: {load} is in {folder}, which --overwrite would clear; copy that "
                              "checkpoint elsewhere first, or continue the run with --resume")
    removed = []
    paths = [recipe.metrics_path(), recipe.plot_path(), os.path.join(folder, ERROR_LOG),
             os.path.join(folder, WANDB_RUN_ID)]
    if recipe.checkpoint.save and os.path.isdir(folder):
        paths += sorted(os.path.join(folder, n) for n in os.listdir(folder) if _checkpoint_entry(n))
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        else:
            continue
        removed.append(path)
    return removed
