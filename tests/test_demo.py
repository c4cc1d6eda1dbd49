"""The demo's plan report: changed layers and the strategy picture (no processes)."""
import os
import sys

import flexflow as ff
from flexflow.strategy.regions import partitions

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import demo  # noqa: E402
import alexnet_plan  # noqa: E402,F401
from strategy_picture import block_label, draw_strategy  # noqa: E402


def _lenet():
    module, inputs = ff.models.get("lenet", size="small", batch_size=8)
    machine = ff.Machine.preset("p100-cluster", devices=8)
    return ff.trace(module, inputs), machine


def test_changed_layers_lists_exactly_the_ops_that_differ():
    graph, machine = _lenet()
    dp = ff.Strategy.data_parallel(graph, machine)
    assert demo.changed_layers(graph, dp, dp) == []
    strategy = ff.Strategy.random(graph, machine, seed=1)
    rows = demo.changed_layers(graph, strategy, dp)
    listed = [name for _, names, _, _ in rows for name in names]
    assert listed == [op.name for op in graph.compute_ops if strategy[op.name] != dp[op.name]]
    for _, names, new, old in rows:
        assert all(str(strategy[n]) == new and str(dp[n]) == old for n in names)


def test_block_label_follows_the_partition_numbering():
    graph, machine = _lenet()
    op = next(o for o in graph.compute_ops if o.kind == "linear")
    cfg = ff.ParallelConfig({"n": 2, "c": 2}, (0, 1, 2, 3))
    labels = [block_label(op, cfg, p.index) for p in partitions(op, cfg)]
    assert labels == ["S0C0", "S0C1", "S1C0", "S1C1"]
    starts = [(p.block["n"][0], p.block["c"][0]) for p in partitions(op, cfg)]
    assert starts == sorted(starts) and len(set(starts)) == 4
    assert block_label(op, ff.ParallelConfig({}, (5,)), 0) == "all"


def test_draw_strategy_writes_a_png(tmp_path):
    graph, machine = _lenet()
    dp = ff.Strategy.data_parallel(graph, machine)
    path = tmp_path / "s.png"
    draw_strategy(graph, machine, ff.Strategy.random(graph, machine, seed=2), path, baseline=dp, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layer_rows_and_pictures_of_a_language_model(tmp_path):
    from plan_pictures import draw_layers, draw_timeline, layer_rows
    module, inputs = ff.models.get("llama", size="small", batch_size=8)
    graph = ff.trace(module, inputs)
    machine = ff.Machine.preset("h100-cluster", devices=16)
    fsdp = ff.Strategy.fsdp(graph, machine)
    rows = layer_rows(graph, fsdp)
    names = [r[0] for r in rows]
    blocks = sorted({op.module_path.split(".")[1] for op in graph.compute_ops
                     if op.module_path.startswith("layers.")}, key=int)
    assert [n for n in names if n.startswith("layers.")] == [f"layers.{b}" for b in blocks]
    assert all(split.startswith("S") and len(devices) == 8 for _, split, devices in rows if _ != "loss")
    draw_layers(graph, machine, fsdp, tmp_path / "plan.png", title="t")
    result = ff.Simulator(graph, machine).simulate(fsdp, incremental=False)
    draw_timeline(result, tmp_path / "timeline.png", title="t")
    for name in ("plan.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
