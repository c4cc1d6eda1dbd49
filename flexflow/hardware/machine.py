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
from typing import Iterable

from ..settings import cache_dir
from . import collectives as nccl
from .collectives import CollectiveSpec, GroupShape
from .specs import (
    _EDR_IB,
    _FDR_IB,
    CLUSTER_SPECS,
    GPU_SPECS,
    NCCL_FIGURES,
    NVLINK_BW_BPS,
    NVSWITCH_LINK,
    RAIL_LINK,
    Device,
    DeviceSpec,
    GiB,
    Link,
    LinkSpec,
    _bool,
    _check_keys,
    _efficiency,
    _run_efficiency,
    _int,
    _is_num,
    _link,
    _num,
    _si,
    _spec_dict,
    _try,
)

__all__ = ['CPU_MACHINE_FILE', 'cache_dir', 'cpu_machine_file', 'CALIBRATION_VERSION', 'Machine']


CPU_MACHINE_FILE = "machine-cpu.json"  # the calibrated cpu preset, in cache_dir() (comm.py writes it)


def _cpu_total() -> int:
    """Device count of the cpu preset: one process per core, at least 4 (so small simulations
    work on small hosts), at most 64."""
    return min(max(os.cpu_count() or 1, 4), 64)


def cpu_machine_file() -> Path:
    """Where the calibrated cpu machine lives."""
    return cache_dir() / CPU_MACHINE_FILE


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


# what a calibration must have measured to be used as it is; a file without one of them is
# measured again by calibrate.host.ensure_calibrated()
_CALIBRATION_KEYS = ("exchange_s", "allreduce_latency_s", "allreduce_bandwidth_Bps", "sync_skew", "message_lag_s")


# The calibration's format; a file of another version is measured again.
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


def _today(name: str, kind: str, nodes: int) -> "Machine":
    """A cluster of today: nodes of 8 GPUs on NVSwitch, one NIC per GPU (rails), collectives
    costed as NCCL runs them with published nccl-tests figures (specs.NCCL_FIGURES)."""
    return Machine(name, nodes, 8, CLUSTER_SPECS[kind], NVSWITCH_LINK[kind], RAIL_LINK[kind] if nodes > 1 else None,
                   rails=True, collectives=CollectiveSpec(**NCCL_FIGURES[kind]))


