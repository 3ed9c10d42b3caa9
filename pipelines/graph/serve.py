"""Serve `<run>/graphs/` in circuit-tracer's viewer through our own read-only server
(`pipelines.engine.server`: files only inside their folders, `Host` checked, threaded, no write
endpoint), not circuit-tracer's handler. One server shows a run's explorer and its graphs:

    /                       the explorer (`<run>/explorer/`), when it has been written
    /graphs/, /report/      the graph JSON files and the report (the explorer links them)
    /viewer/                circuit-tracer's front end (its `frontend/assets`)
    /viewer/data/, /viewer/graph_data/   the graphs folder, where the viewer fetches them

The viewer's edits (pins, labels) stay in the browser: nothing is written back.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from pipelines.engine.paths import RunPaths
from pipelines.engine.server import FolderServer
from pipelines.graph.export import read_index

DEFAULT_PORT = 8032  # circuit-tracer's
HOST = "127.0.0.1"
VIEWER = "/viewer/"


def viewer_path(slug: str) -> str:
    """Where the viewer shows the graph of `slug`, relative to the server's root."""
    return f"{VIEWER[1:]}index.html?slug={quote(slug)}"


def viewer_assets() -> Path | None:
    """circuit-tracer's front end folder, or None when circuit-tracer is not installed."""
    try:
        from circuit_tracer.frontend.local_server import DEFAULT_FRONTEND_DIR
    except ImportError:
        return None
    return Path(str(DEFAULT_FRONTEND_DIR))


def run_mounts(run: RunPaths) -> dict[str, Path]:
    """The URL prefixes of a run's server (see the module docstring): the viewer (none without
    circuit-tracer), the graphs and report folders, and the explorer at the root."""
    mounts = {"/": run.explorer, "/graphs/": run.graphs, "/report/": run.report}
    assets = viewer_assets()
    if assets is not None:
        mounts.update({VIEWER: assets, f"{VIEWER}data/": run.graphs, f"{VIEWER}graph_data/": run.graphs})
    return mounts


def graph_server(run: RunPaths, port: int = DEFAULT_PORT, host: str = HOST) -> FolderServer:
    """A (not yet started) server of the run's graphs in circuit-tracer's viewer, and of its
    explorer when written (port 0 picks a free one)."""
    if not read_index(run.graph_index):
        where = run.graph_index if run.graph_index.exists() else run.graphs
        raise FileNotFoundError(f"no graphs in {where}: run `bilinear-circuits graph --prompt TEXT` first")
    if viewer_assets() is None:
        raise FileNotFoundError("circuit-tracer's viewer is not installed: pip install --no-deps circuit-tracer")
    return FolderServer(run_mounts(run), host, port)


def served_lines(run: RunPaths, server: FolderServer) -> list[str]:
    """Where `server` (of `graph_server`) shows the last graph written, and the explorer."""
    lines = [f"circuit-tracer's viewer: {server.url}{viewer_path(read_index(run.graph_index)[-1]['slug'])}"]
    if run.explorer_page.is_file():
        lines.append(f"explorer: {server.url}")
    return lines
