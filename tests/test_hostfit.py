"""The cpu calibration's fit to the executor's steps (flexflow.calibrate.hostfit), without processes:
figures the simulator itself produced are recovered."""
import dataclasses

import pytest

from flexflow.calibrate import hostfit
from flexflow.calibrate.comm import cpu_machine_from_figures
from flexflow.cost.model import CostModel
from flexflow.sim.simulate import Simulator
from flexflow.graph.trace import trace

FIGURES = {"nprocs": 2, "cores": 2, "exchange_s": 80e-6, "latency_s": 40e-6, "bandwidth_Bps": 3e9,
           "allreduce_latency_s": 300e-6, "allreduce_bandwidth_Bps": 1e9, "sync_skew": 0.2,
           "peak_flops": {"float32": 1e11}, "mem_bw_Bps": 1e10, "launch_overhead_s": 4e-6}


@pytest.fixture(autouse=True)
def analytic_op_times(monkeypatch):
    """The steps the fit is given and the fit itself price ops with the analytic cost model.
    ``CostModel.for_machine`` would use any cpu profile in the cache (ops an earlier
    ``parallelize`` measured): with measured op times the fit of the capped skew missed the
    alternating chain by 3-8% (exchange_s at its floor), so the result hung on test order."""
    monkeypatch.setattr(CostModel, "for_machine", classmethod(lambda cls, machine, profile_dir=None: cls(machine)))


def _steps(machine) -> dict:
    """What measure_steps would report if the host behaved as ``machine`` says."""
    cost = CostModel.for_machine(machine)
    out = {}
    for width, batch in hostfit.CASES:
        module, inputs = hostfit.build(width, batch)
        graph = trace(module, inputs)
        sim = Simulator(graph, machine, cost)
        out[f"{width}x{batch}"] = {k: [sim.simulate(s, incremental=False).iteration_time] * 3
                                   for k, s in hostfit.strategies(graph, machine).items()}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("truth", [(250e-6, 700e-6, 0.05, 1.2e9, 100e-6, 150e-6),
                                   (120e-6, 200e-6, 0.12, 5e9, 900e-6, 0.0),
                                   (200e-6, 400e-6, 0.08, 2e9, 300e-6, 200e-6)])
def test_fit_recovers_the_figures_that_made_the_steps(truth):
    base = cpu_machine_from_figures(FIGURES, devices=2)
    assert base.spec.comm_on_cores
    lat, ar, skew, bw, out, lag = truth
    host = hostfit._machine(base, lat, ar, skew, bw, out, lag)
    got = hostfit.fit_figures(base, _steps(host), 2, profile=False)
    assert got["exchange_s"] == pytest.approx(lat, rel=0.02)
    assert got["message_lag_s"] == pytest.approx(lag, rel=0.05, abs=0.05 * lat)
    assert got["bandwidth_Bps"] == pytest.approx(bw, rel=0.05)
    assert got["output_sync_s"] == pytest.approx(out, rel=0.02)
    assert got["allreduce_latency_s"] == pytest.approx(ar, rel=0.02)
    assert got["sync_skew"] == pytest.approx(skew, rel=0.02, abs=1e-3)
    assert max(abs(e) for e in got["fit"]["error"].values()) < 0.02
    assert set(got["fit"]["measured_ms"]) == set(got["fit"]["predicted_ms"])


def test_fit_clamps_figures_the_steps_cannot_support():
    """Steps faster than the simulator can make them (no message costs anything): every
    figure stays at its lower bound, none goes negative."""
    base = cpu_machine_from_figures(FIGURES, devices=2)
    floor = hostfit._machine(base, 0.0, 0.0, 0.0)
    steps = {case: {k: [v[0] * 0.5] for k, v in per.items()} for case, per in _steps(floor).items()}
    got = hostfit.fit_figures(base, steps, 2, profile=False)
    assert got["exchange_s"] == hostfit._LAT_RANGE[0] and got["bandwidth_Bps"] == hostfit._BW_RANGE[1]
    assert got["allreduce_latency_s"] == 0.0 and got["sync_skew"] == 0.0 and got["output_sync_s"] == 0.0


def test_machine_from_figures_uses_the_fitted_figures_on_shared_cores():
    m = cpu_machine_from_figures({**FIGURES, "exchange_s": 222e-6, "output_sync_s": 55e-6,
                                  "message_lag_s": 111e-6}, devices=2)
    assert m.num_devices == 2 and m.intra_node.latency_s == 222e-6 and m.spec.output_sync_s == 55e-6
    assert m.spec.message_lag_s == 111e-6
    assert cpu_machine_from_figures(FIGURES).spec.output_sync_s is None  # not calibrated: one all-reduce
    assert m.intra_node.allreduce_latency_s == 300e-6 and m.spec.sync_skew == 0.2
    roomy = cpu_machine_from_figures({**FIGURES, "cores": 8}, devices=2)  # a spare core per process
    assert not roomy.spec.comm_on_cores and roomy.intra_node.latency_s == 40e-6
    assert roomy.spec.output_sync_s is None
    assert dataclasses.replace(m, name="x").intra_node == m.intra_node


