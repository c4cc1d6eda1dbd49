"""A picture of a strategy: one row per op, one column per device; a cell says
which partition of the op that device holds, its colour how the op is split.

    from strategy_picture import draw_strategy
    draw_strategy(graph, machine, strategy, "strategy.png", baseline=dp, title="...")

Ops whose config differs from ``baseline`` are named in bold, with the
baseline's config beside them.  Devices are grouped by node.
"""
from __future__ import annotations

from flexflow.strategy.config import _LETTER
from flexflow.strategy.regions import partitions  # dim letters as ParallelConfig prints them

__all__ = ["draw_strategy", "block_label", "split_label"]


def split_label(op, config) -> str:
    """How the op is split, without its devices: ``S4 C4``, or ``whole``."""
    return str(config).split(" @")[0]


def block_label(op, config, index: int) -> str:
    """Partition ``index``'s coordinates along the split dims, e.g. ``S1C2``
    (partitions are numbered row-major over the op's dims in declared order)."""
    split = [(d.name, config.degrees[d.name]) for d in op.dims if config.degrees.get(d.name, 1) > 1]
    coords = []
    for name, deg in reversed(split):
        coords.append(f"{_LETTER.get(name, name.upper())}{index % deg}")
        index //= deg
    return "".join(reversed(coords)) or "all"


def draw_strategy(graph, machine, strategy, path, *, baseline=None, title: str = "") -> None:
    """Write the picture as PNG to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    ops = graph.compute_ops
    n_dev = machine.num_devices
    kinds = []  # split labels in first-seen order, one colour each
    for op in ops:
        k = split_label(op, strategy[op.name])
        if k not in kinds:
            kinds.append(k)
    palette = ["#c6d9ec", "#f4a259", "#8cb369", "#e76f51", "#b48ead", "#f2cc8f", "#5b8e7d", "#bc4b51"]
    colour = {k: palette[i % len(palette)] for i, k in enumerate(kinds)}

    cell_w, cell_h = 0.42, 0.26  # inches
    left_in, right_in, top_in, bottom_in = 1.4, 2.1, 0.95, 0.6
    fig_w = left_in + n_dev * cell_w + right_in
    fig_h = top_in + len(ops) * cell_h + bottom_in
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=110)
    ax = fig.add_axes([left_in / fig_w, bottom_in / fig_h, n_dev * cell_w / fig_w, len(ops) * cell_h / fig_h])
    ax.set_xlim(0, n_dev)
    ax.set_ylim(len(ops), 0)
    for r, op in enumerate(ops):
        cfg = strategy[op.name]
        held = {}
        for part in partitions(op, cfg):
            held.setdefault(part.device, []).append(block_label(op, cfg, part.index))
        for d in range(n_dev):
            if d in held:
                ax.add_patch(Rectangle((d, r), 1, 1, facecolor=colour[split_label(op, cfg)],
                                       edgecolor="white", linewidth=0.8))
                ax.text(d + 0.5, r + 0.5, "/".join(held[d]), ha="center", va="center", fontsize=5.5)
        changed = baseline is not None and baseline[op.name] != cfg
        weight = "bold" if changed else "normal"
        label = op.name if op.name.startswith(op.kind) else f"{op.name} ({op.kind})"
        ax.text(-0.15, r + 0.5, label, ha="right", va="center", fontsize=7,
                fontweight=weight)
        note = str(cfg) + (f"   was {split_label(op, baseline[op.name])}" if changed else "")
        ax.text(n_dev + 0.15, r + 0.5, note, ha="left", va="center", fontsize=7, fontweight=weight)
    nodes = [machine.devices[d].node for d in range(n_dev)]
    for d in range(1, n_dev):
        if nodes[d] != nodes[d - 1]:
            ax.axvline(d, color="black", linewidth=1.2)
    starts = [d for d in range(n_dev) if d == 0 or nodes[d] != nodes[d - 1]]
    for i, s in enumerate(starts):
        e = starts[i + 1] if i + 1 < len(starts) else n_dev
        ax.text((s + e) / 2, -1.1, f"node {nodes[s]}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([d + 0.5 for d in range(n_dev)], [str(d) for d in range(n_dev)], fontsize=6.5)
    ax.xaxis.tick_top()
    ax.set_yticks([])
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.text(n_dev / 2, -1.9 if len(starts) > 1 else -1.1, "device", ha="center", va="bottom", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8.5, y=1 - 0.12 / fig_h, va="top")
    handles = [Patch(facecolor=colour[k], label=k) for k in kinds]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.01), ncol=len(kinds),
              fontsize=6.5, frameon=False, title="split (S: samples, C: channels / out-features, "
              "H W: height / width; cell: the block that device holds)", title_fontsize=6.5)
    fig.savefig(path)
    plt.close(fig)
