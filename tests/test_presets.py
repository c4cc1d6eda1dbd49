"""Today's cluster presets: H100 / H200 / A100 nodes of 8 on NVSwitch with one NIC per GPU,
any device count, collectives as NCCL runs them, kernel efficiencies; the paper's presets
as they were."""
import json

import pytest

from flexflow.cost.model import DEFAULT_EFFICIENCY, CostModel
from flexflow.hardware import collectives as nccl
from flexflow.hardware.machine import Machine
from flexflow.hardware.specs import KERNEL_EFFICIENCY, NCCL_FIGURES

TODAY = ("h100-node", "h100-cluster", "h200-cluster", "a100-cluster")
GB = 1e9


def _busbw(m, devices, nbytes):
    """nccl-tests' bus bandwidth of an all-reduce: 2(p-1)/p * bytes / time."""
    p = len(devices)
    return 2 * (p - 1) / p * nbytes / m.allreduce_time_s(devices, nbytes)


@pytest.mark.parametrize("name,kind,devices,nodes", [
    ("h100-node", "H100", 8, 1), ("h100-cluster", "H100", 64, 8),
    ("h200-cluster", "H200", 64, 8), ("a100-cluster", "A100", 64, 8)])
def test_presets_and_their_figures(name, kind, devices, nodes):
    m = Machine.preset(name)
    assert name in Machine.preset_names()
    assert (m.spec.kind, m.num_devices, m.num_nodes, m.devices_per_node) == (kind, devices, nodes, 8)
    assert m.spec.memory_bytes == (141 if kind == "H200" else 80) * 10**9
    assert m.spec.flops("bfloat16") == {"H100": 989e12, "H200": 990e12, "A100": 312e12}[kind]
    assert m.rails and m.collectives is not None and m.spec.efficiency == KERNEL_EFFICIENCY[kind]
    if nodes > 1:  # one NIC per GPU, at the measured rate of one NDR (HDR on A100) NIC
        assert m.inter_node.bandwidth_Bps == (24e9 if kind == "A100" else 48e9)
        assert sum(l.name.startswith("nic-out") for l in m.links) == devices
    back = Machine.from_json(m.to_json())
    assert back == m and back.fingerprint() == m.fingerprint() and back.links == m.links
    text = m.describe()
    assert "NCCL" in text and ("per GPU NIC" in text) == (nodes > 1) and "of peak" in text


def test_any_device_count_in_as_many_nodes_as_it_takes():
    m = Machine.preset("h100-cluster", devices=100)
    assert m.num_devices == 100 and m.num_nodes == 13 and m.devices[99].node == 12
    assert Machine.preset("h200-cluster", devices=512).num_nodes == 64
    one = Machine.preset("a100-cluster", devices=3)
    assert one.num_nodes == 1 and one.num_devices == 3 and one.route(0, 2) != ()
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ValueError, match="h100-cluster"):
            Machine.preset("h100-cluster", devices=bad)
    with pytest.raises(ValueError, match="h100-node"):
        Machine.preset("h100-node", devices=9)  # a node has 8
    with pytest.raises(ValueError, match="p100-cluster"):
        Machine.preset("p100-cluster", devices=17)  # the paper's clusters keep their sizes


def test_the_paper_presets_are_as_they_were():
    """Fingerprints and costs of the presets that tests and recorded results rely on."""
    was = {"p100-cluster": ("5d021ee09d1c5460", 0.0153, 9e-05),
           "k80-cluster": ("952c7efcdad6e8d2", 0.029385, 0.00015285714285714287),
           "h200-node": ("4f5afacf4f68240c", 0.00043088888888888886, 5.222222222222222e-06)}
    for name, (fp, ar, tr) in was.items():
        m = Machine.preset(name)
        assert m.fingerprint() == fp and not m.rails and m.collectives is None and not m.spec.efficiency
        assert m.allreduce_time_s(range(m.num_devices), 1e8) == pytest.approx(ar, rel=1e-12)
        assert m.transfer_time_s(0, m.num_devices - 1, 1e6) == pytest.approx(tr, rel=1e-12)
        assert "rails" not in json.loads(m.to_json()) and "efficiency" not in json.loads(m.to_json())["device"]


def test_rails_give_each_gpu_its_own_nic():
    m = Machine.preset("h100-cluster", devices=16)
    out, inn = m.route(3, 12)
    assert m.links[out].name == "nic-out gpu3" and m.links[inn].name == "nic-in gpu12"
    assert m.route(4, 12)[0] != out  # another GPU of the node: another NIC
    assert m.transfer_time_s(0, 8, 48e9) == pytest.approx(1 + 10e-6)
    # data parallelism across nodes inside tensor parallelism: each rail is its own ring
    rail0, rail1 = set(m.allreduce_links([0, 8])), set(m.allreduce_links([1, 9]))
    assert rail0 and rail1 and not rail0 & rail1
    # a group spanning nodes holds the NICs of all its members (NCCL spreads channels over them)
    names = {m.links[i].name for i in m.allreduce_links(range(16))}
    assert {f"nic-out gpu{d}" for d in range(16)} <= names


