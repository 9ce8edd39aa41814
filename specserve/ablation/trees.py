"""The tree shapes a configuration drafts and what the target accepted of them, drawn as
SpecInfer and Sequoia draw theirs: the most common shapes, each node shaded by how often it
was on the accepted path.

A shape is the drafted tree's topology (its parent tuple), whatever its tokens: trees of one
shape differ in tokens from step to step, but share where acceptance concentrates.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

from specserve.tree import TokenTree


class TreeShapes:
    """Counts of drafted shapes, and per shape how often each node was accepted."""

    def __init__(self, saved: list[dict] | None = None):
        self.count: Counter[tuple[int, ...]] = Counter()
        self.accepted: dict[tuple[int, ...], list[int]] = {}
        for entry in saved or []:
            shape = tuple(entry["parents"])
            self.count[shape] = entry["count"]
            self.accepted[shape] = list(entry["accepted"])

    def observe(self, tree: TokenTree, path: list[int]) -> None:
        shape = tuple(tree.parents)
        self.count[shape] += 1
        accepted = self.accepted.setdefault(shape, [0] * len(shape))
        for node in path:
            accepted[node] += 1

    def most_common(self, n: int) -> list[dict]:
        return [{"parents": list(shape), "count": count, "accepted": self.accepted[shape]}
                for shape, count in self.count.most_common(n)]

    @property
    def total(self) -> int:
        return sum(self.count.values())


def _layered_positions(parents: list[int]) -> dict[int, tuple[float, float]]:
    """Root on top, each depth a row; leaves spread evenly, parents centred over their children."""
    children: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    positions: dict[int, tuple[float, float]] = {}
    next_leaf = [0.0]

    def place(node: int, depth: int) -> float:
        if not children[node]:
            x = next_leaf[0]
            next_leaf[0] += 1
        else:
            xs = [place(child, depth + 1) for child in children[node]]
            x = sum(xs) / len(xs)
        positions[node] = (x, -depth)
        return x

    place(0, 0)
    return positions


def draw_tree_shapes(shapes: list[dict], path: Path, title: str, steps: int) -> None:
    """One panel per shape: nodes shaded (and labelled) by their share of that shape's steps in
    which they were accepted; the root is always accepted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    columns = min(3, max(1, len(shapes)))
    rows = -(-len(shapes) // columns) if shapes else 1
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, entry in zip(axes.flat, shapes, strict=False):
        parents, count = entry["parents"], entry["count"]
        share = [a / count for a in entry["accepted"]]
        graph = nx.DiGraph()
        graph.add_nodes_from(range(len(parents)))
        graph.add_edges_from((p, n) for n, p in enumerate(parents) if p >= 0)
        positions = _layered_positions(parents)
        nx.draw_networkx(graph, positions, ax=ax, node_color=share, cmap="Greens", vmin=0, vmax=1,
                         edgecolors="black", linewidths=0.5, node_size=420, arrows=False, with_labels=False)
        for dark, colour in ((False, "black"), (True, "white")):  # labels readable on light and dark nodes
            nx.draw_networkx_labels(graph, positions, {n: f"{v:.0%}" for n, v in enumerate(share) if (v > 0.6) == dark},
                                    ax=ax, font_size=6, font_color=colour)
        mat = sum(entry["accepted"]) / count  # accepted nodes incl. the root = tokens emitted per step
        ax.set_title(f"{len(parents) - 1} drafted nodes: {count / steps:.0%} of steps, MAT {mat:.2f}", fontsize=8)
    fig.suptitle(textwrap.fill(title, 40 * columns), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
