"""`bilinear-circuits graph` on a tiny trained run: circuit-tracer's schemas accept every file,
the tables add up (every target's incoming edges plus constant equal its value), the links
name kept nodes, and bad input gets a one-line error."""

from __future__ import annotations

import json
import shutil
import tarfile
import threading
from pathlib import Path

import pandas as pd
import pytest
import torch

from pipelines import schemas
from pipelines.cli import main

pytestmark = pytest.mark.slow

PROMPTS = ["Lily was sad. She was not", "Once upon a time, there was a girl"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    base = ["--out", str(out), "--threads", "1"]
    assert main(["corpus", "--out", str(out), "--n-stories", "1500", "--seed", "3"]) == 0
    assert main(["train-lm", *base, "--preset", "tiny", "--train-tokens", "40000", "--vocab-size", "600"]) == 0
    assert main(["train-saes", *base, "--train-tokens", "20480", "--batch-size", "1024", "--k", "4"]) == 0
    assert main(["features", *base, "--rows", "48"]) == 0
    prompts = out / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")
    assert main(["graph", *base, "--prompts", str(prompts)]) == 0
    return out


def _last_slug(run: Path) -> str:
    """The name of the graph written last (graph names carry a digest of prompt and settings)."""
    return json.loads((run / "graphs" / "graph-metadata.json").read_text())["graphs"][-1]["slug"]


def test_files_pass_circuit_tracers_schemas(run):
    from circuit_tracer.frontend.feature_models import Model as Feature
    from circuit_tracer.frontend.graph_models import Model

    meta = json.loads((run / "graphs" / "graph-metadata.json").read_text())
    assert [g["prompt"] for g in meta["graphs"]] == PROMPTS
    for entry in meta["graphs"]:
        data = json.loads((run / "graphs" / f"{entry['slug']}.json").read_text())
        graph = Model(**data)
        ids = {n.node_id for n in graph.nodes}
        assert len(ids) == len(graph.nodes)
        assert graph.links and all(link["source"] in ids and link["target"] in ids for link in graph.links)
        kinds = {n.feature_type for n in graph.nodes}
        assert {"embedding", "logit", "cross layer transcoder"} <= kinds
        assert sum(n.is_target_logit for n in graph.nodes) == 1
        assert [n.ctx_idx for n in graph.nodes if n.feature_type == "embedding"] == list(range(len(data["metadata"]["prompt_tokens"])))
        features = [n for n in graph.nodes if n.feature_type == "cross layer transcoder"]
        # labels come from the features table, and the viewer finds each feature's detail file
        assert all(n.clerp and "no description" not in n.clerp for n in features)
        for n in features:
            Feature(**json.loads((run / "graphs" / "features" / f"{n.feature}.json").read_text()))


def test_tables_add_up_and_match_the_json(run):
    nodes = schemas.read(run / "tables", "graph_nodes")
    edges = schemas.read(run / "tables", "graph_edges")
    ands = schemas.read(run / "tables", "graph_and_edges")
    assert set(nodes["prompt"]) == set(edges["prompt"]) == {json.loads(p.read_text())["metadata"]["slug"]
                                                           for p in (run / "graphs").glob("*.json")
                                                           if p.name != "graph-metadata.json"}
    targets = nodes[nodes["kind"].isin(["input", "output", "logit"])]
    scale = targets["incoming"].abs() + targets["constant"].abs() + targets["value"].abs()
    assert ((targets["incoming"] + targets["constant"] - targets["value"]).abs() <= 1e-4 * scale).all()
    kept = nodes[nodes["kept"]]
    assert set(edges["source"]) | set(edges["target"]) <= set(kept["node_id"])
    first = nodes["prompt"].iloc[0]
    data = json.loads((run / "graphs" / f"{first}.json").read_text())
    assert {n["node_id"] for n in data["nodes"]} == set(kept[kept["prompt"] == first]["node_id"])
    # an AND hyperedge joins two parts of the same layer and position as its output target
    by_id = nodes.set_index(["prompt", "node_id"])
    for r in ands.head(20).itertuples():
        t, a, b = (by_id.loc[(r.prompt, x)] for x in (r.target, r.source_a, r.source_b))
        assert t["kind"] == "output" and a["kind"] in ("input", "input_error") and b["kind"] in ("input", "input_error")
        assert t["layer"] == a["layer"] == b["layer"] and t["pos"] == a["pos"] == b["pos"]


def test_target_option_and_bad_input(run, tmp_path, capsys):
    base = ["--out", str(run), "--threads", "1"]
    assert main(["graph", *base, "--prompt", "She was not", "--target", "happy"]) == 0
    data = json.loads((run / "graphs" / f"{_last_slug(run)}.json").read_text())
    assert [n["clerp"] for n in data["nodes"] if n["feature_type"] == "logit"][0].startswith('Output "happy"')
    capsys.readouterr()
    for args, message in [
        (["--prompt", "   "], "--prompt is empty"),
        (["--prompt", "she was " * 80], "more than the model's context of 64"),
        (["--prompt", "she was not", "--target", "zzqqxx unicorn"], "--target 'zzqqxx unicorn' is not a token of the vocabulary"),
        (["--prompt", "she was not", "--node-threshold", "1.5"], "node_threshold"),
    ]:
        assert main(["graph", *base, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err, err
    # SAEs of another model: an SAE of another width, recorded as reading layer 0
    from sae.topk import TopKAutoencoder, save_sae_lens

    other = save_sae_lens(TopKAutoencoder(16, 64, 4), tmp_path / "other", {"hook_name": "blocks.0.hook_resid_mid"})
    assert main(["graph", *base, "--prompt", "she was not", "--layer", "0", "--sae-in", str(other),
                 "--sae-out", str(run / "saes" / "layer0_mlp_out")]) == 2
    err = capsys.readouterr().err
    assert "reads width 16 but the model's d_model is 32" in err


def test_saes_trained_on_another_model_of_the_same_shape_are_refused(run, tmp_path, capsys):
    """An SAE of the same width and hook, but trained on another model (its stamp records that
    model's digest), is refused by name rather than read as if it belonged to this one."""
    other = tmp_path / "other_resid_mid"
    shutil.copytree(run / "saes" / "layer0_resid_mid", other)
    stamp = json.loads((other / ".stamp.json").read_text())
    stamp["inputs"]["model"] = "0" * 64
    (other / ".stamp.json").write_text(json.dumps(stamp))
    capsys.readouterr()
    assert main(["graph", "--out", str(run), "--threads", "1", "--prompt", "she was not", "--layer", "0",
                 "--sae-in", str(other), "--sae-out", str(run / "saes" / "layer0_mlp_out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and str(other) in err and "another model" in err and "\n" not in err, err


def test_explicit_saes_of_one_layer(run):
    out = ["--out", str(run), "--threads", "1"]
    assert main(["graph", *out, "--prompt", "The dog was happy", "--layer", "1", "--sae-in",
                 str(run / "saes" / "layer1_resid_mid"), "--sae-out", str(run / "saes" / "layer1_mlp_out")]) == 0
    nodes = schemas.read(run / "tables", "graph_nodes")
    nodes = nodes[nodes["prompt"] == _last_slug(run)]
    features = nodes[nodes["kind"].isin(["input", "output"])]
    assert set(features["layer"]) == {1}
    # layer 0's MLP is one error node per position, holding its whole output
    assert (nodes[(nodes["layer"] == 0)]["kind"] == "output_error").all()
    assert len(nodes[nodes["layer"] == 0]) == len(nodes[nodes["kind"] == "token"])
    assert torch.isfinite(torch.tensor(pd.to_numeric(nodes["value"]).to_numpy())).all()


def _graph_files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for folder in ("graphs", "tables/graph_nodes")
            for p in sorted((run / folder).rglob("*")) if p.is_file()}


def _refused(argv: list[str], capsys, *words: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and all(w in err for w in words), err
    return err


def test_layer_must_exist_and_have_saes(run, tmp_path, capsys):
    """Issue 51 item 8: `--layer 7`, `-1` or a layer without SAEs made a graph of every layer."""
    base = ["graph", "--out", str(run), "--threads", "1", "--prompt", "she was not"]
    before = _graph_files(run)
    for layer in ("7", "-1"):
        _refused([*base, "--layer", layer], capsys, f"--layer {layer}", "0 to 1")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "saes" / "layer1_mlp_out")
    _refused(["graph", "--out", str(copy), "--threads", "1", "--prompt", "she was not", "--layer", "1"], capsys,
             "--layer 1", "layers with both: 0")
    assert _graph_files(run) == before
    # a layer with SAEs: only its latents are nodes
    assert main([*base, "--layer", "0"]) == 0
    nodes = schemas.read(run / "tables", "graph_nodes")
    kinds = nodes[nodes["prompt"] == json.loads((run / "graphs" / "graph-metadata.json").read_text())["graphs"][-1]["slug"]]
    assert set(kinds[kinds["kind"].isin(["input", "output"])]["layer"]) == {0}
    assert (kinds[kinds["layer"] == 1]["kind"] == "output_error").all()


def test_labels_come_only_from_a_features_table_of_the_same_saes(run, tmp_path, capsys):
    """Issue 51 item 7: the run's features table describes its own SAEs; a graph from other SAEs
    (here the layer's SAEs copied with one file more: another digest, as another seed's SAEs
    have) labelled their latents with it. `report` and `verdicts` refuse that; `graph` too."""
    other = tmp_path / "layer0_resid_mid"
    shutil.copytree(run / "saes" / "layer0_resid_mid", other)
    (other / "note.txt").write_text("retrained")
    before = _graph_files(run)
    _refused(["graph", "--out", str(run), "--threads", "1", "--prompt", "she was not", "--layer", "0", "--sae-in",
              str(other), "--sae-out", str(run / "saes" / "layer0_mlp_out")], capsys,
             "layer 0 resid_mid features table", str(other), "rerun `features`")
    assert _graph_files(run) == before
    # retrained in place (the run's own SAE changed after `features`): refused the same way
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "saes" / "layer0_mlp_out" / "note.txt").write_text("retrained")
    _refused(["graph", "--out", str(copy), "--threads", "1", "--prompt", "she was not"], capsys,
             "layer 0 mlp_out features table", "rerun `features`")


def test_prompt_files_are_utf8_with_or_without_a_byte_order_mark_and_checked_whole(run, tmp_path, capsys):
    """Issue 51 items 9 and 13: a byte-order mark is not part of the first prompt; a Latin-1
    file is named; a too-long line is named by file and line before any graph is written."""
    base = ["graph", "--out", str(run), "--threads", "1"]
    marked = tmp_path / "marked.txt"
    marked.write_bytes("\ufeffShe was not\n".encode("utf-8"))
    assert main([*base, "--prompts", str(marked)]) == 0
    meta = json.loads((run / "graphs" / "graph-metadata.json").read_text())["graphs"][-1]
    assert meta["prompt"] == "She was not" and "[UNK]" not in "".join(meta["prompt_tokens"])
    assert main([*base, "--prompt", "She was not"]) == 0
    plain = json.loads((run / "graphs" / "graph-metadata.json").read_text())["graphs"][-1]
    assert meta["prompt_tokens"] == plain["prompt_tokens"]
    latin = tmp_path / "latin.txt"
    latin.write_bytes("she was not caf\xe9\n".encode("latin-1"))
    _refused([*base, "--prompts", str(latin)], capsys, f"--prompts {latin}", "not UTF-8")
    long = tmp_path / "long.txt"
    long.write_text("she was sad\nthe dog was happy\n\n" + "she was " * 80 + "\n")
    before = _graph_files(run)
    _refused([*base, "--prompts", str(long)], capsys, f"--prompts {long}, line 4", "more than the model's context")
    assert _graph_files(run) == before  # lines 1 and 2 are not written either


NPM = Path(__file__).resolve().parents[1] / ".cache" / "npm"  # `make install` fetches these packages
JETPACK, DAGRE = NPM / "d3-jetpack-2.3.0.tgz", NPM / "dagre-0.8.5.tgz"


def _npm_file(package: Path, member: str) -> str:
    with tarfile.open(package) as tar:
        return tar.extractfile(f"package/{member}").read().decode()


def _d3_with_jetpack() -> str:
    """npm's d3 v7 + jetpack bundle, its jetpack methods put on the prototypes `d3.select` uses
    (the bundle holds two copies of d3-selection and patches the other one)."""
    bundle = _npm_file(JETPACK, "build/d3v7+jetpack.js")
    marker = "selection.prototype.translate = translateSelection;"
    head, _, tail = bundle.rpartition(marker)
    tail = tail.replace("selection.prototype.", "selection$1.prototype.").replace("transition.prototype.",
                                                                                 "transition$1.prototype.")
    return head + marker.replace("selection.", "selection$1.") + tail


def _viewer_scripts() -> dict[str, str]:
    """What the test serves for the viewer's scripts from the web, by file name: d3 with npm's
    jetpack, our shim for the rest of the web-hosted jetpack build, npm's dagre (the subgraph's
    layout); the others (live reload, .npy and gzip readers) are unused on our files and left empty."""
    return {"d3.js": _d3_with_jetpack(), "dagre.min.js": _npm_file(DAGRE, "dist/dagre.min.js"),
            "jetpack_2024-07-20.js": (Path(__file__).parent / "circuit_tracer_viewer_shim.js").read_text()}


def _viewer_page(p, port: int, errors: list):
    """Chromium and a page for the viewer served on `port`: its scripts from the web replaced by
    `_viewer_scripts`, page errors collected in `errors`."""
    from tests.test_explorer import CHROMIUM_ARGS, chromium_path

    scripts = _viewer_scripts()
    browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route(lambda url: not url.startswith(f"http://127.0.0.1:{port}/"),
               lambda route: route.fulfill(body=scripts.get(route.request.url.rsplit("/", 1)[1], ""),
                                           content_type="application/javascript"))
    return browser, page


def test_circuit_tracers_viewer_draws_the_served_graph(run):
    """circuit-tracer's own server and front end, in Debian's chromium: the page lists our
    graphs, fetches the one asked for, its own data code keeps every node and link, its link
    graph draws one mark per node of our file, and clicking the top logit draws its links and
    lists its input features.

    The viewer loads d3 and its helpers from the web; here they come from npm and from our shim
    of the viewer's jetpack build (`_viewer_scripts`).
    """
    from tests.test_explorer import chromium_path

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed")
    if chromium_path() is None or not (JETPACK.is_file() and DAGRE.is_file()):
        pytest.skip("needs Debian's chromium and npm's d3-jetpack and dagre (make install fetches them)")
    from pipelines.graph.serve import graph_server

    slug = json.loads((run / "graphs" / "graph-metadata.json").read_text())["graphs"][0]["slug"]
    data = json.loads((run / "graphs" / f"{slug}.json").read_text())
    from pipelines.engine.paths import RunPaths

    from pipelines.graph.serve import viewer_path

    server = graph_server(RunPaths(run), 0)
    assert server.server_address[0] == "127.0.0.1"
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    errors, fetched = [], []
    try:
        with sync_playwright() as p:
            browser, page = _viewer_page(p, port, errors)
            page.on("response", lambda r: fetched.append((r.status, r.url)))
            page.goto(f"http://127.0.0.1:{port}/{viewer_path(slug)}")
            page.wait_for_function("document.querySelectorAll('select.graph-prompt-select option').length > 0")
            options = page.eval_on_selector_all("select.graph-prompt-select option", "els => els.map(e => e.value)")
            page.wait_for_function("document.querySelectorAll('.link-graph text.node').length > 0", timeout=20000)
            seen = page.evaluate("""async slug => {
                const data = await util.getFile(`./graph_data/${slug}.json`)
                const formatted = await utilCg.formatData(data, {pinnedIds: []})
                return {nodes: formatted.nodes.map(d => d.nodeId), links: formatted.links.length,
                        logits: formatted.nodes.filter(d => d.feature_type == 'logit').map(d => d.logitPct)}
            }""", slug)
            # each mark's node and its place: inside the plot, on its own spot
            drawn = page.eval_on_selector_all(".link-graph text.node", """els => els.map(e => {
                const r = e.getBoundingClientRect()
                return {id: e.__data__.nodeId, type: e.__data__.feature_type, x: r.x + r.width / 2,
                        y: r.y + r.height / 2, clerp: e.__data__.clerp, p: e.__data__.logitPct}})""")
            plot = page.eval_on_selector(".link-graph svg", "e => { const r = e.getBoundingClientRect(); "
                                         "return [r.x, r.y, r.x + r.width, r.y + r.height] }")
            top = max((d for d in drawn if d["type"] == "logit"), key=lambda d: d["p"])
            page.mouse.click(top["x"], top["y"])
            page.wait_for_function("document.querySelectorAll('.link-graph text.node.clicked').length == 1")
            clicked = page.eval_on_selector(".link-graph text.node.clicked", "e => e.__data__.nodeId")
            painted = page.evaluate("""() => [...document.querySelectorAll('.link-graph canvas')].map(cv => {
                const a = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data
                let n = 0
                for (let i = 3; i < a.length; i += 4) n += a[i] > 0
                return n })""")
            title = page.inner_text(".node-connections .feature-title")
            inputs = page.eval_on_selector_all(".node-connections .input .feature-row", "els => els.map(e => e.__data__.nodeId)")
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    assert not errors, errors
    assert set(options) == {g["slug"] for g in json.loads((run / "graphs" / "graph-metadata.json").read_text())["graphs"]}
    assert (200, f"http://127.0.0.1:{port}/viewer/graph_data/{slug}.json") in fetched
    assert sorted(seen["nodes"]) == sorted(n["node_id"] for n in data["nodes"])
    assert seen["links"] == len(data["links"])
    assert all(p > 0 for p in seen["logits"])  # the viewer parses each logit's probability from its label
    assert sorted(d["id"] for d in drawn) == sorted(n["node_id"] for n in data["nodes"])
    assert all(plot[0] < d["x"] < plot[2] and plot[1] < d["y"] < plot[3] for d in drawn)
    assert len({(round(d["x"], 1), round(d["y"], 1)) for d in drawn}) == len(drawn)
    assert clicked == top["id"] and title == top["clerp"]
    # its incoming links, drawn on the canvas layers, their sources listed as its input features
    assert any(painted), painted
    sources = {link["source"] for link in data["links"] if link["target"] == top["id"] and link["weight"] != 0}
    assert sources and sorted(inputs) == sorted(sources)


def test_demo_graph_of_a_negation_prompt(run):
    """The demo's graph: a prompt of the corpus ending just before a negated sentiment word,
    its target that word's first piece, the printed path starting at the negation's token."""
    from pipelines.demo import NEGATION, DemoConfig, negation_graph, negation_prompt
    from pipelines.engine.paths import RunPaths
    from pipelines.inputs import ModelInputs

    cfg = DemoConfig.small()
    prompt, word, cue = negation_prompt(cfg.stories)
    assert NEGATION.search(prompt[cue[0]:cue[1]]) and not prompt.endswith(word)
    lines = negation_graph(RunPaths(run), ModelInputs(run / "lm"), cfg)
    path = next(line for line in lines if "strongest path:" in line).split("strongest path: ")[1]
    first = path.split(" -> ")[0]
    assert path != "none" and NEGATION.search(first.split('"')[1]), lines
    assert path.split(" -> ")[-1].startswith("logit")


def test_report_draws_each_graph(run, tmp_path):
    from pipelines.engine.paths import RunPaths
    from pipelines.report.page import _graphs, _Pictures

    shown = _graphs(RunPaths(run), _Pictures(tmp_path, 40))
    slugs = {g["slug"] for g in json.loads((run / "graphs" / "graph-metadata.json").read_text())["graphs"]}
    assert {g["slug"] for g in shown} <= slugs and len(shown) == min(3, len(slugs))
    for g in shown:
        assert (tmp_path / g["picture"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert 0 <= g["replacement"] <= 1 and 0 <= g["completeness"] <= 1 and g["path"]


def _copy_run(run: Path, tmp_path: Path) -> Path:
    """A copy of the module's run for tests that write graphs (the other tests read its own)."""
    out = tmp_path / "run"
    shutil.copytree(run, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def test_graph_names_never_collide_and_a_rerun_replaces_only_its_own(run, tmp_path):
    """Issue 51, items 5 and 6: prompts differing in case or punctuation, sharing their first 60
    slug characters, ending in a number like the old "-2" suffix, made of punctuation or of
    non-Latin letters overwrote each other's JSON, index entry and table parts across commands;
    the prompt "Graph metadata" replaced the viewer's index. Each is one command here."""
    out = _copy_run(run, tmp_path)
    base = ["--out", str(out), "--threads", "1"]
    long = "Once upon a time there was a girl who liked to play in the park with"
    prompts = ["Lily was sad. She was not", "lily was sad; she was NOT", long + " her dog", long + " her cat",
               "Lily was sad", "Lily was sad 2", "?!", "...", "Graph metadata", "features", "Лили была грустной",
               "莉莉很难过"]
    index = out / "graphs" / "graph-metadata.json"
    before = {g["slug"] for g in json.loads(index.read_text())["graphs"]}
    for prompt in prompts:
        assert main(["graph", *base, "--prompt", prompt]) == 0, prompt
    graphs = json.loads(index.read_text())["graphs"]
    # the module's run has a graph of prompts[0] with these settings: it was replaced, not added
    assert len(graphs) == len(before) + len(prompts) - 1 and len({g["slug"] for g in graphs}) == len(graphs)
    mine = [next(g for g in graphs if g["prompt"] == prompt) for prompt in prompts]
    slugs = [g["slug"] for g in mine]
    assert len(set(slugs)) == len(prompts) and not {"graph-metadata", "features"} & set(slugs)
    for g in mine:
        assert json.loads((out / "graphs" / f"{g['slug']}.json").read_text())["metadata"]["prompt"] == g["prompt"]
    nodes = pd.read_parquet(out / "tables" / "graph_nodes")
    assert set(slugs) <= set(nodes["prompt"]) and before <= set(nodes["prompt"])  # earlier graphs kept
    # the same prompt and settings again: its own graph replaced, nothing added
    files = sorted(p.name for p in (out / "graphs").iterdir())
    assert main(["graph", *base, "--prompt", prompts[0]]) == 0
    assert sorted(p.name for p in (out / "graphs").iterdir()) == files
    again = json.loads(index.read_text())["graphs"]
    assert len(again) == len(graphs) and again[-1]["slug"] == slugs[0]
    assert len(pd.read_parquet(out / "tables" / "graph_nodes")) == len(nodes)
    # other settings make another graph
    assert main(["graph", *base, "--prompt", prompts[0], "--node-threshold", "0.5"]) == 0
    assert len(json.loads(index.read_text())["graphs"]) == len(graphs) + 1


XSS = '<img src=x onerror="window.__xss = (window.__xss || 0) + 1">'


def _skip_without_viewer_browser() -> None:
    from tests.test_explorer import chromium_path

    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed")
    if chromium_path() is None or not (JETPACK.is_file() and DAGRE.is_file()):
        pytest.skip("needs Debian's chromium and npm's d3-jetpack and dagre (make install fetches them)")


def _hover_every_node(out: Path, url: str) -> dict:
    """Serve the run `out` as `graph --serve` does, open the viewer at `url` (relative to the
    server) and hover each node: the page errors, the nodes' positions, the tooltip each showed
    (its text, its element count, its `img[onerror]` count), how many times `XSS` ran, the
    images in the page and the Content-Security-Policy directives that blocked something."""
    from playwright.sync_api import sync_playwright

    from pipelines.engine.paths import RunPaths
    from pipelines.graph.serve import graph_server

    server = graph_server(RunPaths(out), 0)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen = {"errors": [], "shown": []}
    try:
        with sync_playwright() as p:
            browser, page = _viewer_page(p, port, seen["errors"])
            page.add_init_script("""window.__blocked = [];
                document.addEventListener('securitypolicyviolation', e => window.__blocked.push(e.violatedDirective))""")
            page.goto(f"http://127.0.0.1:{port}/{url}")
            page.wait_for_function("document.querySelectorAll('.link-graph text.node').length > 0", timeout=20000)
            seen["marks"] = page.eval_on_selector_all(".link-graph text.node", """els => els.map(e => {
                const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]})""")
            for x, y in seen["marks"]:
                page.mouse.move(x, y)
                page.wait_for_timeout(30)
                seen["shown"].append(page.eval_on_selector(".tooltip", """t => [t.textContent,
                    t.querySelectorAll('*').length, t.querySelectorAll('img[onerror]').length]"""))
            page.wait_for_timeout(300)  # an image's error event fires after it fails to load
            seen["ran"], seen["images"], seen["blocked"] = page.evaluate(
                "[window.__xss || 0, document.querySelectorAll('img').length, window.__blocked]")
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    return seen


def test_html_in_labels_runs_no_script_in_the_viewer(run, tmp_path):
    """Issue 51, item 3: a label holding HTML reached each node's `clerp`, which the viewer's
    tooltip inserts as HTML, and ran script on hover. With every feature description (what the
    labels become) and the prompt carrying an `<img onerror>`, hovering every node of circuit-
    tracer's viewer, served by `graph --serve`'s server, runs nothing and shows the text."""
    _skip_without_viewer_browser()
    from pipelines.graph.serve import viewer_path

    out = _copy_run(run, tmp_path)
    for part in (out / "tables" / "features").rglob("*.parquet"):
        frame = pd.read_parquet(part)
        pd.DataFrame.to_parquet(frame.assign(description=[f"context={XSS} #{i}" for i in range(len(frame))]), part)
    assert main(["graph", "--out", str(out), "--threads", "1", "--prompt", "Lily was <b>sad</b> <img>. She was not"]) == 0
    slug = json.loads((out / "graphs" / "graph-metadata.json").read_text())["graphs"][-1]["slug"]
    data = json.loads((out / "graphs" / f"{slug}.json").read_text())
    assert any(XSS in n["clerp"].replace("&lt;", "<").replace("&gt;", ">") for n in data["nodes"])
    seen = _hover_every_node(out, viewer_path(slug))
    errors, marks, shown, ran, images = (seen[k] for k in ("errors", "marks", "shown", "ran", "images"))
    assert not errors, errors
    assert len(marks) == len(data["nodes"]) and ran == 0 and images == 0
    texts = [text for text, _, _ in shown]
    assert any(XSS in t for t in texts), texts[:5]  # the label reached the tooltip, as text
    # no '<' left where the viewer inserts text as HTML (the labels, and the prompt's tokens in token nodes' labels)
    assert not [t for t in data["metadata"]["prompt_tokens"] if "<" in t] and not [n for n in data["nodes"] if "<" in n["clerp"]]


def test_script_in_the_viewers_url_runs_nothing(run):
    """circuit-tracer's viewer takes node labels from its URL (`?clerps=[[feature, label]]`) and
    its tooltip inserts them as HTML, so a link could run an `<img onerror>` on hover. The
    server's Content-Security-Policy runs only the page's own scripts: hovering every node
    with such a label runs nothing, and the only thing the policy blocks is that handler."""
    from urllib.parse import quote

    from pipelines.graph.serve import viewer_path

    _skip_without_viewer_browser()

    slug = _last_slug(run)
    nodes = json.loads((run / "graphs" / f"{slug}.json").read_text())["nodes"]
    # labels are keyed by feature index; a logit's label carries its probability, which the viewer parses
    tokens = {n["feature"] for n in nodes if n["feature_type"] in ("logit", "embedding")}
    keys = {n["feature"] for n in nodes if n["feature_type"] != "logit" and n["feature_type"] != "embedding"} - tokens
    assert -1 in keys  # the reconstruction error nodes, as in the report's `clerps=[["-1", ...]]`
    clerps = json.dumps([[str(k), XSS] for k in sorted(keys)])
    seen = _hover_every_node(run, f"{viewer_path(slug)}&clerps={quote(clerps)}")
    errors, marks, shown, ran, blocked = (seen[k] for k in ("errors", "marks", "shown", "ran", "blocked"))
    assert not errors, errors
    assert marks and any(n for _, _, n in shown)  # the URL's label reached the tooltip as markup
    assert ran == 0 and blocked and set(blocked) == {"script-src-attr"}, (ran, blocked)