def test_allreduce_bus_bandwidths_are_the_published_ones():
    h100 = Machine.preset("h100-cluster")
    big = 8 * 2**30  # nccl-tests' largest sizes, where the bandwidth term dominates
    # one node: NVLink SHARP, about 480 GB/s bus bandwidth on 8 GPUs (nccl-tests issues 212, 290)
    assert 460 * GB < _busbw(h100, range(8), big) <= 480 * GB
    # two GPUs: the ring at NVLink's effective 370 GB/s
    assert 360 * GB < _busbw(h100, range(2), big) <= 370 * GB
    # across nodes: NIC-bound, 8 NICs a node (rails) or one per node in a data-parallel rail
    assert 340 * GB < _busbw(h100, range(64), big) <= 370 * GB
    assert 45 * GB < _busbw(h100, range(0, 64, 8), big) <= 48 * GB
    a100 = Machine.preset("a100-cluster")
    assert 225 * GB < _busbw(a100, range(8), big) <= 235 * GB  # no NVLink SHARP on A100
    assert 22 * GB < _busbw(a100, range(0, 64, 8), big) <= 24 * GB


def test_nccl_picks_the_faster_algorithm():
    spec = nccl.CollectiveSpec(**NCCL_FIGURES["H100"])
    many = nccl.GroupShape(p=1024, nodes=128, per_node=8, node_size=8, rails=True)
    opts = nccl._allreduce_options(spec, many)
    ring = nccl._latency("ring", "ll", many, 2)
    tree = nccl._latency("tree", "ll", many, 2)
    assert tree < ring / 4  # a tree's latency grows with log2(nodes), a ring's with the ranks
    lat, total = nccl.allreduce_s(spec, many, 1024)
    assert lat == min(o[0] for o in opts) and total == pytest.approx(min(a + b * 1024 for a, b in opts))
    # large messages: the ring (the tree reaches 0.9 of its bandwidth)
    lat_big, total_big = nccl.allreduce_s(spec, many, 2**33)
    assert total_big == pytest.approx(min(a + b * 2**33 for a, b in opts))
    assert lat_big > lat
    m = Machine.preset("h100-cluster", devices=1024)
    assert m.allreduce_latency_s(range(1024)) == pytest.approx(lat)
    assert m.allreduce_latency_s(range(8)) < m.allreduce_latency_s(range(16)) < m.allreduce_latency_s(range(64))
    assert m.allreduce_time_s([5], 1e9) == 0 and m.allreduce_time_s(range(8), 0) == 0


def test_reduce_scatter_and_bucketed_allreduce():
    m = Machine.preset("h100-cluster", devices=16)
    big = 2**32
    rs = m.reduce_scatter_time_s(range(16), big)
    ring_busbw = 15 / 16 * big / rs
    assert 350 * GB < ring_busbw <= 370 * GB and m.allgather_time_s(range(16), big) == rs
    # a gradient in 25 MiB buckets: the whole bandwidth term, the latency in proportion
    bucket = 25 * 2**20
    t_small = m.bucketed_allreduce_time_s(range(16), bucket // 4, bucket)
    t_bucket = m.bucketed_allreduce_time_s(range(16), bucket, bucket)
    assert t_bucket == pytest.approx(m.allreduce_time_s(range(16), bucket))
    assert 0 < t_small < t_bucket / 3
    # the paper's clusters: half a ring all-reduce
    p100 = Machine.preset("p100-cluster")
    assert p100.reduce_scatter_time_s(range(16), 1e8) == p100.allreduce_time_s(range(16), 1e8) / 2


def test_kernel_efficiency_reaches_the_cost_model():
    from flexflow.hardware.specs import RUN_EFFICIENCY
    run = RUN_EFFICIENCY["H100"]
    h100 = CostModel(Machine.preset("h100-node"))
    assert h100.efficiency["linear"] == pytest.approx(0.8 * run)
    assert h100.efficiency["attention"] == pytest.approx(0.35 * run)
    assert h100.efficiency["default"] == pytest.approx(DEFAULT_EFFICIENCY["default"] * run)  # every rule
    a100 = CostModel(Machine.preset("a100-cluster"))
    assert a100.efficiency["attention"] == pytest.approx(0.6 * RUN_EFFICIENCY["A100"])
    p100 = CostModel(Machine.preset("p100-cluster"))
    assert p100.efficiency == DEFAULT_EFFICIENCY  # the paper's presets: the defaults as before
    mine = CostModel(Machine.preset("h100-node"), efficiency={"linear": 0.5})
    assert mine.efficiency["linear"] == 0.5  # a caller's figures win, as given


def test_machine_json_with_rails_and_collectives(tmp_path):
    d = json.loads(Machine.preset("h100-cluster", devices=16).to_json())
    assert d["rails"] is True and d["collectives"]["nvls_busbw_Bps"] == 480e9
    assert d["device"]["efficiency"]["matmul"] == 0.8
    for path, value, key in [(("rails",), "yes", "rails"),
                             (("collectives", "ring_busbw_Bps"), -1, "collectives.ring_busbw_Bps"),
                             (("collectives", "fast"), 1, "collectives.fast"),
                             (("device", "efficiency", "linear"), 1.5, "device.efficiency.linear"),
                             (("device", "efficiency"), [0.5], "device.efficiency"),
                             (("device", "run_efficiency"), 1.5, "device.run_efficiency"),
                             (("device", "run_efficiency"), 0, "device.run_efficiency")]:
        bad = json.loads(json.dumps(d))
        target = bad
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = value
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            Machine.from_json(json.dumps(bad))
    m = Machine.from_json(json.dumps(d))
    m.save(tmp_path / "m.json")
    assert Machine.load(tmp_path / "m.json") == m
