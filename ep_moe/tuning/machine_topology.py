"""What the machine looks like to the tuner: ranks per NVLink domain, nodes, the GPU, its NVLinks and NIC.

`detect_topology` asks NVML (``pynvml`` / ``nvidia-ml-py``) when it imports, else parses ``nvidia-smi``,
else falls back to datasheet numbers for the GPU's name; on a machine without GPUs it answers with zeros
(no SMs, no links) and never raises. `Topology.preset` builds a topology for a named GPU without
detecting anything (planning for another machine, tests).
"""

from __future__ import annotations

import glob
import logging
import math
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, replace

log = logging.getLogger("ep_moe")

# name fragment -> (SMs, NVLink links, GB/s per link and direction). Per-link speeds are what
# `nvidia-smi nvlink -s` reports (NVLink 4: 26.562 GB/s; NVLink 3: 25; NVLink 5: 50).
DATASHEET: dict[str, tuple[int, int, float]] = {
    "GB200": (152, 18, 50.0),
    "B200": (148, 18, 50.0),
    "H200": (132, 18, 26.5625),
    "H100": (132, 18, 26.5625),
    "H800": (132, 8, 26.5625),
    "H20": (78, 18, 26.5625),
    "A100": (108, 12, 25.0),
    "A800": (108, 8, 25.0),
}
NVLINK_GBS_BY_VERSION = {2: 25.0, 3: 25.0, 4: 26.5625, 5: 50.0}
FALLBACK_GPU = "H200"  # planning on a machine without a GPU: assume this one (datasheet numbers)
DEFAULT_RANKS_PER_DOMAIN = 8  # GPUs of one NVLink domain where nothing says otherwise (an HGX node)
FALLBACK_DEVICE_SMS = 132