def _grown(m: "Machine", devices: int) -> "Machine":
    """``m`` with ``devices`` devices in as many of its nodes as it takes."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"machine preset {m.name!r}: devices={devices!r} must be a positive integer")
    nodes = math.ceil(devices / m.devices_per_node)
    return dataclasses.replace(m, num_nodes=nodes, num_devices=devices,
                               inter_node=m.inter_node or (RAIL_LINK[m.spec.kind] if nodes > 1 else None))


# Presets whose devices=N is any count, in as many nodes as it takes (the paper's clusters
# keep their sizes)
_ELASTIC = ("h100-cluster", "h200-cluster", "a100-cluster")


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
    # DGX / HGX H100: 8 x H100 SXM 80 GB on NVSwitch; the clusters 8 such nodes unless
    # devices=N, each GPU with its own 400 Gb/s NIC; A100 nodes with 200 Gb/s NICs
    "h100-node": lambda: _today("h100-node", "H100", 1),
    "h100-cluster": lambda: _today("h100-cluster", "H100", 8),
    "h200-cluster": lambda: _today("h200-cluster", "H200", 8),
    "a100-cluster": lambda: _today("a100-cluster", "A100", 8),
    "cpu": _cpu_preset,
}


@dataclass(frozen=True, repr=False)
class Machine:
    """Devices on nodes; one directed link per ordered device pair inside a node and an
    outgoing + incoming NIC link per node, or per device with ``rails`` (one NIC per GPU, as
    in DGX / HGX nodes). num_devices < nodes * devices_per_node keeps the first devices (the
    last node is partial).  ``collectives``: all-reduces and other collectives costed as NCCL
    runs them (:mod:`flexflow.hardware.collectives`); None: a plain ring over the links."""
    name: str
    num_nodes: int
    devices_per_node: int
    spec: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec | None = None
    num_devices: int | None = None  # None: every device of every node
    rails: bool = False  # one NIC per device instead of one per node
    collectives: CollectiveSpec | None = None  # NCCL's algorithms and bus bandwidths
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
        if nodes > 1 and self.rails:  # keyed by device
            for d in devices:
                nic_out[d.id] = add(f"nic-out gpu{d.id}", self.inter_node)
                nic_in[d.id] = add(f"nic-in gpu{d.id}", self.inter_node)
        elif nodes > 1:  # keyed by node
            for node in range(nodes):
                nic_out[node] = add(f"nic-out node{node}", self.inter_node)
                nic_in[node] = add(f"nic-in node{node}", self.inter_node)
        for k, v in dict(num_devices=n, devices=devices, links=tuple(links), _intra=intra,
                         _nic_out=nic_out, _nic_in=nic_in, _rings={}).items():
            object.__setattr__(self, k, v)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def preset_names(cls) -> list[str]:
        """The names of the machine presets."""
        return list(_PRESETS)

    @classmethod
    def preset(cls, name: str, devices: int | None = None) -> "Machine":
        """A named cluster; devices=N keeps its first N devices (node-major); for today's
        clusters (h100-, h200-, a100-cluster) N is any count, in as many nodes as it takes."""
        if name not in _PRESETS:
            raise ValueError(f"unknown machine preset {name!r}; valid presets: {', '.join(_PRESETS)}")
        m = _PRESETS[name]()
        if devices is None:
            return m
        if name in _ELASTIC:
            return _grown(m, devices)
        if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= m.num_devices:
            raise ValueError(f"machine preset {name!r} has {m.num_devices} devices; "
                             f"devices={devices!r} must be an integer in 1..{m.num_devices}")
        return m.with_devices(devices)

    def with_devices(self, n: int) -> "Machine":
        """The same machine keeping only its first n devices."""
        if not 1 <= n <= self.num_devices:
            raise ValueError(f"machine {self.name!r} has {self.num_devices} devices; cannot keep {n}")
        return dataclasses.replace(self, num_nodes=math.ceil(n / self.devices_per_node), num_devices=n)

    def with_memory(self, nbytes: int) -> "Machine":
        """The same machine with ``nbytes`` of memory per device (to plan under a cap)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes <= 0:
            raise ValueError(f"memory per device must be a positive number of bytes, got {nbytes!r}")
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, memory_bytes=int(nbytes)))

    @classmethod
    def detect(cls) -> "Machine":
        """This host: its NVIDIA GPUs as one node (pynvml), else the cpu preset with one
        process per core (never raises for a missing driver).  On a CPU host the preset
        takes the figures a host calibration wrote (:func:`flexflow.calibrate.calibrate`,
        ``flexflow calibrate``) when there are any, else the defaults: detecting only
        reads, it never measures."""
        m = _try(_detect_gpus, None)  # a broken driver must not break the library
        if m is not None:
            return m
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
        if ns == nd:
            return (self._intra[s, d],)
        return (self._nic_out[s], self._nic_in[d]) if self.rails else (self._nic_out[ns], self._nic_in[nd])

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
        """Link ids a ring all-reduce among these devices occupies (with rails, every member's
        NIC: NCCL spreads its channels over them)."""
        links = {i for hop in self._ring(devices) for i in hop}
        if self.rails and self.num_nodes > 1 and len({self.devices[self._id(d)].node for d in devices}) > 1:
            for d in {self._id(d) for d in devices}:
                links.update((self._nic_out[d], self._nic_in[d]))
        return tuple(sorted(links))

    def _group(self, devices: Iterable) -> GroupShape:
        ids = {self._id(d) for d in devices}
        per = {}
        for i in ids:
            per[self.devices[i].node] = per.get(self.devices[i].node, 0) + 1
        return GroupShape(len(ids), len(per), max(per.values(), default=0), self.devices_per_node, self.rails)

    def allreduce_time_s(self, devices: Iterable, nbytes: float) -> float:
        """All-reduce of nbytes on each device.  With ``collectives``: NCCL's fastest ring, tree
        or NVLink-SHARP algorithm (:mod:`flexflow.hardware.collectives`).  Else a ring:
        2(n-1) steps, each moving nbytes/n over the slowest link of the ring plus the largest
        hop latency."""
        if self.collectives is not None:
            return nccl.allreduce_s(self.collectives, self._group(devices), nbytes)[1]
        hops = self._ring(devices)
        n = len(hops)
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw = min(self.links[i].ar_bandwidth_Bps for hop in hops for i in hop)
        lat = max(sum(self.links[i].ar_latency_s for i in hop) for hop in hops)
        return 2 * (n - 1) * (lat + nbytes / n / bw)

    def allreduce_latency_s(self, devices: Iterable) -> float:
        """The latency term of one all-reduce among these devices: NCCL's quickest for a tiny
        message with ``collectives``, else 2(n-1) ring hop latencies."""
        if self.collectives is not None:
            return nccl.allreduce_latency_s(self.collectives, self._group(devices))
        hops = self._ring(devices)
        n = len(hops)
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * max(sum(self.links[i].ar_latency_s for i in hop) for hop in hops)

    def bucketed_allreduce_time_s(self, devices: Iterable, nbytes: float, bucket_bytes: float) -> float:
        """Share of ring all-reduces that a gradient of nbytes takes when gradients travel in
        buckets of ``bucket_bytes`` (as the executor sends them): the bandwidth term in full,
        the per-step latency in proportion to the bucket share (at most one whole latency)."""
        if self.collectives is not None:  # the bucket by the algorithm NCCL picks for its size
            lat, full = nccl.allreduce_s(self.collectives, self._group(devices), bucket_bytes)
            if full == 0.0 or nbytes <= 0:
                return 0.0
            return (full - lat) / bucket_bytes * nbytes + lat * min(1.0, nbytes / bucket_bytes)
        full = self.allreduce_time_s(devices, nbytes)
        if full == 0.0:
            return 0.0
        hops = self._ring(devices)
        n = len(hops)
        lat = 2 * (n - 1) * max(sum(self.links[i].ar_latency_s for i in hop) for hop in hops)
        return full - lat + lat * min(1.0, nbytes / bucket_bytes)

    def reduce_scatter_time_s(self, devices: Iterable, nbytes: float) -> float:
        """Reduce-scatter of a buffer of nbytes on each device (each keeps 1/n, reduced): a ring
        of n-1 steps; as an all-gather of the same buffer.  Without ``collectives``, half the
        ring all-reduce (which is a reduce-scatter and an all-gather)."""
        if self.collectives is not None:
            return nccl.ring_collective_s(self.collectives, self._group(devices), nbytes)
        return self.allreduce_time_s(devices, nbytes) / 2

    def allgather_time_s(self, devices: Iterable, nbytes: float) -> float:
        """All-gather into a buffer of nbytes on each device (each contributes 1/n)."""
        return self.reduce_scatter_time_s(devices, nbytes)

    def allreduce_bytes_sent(self, devices: Iterable, nbytes: float) -> float:
        """Bytes all devices send in a ring all-reduce: 2(n-1)/n * nbytes each, 2(n-1)*nbytes in all."""
        n = len({self._id(d) for d in devices})
        return 2 * (n - 1) * nbytes if n > 1 else 0

    # ---- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The machine as a plain dict (devices, nodes, links), as its JSON file holds it."""
        link = lambda ls: None if ls is None else {k: v for k, v in dataclasses.asdict(ls).items()
                                                   if v is not None}
        d = {"name": self.name, "nodes": self.num_nodes, "devices_per_node": self.devices_per_node,
             "num_devices": self.num_devices, "device": _spec_dict(self.spec),
             "intra_node": link(self.intra_node), "inter_node": link(self.inter_node)}
        if self.rails:  # only when set: older descriptions and their fingerprints stay as they were
            d["rails"] = True
        if self.collectives is not None:
            d["collectives"] = self.collectives.to_dict()
        return d

    def to_json(self, indent: int | None = 2) -> str:
        """The machine as JSON (``Machine.from_json`` reads it back)."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d) -> "Machine":
        """Build from a cluster description; ValueError names the bad key."""
        _check_keys(d, "", {"name", "nodes", "devices_per_node", "device", "intra_node"},
                    {"num_devices", "inter_node", "comment", "measured", "rails", "collectives"})
        dev = d["device"]
        _check_keys(dev, "device.", {"kind", "peak_flops", "mem_bw_Bps", "memory_bytes"},
                    {"launch_overhead_s", "backend", "comm_on_cores", "sync_skew", "output_sync_s",
                     "message_lag_s", "efficiency", "run_efficiency"})
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
                          _num(dev, "message_lag_s", "device.", zero_ok=True, default=0.0),
                          _efficiency(dev), _run_efficiency(dev))
        nodes, dpn, inter = _int(d, "nodes"), _int(d, "devices_per_node"), d.get("inter_node")
        if nodes > 1 and inter is None:
            raise ValueError(f"machine JSON: 'inter_node' is required for {nodes} nodes")
        n = None if d.get("num_devices") is None else _int(d, "num_devices")
        intra, inter = _link(d["intra_node"], "intra_node"), None if inter is None else _link(inter, "inter_node")
        coll = d.get("collectives")
        if coll is not None:
            _check_keys(coll, "collectives.", {"ring_busbw_Bps", "nic_busbw_Bps"}, {"nvls_busbw_Bps"})
            coll = CollectiveSpec(_num(coll, "ring_busbw_Bps", "collectives."),
                                  _num(coll, "nic_busbw_Bps", "collectives."),
                                  _num(coll, "nvls_busbw_Bps", "collectives.", zero_ok=True, default=0.0))
        try:
            return cls(d["name"], nodes, dpn, spec, intra, inter, n, _bool(d, "rails", ""), coll)
        except ValueError as e:
            raise ValueError(f"machine JSON: 'num_devices': {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "Machine":
        """A machine from its JSON text: a cluster you describe yourself."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"machine JSON is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def save(self, path) -> None:
        """Write the machine's JSON to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path) -> "Machine":
        """A machine read from a JSON file written by ``save`` (or by hand)."""
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
        """A few lines on the machine: devices, nodes, links."""
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
            lines.append(f"  inter-node {e.kind}: {_si(e.bandwidth_Bps)}B/s per {'GPU' if self.rails else 'node'} "
                         f"NIC direction, {e.latency_s * 1e6:g} us")
        c = self.collectives
        if c is not None:
            nvls = f", NVLink SHARP all-reduce {_si(c.nvls_busbw_Bps)}B/s" if c.nvls_busbw_Bps else ""
            lines.append(f"  collectives as NCCL runs them (ring / tree): bus bandwidth {_si(c.ring_busbw_Bps)}B/s "
                         f"in a node{nvls}, {_si(c.nic_busbw_Bps)}B/s per NIC")
        if s.efficiency:
            lines.append("  kernels reach " + ", ".join(f"{k} {v:.0%}" for k, v in sorted(s.efficiency.items()))
                         + " of peak")
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
