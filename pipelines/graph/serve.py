"""Serve `<run>/graphs/` in circuit-tracer's own viewer: its request handler and front end,
bound to 127.0.0.1 (circuit-tracer's `serve` listens on every interface)."""

from __future__ import annotations

import functools
from urllib.parse import quote

from pipelines.engine.paths import RunPaths

DEFAULT_PORT = 8032  # circuit-tracer's
HOST = "127.0.0.1"


def viewer_url(slug: str, port: int = DEFAULT_PORT) -> str:
    """Where `graph --serve` shows the graph of `slug`."""
    return f"http://{HOST}:{port}/index.html?slug={quote(slug)}"


def graph_server(run: RunPaths, port: int = DEFAULT_PORT, host: str = HOST):
    """A (not yet started) HTTP server of circuit-tracer's viewer over the run's graphs (port 0
    picks a free one); call `serve_forever()` on it, `shutdown()` and `server_close()` to stop it."""
    from circuit_tracer.frontend.local_server import DEFAULT_FRONTEND_DIR, CircuitGraphHandler, ReusableTCPServer

    if not run.graph_index.is_file():
        raise FileNotFoundError(f"no graphs in {run.graphs}: run `bilinear-circuits graph --prompt TEXT` first")
    handler = functools.partial(CircuitGraphHandler, frontend_dir=str(DEFAULT_FRONTEND_DIR), data_dir=str(run.graphs))
    return ReusableTCPServer((host, port), handler)