@dataclass(frozen=True)
class Topology:
    """One expert-parallel group as the bandwidth model sees it.

    Attributes:
        world_size: ranks in the EP group.
        ranks_per_domain: ranks that reach each other over NVLink (one node unless multi-node NVLink).
        num_nodes: NVLink domains the group spans (scale-out ranks per GPU index).
        gpu_name: device name ("" without a GPU).
        num_sms: streaming multiprocessors per GPU (0 without a GPU).
        nvlink_links: active NVLink links per GPU (0 without NVLink).
        nvlink_link_gbs: GB/s per link and direction.
        nic_gbs: the GPU's NIC rate in GB/s (400 Gb/s -> 50), None where there is none.
        driver: driver / CUDA version string ("" when unknown).
        source: where the numbers came from: "nvml", "nvidia-smi", "datasheet", "cpu" or "preset".
    """

    world_size: int = 1
    ranks_per_domain: int = 1
    num_nodes: int = 1
    gpu_name: str = ""
    num_sms: int = 0
    nvlink_links: int = 0
    nvlink_link_gbs: float = 0.0
    nic_gbs: float | None = None
    driver: str = ""
    source: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_domain", "num_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology: argument '{name}' must be a positive int, got {value!r}")
        if self.world_size % self.ranks_per_domain and self.num_nodes > 1:
            raise ValueError(f"Topology: argument 'world_size' ({self.world_size}) must be a multiple of "
                             f"ranks_per_domain ({self.ranks_per_domain}) when the group spans nodes")

    @property
    def nvlink_gbs(self) -> float:
        """Raw NVLink bandwidth per GPU and direction (all links), GB/s."""
        return self.nvlink_links * self.nvlink_link_gbs

    @property
    def intranode(self) -> bool:
        """True when every rank of the group is in one NVLink domain."""
        return self.num_nodes == 1

    @property
    def nvlink_ranks(self) -> int:
        """Ranks of the group inside one NVLink domain."""
        return min(self.ranks_per_domain, self.world_size)

    @property
    def has_gpu(self) -> bool:
        return self.num_sms > 0

    def key(self) -> str:
        """A stable string naming the hardware and the group shape (for calibration caches)."""
        nic = f"{self.nic_gbs:g}GBps" if self.nic_gbs else "nonic"
        return (f"{self.gpu_name or 'cpu'}|sms{self.num_sms}|nvl{self.nvlink_links}x{self.nvlink_link_gbs:g}"
                f"|{nic}|{self.num_nodes}x{self.nvlink_ranks}|{self.driver or 'nodriver'}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)

    def with_group(self, world_size: int, ranks_per_domain: int | None = None) -> Topology:
        """The same hardware for a group of ``world_size`` ranks (``ranks_per_domain`` ranks per node). By default
        the group keeps this topology's ranks per domain; a topology of one rank, which says nothing of how ranks
        share nodes, gives domains of `DEFAULT_RANKS_PER_DOMAIN` (an HGX node)."""
        default = DEFAULT_RANKS_PER_DOMAIN if self.world_size == 1 else self.ranks_per_domain
        per_domain = min(ranks_per_domain or default, world_size)
        return replace(self, world_size=world_size, ranks_per_domain=per_domain,
                       num_nodes=max(1, math.ceil(world_size / per_domain)))

    @classmethod
    def preset(cls, gpu: str, world_size: int = 8, ranks_per_domain: int = 8, nic_gbps: float | None = None,
               nvlink_links: int | None = None, nvlink_link_gbs: float | None = None) -> Topology:
        """A topology for a named GPU from the datasheet table (nothing is detected).

        Args:
            gpu: a name containing one of `DATASHEET`'s keys ("H100", "H200", "B200", ...).
            world_size, ranks_per_domain: the EP group and how many of its ranks share an NVLink domain.
            nic_gbps: NIC line rate in Gb/s (400 for CX7), None for none.
            nvlink_links, nvlink_link_gbs: override the datasheet's link count and per-link speed.
        """
        sheet = datasheet(gpu)
        if sheet is None:
            raise ValueError(f"Topology.preset: argument 'gpu' must name one of {sorted(DATASHEET)}, got {gpu!r}")
        sms, links, link_gbs = sheet
        per_domain = min(ranks_per_domain, world_size)
        return cls(world_size=world_size, ranks_per_domain=per_domain,
                   num_nodes=max(1, math.ceil(world_size / per_domain)), gpu_name=gpu, num_sms=sms,
                   nvlink_links=links if nvlink_links is None else nvlink_links,
                   nvlink_link_gbs=link_gbs if nvlink_link_gbs is None else nvlink_link_gbs,
                   nic_gbs=None if not nic_gbps else nic_gbps / 8.0, source="preset")

    def describe(self) -> str:
        """One line for humans."""
        gpu = f"{self.gpu_name} ({self.num_sms} SMs)" if self.has_gpu else "no GPU"
        nvl = (f"{self.nvlink_links} NVLinks x {self.nvlink_link_gbs:g} GB/s = {self.nvlink_gbs:g} GB/s/dir"
               if self.nvlink_links else "no NVLink")
        nic = f"NIC {self.nic_gbs:g} GB/s" if self.nic_gbs else "no NIC"
        return (f"EP{self.world_size} = {self.num_nodes} node(s) x {self.nvlink_ranks} rank(s); {gpu}; {nvl}; "
                f"{nic}; {self.driver or 'driver unknown'} [{self.source}]")

    def __str__(self) -> str:
        return self.describe()


def datasheet(gpu_name: str) -> tuple[int, int, float] | None:
    """(SMs, NVLink links, GB/s per link and direction) for a GPU name, or None if unknown."""
    upper = gpu_name.upper()
    for fragment, values in DATASHEET.items():  # longer names first in the table (GB200 before B200)
        if fragment in upper:
            return values
    return None


# ------------------------------------------------------------------------------------------ parsers
def parse_nvlink_status(text: str, gpu_index: int = 0) -> list[float]:
    """Per-link GB/s of one GPU from ``nvidia-smi nvlink -s`` output (inactive links are skipped)."""
    blocks = re.split(r"^GPU (\d+):", text, flags=re.MULTILINE)
    # blocks = [preamble, idx0, body0, idx1, body1, ...]
    for i in range(1, len(blocks) - 1, 2):
        if int(blocks[i]) == gpu_index:
            return [float(v) for v in re.findall(r"Link \d+:\s*([\d.]+)\s*GB/s", blocks[i + 1])]
    return []


def parse_topo_matrix(text: str, gpu_index: int = 0) -> int:
    """Largest ``NV<k>`` link count from GPU ``gpu_index``'s row of ``nvidia-smi topo -m`` (0 if none)."""
    for line in text.splitlines():
        if re.match(rf"^\s*GPU{gpu_index}\s", line):
            counts = [int(k) for k in re.findall(r"\bNV(\d+)\b", line)]
            return max(counts, default=0)
    return 0


def parse_ib_rate(text: str) -> float | None:
    """Gb/s from an ``/sys/class/infiniband/*/ports/*/rate`` line such as ``400 Gb/sec (4X NDR)``."""
    match = re.match(r"\s*([\d.]+)\s*Gb/sec", text)
    return float(match.group(1)) if match else None


# ------------------------------------------------------------------------------------------ detection
def _run(cmd: list[str], timeout_s: float = 10.0) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _nvml_links(index: int) -> tuple[int, float, str] | None:
    """(active links, GB/s per link, driver) through NVML, None if NVML is absent or fails."""
    try:
        import pynvml  # provided by the nvidia-ml-py package
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        links, version = 0, 0
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                    links += 1
                    version = max(version, int(pynvml.nvmlDeviceGetNvLinkVersion(handle, link)))
            except Exception:  # NVML raises NotSupported for links that do not exist
                continue
        return links, NVLINK_GBS_BY_VERSION.get(version, 0.0), f"driver {driver}"
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _physical_index(index: int) -> int:
    """The NVML/nvidia-smi index of torch device ``index`` (CUDA_VISIBLE_DEVICES renumbers devices)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return index
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    if index < len(parts) and parts[index].isdigit():
        return int(parts[index])
    return index


def detect_nic_gbs() -> float | None:
    """The fastest active InfiniBand/RoCE port's rate in GB/s, or None (also ``EP_MOE_NIC_GBPS``, Gb/s)."""
    override = os.environ.get("EP_MOE_NIC_GBPS")
    if override:
        try:
            return float(override) / 8.0 or None
        except ValueError:
            log.warning("ep_moe: ignoring EP_MOE_NIC_GBPS=%r (not a number)", override)
    best: float | None = None
    for rate_file in glob.glob("/sys/class/infiniband/*/ports/*/rate"):
        try:
            state_file = os.path.join(os.path.dirname(rate_file), "state")
            if os.path.exists(state_file):
                with open(state_file) as f:
                    if "ACTIVE" not in f.read():
                        continue
            with open(rate_file) as f:
                gbps = parse_ib_rate(f.read())
        except OSError:
            continue
        if gbps:
            best = max(best or 0.0, gbps / 8.0)
    return best


def _group_sizes(world_size: int | None, local_world_size: int | None) -> tuple[int, int]:
    try:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
    except Exception:
        initialized = False
    if world_size is None:
        world_size = dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if local_world_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        local_world_size = int(env) if env else world_size
    world_size = max(1, int(world_size))
    return world_size, max(1, min(int(local_world_size), world_size))


def detect_topology(world_size: int | None = None, local_world_size: int | None = None,
                    device_index: int | None = None) -> Topology:
    """Describe this machine for an EP group; never raises.

    Args:
        world_size: ranks in the EP group (default: the initialized process group, else ``WORLD_SIZE``, else 1).
        local_world_size: ranks per node (default ``LOCAL_WORLD_SIZE``, else ``world_size``: one node).
        device_index: the CUDA device to describe (default: the current one).
    """
    world, local = _group_sizes(world_size, local_world_size)
    base = Topology(world_size=world, ranks_per_domain=local, num_nodes=max(1, math.ceil(world / local)))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    nic = None
    try:
        nic = detect_nic_gbs()
    except Exception:
        nic = None
    if not has_cuda:
        return replace(base, nic_gbs=nic, source="cpu")
    try:
        index = torch.cuda.current_device() if device_index is None else device_index
        props = torch.cuda.get_device_properties(index)
        name, sms = props.name, int(props.multi_processor_count)
        cuda = f"cuda {torch.version.cuda}"
    except Exception as exc:  # a broken driver must not stop planning
        log.warning("ep_moe: could not query the GPU (%s); planning without one", exc)
        return replace(base, nic_gbs=nic, source="cpu")
    physical = _physical_index(index)
    links, link_gbs, driver, source = 0, 0.0, "", ""
    nvml = _nvml_links(physical)
    if nvml is not None:
        links, link_gbs, driver = nvml
        source = "nvml"
    if not links or not link_gbs:
        speeds = parse_nvlink_status(_run(["nvidia-smi", "nvlink", "-s", "-i", str(physical)]), physical)
        if not speeds:  # some versions ignore -i and number GPUs from 0
            speeds = parse_nvlink_status(_run(["nvidia-smi", "nvlink", "-s"]), physical)
        if speeds:
            links, link_gbs, source = len(speeds), max(speeds), "nvidia-smi"
        else:
            nv = parse_topo_matrix(_run(["nvidia-smi", "topo", "-m"]), physical)
            if nv:
                sheet = datasheet(name)
                links, link_gbs, source = nv, (sheet[2] if sheet else 25.0), "nvidia-smi"
    if not driver:
        version = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                        str(physical)]).strip()
        driver = f"driver {version}" if version else ""
    if not links:
        sheet = datasheet(name)
        if sheet is not None and local > 1:  # a multi-GPU node of a known NVLink part: trust the datasheet
            links, link_gbs, source = sheet[1], sheet[2], "datasheet"
        source = source or "datasheet"
    driver = ", ".join(part for part in (driver, cuda) if part)
    return replace(base, gpu_name=name, num_sms=sms, nvlink_links=links, nvlink_link_gbs=link_gbs,
                   nic_gbs=nic, driver=driver, source=source)


__all__ = ["DATASHEET", "DEFAULT_RANKS_PER_DOMAIN", "Topology", "datasheet", "detect_nic_gbs", "detect_topology", "parse_ib_rate",
           "parse_nvlink_status", "parse_topo_matrix"]
