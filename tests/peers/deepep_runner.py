"""Run DeepEP's own test programs, unmodified, against ep_moe's DeepEP shim (`ep_moe.compat.deep_ep`).

Suite (what ``tests/peers/deepep.sh`` runs)::

    python tests/peers/deepep_runner.py --deep-ep DEEPEP_DIR [--processes 1,2] [--timeout 300] [--only test_ep,...]
                                        [--log-dir DIR] [--dry-run]

runs each program of `PROGRAMS` with 1 and with 2 processes and prints one line per run (PASS / FAIL / SKIP, a FAIL
with its exit status or TIMEOUT and the last lines of its output), then a summary; the exit status is 1 if any
run failed. ``deep_ep`` is ep_moe's shim; ``deep_ep.utils`` is the checkout's own (``--deep-ep`` of the shim's
launcher). A run of N processes on fewer GPUs shares them (``EP_MOE_SYMMETRIC_MEMORY=vmm``) through the
adaptations below; otherwise a program runs through ``python -m ep_moe.compat.deep_ep --deep-ep DIR``, untouched.

One program (what the suite runs where an adaptation is needed)::

    python tests/peers/deepep_runner.py launch --deep-ep DEEPEP_DIR [--share-gpu] [--device cuda|cpu]
                                        [--rdma-gbs GBS] program.py ARGS...

Adaptations, only for what one GPU cannot meet; none edits DeepEP's files (`activate` applies them after the
checkout's ``deep_ep.utils.envs`` is imported, in the launching process and, through a ``deep_ep.py`` in a
temporary folder ahead on ``sys.path``/``PYTHONPATH``, in every process the program spawns):

* ``--share-gpu``: DeepEP's ``init_dist`` runs as written, except that ``init_process_group`` gets backend gloo
  without ``device_id`` (NCCL refuses two ranks on one device) and ``torch.cuda.set_device(local_rank)`` selects
  ``local_rank % device_count`` (there is no device 1); seed, default dtype and device, the ``_local_rank`` that
  ``dist_print`` reads and the returned group are DeepEP's. Under gloo, ``all_to_all_single`` (DeepEP's reference
  dispatch), ``all_gather`` (test_intranode) and ``all_gather_into_tensor`` (test_engram) stage CUDA tensors
  through the host, and FP8 ones as bytes (gloo has no FP8 type, and the torch documentation lists no CUDA
  support for them under gloo).
* ``--rdma-gbs``: where DeepEP's ``get_rdma_gbs`` finds no RDMA NIC (it returns 0), this rate instead: test_pp
  divides by it to size a sleep in its profiling loop.
* ``--device cpu`` (tests only): the shared ranks run on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import json
import math
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ADAPT_ENV = "DEEPEP_RUNNER_ADAPT"
DEFAULT_TIMEOUT_S = 300.0
NOMINAL_RDMA_GBS = 50.0  # a 400 Gb/s NIC
TAIL_LINES = 15
# DeepEP's bench_kineto times kernels by DeepEP's CUDA kernel names (send_impl, engram_fetch_impl, ...), which
# ep_moe's kernels do not carry: it returns 0 for them and test_pp / test_engram divide by it. DeepEP's own switch
# EP_USE_NVIDIA_TOOLS=1 (meant for Nsight runs) makes bench_kineto return 1 s without profiling.
NO_KINETO = {"EP_USE_NVIDIA_TOOLS": "1"}


# ------------------------------------------------------------------------------------------ the programs
@dataclasses.dataclass(frozen=True)
class Program:
    """One of DeepEP's test programs and the smallest arguments of its own argparse that keep its checks."""

    path: str                      # under the checkout's tests/
    args: tuple[str, ...] = ()     # ``--num-processes N`` is added
    label: str = ""                # the name printed (default: path)
    min_processes: int = 1         # fewer: SKIP, with ``why``
    why: str = ""
    env: tuple[tuple[str, str], ...] = ()
    rdma: bool = False             # needs the ``--rdma-gbs`` adaptation

    @property
    def name(self) -> str:
        return self.label or self.path


