"""Eager-op counts and the analytic CPU cost model that charges per eager op."""
import dataclasses

import torch

import flexflow as ff
from flexflow.calibrate.comm import write_cpu_machine_file
from flexflow.cost.model import CostModel
from flexflow.graph.ir import Op
from flexflow.hardware.machine import Machine
from flexflow.graph.opcount import eager_op_counts
from flexflow.strategy.regions import partitions


def _graph(name="rnnlm"):
    module, inputs = ff.models.get(name, batch_size=4, size="small")
    return ff.trace(module, inputs)


def _first(graph, rule):
    return next(op for op in graph.compute_ops if op.rule == rule)


def test_counts_follow_what_the_rule_issues():
    g = _graph()
    m = Machine.preset("cpu", devices=2)
    s = ff.Strategy.data_parallel(g, m)
    cell = _first(g, "lstm_cell")
    f, b = eager_op_counts(cell, partitions(cell, s[cell.name])[0])
    assert f >= 10 and b >= 10, (f, b)  # the gates: matmuls, adds, sigmoids, tanhs, products
    tr = _first(g, "transpose")
    f2, b2 = eager_op_counts(tr, partitions(tr, s[tr.name])[0])
    assert f2 <= 2 and b2 <= 4 and f2 < f


def test_an_op_that_needs_values_counts_one():
    g = _graph()
    cell = _first(g, "lstm_cell")
    part = partitions(cell, ff.Strategy.data_parallel(g, Machine.preset("cpu", devices=1))[cell.name])[0]
    broken = dataclasses.replace(cell, rule="opaque", target=lambda *a, **k: torch.ones(1).item())
    assert eager_op_counts(broken, part) == (1, 1)


def test_cpu_analytic_time_charges_the_launch_overhead_per_eager_op():
    g = _graph()
    m = Machine.preset("cpu", devices=2)
    spec = dataclasses.replace(m.spec, launch_overhead_s=1e-3)  # 1 ms per eager op: overhead dominates
    m = dataclasses.replace(m, spec=spec)
    cm = CostModel(m)
    s = ff.Strategy.data_parallel(g, m)
    cell = _first(g, "lstm_cell")
    part = partitions(cell, s[cell.name])[0]
    nf, nb = eager_op_counts(cell, part)
    f, b = cm.op_time(cell, part, 0)
    assert abs(f - (nf + 1) * 1e-3) < 2e-4 and abs(b - nb * 1e-3) < 2e-4, (f, b, nf, nb)
    # other device kinds keep one launch overhead per op
    gpu = Machine.preset("p100-cluster", devices=2)
    fg, _ = CostModel(gpu).op_time(cell, part, 0)
    assert fg < 5 * gpu.spec.launch_overhead_s + 1e-3


def test_calibrated_file_carries_the_eager_op_time(tmp_path):
    figures = {"latency_s": 1e-4, "bandwidth_Bps": 1e9, "peak_flops": {"float32": 1e10},
               "mem_bw_Bps": 5e9, "launch_overhead_s": 7e-6}
    path = write_cpu_machine_file(figures, tmp_path / "m.json")
    assert Machine.load(path).spec.launch_overhead_s == 7e-6
