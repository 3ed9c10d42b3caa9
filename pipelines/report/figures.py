"""The report's figures, each drawn from plain arrays (no model, no tables, no math)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import to_rgba_array
from matplotlib.figure import Figure


def save(path: Path, dpi: int, figure, *args) -> None:
    """Draw `figure(*args)` (a function of this module) and write it to `path` as a PNG (what a
    worker process of the report runs: it needs nothing but this module)."""
    figure(*args).savefig(path, dpi=dpi)


def _text(label: str) -> str:
    """Text for matplotlib labels: a literal `$` would otherwise start mathtext."""
    return label.replace("$", r"\$")


def correlation_by_rank(curves: dict[int, tuple[np.ndarray, np.ndarray]]) -> Figure:
    """Mean active-only correlation against the rank r, one line per layer."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    for layer, (ranks, means) in sorted(curves.items()):
        ax.plot(ranks, means, marker="o", label=f"layer {layer}")
    ax.set_xlabel("eigenvectors r")
    ax.set_ylabel("mean active-only correlation")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def histograms(values: dict[int, np.ndarray], nan_counts: dict[int, int], rank: int) -> Figure:
    """Histogram of correlations per layer, panels side by side."""
    layers = sorted(values)
    fig = Figure(figsize=(3.2 * len(layers), 3), layout="constrained")
    axes = fig.subplots(1, len(layers), squeeze=False, sharey=True)[0]
    for ax, layer in zip(axes, layers):
        ax.hist(values[layer], bins=np.linspace(-1, 1, 41), color="tab:blue")
        ax.set_title(f"layer {layer} (NaN: {nan_counts.get(layer, 0)})", fontsize=10)
        ax.set_xlabel(f"rank-{rank} correlation")
    axes[0].set_ylabel("output features")
    return fig


def heatmap(matrix: np.ndarray, row_labels: list[str], column_labels: list[str], title: str) -> Figure:
    """A symmetric matrix in a diverging colour map, each cell annotated."""
    n = len(row_labels)
    width = max(len(label) for label in row_labels) if row_labels else 10
    fig = Figure(figsize=(4.5 + 0.08 * width, 1.2 + 0.5 * n), layout="constrained")
    ax = fig.add_subplot()
    scale = float(np.abs(matrix).max()) or 1.0
    image = ax.imshow(matrix, cmap="RdBu_r", vmin=-scale, vmax=scale)
    ax.set_yticks(range(n), [_text(label) for label in row_labels], fontsize=8)
    ax.set_xticks(range(n), [_text(label) for label in column_labels], fontsize=8, rotation=45)
    for (r, c), value in np.ndenumerate(matrix):
        ax.text(c, r, f"{value:.2g}", ha="center", va="center", fontsize=6,
                color="white" if abs(value) > 0.6 * scale else "black")
    fig.colorbar(image, ax=ax, shrink=0.8)
    ax.set_title(_text(title), fontsize=10)
    return fig


def spectrum(ranks: np.ndarray, eigenvalues: np.ndarray, title: str) -> Figure:
    """Eigenvalues by rank, positive red and negative blue."""
    fig = Figure(figsize=(4.5, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(ranks, eigenvalues, color=np.where(eigenvalues >= 0, "tab:red", "tab:blue"))
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("rank (by |eigenvalue|)")
    ax.set_ylabel("eigenvalue")
    ax.set_title(_text(title), fontsize=10)
    return fig


def scatter(panels: list[tuple[str, np.ndarray, np.ndarray, float]], title: str, max_points: int = 3000) -> Figure:
    """Approximation against activation, one panel per (name, x, y, correlation)."""
    fig = Figure(figsize=(3.4 * len(panels), 3.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    shown = np.random.default_rng(0).permutation(len(panels[0][2]))[:max_points]
    for ax, (name, x, y, corr) in zip(axes, panels):
        ax.scatter(x[shown], y[shown], s=4, alpha=0.4, linewidths=0)
        ax.set_title(f"{name}: corr {corr:.3f}", fontsize=10)
        ax.set_xlabel(f"{name} approximation")
    axes[0].set_ylabel("SAE activation")
    fig.suptitle(_text(title), fontsize=10)
    return fig


def spread(x: np.ndarray, y: np.ndarray, width: float = 0.8) -> np.ndarray:
    """`x [n]` with the nodes that share a point `(x, y)` side by side across `width` about it,
    in their order: a position's latents of one row, or the logits, one beside the other."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    out = x.copy()
    _, cell, count = np.unique(np.stack([x, y], 1), axis=0, return_inverse=True, return_counts=True)
    cell = cell.reshape(-1)
    for c in np.flatnonzero(count > 1):
        mine = np.flatnonzero(cell == c)
        step = width / len(mine)
        out[mine] += (np.arange(len(mine)) - (len(mine) - 1) / 2) * step
    return out


def attribution_graph(x: np.ndarray, y: np.ndarray, kinds: list[str], edges: np.ndarray, weights: np.ndarray,
                      path: list[int], tokens: list[str], title: str, labels: list[str]) -> Figure:
    """A pruned attribution graph: nodes at (position, viewer row), those of one point side by
    side (`spread`), each named by its `labels` entry (a latent's number, a logit's token; ""
    for none), edges `[E, 2]` (source, target indices into the nodes) drawn by |weight| (red
    positive, blue negative), the strongest path in black."""
    crowd = int(np.unique(np.stack([x, y], 1), axis=0, return_counts=True)[1].max()) if len(x) else 1
    x = spread(x, y)
    # room for the most nodes side by side at one point, their labels a few points apart
    fig = Figure(figsize=(min(40.0, max(6.0, (len(tokens) + 1) * max(0.45, 0.13 * crowd))), 5), layout="constrained")
    ax = fig.add_subplot()
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    scale = float(np.abs(weights).max()) if len(weights) else 1.0
    strength = np.abs(weights) / scale
    # one collection, not a line per edge (a graph of a few hundred edges took a second to build)
    colours = to_rgba_array(np.where(weights > 0, "tab:red", "tab:blue"))
    colours[:, 3] = 0.1 + 0.6 * strength
    segments = np.stack([np.stack([x[edges[:, 0]], y[edges[:, 0]]], -1), np.stack([x[edges[:, 1]], y[edges[:, 1]]], -1)], 1)
    ax.add_collection(LineCollection(segments, colors=colours, linewidths=0.3 + 1.5 * strength, zorder=1))
    for a, b in zip(path[:-1], path[1:]):
        ax.plot([x[a], x[b]], [y[a], y[b]], color="black", linewidth=2.5, zorder=2)
    colours = {"token": "tab:gray", "input": "tab:green", "output": "tab:orange", "input_error": "tab:purple",
               "output_error": "tab:purple", "logit": "tab:red"}
    for kind, colour in colours.items():
        mine = [i for i, k in enumerate(kinds) if k == kind]
        if mine:
            ax.scatter(x[mine], y[mine], s=18, color=colour, label=kind, zorder=3,
                       marker="s" if kind.endswith("error") else "o")
    for i, label in enumerate(labels):
        if label:
            ax.annotate(_text(label), (x[i], y[i]), xytext=(0, 4), textcoords="offset points", fontsize=5,
                        rotation=90, ha="center", va="bottom", zorder=4)
    ax.set_xticks(range(len(tokens)), [_text(t) for t in tokens], rotation=60, fontsize=8)
    ax.set_ylabel("row (tokens; per layer: input latents, output latents; logits)")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(_text(title), fontsize=10)
    return fig
