"""The interactive explorer: a static single-page site under `<run>/explorer/`.

`write_explorer(run)` reads the run's Parquet tables once and writes them as compact
columnar JSON inside small JavaScript files (`data/*.js`, one per layer and kind of data, so
that a page loads only what it needs), next to a page shell, the app (`static/app.js`) and
Plotly's bundle copied from the installed `plotly` package. The site opens from the file
system with no server and no network; `serve(folder)` serves it over HTTP on 127.0.0.1 when
that is more convenient. Feature pages are rendered in the browser from the data, on demand.
See `pipelines.explorer.data` for the data format.
"""

from pipelines.explorer.site import make_server, serve, write_explorer

__all__ = ["write_explorer", "serve", "make_server"]
