"""Serve `<run>/graphs/` in circuit-tracer's own viewer: its request handler and front end,
bound to 127.0.0.1 (circuit-tracer's `serve` listens on every interface)."""

from __future__ import annotations

import functools
from pathlib import Path

DEFAULT_PORT = 8032  # circuit-tracer's


def graph_server(folder: Path, port: int = DEFAULT_PORT, host: str = "127.0.0.1"):
    """A (not yet started) HTTP server of circuit-tracer's viewer over the graphs in `folder`;
    call `serve_forever()` on it, `shutdown()` and `server_close()` to stop it."""
    from circuit_tracer.frontend.local_server import DEFAULT_FRONTEND_DIR, CircuitGraphHandler, ReusableTCPServer

    if not (Path(folder) / "graph-metadata.json").is_file():
        raise FileNotFoundError(f"no graphs in {folder}: run `bilinear-circuits graph --prompt TEXT` first")
    handler = functools.partial(CircuitGraphHandler, frontend_dir=str(DEFAULT_FRONTEND_DIR), data_dir=str(folder))
    return ReusableTCPServer((host, port), handler)