def test_output_sync_replaces_the_loss_all_reduce_latency():
    """A calibrated ``output_sync_s`` is what returning the loss adds to a step, in place of
    one all-reduce latency among all devices; it round-trips through the machine JSON and
    changes the fingerprint."""
    from flexflow.hardware.machine import Machine
    base = cpu_machine_from_figures(FIGURES, devices=2)
    module, inputs = hostfit.build(64, 32)
    graph = trace(module, inputs)
    cost = CostModel(base)
    times = {}
    for out in (None, 0.0, 50e-6):
        m = hostfit._machine(base, 80e-6, 300e-6, 0.0, None, out)
        single = hostfit.strategies(graph, m)["single"]
        times[out] = Simulator(graph, m, cost).simulate(single, incremental=False).iteration_time
        assert Machine.from_json(m.to_json()) == m
    assert times[None] - times[0.0] == pytest.approx(base.allreduce_latency_s(range(2)), abs=1e-9)
    assert times[50e-6] - times[0.0] == pytest.approx(50e-6, abs=1e-9)
    assert hostfit._machine(base, 80e-6, 300e-6, 0.0, None, 0.0).fingerprint() != \
        hostfit._machine(base, 80e-6, 300e-6, 0.0, None, None).fingerprint()
    assert "output_sync_s" not in base.to_dict()["device"]  # uncalibrated descriptions unchanged


def test_the_loss_rides_on_data_parallel_gradients_only():
    """Under the executor's default (``reduce_outputs="with_gradients"``) a strategy
    with a gradient bucket over every device and no activation exchange pays nothing
    for returning the loss; under "eager" it pays ``output_sync_s``.  Strategies that
    exchange activations, or hold everything on one device, pay it either way."""
    import flexflow as ff
    from flexflow.strategy.strategy import Strategy
    base = cpu_machine_from_figures(FIGURES, devices=2)
    m = hostfit._machine(base, 80e-6, 300e-6, 0.0, None, 70e-6)
    module, inputs = ff.models.get("lenet", batch_size=8, size="small", device="meta")
    graph = trace(module, inputs)
    cost = CostModel(m)
    strategies = {"dp": Strategy.data_parallel(graph, m), "mp": Strategy.model_parallel(graph, m),
                  "one": Strategy.single_device(graph, m)}

    def t(name, mode):
        return Simulator(graph, m, cost, reduce_outputs=mode).simulate(strategies[name], incremental=False) \
            .iteration_time
    assert t("dp", "eager") - t("dp", "with_gradients") == pytest.approx(70e-6, abs=1e-9)
    assert t("mp", "eager") == t("mp", "with_gradients")
    assert t("one", "eager") == t("one", "with_gradients")
    with pytest.raises(ValueError, match="reduce_outputs"):
        Simulator(graph, m, cost, reduce_outputs="later")


def test_a_failed_fit_keeps_the_micro_figures(monkeypatch):
    """When the calibration chains did not run on some rank, or the fit fails, the
    calibration warns and keeps the micro-benchmark figures (nothing is lost)."""
    from flexflow.calibrate import comm
    figs = dict(FIGURES, samples={})
    with pytest.warns(UserWarning, match="keeping the micro-benchmark figures"):
        comm._fit_or_keep(figs, [{"steps": {}}, {"steps": None, "steps_error": "OSError: boom"}], 2)
    assert figs["exchange_s"] == FIGURES["exchange_s"] and "boom" in figs["fit_error"]
    assert figs["micro"]["exchange_s"] == FIGURES["exchange_s"]

    def broken(*a, **k):
        raise ValueError("no profile")
    monkeypatch.setattr(hostfit, "fit_figures", broken)
    figs = dict(FIGURES, samples={})
    with pytest.warns(UserWarning, match="no profile"):
        comm._fit_or_keep(figs, [{"steps": {"64x32": {}}}] * 2, 2)
    assert figs["allreduce_latency_s"] == FIGURES["allreduce_latency_s"] and "output_sync_s" not in figs


@pytest.mark.slow
def test_fit_caps_the_skew():
    """A skew above the cap (noise in the data-parallel chains, in practice) is held at the
    cap, and the all-reduce latency refitted with it; every other figure still fits."""
    base = cpu_machine_from_figures(FIGURES, devices=2)
    host = hostfit._machine(base, 150e-6, 300e-6, 0.4, 2e9, 500e-6)
    got = hostfit.fit_figures(base, _steps(host), 2, profile=False)
    assert got["sync_skew"] == hostfit._SKEW_RANGE[1]
    assert got["allreduce_latency_s"] > 300e-6  # it takes up what the skew cannot
    err = got["fit"]["error"]
    assert abs(err["alternate@64x32"]) < 0.01 and abs(err["alternate@256x512"]) < 0.01  # still fitted
