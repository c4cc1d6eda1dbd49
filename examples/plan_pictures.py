"""Pictures of a plan for a model of repeated blocks, where one row per op would be a
thousand rows: the plan as devices x layers, and the simulated step as a timeline.

    from plan_pictures import draw_layers, draw_timeline
    draw_layers(graph, machine, strategy, "plan.png", title="...")
    draw_timeline(result, "timeline.png", title="...")
"""
from __future__ import annotations

from collections import Counter

from flexflow.graph.ir import repeated_block

__all__ = ["layer_rows", "draw_layers", "draw_timeline"]


def layer_rows(graph, strategy) -> list[tuple[str, str, tuple]]:
    """One row per layer in graph order: ``(layer, split, devices)``, the layer's most
    common config (the split without devices, and the devices it runs on).  A layer is a
    repeated block (``layers.3``), else the op's module (``tok_embeddings``, ``output``)."""
    rows: dict[str, Counter] = {}
    for op in graph.compute_ops:
        layer = repeated_block(op.module_path) or (op.module_path.split(".")[0] if op.module_path else "loss")
        cfg = strategy[op.name]
        rows.setdefault(layer, Counter())[(str(cfg).split(" @")[0], tuple(cfg.devices))] += 1
    return [(layer, *counts.most_common(1)[0][0]) for layer, counts in rows.items()]


def draw_layers(graph, machine, strategy, path, title: str = "", max_rows: int = 40) -> None:
    """Devices across, layers down; a cell is coloured by how the layer is split on that
    device (white: the layer does not run there).  Layers past ``max_rows`` are elided
    in the middle."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = layer_rows(graph, strategy)
    if len(rows) > max_rows:
        half = max_rows // 2
        rows = rows[:half] + [("...", "", ())] + rows[-half:]
    splits = sorted({s for _, s, d in rows if d})
    palette = plt.get_cmap("tab10")
    colour = {s: palette(i % 10) for i, s in enumerate(splits)}
    n = machine.num_devices
    fig, ax = plt.subplots(figsize=(min(2 + 0.45 * n, 16), 1.2 + 0.22 * len(rows)))
    for y, (layer, split, devices) in enumerate(rows):
        for d in set(devices):
            ax.add_patch(plt.Rectangle((d, y), 1, 1, color=colour[split], ec="white", lw=0.5))
    per_node = max(1, n // max(1, machine.num_nodes))
    for x in range(per_node, n, per_node):
        ax.axvline(x, color="black", lw=1)
    ax.set_xlim(0, n)
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([y + 0.5 for y in range(len(rows))], [r[0] for r in rows], fontsize=7)
    ax.set_xticks([x + 0.5 for x in range(n)], [str(x) for x in range(n)], fontsize=7)
    ax.set_xlabel("device (black lines: node boundaries)")
    ax.legend(handles=[Patch(color=colour[s], label=s) for s in splits], loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=8, title="split", title_fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_timeline(result, path, title: str = "", max_rows: int = 12) -> None:
    """The simulated step: a row per device and per link that ran a task (a few devices,
    then links, ``max_rows`` in all), a bar per task, coloured by kind (compute, transfer,
    sync...)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events, names = result._trace()
    rows = sorted({e[2] for e in events})
    devices = [r for r in rows if str(names[r]).startswith("device")]
    links = [r for r in rows if r not in set(devices)]
    k = min(len(devices), max(max_rows - len(links), max_rows // 3))
    used = devices[:k] + links[:max_rows - k]  # a few devices, then the links their traffic crossed
    index = {r: i for i, r in enumerate(used)}
    cats = sorted({e[1] for e in events if e[2] in index})
    palette = plt.get_cmap("tab10")
    colour = {c: palette(i % 10) for i, c in enumerate(cats)}
    bars: dict[tuple, list] = {}
    for _, cat, r, start, dur in events:
        if r in index:
            bars.setdefault((index[r], cat), []).append((start / 1e9, max(dur / 1e9, 1e-4)))
    fig, ax = plt.subplots(figsize=(12, 1 + 0.35 * len(used)))
    for (y, cat), spans in bars.items():
        ax.broken_barh(spans, (y + 0.1, 0.8), facecolors=colour[cat])
    ax.set_ylim(len(used), 0)
    ax.set_yticks([i + 0.5 for i in range(len(used))], [names[r] for r in used], fontsize=7)
    ax.set_xlabel("ms")
    ax.legend(handles=[Patch(color=colour[c], label=c) for c in cats], loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
