"""Write the explorer's files under `<run>/explorer/`, and serve them over HTTP.

    explorer/
      index.html            the page shell (every route of the single-page app: #/, #/layer/L,
                            #/out/L/F, #/in/L/F, with ?in=SITE to pick the input SAE's site)
      static/app.js         the app: routing, tables, Plotly figures (all text HTML-escaped)
      static/style.css
      static/plotly.min.js  copied from the installed plotly package, loaded only by pages with plots
      data/*.js             the run's tables as compact JSON (see `pipelines.explorer.data`)

The folder is replaced atomically, so a reader never sees half a site.
"""

from __future__ import annotations

import importlib.resources
import shutil
import time
import warnings
from pathlib import Path

import jinja2

from pipelines.engine.files import atomic_dir
from pipelines.engine.paths import INDEX, RunPaths
from pipelines.engine.server import FolderServer
from pipelines.explorer.data import bundles, script
from pipelines.graph.serve import run_mounts

STATIC_FILES = ("app.js", "style.css")
SHELL = "shell.html"


def plotly_bundle() -> Path | None:
    """plotly.min.js of the installed plotly package, or None when it is not installed."""
    try:
        path = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
    except ModuleNotFoundError:
        return None
    return Path(str(path)) if path.is_file() else None


def _static(name: str) -> str:
    return (importlib.resources.files("pipelines.explorer") / "static" / name).read_text(encoding="utf-8")


def write_explorer(run: RunPaths) -> Path:
    """Write the explorer of `run` (see the module docstring); returns its index.html."""
    start = time.perf_counter()
    data = bundles(run)
    meta = data["meta"]
    plotly = plotly_bundle()
    if plotly is None:
        warnings.warn("plotly is not installed: the explorer is written without its figures", stacklevel=2)
    meta["plotly"] = plotly is not None
    with atomic_dir(run.explorer) as folder:
        (folder / "static").mkdir()
        (folder / "data").mkdir()
        for name in STATIC_FILES:
            (folder / "static" / name).write_text(_static(name), encoding="utf-8")
        if plotly is not None:
            shutil.copyfile(plotly, folder / "static" / "plotly.min.js")
        for name, value in data.items():
            (folder / "data" / f"{name}.js").write_text(script(name, value), encoding="utf-8")
        env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
        html = env.from_string(_static(SHELL)).render(title=f"Explorer: {meta['run']}", run=meta["run"],
                                                      build_s=f"{time.perf_counter() - start:.1f}")
        (folder / INDEX).write_text(html, encoding="utf-8")
    return run.explorer_page


def make_server(folder: str | Path, host: str = "127.0.0.1", port: int = 8000) -> FolderServer:
    """A read-only HTTP server of the explorer `folder` (not started; port 0 picks a free port),
    with the run's report and its graphs in circuit-tracer's viewer beside it
    (`pipelines.graph.serve.run_mounts`) so that the explorer's links work."""
    folder = Path(folder)
    if not (folder / INDEX).is_file():
        raise FileNotFoundError(f"no {INDEX} in {folder}: write the explorer first (bilinear-circuits explore)")
    return FolderServer({**run_mounts(RunPaths(folder.parent)), "/": folder}, host, port)


def serve(folder: str | Path, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve `folder` on http://host:port/ until Ctrl-C (only this machine can reach it by default)."""
    server = make_server(folder, host, port)
    server.run_until_interrupted([f"serving {folder} at {server.url}"])
