"""Machine model: presets, routes, transfer and all-reduce costs, JSON, detection, calibration."""
import json
import sys
import types

import pytest

from flexflow.calibrate.comm import cache_dir, calibrate_gloo, cpu_machine_file, write_cpu_machine_file
from flexflow.hardware.machine import CALIBRATION_VERSION, Machine
from flexflow.hardware.specs import GPU_SPECS, DeviceSpec, Link, LinkSpec


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    """No calibrated file from the user's cache leaks into these tests."""
    monkeypatch.setenv("FLEXFLOW_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("name,count,nodes", [("p100-cluster", 16, 4), ("k80-cluster", 64, 16), ("h200-node", 8, 1)])
def test_preset_counts_and_node_major_ids(name, count, nodes):
    m = Machine.preset(name)
    assert m.num_devices == count == len(m.devices) and m.num_nodes == nodes
    for d in m.devices:
        assert d.id == d.node * m.devices_per_node + d.local
    assert [d.id for d in m.devices] == list(range(count))
    assert name in Machine.preset_names() and "cpu" in Machine.preset_names()
    assert all(isinstance(l, Link) and l.id == i for i, l in enumerate(m.links))


def test_preset_figures():
    p100 = Machine.preset("p100-cluster")
    assert p100.spec.kind == "P100" and p100.spec.flops("float32") == 10.6e12
    assert p100.spec.flops("bfloat16") == 10.6e12  # missing dtype falls back to float32
    assert p100.intra_node.bandwidth_Bps == 20e9 and p100.inter_node.bandwidth_Bps == 12.5e9
    k80 = Machine.preset("k80-cluster")
    assert k80.intra_node.kind == "pcie" and k80.inter_node.bandwidth_Bps == 7e9
    h200 = Machine.preset("h200-node")
    assert h200.spec.flops("torch.bfloat16") == 990e12 and h200.intra_node.bandwidth_Bps == 450e9
    assert h200.spec.backend == "nccl" and Machine.preset("cpu").spec.backend == "gloo"


def test_truncation_and_errors():
    m = Machine.preset("p100-cluster", devices=6)
    assert m.num_devices == 6 and m.num_nodes == 2 and m.devices[5].node == 1
    assert len(Machine.preset("k80-cluster", devices=1).devices) == 1
    for bad in (0, 17, -1):
        with pytest.raises(ValueError, match="p100-cluster"):
            Machine.preset("p100-cluster", devices=bad)
    with pytest.raises(ValueError, match="h200-node"):
        Machine.preset("nope")
    assert Machine.preset("cpu", devices=2).num_devices == 2


def test_routes():
    m = Machine.preset("p100-cluster")
    assert m.route(3, 3) == ()
    (intra,) = m.route(0, 1)
    assert m.links[intra].kind == "nvlink" and m.route(1, 0) != (intra,)
    out, inn = m.route(1, 6)
    assert m.links[out].name == "nic-out node0" and m.links[inn].name == "nic-in node1"
    assert m.route(2, 7) == (out, inn)  # the NIC is shared by the node's devices
    assert m.route(5, 14) == (m.route(4, 12)[0], m.route(0, 13)[1])
    with pytest.raises(ValueError):
        m.route(0, 16)


def test_transfer_time():
    m = Machine.preset("p100-cluster")
    assert m.transfer_time_s(2, 2, 1e9) == 0 and m.transfer_time_s(0, 1, 0) == 0
    assert m.transfer_time_s(0, 1, 1e6) == pytest.approx(5e-6 + 1e6 / 20e9)
    assert m.transfer_time_s(0, 4, 1e6) == pytest.approx(2 * 5e-6 + 1e6 / 12.5e9)
    assert m.transfer_time_s(m.devices[0], m.devices[4], 1e6) == m.transfer_time_s(0, 4, 1e6)


def test_allreduce():
    m = Machine.preset("p100-cluster")
    nbytes = 4e8
    assert m.allreduce_time_s([3], nbytes) == 0 and m.allreduce_time_s([], nbytes) == 0
    intra = m.allreduce_time_s(range(4), nbytes)
    assert intra == pytest.approx(2 * 3 * (5e-6 + nbytes / 4 / 20e9))
    cross = m.allreduce_time_s([0, 1, 4, 5], nbytes)
    assert cross == pytest.approx(2 * 3 * (10e-6 + nbytes / 4 / 12.5e9)) and cross > intra
    for n in (1, 2, 4, 16):
        assert m.allreduce_bytes_sent(range(n), 1000) == 2 * (n - 1) * 1000
    assert m.allreduce_time_s([1, 0, 3, 2], nbytes) == intra  # order-free
    links = m.allreduce_links([0, 1, 4, 5])
    names = {m.links[i].name for i in links}
    assert {"nic-out node0", "nic-in node1", "nic-out node1", "nic-in node0"} <= names
    assert set(m.allreduce_links(range(4))) == {m.route(i, (i + 1) % 4)[0] for i in range(4)}


def test_json_round_trip_and_fingerprint(tmp_path):
    for name in ("p100-cluster", "k80-cluster", "h200-node", "cpu"):
        m = Machine.preset(name)
        back = Machine.from_json(m.to_json())
        assert back == m and back.fingerprint() == m.fingerprint()
        assert back.links == m.links and back.devices == m.devices
    m = Machine.preset("p100-cluster", devices=6)
    m.save(tmp_path / "m.json")
    assert Machine.load(tmp_path / "m.json") == m
    fps = {Machine.preset("p100-cluster").fingerprint(), m.fingerprint(),
           Machine.preset("k80-cluster").fingerprint(), Machine.preset("h200-node").fingerprint()}
    assert len(fps) == 4 and Machine.preset("h200-node").fingerprint() == Machine.preset("h200-node").fingerprint()
    assert "p100-cluster" in repr(m) and "P100" in m.describe() and m.fingerprint() in m.describe()


def test_user_cluster_json():
    text = json.dumps({"name": "mine", "nodes": 2, "devices_per_node": 2,
                       "device": {"kind": "A100", "peak_flops": 19.5e12, "mem_bw_Bps": 2e12, "memory_bytes": 8e10},
                       "intra_node": {"bandwidth_Bps": 300e9, "latency_s": 3e-6, "kind": "nvlink"},
                       "inter_node": {"bandwidth_Bps": 25e9, "latency_s": 4e-6}})
    m = Machine.from_json(text)
    assert m.num_devices == 4 and m.spec.flops("float16") == 19.5e12 and m.spec.backend == "nccl"
    assert m.transfer_time_s(0, 2, 25e9) == pytest.approx(1 + 8e-6)


@pytest.mark.parametrize("path,value,key", [
    (("nodes",), 0, "nodes"),
    (("device", "mem_bw_Bps"), -1, "device.mem_bw_Bps"),
    (("intra_node", "bandwidth_Bps"), "fast", "intra_node.bandwidth_Bps"),
    (("inter_node",), None, "inter_node"),
    (("device", "backend"), "mpi", "device.backend"),
    (("bogus",), 1, "bogus"),
    (("device", "peak_flops"), {"bfloat16": 1e12}, "device.peak_flops"),
    (("num_devices",), 17, "num_devices"),
])
def test_bad_json_names_the_key(path, value, key):
    d = json.loads(Machine.preset("p100-cluster").to_json())
    target = d
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Machine.from_json(json.dumps(d))
    del target[path[-1]]
    if path != ("bogus",) and path[-1] not in ("backend", "inter_node", "num_devices"):
        with pytest.raises(ValueError, match="missing key '" + key):
            Machine.from_json(json.dumps(d))
    with pytest.raises(ValueError, match="not valid JSON"):
        Machine.from_json("{")


def test_detect_without_driver():
    m = Machine.detect()
    assert isinstance(m, Machine) and m.num_devices >= 1
    assert m.spec.kind == "cpu" or m.spec.backend == "nccl"


def test_detect_with_fake_nvml(monkeypatch):
    class NVMLError(Exception):
        pass
    fake = types.SimpleNamespace(
        NVMLError=NVMLError, NVML_NVLINK_MAX_LINKS=4, NVML_FEATURE_ENABLED=1,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 8,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=150 * 2**30),
        nvmlDeviceGetNvLinkState=lambda h, link: 1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    m = Machine.detect()
    assert m.num_devices == 8 and m.spec.kind == "H200" and m.intra_node.kind == "nvlink"
    assert m.spec.memory_bytes == 150 * 2**30 and m.intra_node.bandwidth_Bps == 450e9

    def no_link(h, link):
        raise NVMLError("not supported")
    monkeypatch.setattr(fake, "nvmlDeviceGetName", lambda h: "Mystery GPU 9000")
    monkeypatch.setattr(fake, "nvmlDeviceGetNvLinkState", no_link)
    m = Machine.detect()
    assert m.intra_node.kind == "pcie" and m.spec.flops("float32") > 0 and m.spec.kind == "Mystery GPU 9000"

    def broken():
        raise NVMLError("Driver Not Loaded")
    monkeypatch.setattr(fake, "nvmlInit", broken)
    assert Machine.detect().spec.kind == "cpu"


def test_cache_dir(monkeypatch, tmp_path):
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("FLEXFLOW_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "flexflow"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir().parts[-2:] == (".cache", "flexflow")


@pytest.mark.slow
def test_calibration_feeds_cpu_preset():
    assert not cpu_machine_file().exists()
    before = Machine.preset("cpu")
    fig = calibrate_gloo(nprocs=2, sizes_bytes=(4096, 65536, 1 << 20), repeats=3, warmup=1)
    assert fig["bandwidth_Bps"] > 0 and fig["latency_s"] > 0
    assert fig["allreduce_bandwidth_Bps"] > 0 and fig["allreduce_latency_s"] > 0
    assert fig["peak_flops"]["float32"] > 0 and fig["mem_bw_Bps"] > 0
    path = write_cpu_machine_file(fig)
    assert path == cpu_machine_file() and path.exists()
    m = Machine.preset("cpu")
    # a host with fewer than 2 cores per process runs gloo's threads on the computing cores:
    # a message then costs what it costs between compute, and holds both ends
    on_cores = fig["cores"] < 2 * fig["nprocs"]
    assert m.spec.comm_on_cores == on_cores and fig["exchange_s"] > 0
    latency = fig["exchange_s"] if on_cores else fig["latency_s"]
    assert m.intra_node.bandwidth_Bps == fig["bandwidth_Bps"] and m.intra_node.latency_s == latency
    assert m.intra_node.allreduce_bandwidth_Bps == fig["allreduce_bandwidth_Bps"]
    assert m.intra_node.allreduce_latency_s == fig["allreduce_latency_s"]
    # the sync skew: the slope of an all-reduce's cost against the compute before it
    assert 0.0 <= fig["sync_skew"] <= 0.5
    assert m.spec.sync_skew == (fig["sync_skew"] if on_cores else 0.0)
    assert m.spec.flops("float32") == fig["peak_flops"]["float32"] and m.spec.mem_bw_Bps == fig["mem_bw_Bps"]
    assert m.num_devices == before.num_devices and m.fingerprint() != before.fingerprint()
    two = Machine.preset("cpu", devices=2)
    assert two.transfer_time_s(0, 1, 1e6) == pytest.approx(latency + 1e6 / fig["bandwidth_Bps"])
    assert two.allreduce_time_s([0, 1], 1e6) == pytest.approx(
        2 * (fig["allreduce_latency_s"] + 1e6 / 2 / fig["allreduce_bandwidth_Bps"]))
    assert Machine.from_json(m.to_json()) == m  # the new keys round-trip
    if on_cores:  # fitted to the executor's steps on the calibration chains; the micro figures kept
        assert set(fig["micro"]) == {"exchange_s", "bandwidth_Bps", "allreduce_latency_s", "sync_skew"}
        assert m.spec.output_sync_s == fig["output_sync_s"] >= 0
        assert set(fig["fit"]["measured_ms"]) == set(fig["fit"]["predicted_ms"]) and fig["fit"]["error"]
        saved = json.loads(path.read_text())["measured"]
        assert saved["fit"] == fig["fit"] and saved["version"] == CALIBRATION_VERSION and "samples" not in saved



def test_corrupt_machine_file_is_ignored(tmp_path):
    path = cpu_machine_file()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="machine-cpu.json"):
        m = Machine.preset("cpu")
    assert m.spec.kind == "cpu"


def test_device_spec_validation():
    with pytest.raises(ValueError, match="float32"):
        DeviceSpec("x", {"bfloat16": 1.0}, 1.0, 1, 0.0)
    assert LinkSpec(1.0, 0.0, "k") == LinkSpec(1.0, 0.0, "k")
    assert hash(Machine.preset("h200-node")) == hash(Machine.preset("h200-node"))
    assert GPU_SPECS["K80"].flops("float16") == 4.4e12


@pytest.mark.slow
def test_detect_only_reads_and_calibrating_is_its_own_step(monkeypatch):
    """detect() never measures; ensure_calibrated() measures a host without a current
    file once, and detect() and the cpu preset then read that file.  (One real
    calibration; measuring again, for a stale file, rewrites the figures it measured.)"""
    from flexflow.calibrate import host
    from flexflow.calibrate.host import ensure_calibrated
    monkeypatch.setattr("flexflow.hardware.machine._detect_gpus", lambda: None)
    monkeypatch.setenv("FLEXFLOW_NO_CALIBRATE", "1")
    path = cpu_machine_file()
    assert not path.exists()
    before = Machine.detect()
    assert before.spec.kind == "cpu" and not path.exists()  # detecting wrote nothing
    assert ensure_calibrated() is False and not path.exists()  # the setting says not to
    monkeypatch.delenv("FLEXFLOW_NO_CALIBRATE")
    assert ensure_calibrated() is True and path.exists()
    m = Machine.detect()
    assert m.spec.kind == "cpu" and Machine.preset("cpu").intra_node == Machine.load(path).intra_node
    figures = json.loads(path.read_text())["measured"]
    measured = []

    def measure_again(nprocs=2, path=None, **kwargs):
        measured.append(path)
        return {**figures, "path": str(write_cpu_machine_file(figures, path))}
    monkeypatch.setattr(host, "calibrate", measure_again)
    stamp = path.stat().st_mtime_ns
    assert ensure_calibrated() is True and path.stat().st_mtime_ns == stamp and not measured  # not twice
    assert Machine.detect().fingerprint() == m.fingerprint()
    # a file from an older calibration (no cost of a message between compute) is measured again
    d = json.loads(path.read_text())
    del d["measured"]["exchange_s"]
    path.write_text(json.dumps(d))
    ensure_calibrated()
    assert measured == [path] and "exchange_s" in json.loads(path.read_text())["measured"]
    # and so is one of an older calibration format
    d = json.loads(path.read_text())
    d["measured"]["version"] = 1
    path.write_text(json.dumps(d))
    ensure_calibrated()
    assert measured == [path, path] and json.loads(path.read_text())["measured"]["version"] == CALIBRATION_VERSION
