"""The trees a configuration drafts and what the target accepted of them, drawn as SpecInfer
and Sequoia draw theirs.

Two views of the same steps:

* by *position*: a drafted node is named by its path of sibling ranks from the root ((0, 1) is
  the root's likeliest child's second child: drafters add siblings likeliest first). Summed over
  every step this is one tree — where the drafter spends its budget and where acceptance
  concentrates — however varied the individual trees (a dynamic tree at budget 16 rarely
  repeats its exact topology);
* by *shape*: the drafted tree's exact topology (its parent tuple), whatever its tokens; the
  most common ones, each node shaded by how often it was accepted.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

from specserve.tree import TokenTree

Position = tuple[int, ...]  # sibling ranks from the root; () is the root


class TreeShapes:
    """Per position, how often it was drafted and accepted; per exact shape, how often it was
    drafted and how often each of its nodes was accepted."""

    def __init__(self, saved: dict | None = None):
        saved = saved or {}
        self.drafted: Counter[Position] = Counter()
        self.accepted: Counter[Position] = Counter()
        for entry in saved.get("positions", []):
            position = tuple(entry["position"])
            self.drafted[position], self.accepted[position] = entry["drafted"], entry["accepted"]
        self.count: Counter[tuple[int, ...]] = Counter()
        self.accepted_in_shape: dict[tuple[int, ...], list[int]] = {}
        for entry in saved.get("shapes", []):
            shape = tuple(entry["parents"])
            self.count[shape] = entry["count"]
            self.accepted_in_shape[shape] = list(entry["accepted"])

    def observe(self, tree: TokenTree, path: list[int]) -> None:
        """One verifying step: `tree` as drafted (node 0 the root), `path` the accepted nodes."""
        positions = node_positions(tree)
        self.drafted.update(positions)
        self.accepted.update(positions[node] for node in path)
        shape = tuple(tree.parents)
        self.count[shape] += 1
        accepted = self.accepted_in_shape.setdefault(shape, [0] * len(shape))
        for node in path:
            accepted[node] += 1

    @property
    def steps(self) -> int:
        return sum(self.count.values())

    def most_common_positions(self, n: int) -> list[dict]:
        """The `n` most often drafted positions, root included; a node is drafted whenever its
        children are, so (ties going to the shallower) the list holds every listed node's parent."""
        ranked = sorted(self.drafted, key=lambda p: (-self.drafted[p], len(p), p))[:n]
        return [{"position": list(p), "drafted": self.drafted[p], "accepted": self.accepted[p]} for p in ranked]

    def most_common(self, n: int | None = None) -> list[dict]:
        return [{"parents": list(shape), "count": count, "accepted": self.accepted_in_shape[shape]}
                for shape, count in self.count.most_common(n)]

    def to_json(self) -> dict:
        """Everything, so that a resumed run keeps counting where it stopped."""
        return {"steps": self.steps, "positions": self.most_common_positions(len(self.drafted)),
                "shapes": self.most_common()}


def node_positions(tree: TokenTree) -> list[Position]:
    """Each node's sibling-rank path from the root (children ranked in node order)."""
    positions: list[Position] = [()] * len(tree)
    for node, children in enumerate(tree.children):  # parents precede their children
        for rank, child in enumerate(children):
            positions[child] = (*positions[node], rank)
    return positions


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


def _draw_tree(ax, parents: list[int], shade: list[float], sizes: list[float] | None = None) -> None:
    """Nodes labelled by `shade`, a share in [0, 1], and shaded by it on a scale that tops out at
    the best drafted node (the root, always accepted, would otherwise wash every other node out)."""
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(parents)))
    graph.add_edges_from((p, n) for n, p in enumerate(parents) if p >= 0)
    layout = _layered_positions(parents)
    top = max(shade[1:], default=1.0) or 1.0
    nx.draw_networkx(graph, layout, ax=ax, node_color=shade, cmap="Greens", vmin=0, vmax=top,
                     node_size=sizes or 420, edgecolors="black", linewidths=0.5, arrows=False, with_labels=False)
    for dark, colour in ((False, "black"), (True, "white")):  # labels readable on light and dark nodes
        nx.draw_networkx_labels(graph, layout, {n: f"{v:.0%}" for n, v in enumerate(shade) if (v > 0.6 * top) == dark},
                                ax=ax, font_size=6, font_color=colour)
    ax.axis("off")


def draw_tree_shapes(trees: dict, path: Path, title: str, nodes: int = 24, shapes: int = 3,
                     min_share: float = 0.05) -> None:
    """Top: the `nodes` most often drafted positions over all steps, sized by how often drafted
    and shaded by how often accepted (per step). Below: the `shapes` most common exact trees
    among those drafted in at least `min_share` of steps (a dynamic tree seldom repeats; its
    commonest exact shapes are then the small trees of the last steps, where the budget is cut to
    the tokens left), shaded by how often each node was accepted when that tree was drafted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = trees["steps"]
    top = trees["positions"][:nodes]
    ordered = sorted(top, key=lambda e: (len(e["position"]), e["position"]))  # parents first, siblings by rank
    index = {tuple(entry["position"]): i for i, entry in enumerate(ordered)}
    parents = [index[tuple(e["position"][:-1])] if e["position"] else -1 for e in ordered]
    common = [entry for entry in trees["shapes"][:shapes] if entry["count"] >= min_share * steps]
    columns = max(1, len(common))
    fig = plt.figure(figsize=(max(9.0, 3.6 * columns), 8.4 if common else 4.8))
    grid = fig.add_gridspec(2 if common else 1, columns, height_ratios=[1.4, 1] if common else [1])
    ax = fig.add_subplot(grid[0, :])
    _draw_tree(ax, parents, [e["accepted"] / steps for e in ordered],
               [120 + 600 * e["drafted"] / steps for e in ordered])
    mat = sum(entry["accepted"] for entry in trees["positions"]) / steps  # root included: tokens per step
    ax.set_title(f"all {steps} steps, the {len(ordered) - 1} most drafted positions (siblings likeliest "
                 f"first): size = share of steps drafted, shade = share accepted; MAT {mat:.2f}", fontsize=8)
    for column, entry in enumerate(common):
        ax = fig.add_subplot(grid[1, column])
        count = entry["count"]
        _draw_tree(ax, entry["parents"], [a / count for a in entry["accepted"]])
        ax.set_title(f"{len(entry['parents']) - 1} drafted nodes: {count / steps:.0%} of steps, "
                     f"MAT {sum(entry['accepted']) / count:.2f}", fontsize=8)
    fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
