"""Machine model: devices, nodes and the directed links the simulator schedules transfers on.

Device k is global rank k (node-major: k = node * devices_per_node + local). A machine is
built from a compact cluster description (JSON), so users can describe their own clusters.
Figures come from /work/shared/REFERENCE.md ("REF") or vendor datasheets ("datasheet").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ['GiB', 'DeviceSpec', 'Device', 'LinkSpec', 'Link', 'GPU_SPECS', 'NVLINK_BW_BPS',  # noqa: RUF022
           'KERNEL_EFFICIENCY', 'NCCL_FIGURES', 'CLUSTER_SPECS', 'NVSWITCH_LINK', 'RAIL_LINK']


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
    # Fraction of the peak FLOP/s that an op rule's kernels reach on this device, from
    # published kernel measurements (KERNEL_EFFICIENCY); the cost model's defaults where empty
    efficiency: Mapping[str, float] = field(default_factory=dict, hash=False)
    # What a training run reaches of those rates, every op rule alike (RUN_EFFICIENCY):
    # the cost model multiplies its efficiencies by it (not ones given it explicitly)
    run_efficiency: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "peak_flops", {str(k): float(v) for k, v in dict(self.peak_flops).items()})
        object.__setattr__(self, "efficiency", {str(k): float(v) for k, v in dict(self.efficiency).items()})
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


# Fraction of peak FLOP/s by op rule, from published kernel measurements at large sizes:
# - matrix products (cuBLAS, bf16): 798 of 989 TFLOP/s on an H100 SXM at 8192^3 with
#   PyTorch 2.7 (github.com/zzc0721/torch-performance-test-data issue 79), 790 of 990 on an
#   H200 (REF, measured), 234 of 312 on an A100 at 4096^3 (same table, issue 108);
# - fused attention (F.scaled_dot_product_attention runs FlashAttention-2): about 35% of an
#   H100's peak (Shah et al. 2024, "FlashAttention-3", arXiv 2407.08608), 50-73% of an A100's
#   forward and less backward (Dao 2023, "FlashAttention-2", arXiv 2307.08691): 0.6.
# The cost model counts a causal attention's FLOPs whole but times the half its kernel runs.
KERNEL_EFFICIENCY = {
    "H100": {"linear": 0.8, "linear_t": 0.8, "matmul": 0.8, "attention": 0.35},
    "H200": {"linear": 0.8, "linear_t": 0.8, "matmul": 0.8, "attention": 0.35},
    "A100": {"linear": 0.75, "linear_t": 0.75, "matmul": 0.75, "attention": 0.6},
}


# Bus bandwidths (bytes/s) of published nccl-tests runs, for flexflow.hardware.collectives:
# - H100 / H200 nodes (NVSwitch, NVLink 4): the ring reaches 370 GB/s, the line rate less
#   NCCL's protocol overhead; all_reduce with NVLink SHARP peaks at about 480 GB/s on 8 GPUs
#   (NVIDIA/nccl-tests issues 212 and 290; 475 GB/s on 8 H200s, issue 272);
# - one ConnectX-7 NIC at NDR 400 Gb/s: 46-49 GB/s (NVIDIA/nccl-tests issues 290 and 267);
# - A100 nodes (NVLink 3): NCCL's own model caps the bus bandwidth at 235 GB/s
#   (src/graph/tuning.cc), the 230-250 GB/s measured (nccl-tests issue 100);
# - one HDR 200 Gb/s NIC: 96 GB/s peak over 4 NICs, 24 each (NVIDIA/nccl-tests issue 119).
NCCL_FIGURES = {
    "H100": {"ring_busbw_Bps": 370e9, "nic_busbw_Bps": 48e9, "nvls_busbw_Bps": 480e9},
    "H200": {"ring_busbw_Bps": 370e9, "nic_busbw_Bps": 48e9, "nvls_busbw_Bps": 475e9},
    "A100": {"ring_busbw_Bps": 235e9, "nic_busbw_Bps": 24e9, "nvls_busbw_Bps": 0.0},
}


# What a training run reaches of the kernels' rates (gaps between kernels, memory-bound ops
# the roofline prices low, clocks under sustained load): one factor per GPU kind on every op
# rule's efficiency, fitted to the rows of benchmarks/published.py marked ``fit`` (MosaicML
# MPT and torchtitan runs) and checked on the others, which no fit has seen
# (benchmarks/results/published.md).  The H200 takes the H100's: the same GH100 compute,
# and no published H200 row.
RUN_EFFICIENCY = {"H100": 0.574, "H200": 0.574, "A100": 0.841}


# The devices of today's cluster presets: the datasheet figures with the kernel efficiencies
# and the run factor (GPU_SPECS keeps the plain figures the older presets and detect() use).
CLUSTER_SPECS = {k: dataclasses.replace(GPU_SPECS[k], efficiency=KERNEL_EFFICIENCY[k],
                                        run_efficiency=RUN_EFFICIENCY[k]) for k in KERNEL_EFFICIENCY}


# Links of today's clusters: a point-to-point message over NVSwitch at NCCL's effective
# NVLink rate (above), over the network at one NIC's (one rail per GPU)
NVSWITCH_LINK = {k: LinkSpec(f["ring_busbw_Bps"], 3e-6, "nvswitch") for k, f in NCCL_FIGURES.items()}
RAIL_LINK = {k: LinkSpec(f["nic_busbw_Bps"], 5e-6, "infiniband") for k, f in NCCL_FIGURES.items()}


def _spec_dict(spec: DeviceSpec) -> dict:
    """A device spec as JSON; ``comm_on_cores``, ``sync_skew``, ``output_sync_s``, ``message_lag_s``,
    ``efficiency`` and ``run_efficiency`` only when set (descriptions without them, and their fingerprints, stay as they were)."""
    d = dataclasses.asdict(spec)
    if not d["efficiency"]:
        del d["efficiency"]
    if not d["comm_on_cores"]:
        del d["comm_on_cores"]
    if not d["sync_skew"]:
        del d["sync_skew"]
    if d["output_sync_s"] is None:
        del d["output_sync_s"]
    if d["run_efficiency"] == 1.0:
        del d["run_efficiency"]
    if not d["message_lag_s"]:
        del d["message_lag_s"]
    return d


def _bool(d: dict, key: str, where: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise ValueError(f"machine JSON: '{where}{key}' must be true or false, not {v!r}")
    return v


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


def _run_efficiency(dev: dict) -> float:
    """``device.run_efficiency`` of a machine JSON: a fraction in (0, 1], 1 when absent."""
    if dev.get("run_efficiency") is None:
        return 1.0
    v = _num(dev, "run_efficiency", "device.")
    if v > 1:
        raise ValueError(f"machine JSON: 'device.run_efficiency' must be at most 1, not {dev['run_efficiency']!r}")
    return v


def _efficiency(dev: dict) -> dict:
    """``device.efficiency`` of a machine JSON: op rule -> fraction of peak in (0, 1]."""
    eff = dev.get("efficiency", {})
    if not isinstance(eff, dict):
        raise ValueError("machine JSON: 'device.efficiency' must be an object (op rule -> fraction of peak)")
    for k in eff:
        if _num(eff, k, "device.efficiency.") > 1:
            raise ValueError(f"machine JSON: 'device.efficiency.{k}' must be at most 1, not {eff[k]!r}")
    return eff
