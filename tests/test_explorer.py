"""The interactive explorer: its data round-trips the tables, missing tables leave marked
sections, table text is escaped, and (slow, with Chromium and Playwright) the site works in a
real browser opened from the file system."""

from __future__ import annotations

import http.server
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from circuits.tables import SCHEMAS
from pipelines.analysis.features import FEATURE_LABELS_SCHEMA, FEATURES_SCHEMA
from pipelines.engine.paths import RunPaths
from pipelines.engine.tables import read_table, write_table
from pipelines.explorer import data as xdata
from pipelines.explorer.site import make_server, plotly_bundle, serve, write_explorer

PLANTED = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> & \'quoted\''
PLANTED_CONTEXT = 'she said <b>no</b> and [<script>] \u2028 left'
REL = 10 ** -(xdata.DIGITS - 1) / 2  # 4 significant digits: relative error at most 5e-4


# ------------------------------------------------------------------ a synthetic run


def synthetic_run(root: Path, layers=(0, 1), n_out: int = 12, n_in: int = 16, sites=("resid_mid",),
                  skip=(), seed: int = 0) -> RunPaths:
    """Circuit and feature tables of the shapes the stages write, with random numbers."""
    run = RunPaths(root)
    rng = np.random.default_rng(seed)
    for layer in layers:
        for site in sites:
            part, keys = f"{site}-sae", {"outputs": "sae", "input_site": site}
            tables = {}
            rows = []
            for f in range(n_out):
                for kind, n in (("self", 4), ("cross", 4), ("linear", 3), ("constant", 1)):
                    for rank in range(1, n + 1):
                        a = int(rng.integers(0, n_in))
                        b = {"self": a, "cross": int(rng.integers(0, n_in)), "linear": -1, "constant": -1}[kind]
                        rows.append({"out_feature": f, "rank": rank, "in_a": -1 if kind == "constant" else a, "in_b": b,
                                     "kind": kind, "coefficient": float(rng.normal(0, 0.1)) / rank})
            tables["interactions"] = pd.DataFrame(rows)
            rows = []
            for f in range(n_out):
                for w in range(1, 4):
                    a = int(rng.integers(0, n_in - 1))
                    rows.append({"out_feature": f, "in_a": a, "in_b": a + 1, "and_score": float(rng.normal()),
                                 "cross": float(rng.normal()), "self_a": float(rng.normal()), "self_b": float(rng.normal()),
                                 "weight_rank": w, "n_active": float(rng.integers(0, 300)), "coactivation": float(rng.random()),
                                 "mean_contribution": float(rng.normal()), "contribution_share": float(rng.random()),
                                 "and_data": float("nan") if w == 3 else float(rng.random()),
                                 "data_rank": None if w == 3 else w, "layer_rank": f + 1 if w == 1 and f < n_out // 2 else None})
            gates = pd.DataFrame(rows)
            gates["data_rank"] = gates["data_rank"].astype("Int64")
            gates["layer_rank"] = gates["layer_rank"].astype("Int64")
            tables["gates"] = gates
            best = gates[gates["layer_rank"].notna() & (gates["layer_rank"] <= 2)]
            cells = ["on_on", "on_off", "off_on", "off_off"]
            tables["gate_truth"] = pd.concat([best[["out_feature", "in_a", "in_b", "layer_rank"]].assign(
                cell=c, n_tokens=100 + i, mean_activation=1.0 / (i + 1), active_share=0.5, quantile_activation=2.0)
                for i, c in enumerate(cells)])
            ablation = pd.concat([best[["out_feature", "in_a", "in_b", "layer_rank"]].assign(ablated=c) for c in ("a", "b", "both")])
            for c in ("activation_before", "activation_after", "pre_before", "pre_after", "pre_change_predicted",
                      "logprob_before", "logprob_after"):
                ablation[c] = rng.normal(size=len(ablation))
            tables["gate_ablation"] = ablation.assign(n_tokens=50)
            tables["eigen"] = pd.DataFrame([{"out_feature": f, "rank": r, "eigenvalue": float(rng.normal()),
                                             "energy_share": float(rng.random()), "activation_share": float(rng.normal())}
                                            for f in range(n_out) for r in range(1, 7)])
            tables["eigen_inputs"] = pd.DataFrame([{"out_feature": f, "eigen_rank": e, "input_rank": i,
                                                    "in_feature": int(rng.integers(0, n_in)), "cosine": float(rng.normal())}
                                                   for f in range(n_out) for e in range(1, 3) for i in range(1, 4)])
            tables["lowrank"] = pd.DataFrame([{"out_feature": f, "n_eigs": r, "n_active": 40 + f,
                                               "corr_active": float("nan") if f == 0 else float(rng.random())}
                                              for f in range(n_out) for r in range(1, 5)])
            tables["lowrank_samples"] = pd.DataFrame([{"out_feature": f, "sample": t, "n_eigs": r,
                                                       "activation": float(rng.random()), "approx": float(rng.normal()),
                                                       "offset": 0.5} for f in range(n_out) for t in range(1, 4)
                                                      for r in range(1, 5)])
            for name, df in tables.items():
                if name in skip:
                    continue
                if name == "gate_ablation":  # the ablation stage leaves outputs and input_site empty
                    df = df.assign(outputs=None, input_site=None)
                else:
                    df = df.assign(**keys)
                write_table(df, run.tables, name, layer, SCHEMAS[name], part)
        feats, labels = [], []
        for site, n in (("mlp_out", n_out), *((s, n_in) for s in sites)):
            for f in range(n):
                feats.append({"site": site, "feature": f, "frequency": float(rng.random()) / 10,
                              "max_activation": float(rng.random() * 5), "mean_activation": float(rng.random()),
                              "top_contexts": [f"the cat [sat{f}] on", f"a dog [ran] far {site}"], "top_documents": [1, 2],
                              "top_tokens": [f"sat{f}", "ran"], "sample_contexts": [f"x [y] z{f}"], "sample_quantiles": [0.5],
                              "top_token": f"sat{f}", "top_token_share": 0.4, "is_token_feature": False,
                              "boosted_tokens": ["good", "happy"] if site == "mlp_out" else [],
                              "suppressed_tokens": ["bad"] if site == "mlp_out" else [], "label": None, "label_share": None,
                              "boost_label": None, "boost_sd": None, "description": f"{site} feature {f} on sat{f}"})
                for cls in ("negative", "positive"):
                    labels.append({"site": site, "feature": f, "channel": "context", "class": cls, "kind": "activation_share",
                                   "value": float(rng.random()), "n_tokens": None})
        features = pd.DataFrame(feats)
        labels = pd.DataFrame(labels)
        for site in ("mlp_out", *sites):  # one part per site, as the features stage writes them
            if "features" not in skip:
                write_table(features[features["site"] == site], run.tables, "features", layer, FEATURES_SCHEMA, part=site)
            if "feature_labels" not in skip:
                write_table(labels[labels["site"] == site], run.tables, "feature_labels", layer, FEATURE_LABELS_SCHEMA,
                            part=site)
        if "sae_metrics" not in skip:
            metrics = pd.DataFrame([{"site": s, "hook": f"blocks.{layer}.hook_{s}", "d_in": 8,
                                     "d_sae": n_out if s == "mlp_out" else n_in, "k": 2, "nmse": 0.1, "l0": 2.0}
                                    for s in ("mlp_out", *sites)])
            write_table(metrics, run.tables, "sae_metrics", layer)
    return run


def plant(run: RunPaths, layer: int, site: str, feature: int, description: str = PLANTED, context: str | None = None) -> None:
    """Replace one feature's description (and first top context) in the features table."""
    features = read_table(run.tables, "features", [layer])
    hit = (features["site"] == site) & (features["feature"] == feature)
    assert hit.sum() == 1
    features.loc[hit, "description"] = description
    if context is not None:
        index = features.index[hit][0]
        features.at[index, "top_contexts"] = [context] + list(features.at[index, "top_contexts"])[1:]
    rows = features[features["site"] == site]
    write_table(rows, run.tables, "features", layer, FEATURES_SCHEMA, part=site)


def load_data(run: RunPaths, name: str):
    return xdata.parse_script((run.explorer / "data" / f"{name}.js").read_text(encoding="utf-8"))


def assert_close_frames(exported: pd.DataFrame, source: pd.DataFrame, columns: list[str]) -> None:
    """Exported columns equal the source's: integers and strings exactly, floats within the rounding."""
    assert len(exported) == len(source)
    for c in columns:
        got, want = list(exported[c]), list(source[c])
        if pd.api.types.is_float_dtype(source[c].dtype):
            for g, w in zip(got, want):
                if w is None or not math.isfinite(w):
                    assert g is None, (c, g, w)
                else:
                    assert g is not None and abs(g - w) <= REL * abs(w) + 1e-300, (c, g, w)
        else:
            assert [None if pd.isna(w) else (int(w) if isinstance(w, (int, np.integer)) else str(w)) for w in want] == got, c


# ------------------------------------------------------------------ unit tests


def test_round_sig_keeps_four_significant_digits():
    values = np.array([0.123456, -98765.4321, 1.0, 0.0, 9.99996, 1.23456e-7, -3.3333e12, float("nan"), float("inf"), 5e-320])
    rounded = xdata.round_sig(values)
    for v, r in zip(values, rounded):
        if not math.isfinite(v):
            assert (math.isnan(v) and math.isnan(r)) or r == v
        elif v == 0:
            assert r == 0
        else:
            assert abs(r - v) <= REL * abs(v), (v, r)
            assert float(f"{v:.4g}") == pytest.approx(r, rel=1e-12)
    assert xdata._floats([0.1234449, 2.0, float("nan"), -0.0]) == [0.1234, 2, None, 0]
    assert len(json.dumps(xdata._floats(np.random.default_rng(0).normal(size=1000)))) < 1000 * 10


def test_export_matches_tables(tmp_path):
    run = synthetic_run(tmp_path / "run")
    write_explorer(run)
    for layer in (0, 1):
        files = {f: load_data(run, f"{f}_L{layer}_resid_mid") for f in ("circuits", "samples")}
        for name, spec in xdata.CIRCUIT_TABLES.items():
            bundle = files[spec.get("file", "circuits")]
            source = read_table(run.tables, name, [layer]).sort_values(spec["sort"], kind="stable").reset_index(drop=True)
            if name == "lowrank_samples":  # ranks 1, 2 and the largest (4) only
                source = source[source["n_eigs"] != 3].reset_index(drop=True)
            columns = [c for c in spec["need"] if c != "layer"]
            exported = xdata.decode_table(bundle[name])
            assert list(exported.columns) == columns
            assert_close_frames(exported, source, columns)
        feats = load_data(run, f"features_L{layer}")
        source = read_table(run.tables, "features", [layer]).sort_values(["site", "feature"]).reset_index(drop=True)
        exported = xdata.decode_table(feats["features"])
        assert_close_frames(exported, source, ["site", "feature", "frequency", "description", "top_token"])
        assert exported["top_contexts"].tolist() == [list(v) for v in source["top_contexts"]]
        assert exported["sample_quantiles"].tolist() == [list(v) for v in source["sample_quantiles"]]
        labels = xdata.decode_table(feats["feature_labels"])
        source = read_table(run.tables, "feature_labels", [layer])
        assert len(labels) == len(source)
        assert sorted(labels["value"]) == pytest.approx(sorted(source["value"]), rel=REL)
    # the index: one row per output feature, with the rank-2 correlation, best gate and top energy share
    index = load_data(run, "index")
    base = xdata.decode_table(index["features"])
    stats = xdata.decode_table(index["stats"]["resid_mid"])
    assert len(base) == 2 * 12 and index["corr_rank"] == 2
    lowrank, gates, eigen = (read_table(run.tables, n) for n in ("lowrank", "gates", "eigen"))
    for i, row in base.iterrows():
        key = (lowrank["layer"] == row["layer"]) & (lowrank["out_feature"] == row["feature"])
        corr = lowrank.loc[key & (lowrank["n_eigs"] == 2), "corr_active"].iloc[0]
        assert (stats.at[i, "corr"] is None) if math.isnan(corr) else stats.at[i, "corr"] == pytest.approx(corr, rel=REL)
        best = gates[(gates["layer"] == row["layer"]) & (gates["out_feature"] == row["feature"]) & eq(gates["data_rank"], 1)]
        assert stats.at[i, "gate_share"] == pytest.approx(best["contribution_share"].iloc[0], rel=REL)
        assert stats.at[i, "gate_and_score"] == pytest.approx(best["and_score"].iloc[0], rel=REL)
        top = eigen[(eigen["layer"] == row["layer"]) & (eigen["out_feature"] == row["feature"]) & (eigen["rank"] == 1)]
        assert stats.at[i, "energy1"] == pytest.approx(top["energy_share"].iloc[0], rel=REL)
        assert row["description"] == f"mlp_out feature {row['feature']} on sat{row['feature']}"
    meta = load_data(run, "meta")
    assert meta["layers"] == [0, 1] and meta["input_sites"] == ["resid_mid"] and meta["missing"] == {"hosvd": "not in this run"}
    assert {(c["layer"], c["site"]): c["n"] for c in meta["counts"]}[(1, "resid_mid")] == 16
    verdicts = xdata.decode_table(meta["verdicts"]["resid_mid"])
    assert len(verdicts) == 2 * 2 and set(verdicts["layer_rank"]) == {1, 2}  # the candidates with a truth table
    assert all(isinstance(v, bool) for v in verdicts["is_and"]) and all(v in (True, False, None) for v in verdicts["negation_gate"])


def test_columns_keep_their_types():
    encode = xdata.encode_column
    assert encode(pd.Series([True, None, False], dtype=object)) == ([True, None, False], None)
    assert encode(pd.Series(["a", None, float("nan"), 3, 2.5], dtype=object)) == (["a", None, None, 3, 2.5], None)
    assert encode(pd.Series(["a", pd.NA], dtype="string")) == (["a", None], None)
    assert encode(pd.Series([1, None], dtype="Int64")) == ([1, None], None)
    assert encode(pd.Series(["x", None, "y", "x"]), categorical=True) == ([0, -1, 1, 0], ["x", "y"])
    assert encode(pd.Series([[0.123456, float("nan")], None, []], dtype=object)) == ([[0.1235, None], [], []], None)
    table = xdata.encode_table(pd.DataFrame({"kind": ["self", "cross", None], "v": [1.0, float("inf"), 0.5]}),
                               categories=["kind"])
    assert xdata.decode_table(table).to_dict("list") == {"kind": ["self", "cross", None], "v": [1, None, 0.5]}


def test_site_files_work_offline(tmp_path):
    run = synthetic_run(tmp_path / "run")
    index = write_explorer(run)
    assert index == run.explorer / "index.html" and index.is_file()
    bundle = plotly_bundle()
    assert bundle is not None, "plotly is a dependency: its bundle must ship with the site"
    assert (run.explorer / "static" / "plotly.min.js").read_bytes() == bundle.read_bytes()
    html = index.read_text(encoding="utf-8")
    app = (run.explorer / "static" / "app.js").read_text(encoding="utf-8")
    for text in (html, app):
        assert "http://" not in text and "https://" not in text and "fetch(" not in text and "XMLHttpRequest" not in text
    for src in ("data/meta.js", "data/index.js", "static/app.js", "static/style.css"):
        assert src in html and (run.explorer / src).is_file()
    names = sorted(p.name for p in (run.explorer / "data").iterdir())
    assert names == sorted(["meta.js", "index.js", "features_L0.js", "features_L1.js", "circuits_L0_resid_mid.js",
                            "circuits_L1_resid_mid.js", "samples_L0_resid_mid.js", "samples_L1_resid_mid.js"])
    for path in (run.explorer / "data").iterdir():
        xdata.parse_script(path.read_text(encoding="utf-8"))  # valid JSON inside
    # rewriting replaces the folder (no stale files)
    (run.explorer / "data" / "stale.js").write_text("x", encoding="utf-8")
    write_explorer(run)
    assert not (run.explorer / "data" / "stale.js").exists()


def test_missing_tables_build_with_sections_marked(tmp_path):
    run = synthetic_run(tmp_path / "run", skip=("eigen", "gates", "gate_truth", "features", "sae_metrics"))
    # a table written by an older version, lacking a column, counts as missing too
    lowrank = read_table(run.tables, "lowrank").drop(columns=["corr_active"])
    shutil.rmtree(run.tables / "lowrank")
    write_table(lowrank, run.tables, "lowrank", 0, part="resid_mid-sae")
    write_explorer(run)
    meta = load_data(run, "meta")
    assert meta["missing"]["eigen"] == "not in this run"
    assert meta["missing"]["features"] == "not in this run"
    assert "corr_active" in meta["missing"]["lowrank"]
    assert {"eigen", "gates", "gate_truth", "features", "sae_metrics", "lowrank"} <= set(meta["missing"])
    assert meta["verdicts"]["resid_mid"] is None and meta["verdicts_missing"]["resid_mid"]
    circuits = load_data(run, "circuits_L0_resid_mid")
    assert circuits["eigen"] is None and circuits["gates"] is None and circuits["interactions"]["n"] > 0
    assert load_data(run, "features_L0")["features"] is None
    index = load_data(run, "index")
    assert index["features"]["n"] == 2 * 12  # the feature count comes from the circuit tables
    assert "gate_share" not in index["stats"]["resid_mid"]["columns"]
    assert "description" not in index["features"]["columns"]
    app = (Path(xdata.__file__).parent / "static" / "app.js").read_text(encoding="utf-8")
    assert "data-missing" in app  # the page marks each section whose table is missing


def test_a_run_without_tables_still_builds(tmp_path):
    run = RunPaths(tmp_path / "empty")
    run.root.mkdir()
    write_explorer(run)
    meta = load_data(run, "meta")
    assert meta["layers"] == [] and meta["present"] == [] and "interactions" in meta["missing"]
    assert load_data(run, "index")["features"]["n"] == 0


def test_several_input_sites(tmp_path):
    run = synthetic_run(tmp_path / "run", layers=(0,), sites=("mlp_in", "resid_mid"))
    write_explorer(run)
    meta = load_data(run, "meta")
    assert meta["input_sites"] == ["resid_mid", "mlp_in"]
    for site in meta["input_sites"]:
        bundle = load_data(run, f"circuits_L0_{site}")
        source = read_table(run.tables, "interactions")
        assert bundle["interactions"]["n"] == int((source["input_site"] == site).sum())
    assert set(load_data(run, "index")["stats"]) == {"resid_mid", "mlp_in"}


def test_table_text_stays_data_and_the_shell_is_escaped(tmp_path):
    root = tmp_path / "run <i>&amp"  # a folder name is text too
    run = synthetic_run(root, layers=(0,))
    plant(run, 0, "mlp_out", 3, PLANTED, PLANTED_CONTEXT)
    write_explorer(run)
    html = (run.explorer / "index.html").read_text(encoding="utf-8")
    assert "<i>" not in html and "run &lt;i&gt;&amp;amp" in html
    text = (run.explorer / "data" / "features_L0.js").read_text(encoding="utf-8")
    assert "\u2028" not in text  # a raw line separator would end a JS string in older engines
    features = xdata.decode_table(xdata.parse_script(text)["features"])
    row = features[(features["site"] == "mlp_out") & (features["feature"] == 3)].iloc[0]
    assert row["description"] == PLANTED and row["top_contexts"][0] == PLANTED_CONTEXT
    index = xdata.decode_table(load_data(run, "index")["features"])
    assert index.loc[index["feature"] == 3, "description"].iloc[0] == PLANTED


def test_serve_binds_locally_and_serves_the_site(tmp_path, monkeypatch, capsys):
    run = synthetic_run(tmp_path / "run", layers=(0,))
    write_explorer(run)
    server = make_server(run.explorer, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
            assert response.status == 200 and b'id="main"' in response.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/meta.js", timeout=10) as response:
            assert xdata.parse_script(response.read().decode())["layers"] == [0]
    finally:
        server.shutdown()
        server.server_close()

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(http.server.ThreadingHTTPServer, "serve_forever", interrupted)
    serve(run.explorer, port=0)
    out = capsys.readouterr().out
    assert "http://127.0.0.1:" in out and "Ctrl-C" in out and "stopped" in out
    with pytest.raises(FileNotFoundError):
        make_server(tmp_path / "nowhere", port=0)


# ------------------------------------------------------------------ in a browser

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BUDGET_MS = 2000


def chromium_path() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The small demo (every stage, explorer included), with a planted description on the
    best gate's output feature and on one of its inputs. EXPLORER_TEST_RUN=DIR reuses the
    tables of a finished small demo in DIR instead (copied; for working on the explorer)."""
    from pipelines.demo import DemoConfig, run_demo

    run = RunPaths(tmp_path_factory.mktemp("explorer_demo"))
    reuse = os.environ.get("EXPLORER_TEST_RUN")
    if reuse:
        shutil.copytree(RunPaths(reuse).tables, run.tables)
        write_explorer(run)
    else:
        run_demo(run, DemoConfig.small())
    assert (run.explorer / "index.html").is_file()
    gates = read_table(run.tables, "gates")
    best = gates[eq(gates["layer_rank"], 1)].sort_values("layer").iloc[-1]
    layer, out, a = int(best["layer"]), int(best["out_feature"]), int(best["in_a"])
    plant(run, layer, "mlp_out", out, PLANTED, PLANTED_CONTEXT)
    plant(run, layer, "resid_mid", a, PLANTED + " (input)")
    start = time.perf_counter()
    write_explorer(run)
    return SimpleNamespace(paths=run, tables=run.tables, explorer=run.explorer, build_s=time.perf_counter() - start,
                           best=(layer, out, a, int(best["in_b"])))


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; the browser is Debian's chromium)")
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium at /usr/bin/chromium (apt-get install chromium) or $CHROMIUM")
    profile = tempfile.mkdtemp(prefix="explorer-chromium-")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=path, args=CHROMIUM_ARGS, headless=True,
                                                       viewport={"width": 1400, "height": 1000})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


class Page:
    """A page of the explorer, with the console errors and the requests it made."""

    def __init__(self, context, root: Path):
        self.page = context.new_page()
        self.root = root
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("dialog", lambda d: (self.errors.append(f"dialog: {d.message}"), d.dismiss()))

    def open(self, hash_: str = "") -> dict:
        """Load index.html (a fresh document) at `hash_`; the render timing, counted from the
        document's start (loading the page and its data included)."""
        self.page.goto((self.root / "index.html").as_uri() + hash_)
        timing = self.wait(1)
        start = timing["at"] - timing["ms"]  # when the app began to render
        return {**timing, "ms": timing["at"], "content": timing["content"] + start}

    def go(self, hash_: str) -> dict:
        """Follow a route within the page, as a link does."""
        n = self.page.evaluate("window.BCX_TIMINGS.length")
        self.page.evaluate(f"location.hash = {json.dumps(hash_)}")
        return self.wait(n + 1)

    def wait(self, n: int) -> dict:
        self.page.wait_for_function(f"window.BCX_TIMINGS && window.BCX_TIMINGS.length >= {n} && "
                                    "document.getElementById('main').dataset.ready === '1'", timeout=30000)
        return self.page.evaluate("window.BCX_TIMINGS[window.BCX_TIMINGS.length - 1]")

    def after_click(self, selector: str) -> dict:
        n = self.page.evaluate("window.BCX_TIMINGS.length")
        self.page.click(selector)
        return self.wait(n + 1)

    def text(self, selector: str) -> str:
        return self.page.inner_text(selector)


def js_number(value: float) -> str:
    """A number as the app prints it: `String(Number(v.toPrecision(4)))` in JavaScript."""
    r = float(f"{value:.4g}")
    if r == int(r) and abs(r) < 1e21:
        return str(int(r))
    if 1e-6 <= abs(r) < 1e21:
        return np.format_float_positional(r, trim="-")
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{m.group(1)}{m.group(2)}", repr(r))


def eq(series: pd.Series, value) -> pd.Series:
    """`series == value` with nulls False (for nullable integer columns)."""
    return series.eq(value).fillna(False).astype(bool)


@pytest.mark.slow
def test_explorer_in_a_browser(browser, demo_run):  # browser first: its skip saves the demo
    run = demo_run
    layer, out, a, b = run.best
    site = run.explorer
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    timings = {}
    shots = Path(os.environ.get("EXPLORER_SHOTS") or tempfile.mkdtemp(prefix="explorer-shots-"))
    shots.mkdir(parents=True, exist_ok=True)
    page = Page(browser, site)
    p = page.page

    # the index: every output feature, searchable, filterable and sortable
    timings["index (cold)"] = page.open()
    features = read_table(run.tables, "features")
    outs = features[features["site"] == "mlp_out"]
    assert p.locator("#index-body tr").count() == min(200, len(outs))
    assert f"{len(outs)} output features in all" in page.text("#index-count")
    p.screenshot(path=str(shots / "index.png"))
    token = outs.loc[outs["top_token"].notna(), "top_token"].value_counts().index[0]
    p.fill("#search", token)
    rows = p.locator("#index-body tr")
    assert 0 < rows.count() < len(outs)
    for text in rows.all_inner_texts():
        assert token.lower() in text.lower()
    p.fill("#search", "")
    p.select_option("#layer-filter", str(layer))
    layers = p.eval_on_selector_all("#index-body tr", "rows => rows.map(r => r.dataset.layer)")
    assert set(layers) == {str(layer)} and len(layers) == int((outs["layer"] == layer).sum())
    p.click("#index-table th[data-key='corr']")
    values = [float(v) for v in p.eval_on_selector_all("#index-body tr td:nth-child(5)", "c => c.map(x => x.textContent)")
              if v != "–"]
    assert values == sorted(values, reverse=True) and values
    p.fill("#search", "pwned")  # the planted description is found, and shown as text
    assert p.locator("#index-body tr").count() == 1
    assert "<script>" in page.text("#index-body")
    assert p.evaluate("window.__pwned") is None

    # the output feature page, by clicking through from the index (once the index has had the
    # second or so it takes to start Plotly in the background, as it has for a reader)
    p.wait_for_function("window.Plotly !== undefined", timeout=30000)
    timings["output feature (from the index)"] = page.after_click(f"#index-body tr[data-feature='{out}'] td:nth-child(2) a")
    assert p.evaluate("location.hash") == f"#/out/{layer}/{out}"
    assert page.text("#description") == PLANTED
    assert p.evaluate("window.__pwned") is None and p.locator("#main script, #main img").count() == 0
    assert "<b>no</b>" in page.text("#feature .contexts")  # the planted context, as text
    assert p.locator("#feature mark").count() >= 1
    row = features[(features["layer"] == layer) & (features["site"] == "mlp_out") & (features["feature"] == out)].iloc[0]
    body = page.text("#main")
    assert js_number(row["frequency"]) in body
    for tok in row["boosted_tokens"]:
        assert tok in page.text(".logits")
    inter = read_table(run.tables, "interactions", [layer])
    mine = inter[(inter["out_feature"] == out) & (inter["outputs"] == "sae")]
    top_cross = mine[mine["kind"] == "cross"].sort_values("rank").iloc[0]
    assert js_number(top_cross["coefficient"]) in page.text("table.interactions")
    eigen = read_table(run.tables, "eigen", [layer])
    top_eig = eigen[(eigen["out_feature"] == out) & (eigen["rank"] == 1)].iloc[0]
    assert js_number(top_eig["eigenvalue"]) in body
    lowrank = read_table(run.tables, "lowrank", [layer])
    corr = lowrank[(lowrank["out_feature"] == out) & (lowrank["n_eigs"] == 2)]["corr_active"].iloc[0]
    if math.isfinite(corr):
        assert js_number(corr) in page.text("table.lowrank")
    gates = read_table(run.tables, "gates", [layer])
    best = gates[(gates["out_feature"] == out) & eq(gates["layer_rank"], 1)].iloc[0]
    assert js_number(best["contribution_share"]) in page.text("table.gates")
    assert p.locator(".gate-card table.truth").count() >= 1 and p.locator(".gate-card .verdict").count() >= 1
    assert p.locator("#heatmap .main-svg").count() >= 1 and p.locator("#spectrum .main-svg").count() >= 1
    # the scatter of sampled tokens: as many points per rank as the table holds for the feature
    samples = read_table(run.tables, "lowrank_samples", [layer])
    samples = samples[(samples["out_feature"] == out) & (samples["outputs"] == "sae")]
    points = p.evaluate("document.getElementById('samples-plot').data.filter(t => t.mode === 'markers').map(t => t.x.length)")
    assert points and set(points) == {int((samples["n_eigs"] == 1).sum())}
    # hover a heatmap cell: the pair and its coefficient; click it: links to both inputs
    cell = p.evaluate("""() => {
        const el = document.getElementById('heatmap'), t = el.data[0], xa = el._fullLayout.xaxis, ya = el._fullLayout.yaxis;
        for (let i = 0; i < t.z.length; i++) for (let j = 0; j < t.z.length; j++) if (i !== j && t.z[i][j] !== null) {
            const box = el.getBoundingClientRect();
            return {x: box.left + xa._offset + xa.l2p(j), y: box.top + ya._offset + ya.l2p(i), coef: t.z[i][j], ids: t.customdata[i][j]};
        }
        return null; }""")
    if cell is not None:
        p.mouse.move(cell["x"], cell["y"])
        p.wait_for_selector(".hoverlayer .hovertext", timeout=5000)
        hover = p.text_content(".hoverlayer")
        assert js_number(cell["coef"]) in hover and f"in #{cell['ids'][0]}" in hover
        p.mouse.click(cell["x"], cell["y"])
        p.wait_for_selector("#heatmap-pick a")
        assert f"/in/{layer}/{cell['ids'][0]}" in p.inner_html("#heatmap-pick")
    p.screenshot(path=str(shots / "feature.png"))

    # a link to an input feature: the planted input description, and it builds the output we came from
    timings["input feature (link)"] = page.after_click(f"table.gates a[href='#/in/{layer}/{a}']")
    assert p.evaluate("location.hash") == f"#/in/{layer}/{a}"
    assert page.text("#description") == PLANTED + " (input)"
    assert f"#/out/{layer}/{out}" in p.inner_html("#in-gates")
    uses = inter[((inter["in_a"] == a) | (inter["in_b"] == a)) & (inter["kind"] != "constant")]
    if len(uses):
        strongest = uses.loc[uses["coefficient"].abs().idxmax()]
        assert js_number(strongest["coefficient"]) in page.text("table.builds")
    assert p.evaluate("window.__pwned") is None

    # the layer page: distributions and the best gates by layer rank, with verdicts
    timings["layer"] = page.go(f"#/layer/{layer}")
    assert p.locator("#hist-corr .main-svg").count() >= 1
    ranked = gates[gates["layer_rank"].notna()].sort_values("layer_rank")
    assert p.locator("table.best-gates tbody tr").count() == min(100, len(ranked))
    first = p.locator("table.best-gates tbody tr").first.inner_text()
    assert f"out #{int(ranked.iloc[0]['out_feature'])}" in first
    assert js_number(ranked.iloc[0]["contribution_share"]) in first

    # feature ids that do not exist, and routes that do not exist
    for bad in (f"#/out/{layer}/99999", "#/out/77/0", f"#/in/{layer}/-3", "#/out/x/y", "#/nowhere"):
        page.go(bad)
        assert p.locator("#not-found").count() == 1, bad
        assert "Not found" in page.text("#not-found")
    timings["not found"] = page.go(f"#/out/{layer}/99999")
    assert "99999" in page.text("#not-found")

    # a fresh document opened straight on a feature page (Plotly starts up with it)
    cold = Page(browser, site)
    timings["output feature (cold)"] = cold.open(f"#/out/{layer}/{out}")
    timings["output feature (warm)"] = cold.go(f"#/out/{layer}/{0 if out else 1}")
    timings["index (back)"] = cold.go("#/")

    assert not page.errors and not cold.errors, page.errors + cold.errors
    assert all(u.startswith("file://") for u in page.requests + cold.requests), "the site must not use the network"
    report = {k: {"ms": round(v["ms"]), "content_ms": round(v.get("content", v["ms"]))} for k, v in timings.items()}
    print(f"\nexplorer: {size / 1e6:.1f} MB, rebuilt in {run.build_s:.1f} s; render times: {json.dumps(report)}")
    assert size < 50e6 and run.build_s < 60
    for name, t in timings.items():
        assert t.get("content", t["ms"]) < BUDGET_MS, (name, t)  # text and tables on screen
        if "cold" not in name:
            assert t["ms"] < BUDGET_MS, (name, t)  # everything, plots included
    # a cold document also waits for Plotly's own start-up (about a second on a busy 2-core machine)
    assert timings["output feature (cold)"]["ms"] < 2.5 * BUDGET_MS


@pytest.mark.slow
def test_explorer_marks_missing_tables_in_a_browser(browser, demo_run, tmp_path):
    run = RunPaths(tmp_path / "partial")
    shutil.copytree(demo_run.tables, run.tables)
    for name in ("eigen", "eigen_inputs", "gates", "feature_labels"):
        shutil.rmtree(run.tables / name)
    write_explorer(run)
    page = Page(browser, run.explorer)
    page.open("#/out/0/0")
    p = page.page
    for name in ("eigen", "eigen_inputs", "gates", "feature_labels"):
        assert p.locator(f"#main [data-missing='{name}']").count() >= 1, name
    assert "Missing: the eigen table (not in this run)" in page.text("#main")
    assert p.locator("table.interactions").count() >= 1  # what is there is still shown
    page.go("#/layer/0")
    assert p.locator("#main [data-missing='gates']").count() >= 1
    page.go("#/")
    assert p.locator("#main [data-missing='gates']").count() == 1
    assert not page.errors, page.errors