PROGRAMS: tuple[Program, ...] = (
    # Its tuning loops (bench of every chunk size) have no argument to shorten them; the sizes are.
    Program("legacy/test_intranode.py",
            ("--num-tokens", "128", "--hidden", "256", "--num-topk", "4", "--num-experts", "16")),
    # Every mode of enumerate_ep_modes with its checks; --skip-perf-test drops only the kineto timing.
    Program("elastic/test_ep.py",
            ("--num-tokens", "64", "--hidden", "256", "--num-topk", "4", "--num-experts", "16", "--skip-perf-test")),
    # One stress seed (128 random all-gather ops, all checked); the profiling sweep has no argument.
    Program("elastic/test_agrs.py", ("--num-stress-iterations", "1")),
    Program("elastic/test_engram.py",
            ("--num-entries", "4096", "--num-tokens", "64", "--num-entries-per-token", "8"), env=tuple(NO_KINETO.items())),
    Program("elastic/test_engram.py",
            ("--num-entries", "4096", "--num-tokens", "64", "--num-entries-per-token", "8", "--use-fp8"),
            label="elastic/test_engram.py --use-fp8", env=tuple(NO_KINETO.items())),
    Program("elastic/test_pp.py",
            ("--num-tokens", "64", "--hidden", "256", "--num-stress-iterations", "1", "--num-sends", "32"),
            min_processes=2, why="the program asserts num_ranks > 1", env=tuple(NO_KINETO.items()), rdma=True),
    # No argument shortens its 61,000 timed barriers: about 170 s with 2 processes on one H100.
    Program("elastic/test_barrier.py"),
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One program at one process count: the command and the environment it runs with."""

    program: Program
    processes: int
    script: str
    command: tuple[str, ...]
    env: dict[str, str]
    skip: str = ""           # why it does not run
    via_launch: bool = False  # through `launch` (its processes print their stacks on SIGUSR1)

    @property
    def title(self) -> str:
        return f"{self.program.name} [{self.processes} proc{'s' if self.processes > 1 else ''}]"


@dataclasses.dataclass
class Result:
    """How a `Run` ended: ``status`` PASS, FAIL or SKIP; ``detail`` the exit status, TIMEOUT or the reason."""

    run: Run
    status: str
    detail: str = ""
    seconds: float = 0.0
    tail: list[str] = dataclasses.field(default_factory=list)
    log: str = ""


def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (DeepEP's init_dist reads MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan(deep_ep: str, programs: Sequence[Program], processes: Sequence[int], gpus: int,
         device: str = "cuda", python: str = sys.executable) -> list[Run]:
    """The runs: every program at every process count. N processes on fewer than N GPUs share them
    (``launch --share-gpu``, ``EP_MOE_SYMMETRIC_MEMORY=vmm``); a program needing no adaptation runs through the
    shim's own launcher."""
    runs = []
    for program in programs:
        for n in processes:
            share = n > 1 and n > gpus
            env = {"MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1", **dict(program.env)}
            if share:
                env["EP_MOE_SYMMETRIC_MEMORY"] = "vmm"
            script = os.path.join(deep_ep, "tests", program.path)
            target = [script, *program.args, "--num-processes", str(n)]
            if share or program.rdma:
                adapt = ["--share-gpu", "--device", device] if share else []
                if program.rdma:
                    adapt += ["--rdma-gbs", str(NOMINAL_RDMA_GBS)]
                command = [python, str(Path(__file__).resolve()), "launch", "--deep-ep", deep_ep, *adapt, *target]
            else:
                command = [python, "-m", "ep_moe.compat.deep_ep", "--deep-ep", deep_ep, *target]
            skip = f"{program.why}; it needs {program.min_processes} processes" if n < program.min_processes else ""
            runs.append(Run(program, n, script, tuple(command), env, skip, share or program.rdma))
    return runs


def _child_env(run: Run) -> dict[str, str]:
    env = dict(os.environ)
    # DeepEP's init_dist reads WORLD_SIZE / RANK as the number of nodes / this node: one node here.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    env.update(run.env)
    env["MASTER_PORT"] = str(free_port())
    if (REPO / "ep_moe" / "__init__.py").is_file():  # this tree's ep_moe, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _stop(process: subprocess.Popen, grace_s: float = 10.0, dump_s: float = 0.0) -> None:
    """End the run's whole process group (the program and the ranks it spawned); with ``dump_s``, first ask its
    processes for their Python stacks (SIGUSR1, `launch`) and give them that long to print them."""
    if dump_s > 0:
        try:
            os.killpg(process.pid, signal.SIGUSR1)
            time.sleep(dump_s)
        except ProcessLookupError:
            return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return [line for line in text if line.strip()][-lines:]


def execute(run: Run, timeout_s: float, log_dir: Path, tail_lines: int = TAIL_LINES) -> Result:
    """Run one program in its own process group (killed whole at the timeout), its output in a log file."""
    if run.skip:
        return Result(run, "SKIP", run.skip)
    if not os.path.isfile(run.script):
        return Result(run, "FAIL", f"program not found: {run.script}")
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{re.sub(r'[^A-Za-z0-9.]+', '_', run.program.name).strip('_')}-{run.processes}p.log"
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(run.command) + "\n")
        out.flush()
        process = subprocess.Popen(run.command, stdout=out, stderr=subprocess.STDOUT, env=_child_env(run),
                                   cwd=str(log_dir), start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
            detail = f"exit status {code}"
        except subprocess.TimeoutExpired:
            _stop(process, dump_s=3.0 if run.via_launch else 0.0)
            code, detail = None, f"TIMEOUT after {timeout_s:g} s"
        else:
            _stop(process, grace_s=2.0)  # ranks left behind by a failed program
    seconds = time.monotonic() - start
    status = "PASS" if code == 0 else "FAIL"
    return Result(run, status, detail, seconds, [] if status == "PASS" else _tail(log, tail_lines), str(log))


def format_result(result: Result) -> str:
    """One line (a FAIL: and its output's last lines, indented)."""
    if result.status == "SKIP":
        return f"SKIP  {result.run.title}: {result.detail}"
    line = f"{result.status}  {result.run.title} ({result.seconds:.1f} s)"
    if result.status == "PASS":
        return line
    return "\n".join([f"{line}: {result.detail}; log {result.log}", *(f"    | {t}" for t in result.tail)])


def summary(results: Sequence[Result]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    return (f"Summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
            f"(of {len(results)} runs)")


def _git(deep_ep: str, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", deep_ep, *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _describe(deep_ep: str) -> str:
    # A folder inside another repository is no checkout of its own: its revision is unknown.
    top = _git(deep_ep, "rev-parse", "--show-toplevel")
    rev = _git(deep_ep, "rev-parse", "--short", "HEAD") if top and os.path.samefile(top, deep_ep) else ""
    return f"DeepEP checkout: {deep_ep} ({f'commit {rev}' if rev else 'revision unknown'}; the arguments here " \
           "were chosen for dd758caf)"


def _gpus() -> tuple[int, str]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))
    return count, f"python {sys.version.split()[0]}, torch {torch.__version__}, {count} CUDA device(s)" + (
        f" ({names})" if names else "")


def suite(argv: Sequence[str] | None = None) -> int:
    """The suite's command line (see the module docstring); the exit status is 1 if any run failed."""
    parser = argparse.ArgumentParser(prog="deepep_runner.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--deep-ep", required=True, help="a DeepEP checkout")
    parser.add_argument("--processes", default="1,2", help="process counts, comma-separated (default 1,2)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per run (default 300)")
    parser.add_argument("--only", default="", help="run the programs whose name contains one of these (comma-separated)")
    parser.add_argument("--log-dir", default=str(REPO / "out" / "deepep-peers"), help="one log per run")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to count on (default: torch's device count)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--tail", type=int, default=TAIL_LINES, help="output lines shown for a FAIL")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    deep_ep = os.path.abspath(args.deep_ep)
    if not os.path.isfile(os.path.join(deep_ep, "deep_ep", "utils", "__init__.py")):
        print(f"deepep_runner: {deep_ep} is not a DeepEP checkout (no deep_ep/utils/__init__.py)", file=sys.stderr)
        return 2
    processes = [int(p) for p in args.processes.split(",") if p.strip()]
    wanted = [w for w in args.only.split(",") if w.strip()]
    programs = [p for p in PROGRAMS if not wanted or any(w.strip() in p.name for w in wanted)]
    gpus, about = _gpus()
    if args.gpus is not None:
        gpus = args.gpus
    runs = plan(deep_ep, programs, processes, gpus, args.device)
    print(_describe(deep_ep), about, sep="\n", flush=True)
    if args.dry_run:
        for run in runs:
            extra = " ".join(f"{k}={v}" for k, v in run.env.items() if k not in ("MASTER_ADDR", "PYTHONUNBUFFERED"))
            print(f"{run.title}: " + (f"SKIP ({run.skip})" if run.skip else f"{extra} {' '.join(run.command)}".strip()))
        return 0
    results = []
    for run in runs:
        result = execute(run, args.timeout, Path(args.log_dir), args.tail)
        results.append(result)
        print(format_result(result), flush=True)
    print(summary(results), flush=True)
    return 1 if any(r.status == "FAIL" for r in results) else 0


# ------------------------------------------------------------------------------------------ adaptations
@dataclasses.dataclass(frozen=True)
class Adaptations:
    """What `activate` changes (see the module docstring)."""

    share_gpu: bool = False
    device: str = "cuda"
    rdma_gbs: float = 0.0

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_env() -> Adaptations:
        raw = os.environ.get(ADAPT_ENV)
        return Adaptations(**json.loads(raw)) if raw else Adaptations()


def shared_init_dist(original: Callable, device: str = "cuda") -> Callable:
    """DeepEP's ``init_dist`` for ranks sharing GPUs: run as written, but ``init_process_group`` gets gloo and no
    ``device_id``, and ``torch.cuda.set_device(local_rank)`` selects ``local_rank % device_count`` (``device="cpu"``:
    nothing, and ``torch.set_default_device('cuda')`` sets the CPU)."""

    @functools.wraps(original)
    def init_dist(local_rank: int, num_local_ranks: int, *args, **kwargs):
        real_init, real_set_device, real_default = dist.init_process_group, torch.cuda.set_device, torch.set_default_device

        @functools.wraps(real_init)  # DeepEP looks for `device_id` in its signature
        def init_process_group(*a, **kw):
            kw.pop("device_id", None)
            if a:
                a = ("gloo", *a[1:])
            else:
                kw["backend"] = "gloo"
            return real_init(*a, **kw)

        def set_device(_device) -> None:
            if device == "cuda":
                real_set_device(local_rank % max(1, torch.cuda.device_count()))

        def set_default_device(requested) -> None:
            is_cuda = requested is not None and torch.device(requested).type == "cuda"
            real_default("cpu" if device == "cpu" and is_cuda else requested)

        dist.init_process_group, torch.cuda.set_device = init_process_group, set_device
        torch.set_default_device = set_default_device
        try:
            return original(local_rank, num_local_ranks, *args, **kwargs)
        finally:
            dist.init_process_group, torch.cuda.set_device = real_init, real_set_device
            torch.set_default_device = real_default

    return init_dist


def with_nominal_rdma(original: Callable, gbs: float) -> Callable:
    """DeepEP's ``get_rdma_gbs``, giving ``gbs`` where it finds no RDMA NIC (0)."""

    @functools.wraps(original)
    def get_rdma_gbs(*args, **kwargs):
        found = original(*args, **kwargs)
        return found if found else gbs

    return get_rdma_gbs


class _Done:
    """The work of a collective that ran synchronously (for ``async_op=True`` callers)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(None)
        return future


# The types gloo's collectives carry (ProcessGroupGloo's GENERATE_ALL_TYPES); FP8 is not one of them.
GLOO_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                         torch.bool, torch.int32, torch.int64})


def _needs_host(group, tensors) -> bool:
    if str(dist.get_backend(group)).lower() != "gloo":
        return False
    return any(t.is_cuda or t.dtype not in GLOO_DTYPES for t in tensors)


def _rows(t):
    """``t`` as a 2-D ``[rows, columns]`` view of its first dimension (a scalar: one row)."""
    return t.reshape(t.shape[0] if t.dim() else 1, math.prod(t.shape[1:]) if t.dim() else 1)


def _carried(host: torch.Tensor) -> torch.Tensor:
    return host if host.dtype in GLOO_DTYPES else host.view(torch.uint8)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` gloo can carry, rows kept (splits along dim 0 stay valid): 2-D, and as bytes where
    gloo has no such type (FP8)."""
    return _carried(_rows(t.detach().to("cpu").contiguous()))


def host_empty(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised `to_host` of ``t``'s shape and type."""
    return _carried(_rows(torch.empty(t.shape, dtype=t.dtype, device="cpu")))


def from_host(host: torch.Tensor, t: torch.Tensor) -> None:
    """Copy the `to_host` form ``host`` back into ``t``."""
    t.copy_(host.view(t.dtype).reshape(t.shape))


def staged_collectives() -> dict[str, Callable]:
    """``all_to_all_single``, ``all_gather`` and ``all_gather_into_tensor`` that, on a gloo group, move CUDA or
    FP8 tensors through host copies (`to_host`); anything else goes to torch's own."""
    real_a2a, real_ag, real_agt = dist.all_to_all_single, dist.all_gather, dist.all_gather_into_tensor

    @functools.wraps(real_a2a)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if not _needs_host(group, (output, input)):
            return real_a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        host_out = host_empty(output)
        real_a2a(host_out, to_host(input), output_split_sizes, input_split_sizes, group=group)
        from_host(host_out, output)
        return _Done() if async_op else None

    @functools.wraps(real_ag)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not _needs_host(group, (tensor, *tensor_list)):
            return real_ag(tensor_list, tensor, group=group, async_op=async_op)
        host_list = [host_empty(t) for t in tensor_list]
        real_ag(host_list, to_host(tensor), group=group)
        for host, t in zip(host_list, tensor_list):
            from_host(host, t)
        return _Done() if async_op else None

    @functools.wraps(real_agt)
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if not _needs_host(group, (output_tensor, input_tensor)):
            return real_agt(output_tensor, input_tensor, group=group, async_op=async_op)
        host_in = to_host(input_tensor)
        world = dist.get_world_size(group)
        host_out = host_in.new_empty((world * host_in.shape[0], host_in.shape[1]))
        real_agt(host_out, host_in, group=group)
        output_tensor.copy_(host_out.view(output_tensor.dtype).reshape(output_tensor.shape))
        return _Done() if async_op else None

    return {"all_to_all_single": all_to_all_single, "all_gather": all_gather,
            "all_gather_into_tensor": all_gather_into_tensor}


def activate(adapt: Adaptations) -> None:
    """Apply ``adapt`` to the checkout's ``deep_ep.utils.envs`` (imported here, through the installed shim) and,
    for shared GPUs, to ``torch.distributed``'s three collectives. Once per process."""
    import deep_ep.utils.envs as envs

    if getattr(envs, "_deepep_runner_adapted", False):
        return
    envs._deepep_runner_adapted = True
    if adapt.share_gpu:
        envs.init_dist = shared_init_dist(envs.init_dist, adapt.device)
        for name, fn in staged_collectives().items():
            setattr(dist, name, fn)
    if adapt.rdma_gbs > 0:
        envs.get_rdma_gbs = with_nominal_rdma(envs.get_rdma_gbs, adapt.rdma_gbs)


def activate_from_env() -> None:
    """`activate` with the adaptations the launching process put in ``$DEEPEP_RUNNER_ADAPT``; SIGUSR1 then
    prints this process's Python stacks (what the suite asks of a run at its timeout)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    activate(Adaptations.from_env())


_HOOK_SOURCE = """# Written by deepep_runner.py: `import deep_ep` resolves to ep_moe's shim, then the runner's adaptations apply.
_EP_MOE_DEEP_EP_SHIM = True
import importlib.util as _util
import sys as _sys

from ep_moe.compat.deep_ep import install as _install

_install()
if "deepep_runner" not in _sys.modules:
    _spec = _util.spec_from_file_location("deepep_runner", {runner!r})
    _module = _util.module_from_spec(_spec)
    _sys.modules["deepep_runner"] = _module
    _spec.loader.exec_module(_module)
_sys.modules["deepep_runner"].activate_from_env()
"""


def launch(argv: Sequence[str]) -> int:
    """``launch``: run one program with the shim, the checkout's ``deep_ep.utils`` and the adaptations asked for,
    in this process and in every process it spawns."""
    parser = argparse.ArgumentParser(prog="deepep_runner.py launch")
    parser.add_argument("--deep-ep", required=True)
    parser.add_argument("--share-gpu", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rdma-gbs", type=float, default=0.0)
    parser.add_argument("program")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    import ep_moe.compat.deep_ep as shim

    try:
        folder = shim.deep_ep_folder(args.deep_ep)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    adapt = Adaptations(args.share_gpu, args.device, args.rdma_gbs)
    os.environ[shim.ENV_DEEP_EP_PATH] = folder
    os.environ[ADAPT_ENV] = adapt.to_env()
    with tempfile.TemporaryDirectory(prefix="deepep-runner-") as hook:
        Path(hook, "deep_ep.py").write_text(_HOOK_SOURCE.format(runner=str(Path(__file__).resolve())))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH")) if p)
        sys.modules.setdefault("deepep_runner", sys.modules[__name__])
        shim.install()
        activate_from_env()
        program = os.path.abspath(args.program)
        sys.argv = [program, *args.args]
        # The program's folder first (as `python program.py`), then the hook ahead of any other deep_ep; spawned
        # processes copy this sys.path.
        sys.path[0:1] = [os.path.dirname(program), hook]
        runpy.run_path(program, run_name="__main__")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``launch ...`` runs one program; anything else is the suite."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        return launch(argv[1:])
    return suite(argv)


if __name__ == "__main__":
    sys.exit(main())
