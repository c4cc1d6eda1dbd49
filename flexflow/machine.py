"""Machine model: devices, nodes and the directed links the simulator schedules transfers on.

Device k is global rank k (node-major: k = node * devices_per_node + local). A machine is
built from a compact cluster description (JSON), so users can describe their own clusters.
Figures come from /work/shared/REFERENCE.md ("REF") or vendor datasheets ("datasheet").
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

__all__ = ["DeviceSpec", "Device", "Link", "LinkSpec", "Machine", "GPU_SPECS", "NVLINK_BW_BPS", "cache_dir",
           "cpu_machine_file", "CPU_MACHINE_FILE"]

CPU_MACHINE_FILE = "machine-cpu.json"  # the calibrated cpu preset, in cache_dir() (comm.py writes it)

GiB = 2**30
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}


@dataclass(frozen=True)
class DeviceSpec:
    """What one device can do: peak FLOP/s per dtype, memory bandwidth and capacity."""
    kind: str
    peak_flops: Mapping[str, float] = field(hash=False)  # dtype name -> FLOP/s; needs "float32"
    mem_bw_Bps: float
    memory_bytes: int
    launch_overhead_s: float  # fixed cost per kernel / eager op
    backend: str = "nccl"     # torch.distributed backend: "nccl" or "gloo"
    # CPU processes whose communication threads share the cores that compute (gloo on a host
    # with no spare core per process): a message or an all-reduce also occupies the devices
    # at its ends for its duration, instead of overlapping their compute
    comm_on_cores: bool = False
    # On a host whose processes' speeds jitter (a shared VM), a synchronisation makes every
    # rank wait for the slowest: beyond its latency it costs this fraction of the compute
    # the ranks did since the previous one (calibrated; 0 elsewhere)
    sync_skew: float = 0.0
    # What returning the step's outputs (the loss) to every rank adds to a step, where
    # communication runs on the computing cores (calibrated: the all-reduce is started
    # after the forward and waited at the first read, so much of it hides behind the
    # backward); None: one all-reduce latency among all devices
    output_sync_s: float | None = None
    # Where communication runs on the computing cores: of a message's latency, the part
    # that holds no core (the wire and the peer's wake-up).  The rest holds both ends'
    # devices; the consumer starts this long after; messages posted together overlap it
    # (calibrated; 0: the whole latency holds the devices)
    message_lag_s: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "peak_flops", {str(k): float(v) for k, v in dict(self.peak_flops).items()})
        if "float32" not in self.peak_flops:
            raise ValueError(f"device spec {self.kind!r}: peak_flops needs a 'float32' entry")

    def flops(self, dtype="float32") -> float:
        """Peak FLOP/s for a dtype (name or torch.dtype); unknown dtypes fall back to float32."""
        name = str(dtype).removeprefix("torch.")
        return self.peak_flops.get(_DTYPE_ALIASES.get(name, name), self.peak_flops["float32"])


@dataclass(frozen=True)
class Device:
    """One device = one rank: global id, node, local index in its node."""
    id: int
    node: int
    local: int
    spec: DeviceSpec


@dataclass(frozen=True)
class LinkSpec:
    """Bandwidth/latency of one kind of link in a cluster description.  ``allreduce_*``:
    per ring step of an all-reduce over these links, when measured apart from point-to-point
    messages (gloo's all-reduce reduces on the CPU and moves data its own way); None: the
    point-to-point figures."""
    bandwidth_Bps: float
    latency_s: float
    kind: str
    allreduce_bandwidth_Bps: float | None = None
    allreduce_latency_s: float | None = None


@dataclass(frozen=True)
class Link:
    """A directed resource transfers occupy (one intra-node device pair, or one NIC direction)."""
    id: int
    name: str
    bandwidth_Bps: float
    latency_s: float
    kind: str
    ar_bandwidth_Bps: float  # per ring step of an all-reduce (LinkSpec.allreduce_*, else the above)
    ar_latency_s: float


# GPUs known by name. memory_bytes is the nominal size; detect() uses the measured one.
# Launch overhead 5 us: typical CUDA kernel launch gap seen from PyTorch eager.
GPU_SPECS = {
    # REF: ~67 TFLOP/s fp32, 990 TFLOP/s dense bf16 (790 measured), 4.8 TB/s, 141 GB.
    "H200": DeviceSpec("H200", {"float32": 67e12, "bfloat16": 990e12, "float16": 990e12}, 4.8e12, 141 * 10**9, 5e-6),
    # datasheet (H100 SXM): 67 TFLOP/s fp32, 989 dense bf16/fp16, 3.35 TB/s, 80 GB.
    "H100": DeviceSpec("H100", {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12}, 3.35e12, 80 * 10**9, 5e-6),
    # datasheet (A100 SXM 80GB): 19.5 TFLOP/s fp32, 312 bf16/fp16 tensor, 2.0 TB/s.
    "A100": DeviceSpec("A100", {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}, 2.0e12, 80 * 10**9, 5e-6),
    # datasheet (V100 SXM2): 15.7 TFLOP/s fp32, 125 fp16 tensor, 900 GB/s; no bf16 -> fp32.
    "V100": DeviceSpec("V100", {"float32": 15.7e12, "float16": 125e12}, 900e9, 32 * GiB, 5e-6),
    # REF: P100 SXM2 ~10.6 TFLOP/s fp32, 732 GB/s, 16 GB; datasheet: fp16 2x fp32.
    "P100": DeviceSpec("P100", {"float32": 10.6e12, "float16": 21.2e12}, 732e9, 16 * GiB, 5e-6),
    # REF: one GK210 of a K80, ~4.4 TFLOP/s fp32 boost, 240 GB/s, 12 GB; no fast fp16/bf16.
    "K80": DeviceSpec("K80", {"float32": 4.4e12}, 240e9, 12 * GiB, 5e-6),
}
# NVLink bandwidth per direction between two GPUs. REF: NVLink 4 ~450 GB/s per GPU (H100/H200
# through NVSwitch), NVLink 1 ~20 GB/s per link (P100); datasheet: A100 300, V100 150 GB/s.
NVLINK_BW_BPS = {"H200": 450e9, "H100": 450e9, "A100": 300e9, "V100": 150e9, "P100": 20e9}

# Links: latency_s is per link and route latencies add up, so each NIC direction carries half
# of a typical ~10 us end-to-end NCCL inter-node latency.
_EDR_IB = LinkSpec(12.5e9, 5e-6, "infiniband")   # REF: 100 Gb/s EDR = 12.5 GB/s per node NIC
_FDR_IB = LinkSpec(7e9, 5e-6, "infiniband")      # REF: 56 Gb/s FDR = 7 GB/s per node NIC


def _cpu_total() -> int:
    """Device count of the cpu preset: one process per core, at least 4 (so small simulations
    work on small hosts), at most 64."""
    return min(max(os.cpu_count() or 1, 4), 64)


def cache_dir() -> Path:
    """$FLEXFLOW_CACHE_DIR, else $XDG_CACHE_HOME/flexflow, else ~/.cache/flexflow (not created)."""
    env = os.environ.get("FLEXFLOW_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "flexflow"


def cpu_machine_file() -> Path:
    """Where the calibrated cpu machine lives."""
    return cache_dir() / CPU_MACHINE_FILE



def _spec_dict(spec: DeviceSpec) -> dict:
    """A device spec as JSON; ``comm_on_cores``, ``sync_skew``, ``output_sync_s`` and ``message_lag_s`` only
    when set (descriptions without them, and their fingerprints, stay as they were)."""
    d = dataclasses.asdict(spec)
    if not d["comm_on_cores"]:
        del d["comm_on_cores"]
    if not d["sync_skew"]:
        del d["sync_skew"]
    if d["output_sync_s"] is None:
        del d["output_sync_s"]
    if not d["message_lag_s"]:
        del d["message_lag_s"]
    return d


def _bool(d: dict, key: str, where: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise ValueError(f"machine JSON: '{where}{key}' must be true or false, not {v!r}")
    return v


def _cpu_default() -> "Machine":
    """The uncalibrated cpu preset. Modest per-process figures for one core (one thread):
    ~50 GFLOP/s fp32 matmul (AVX2 FMA), ~10 GB/s copy bandwidth; ~10 us per eager op.
    gloo between local processes runs over loopback TCP: ~2 GB/s, ~50 us per message."""
    n = _cpu_total()
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 * GiB * n
    spec = DeviceSpec("cpu", {"float32": 50e9}, 10e9, int(ram // n), 1e-5, "gloo")
    return Machine("cpu", 1, n, spec, LinkSpec(2e9, 50e-6, "loopback"))


def _calibrate_once() -> None:
    """Calibrate the cpu machine into the cache unless a calibrated file is there."""
    path = cpu_machine_file()
    if _calibration_current(path):
        return
    import fcntl
    import sys
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:  # processes of one host calibrate once, together
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _calibration_current(path):
            return
        print(f"flexflow: calibrating this host once (gloo between 2 processes, CPU speed); "
              f"cached in {path}", file=sys.stderr, flush=True)
        try:
            from .profile import calibrate_comm
            calibrate_comm(nprocs=2, path=path, sizes_bytes=(4096, 256 * 1024, 4 * 2**20), repeats=5, warmup=1)
        except Exception as e:  # noqa: BLE001 - an uncalibrated machine still works
            warnings.warn(f"host calibration failed ({type(e).__name__}: {e}); using the cpu preset's defaults")


# what a calibration must have measured to be used as it is (older files lack the cost of a
# message between compute, the all-reduce figures and the sync skew): detect() calibrates again
_CALIBRATION_KEYS = ("exchange_s", "allreduce_latency_s", "allreduce_bandwidth_Bps", "sync_skew", "message_lag_s")
# version 3: on a host whose messages share the computing cores, those three figures (and
# the cost of returning the outputs) are
# fitted to the executor's steps (flexflow.hostfit); older files are measured again.
# version 4: the calibration chain's loss (an MSE) splits with the samples, so its data-parallel
# steps exchange nothing and return the loss on the gradients' all-reduce, as the executor now does
# version 5: the executor's gloo loop threads run under SCHED_BATCH (execute.batch_gloo_loops), and
# a message between busy ranks no longer costs a scheduler slice now and then; the part of a
# message's latency that holds no core is fitted (message_lag_s)
CALIBRATION_VERSION = 5


def _calibration_current(path: Path) -> bool:
    try:
        measured = json.loads(path.read_text()).get("measured") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return all(k in measured for k in _CALIBRATION_KEYS) and measured.get("version") == CALIBRATION_VERSION


def _cpu_preset() -> "Machine":
    """The cpu preset, taken from the calibrated machine file when one exists (see comm.py)."""
    path = cpu_machine_file()
    if path.exists():
        try:
            return dataclasses.replace(Machine.load(path), name="cpu")
        except (ValueError, OSError) as e:
            warnings.warn(f"ignoring calibrated machine file {path}: {e}")
    return _cpu_default()


_PRESETS = {
    "p100-cluster": lambda: Machine("p100-cluster", 4, 4, GPU_SPECS["P100"],
                                    LinkSpec(NVLINK_BW_BPS["P100"], 5e-6, "nvlink"), _EDR_IB),
    # REF: PCIe switches inside a K80 node, ~10 GB/s (PCIe 3 x16 effective); 10 us via host.
    "k80-cluster": lambda: Machine("k80-cluster", 16, 4, GPU_SPECS["K80"],
                                   LinkSpec(10e9, 10e-6, "pcie"), _FDR_IB),
    # One ordered GPU pair = one link at the per-GPU NVLink 4 rate (NVSwitch is non-blocking);
    # a GPU sending to several peers at once is therefore modelled optimistically.
    "h200-node": lambda: Machine("h200-node", 1, 8, GPU_SPECS["H200"],
                                 LinkSpec(NVLINK_BW_BPS["H200"], 3e-6, "nvswitch")),
    "cpu": _cpu_preset,
}


@dataclass(frozen=True, repr=False)
class Machine:
    """Devices on nodes; one directed link per ordered device pair inside a node and an
    outgoing + incoming NIC link per node. num_devices < nodes * devices_per_node keeps
    the first devices (the last node is partial)."""
    name: str
    num_nodes: int
    devices_per_node: int
    spec: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec | None = None
    num_devices: int | None = None  # None: every device of every node
    devices: tuple = field(init=False, compare=False)
    links: tuple = field(init=False, compare=False)

    def __post_init__(self):
        nodes, dpn = self.num_nodes, self.devices_per_node
        n = nodes * dpn if self.num_devices is None else self.num_devices
        if nodes < 1 or dpn < 1:
            raise ValueError(f"machine {self.name!r}: nodes and devices_per_node must be >= 1")
        if not (nodes - 1) * dpn < n <= nodes * dpn:
            raise ValueError(f"machine {self.name!r}: num_devices={n} does not fit {nodes} nodes x {dpn}")
        if nodes > 1 and self.inter_node is None:
            raise ValueError(f"machine {self.name!r}: {nodes} nodes need an inter_node link")
        devices = tuple(Device(i, i // dpn, i % dpn, self.spec) for i in range(n))
        links, intra, nic_out, nic_in = [], {}, {}, {}

        def add(name, ls):
            ar_bw = ls.bandwidth_Bps if ls.allreduce_bandwidth_Bps is None else ls.allreduce_bandwidth_Bps
            ar_lat = ls.latency_s if ls.allreduce_latency_s is None else ls.allreduce_latency_s
            links.append(Link(len(links), name, ls.bandwidth_Bps, ls.latency_s, ls.kind, ar_bw, ar_lat))
            return len(links) - 1
        for node in range(nodes):
            ids = [d.id for d in devices if d.node == node]
            for a in ids:
                for b in ids:
                    if a != b:
                        intra[a, b] = add(f"{self.intra_node.kind} {a}->{b}", self.intra_node)
        if nodes > 1:
            for node in range(nodes):
                nic_out[node] = add(f"nic-out node{node}", self.inter_node)
                nic_in[node] = add(f"nic-in node{node}", self.inter_node)
        for k, v in dict(num_devices=n, devices=devices, links=tuple(links), _intra=intra,
                         _nic_out=nic_out, _nic_in=nic_in, _rings={}).items():
            object.__setattr__(self, k, v)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def preset_names(cls) -> list[str]:
        return list(_PRESETS)

    @classmethod
    def preset(cls, name: str, devices: int | None = None) -> "Machine":
        """A named cluster; devices=N keeps its first N devices (node-major)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown machine preset {name!r}; valid presets: {', '.join(_PRESETS)}")
        m = _PRESETS[name]()
        if devices is None:
            return m
        if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= m.num_devices:
            raise ValueError(f"machine preset {name!r} has {m.num_devices} devices; "
                             f"devices={devices!r} must be an integer in 1..{m.num_devices}")
        return m.with_devices(devices)

    def with_devices(self, n: int) -> "Machine":
        """The same machine keeping only its first n devices."""
        if not 1 <= n <= self.num_devices:
            raise ValueError(f"machine {self.name!r} has {self.num_devices} devices; cannot keep {n}")
        return dataclasses.replace(self, num_nodes=math.ceil(n / self.devices_per_node), num_devices=n)

    @classmethod
    def detect(cls, calibrate: bool | None = None) -> "Machine":
        """This host: its NVIDIA GPUs as one node (pynvml), else the cpu preset with one
        process per core (never raises for a missing driver).  On a CPU host the
        preset is the calibrated one: the first call measures gloo between local
        processes and this CPU's speed (a few seconds) and caches the figures
        (``flexflow profile --comm`` redoes it); ``calibrate=False`` or
        $FLEXFLOW_NO_CALIBRATE=1 skips that and uses the cached file or the defaults."""
        m = _try(_detect_gpus, None)  # a broken driver must not break the library
        if m is not None:
            return m
        if calibrate is None:
            calibrate = os.environ.get("FLEXFLOW_NO_CALIBRATE", "") in ("", "0")
        if calibrate:
            _calibrate_once()
        cpu = cls.preset("cpu")
        return cpu.with_devices(min(os.cpu_count() or 1, cpu.num_devices))

    # ---- routes and costs ---------------------------------------------------------------
    def _id(self, d) -> int:
        i = d.id if isinstance(d, Device) else d
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_devices:
            raise ValueError(f"device {d!r} is not on machine {self.name!r} (0..{self.num_devices - 1})")
        return i

    def route(self, src, dst) -> tuple[int, ...]:
        """Link ids a point-to-point transfer src -> dst occupies (empty when src == dst)."""
        s, d = self._id(src), self._id(dst)
        if s == d:
            return ()
        ns, nd = self.devices[s].node, self.devices[d].node
        return (self._intra[s, d],) if ns == nd else (self._nic_out[ns], self._nic_in[nd])

    def route_figures(self, src, dst) -> tuple[float, float] | None:
        """(sum of link latencies, slowest bandwidth) on the route src -> dst; None when
        src == dst."""
        r = self.route(src, dst)
        if not r:
            return None
        links = [self.links[i] for i in r]
        return sum(l.latency_s for l in links), min(l.bandwidth_Bps for l in links)

    def transfer_time_s(self, src, dst, nbytes: float) -> float:
        """Sum of link latencies on the route + nbytes / slowest bandwidth on the route."""
        fig = self.route_figures(src, dst)
        if fig is None or nbytes <= 0:
            return 0.0
        return fig[0] + nbytes / fig[1]

    def _ring(self, devices: Iterable) -> tuple[tuple[int, ...], ...]:
        """Routes of the ring hops, devices in id order (node-major: fewest node crossings)."""
        ids = tuple(sorted({self._id(d) for d in devices}))
        if ids not in self._rings:
            self._rings[ids] = tuple(self.route(a, b) for a, b in zip(ids, ids[1:] + ids[:1])) \
                if len(ids) > 1 else ()
        return self._rings[ids]

    def allreduce_links(self, devices: Iterable) -> tuple[int, ...]:
        """Link ids a ring all-reduce among these devices occupies."""
        return tuple(sorted({i for hop in self._ring(devices) for i in hop}))

    def allreduce_time_s(self, devices: Iterable, nbytes: float) -> float:
        """Ring all-reduce of nbytes on each device: 2(n-1) steps, each moving nbytes/n over the
        slowest link of the ring plus the largest hop latency."""
        hops = self._ring(devices)
        n = len(hops)
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw = min(self.links[i].ar_bandwidth_Bps for hop in hops for i in hop)
        lat = max(sum(self.links[i].ar_latency_s for i in hop) for hop in hops)
        return 2 * (n - 1) * (lat + nbytes / n / bw)

    def allreduce_latency_s(self, devices: Iterable) -> float:
        """The latency term of one ring all-reduce among these devices (2(n-1) hop latencies)."""
        hops = self._ring(devices)
        n = len(hops)
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * max(sum(self.links[i].ar_latency_s for i in hop) for hop in hops)

    def bucketed_allreduce_time_s(self, devices: Iterable, nbytes: float, bucket_bytes: float) -> float:
        """Share of ring all-reduces that a gradient of nbytes takes when gradients travel in
        buckets of ``bucket_bytes`` (as the executor sends them): the bandwidth term in full,
        the per-step latency in proportion to the bucket share (at most one whole latency)."""
        full = self.allreduce_time_s(devices, nbytes)
        if full == 0.0:
            return 0.0
        hops = self._ring(devices)
        n = len(hops)
        lat = 2 * (n - 1) * max(sum(self.links[i].ar_latency_s for i in hop) for hop in hops)
        return full - lat + lat * min(1.0, nbytes / bucket_bytes)

    def allreduce_bytes_sent(self, devices: Iterable, nbytes: float) -> float:
        """Bytes all devices send in a ring all-reduce: 2(n-1)/n * nbytes each, 2(n-1)*nbytes in all."""
        n = len({self._id(d) for d in devices})
        return 2 * (n - 1) * nbytes if n > 1 else 0

    # ---- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        link = lambda ls: None if ls is None else {k: v for k, v in dataclasses.asdict(ls).items()
                                                   if v is not None}
        return {"name": self.name, "nodes": self.num_nodes, "devices_per_node": self.devices_per_node,
                "num_devices": self.num_devices, "device": _spec_dict(self.spec),
                "intra_node": link(self.intra_node), "inter_node": link(self.inter_node)}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d) -> "Machine":
        """Build from a cluster description; ValueError names the bad key."""
        _check_keys(d, "", {"name", "nodes", "devices_per_node", "device", "intra_node"},
                    {"num_devices", "inter_node", "comment", "measured"})
        dev = d["device"]
        _check_keys(dev, "device.", {"kind", "peak_flops", "mem_bw_Bps", "memory_bytes"},
                    {"launch_overhead_s", "backend", "comm_on_cores", "sync_skew", "output_sync_s",
                     "message_lag_s"})
        for k, v in (("name", d["name"]), ("device.kind", dev["kind"])):
            if not isinstance(v, str) or not v:
                raise ValueError(f"machine JSON: '{k}' must be a non-empty string, not {v!r}")
        pf = dev["peak_flops"]
        pf = {"float32": pf} if _is_num(pf) else pf
        if not isinstance(pf, dict) or "float32" not in pf:
            raise ValueError("machine JSON: 'device.peak_flops' must be a number or a dict with 'float32'")
        for k in pf:
            _num(pf, k, "device.peak_flops.")
        backend = dev.get("backend", "gloo" if dev["kind"] == "cpu" else "nccl")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"machine JSON: 'device.backend' must be 'nccl' or 'gloo', not {backend!r}")
        spec = DeviceSpec(dev["kind"], pf, _num(dev, "mem_bw_Bps", "device."),
                          int(_num(dev, "memory_bytes", "device.")),
                          _num(dev, "launch_overhead_s", "device.", zero_ok=True, default=5e-6), backend,
                          _bool(dev, "comm_on_cores", "device."),
                          _num(dev, "sync_skew", "device.", zero_ok=True, default=0.0),
                          None if dev.get("output_sync_s") is None
                          else _num(dev, "output_sync_s", "device.", zero_ok=True),
                          _num(dev, "message_lag_s", "device.", zero_ok=True, default=0.0))
        nodes, dpn, inter = _int(d, "nodes"), _int(d, "devices_per_node"), d.get("inter_node")
        if nodes > 1 and inter is None:
            raise ValueError(f"machine JSON: 'inter_node' is required for {nodes} nodes")
        n = None if d.get("num_devices") is None else _int(d, "num_devices")
        intra, inter = _link(d["intra_node"], "intra_node"), None if inter is None else _link(inter, "inter_node")
        try:
            return cls(d["name"], nodes, dpn, spec, intra, inter, n)
        except ValueError as e:
            raise ValueError(f"machine JSON: 'num_devices': {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "Machine":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"machine JSON is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def save(self, path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path) -> "Machine":
        text = Path(path).read_text()  # OSError as is
        try:
            return cls.from_json(text)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def fingerprint(self) -> str:
        """Short stable hash of the description; strategies record it to refuse other machines."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ---- display ------------------------------------------------------------------------
    def __repr__(self) -> str:
        inter = f", {self.inter_node.kind} {_si(self.inter_node.bandwidth_Bps)}B/s" if self.num_nodes > 1 else ""
        return (f"Machine({self.name!r}: {self.num_devices} x {self.spec.kind} on {self.num_nodes} node(s), "
                f"{self.intra_node.kind} {_si(self.intra_node.bandwidth_Bps)}B/s{inter})")

    def describe(self) -> str:
        s, a, e = self.spec, self.intra_node, self.inter_node
        flops = ", ".join(f"{k} {_si(v)}FLOP/s" for k, v in s.peak_flops.items())
        lines = [f"machine {self.name} [{self.fingerprint()}]",
                 f"  {self.num_devices} devices on {self.num_nodes} node(s), {self.devices_per_node} per node",
                 f"  device {s.kind}: {flops}; memory {s.memory_bytes / GiB:.1f} GiB at {_si(s.mem_bw_Bps)}B/s; "
                 f"launch {s.launch_overhead_s * 1e6:g} us; backend {s.backend}",
                 f"  intra-node {a.kind}: {_si(a.bandwidth_Bps)}B/s per direction per pair, {a.latency_s * 1e6:g} us"]
        if a.allreduce_bandwidth_Bps is not None:
            lines.append(f"  all-reduce per ring step: {_si(a.allreduce_bandwidth_Bps)}B/s, "
                         f"{(a.allreduce_latency_s or 0.0) * 1e6:g} us")
        if e is not None:
            lines.append(f"  inter-node {e.kind}: {_si(e.bandwidth_Bps)}B/s per node NIC direction, "
                         f"{e.latency_s * 1e6:g} us")
        if s.comm_on_cores:
            lines.append("  communication runs on the computing cores: a message or all-reduce holds its devices")
        if s.sync_skew:
            lines.append(f"  a synchronisation also costs {s.sync_skew:.1%} of the compute before it "
                         f"(the ranks' speeds jitter)")
        if s.output_sync_s is not None:
            lines.append(f"  returning the outputs to every rank adds {s.output_sync_s * 1e6:g} us to a step")
        if s.comm_on_cores and s.message_lag_s:
            lines.append(f"  of a message's latency, {s.message_lag_s * 1e6:g} us hold no core (messages posted "
                         f"together overlap it)")
        return "\n".join(lines)


def _si(x: float) -> str:
    for unit, f in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= f:
            return f"{x / f:.3g} {unit}"
    return f"{x:.3g} "


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_keys(d, where, required, optional):
    if not isinstance(d, dict):
        raise ValueError(f"machine JSON: {repr(where.rstrip('.')) if where else 'the top level'} must be an object")
    for k in sorted(required - set(d)):
        raise ValueError(f"machine JSON: missing key '{where}{k}'")
    for k in sorted(set(d) - required - optional):
        raise ValueError(f"machine JSON: unknown key '{where}{k}' (expected {', '.join(sorted(required | optional))})")


def _num(d, key, where="", zero_ok=False, default=None) -> float:
    if key not in d and default is not None:
        return default
    v = d[key]
    if not _is_num(v) or v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"machine JSON: '{where}{key}' must be a {'non-negative' if zero_ok else 'positive'} "
                         f"number, not {v!r}")
    return float(v)


def _int(d, key) -> int:
    if isinstance(d[key], bool) or not isinstance(d[key], int) or d[key] < 1:
        raise ValueError(f"machine JSON: '{key}' must be a positive integer, not {d[key]!r}")
    return d[key]


def _link(d, where) -> LinkSpec:
    _check_keys(d, where + ".", {"bandwidth_Bps", "latency_s"},
                {"kind", "allreduce_bandwidth_Bps", "allreduce_latency_s"})
    ar = {k: _num(d, k, where + ".", zero_ok=k.endswith("latency_s"))
          for k in ("allreduce_bandwidth_Bps", "allreduce_latency_s") if d.get(k) is not None}
    return LinkSpec(_num(d, "bandwidth_Bps", where + "."), _num(d, "latency_s", where + ".", zero_ok=True),
                    str(d.get("kind", where)), **ar)


def _try(f, default):
    try:
        return f()
    except Exception:
        return default


def _detect_gpus() -> Machine | None:
    """This host's NVIDIA GPUs as one homogeneous node (GPU 0's kind, smallest memory)."""
    try:
        import pynvml as nv
        nv.nvmlInit()
    except Exception:  # no pynvml, or NVMLError_LibraryNotFound / DriverNotLoaded: no driver
        return None
    try:
        hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        if not hs:
            return None
        name = nv.nvmlDeviceGetName(hs[0])
        name = name.decode() if isinstance(name, bytes) else str(name)
        kind = next((k for k in GPU_SPECS if re.search(rf"\b{k}\b", name.upper())), None)
        h = hs[0]
        if kind:
            spec = GPU_SPECS[kind]
        else:  # unknown GPU: fp32 = one FMA (2 FLOP) per CUDA core per SM cycle, else 20 TFLOP/s;
            # memory bandwidth = bus bytes x memory clock x 2 (DDR), else 1 TB/s; other dtypes
            # fall back to fp32 (no tensor-core guess: conservative).
            cores = _try(lambda: nv.nvmlDeviceGetNumGpuCores(h), 0)
            clk = _try(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM), 0)
            bus = _try(lambda: nv.nvmlDeviceGetMemoryBusWidth(h), 0)
            mclk = _try(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM), 0)
            spec = DeviceSpec(name, {"float32": 2e6 * cores * clk if cores and clk else 20e12},
                              bus / 8 * mclk * 2e6 if bus and mclk else 1e12, 16 * GiB, 5e-6)
        spec = dataclasses.replace(spec, memory_bytes=min(int(nv.nvmlDeviceGetMemoryInfo(x).total) for x in hs))
        on = getattr(nv, "NVML_FEATURE_ENABLED", 1)
        if any(_try(lambda: nv.nvmlDeviceGetNvLinkState(x, k), 0) == on
               for x in hs for k in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            intra = LinkSpec(NVLINK_BW_BPS.get(spec.kind, 50e9), 5e-6, "nvlink")  # unknown NVLink: 50 GB/s
        else:  # PCIe per direction: per-lane rate of the generation x width x 0.8 (protocol
            # overhead); 12 GB/s (PCIe 3 x16 effective) when NVML cannot say
            lane = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
            gen = _try(lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(h), 0)
            width = _try(lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h), 0)
            intra = LinkSpec(lane[gen] * width * 0.8 if gen in lane and width else 12e9, 10e-6, "pcie")
        return Machine(f"detected-{spec.kind.lower()}", 1, len(hs), spec, intra)
    finally:
        _try(nv.nvmlShutdown, None)
