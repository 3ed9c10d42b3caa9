"""The Python API (`bilinear_circuits`): objects in memory against the command line's tables on
the same model, SAEs and tokens; a run folder against its own tables; the caller's model left
as it was."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

import bilinear_circuits as bc
from pipelines.cli import main

# float64: the two sides then agree to rounding (in float32 a lone eigh and a batched one differ in the 6th digit)
CIRCUITS = ["--top-n", "10", "--max-rank", "4", "--corr-rows", "16", "--min-active", "3", "--n-gates", "5",
            "--dtype", "float64"]
LAYER = 1


def _sae(hook: str, d_in: int, d_sae: int, k: int, seed: int):
    """An sae-lens TopK SAE with random weights (a unit-norm decoder, its transpose as encoder)."""
    from sae_lens import TopKSAE, TopKSAEConfig

    torch.manual_seed(seed)
    sae = TopKSAE(TopKSAEConfig(d_in=d_in, d_sae=d_sae, k=k))
    sae.cfg.metadata.hook_name = hook
    with torch.no_grad():
        W_dec = torch.nn.functional.normalize(torch.randn(d_sae, d_in), dim=1)
        sae.W_dec.copy_(W_dec)
        sae.W_enc.copy_(W_dec.T)
        sae.b_dec.copy_(0.1 * torch.randn(d_in))
    return sae


@pytest.fixture(scope="module")
def byo(tmp_path_factory):
    """A model and two sae-lens SAEs built in memory, the same saved for the CLI, and the CLI's
    circuit tables of layer 1 computed from them."""
    from pipelines.data.tokenizer import TokenizerConfig, train_tokenizer
    from pipelines.lm.model import PRESETS, build_model, save_model

    root = tmp_path_factory.mktemp("byo")
    assert main(["corpus", "--out", str(root / "corpus_run"), "--n-stories", "300", "--seed", "2"]) == 0
    texts = pd.read_parquet(root / "corpus_run" / "corpus" / "part.parquet")["text"].tolist()
    tok = train_tokenizer(texts, TokenizerConfig(vocab_size=400))
    cfg = PRESETS["tiny"].replace(d_vocab=tok.get_vocab_size())
    model = build_model(cfg, seed=0).eval()
    save_model(model, cfg, root / "lm")
    tok.save(str(root / "lm" / "tokenizer.json"))
    sae_in = _sae(f"blocks.{LAYER}.hook_resid_mid", 32, 128, 4, seed=1)
    sae_out = _sae(f"blocks.{LAYER}.hook_mlp_out", 32, 128, 4, seed=2)
    sae_in.save_model(str(root / "sae_in"))
    sae_out.save_model(str(root / "sae_out"))
    out = root / "run"
    assert main(["circuits", "--out", str(out), "--model", str(root / "lm"), "--corpus", str(root / "corpus_run" /
                 "corpus"), "--layer", str(LAYER), "--sae-in", str(root / "sae_in"), "--sae-out", str(root / "sae_out"),
                 "--threads", "1", *CIRCUITS]) == 0
    from pipelines.data.tokens import open_token_store

    assert main(["features", "--out", str(out), "--model", str(root / "lm"), "--corpus", str(root / "corpus_run" /
                 "corpus"), "--layer", str(LAYER), "--sae-in", str(root / "sae_in"), "--sae-out", str(root / "sae_out"),
                 "--threads", "1", "--rows", "16"]) == 0
    (store,) = [open_token_store(p) for p in (out / "tokens").iterdir()]
    tokens = np.asarray(store.held_out.tokens[:16], dtype=np.int64)
    tables = {name: pd.read_parquet(out / "tables" / name) for name in ("interactions", "eigen", "lowrank", "gates")}
    tables["features"] = pd.read_parquet(out / "tables" / "features")
    return model, tok, sae_in, sae_out, tokens, tables


def _config():
    return bc.CircuitConfig(top_n=10, max_rank=4, min_active=3, n_gates=5, dtype="float64")


def _active_features(tables: dict, n: int) -> list[int]:
    lowrank = tables["lowrank"]
    busy = lowrank[(lowrank["n_eigs"] == 2) & lowrank["corr_active"].notna()]
    return busy.sort_values("n_active", ascending=False)["out_feature"].head(n).tolist()


def test_objects_in_memory_give_the_clis_tables(byo):
    model, tok, sae_in, sae_out, tokens, tables = byo
    layer = bc.Layer(model, sae_in, sae_out, tokens=torch.from_numpy(tokens), tokenizer=tok, config=_config())
    assert layer.layer == LAYER and layer.input_site == "resid_mid"  # read from the SAEs' hook names
    chosen = _active_features(tables, 3)
    assert len(chosen) == 3
    for f in chosen:
        feature = layer.feature(f)
        mine = feature.interactions.sort_values(["kind", "rank"]).reset_index(drop=True)
        cli = tables["interactions"]
        cli = cli[cli["out_feature"] == f].sort_values(["kind", "rank"]).reset_index(drop=True)
        assert len(mine) == len(cli) > 0
        assert (mine[["in_a", "in_b", "kind"]].to_numpy() == cli[["in_a", "in_b", "kind"]].to_numpy()).all()
        np.testing.assert_allclose(mine["coefficient"], cli["coefficient"], rtol=1e-10, atol=1e-12)
        eig = tables["eigen"]
        np.testing.assert_allclose(feature.eigenvalues, eig[eig["out_feature"] == f].sort_values("rank")["eigenvalue"],
                                   rtol=1e-10, atol=1e-12)
        low = tables["lowrank"]
        row = low[(low["out_feature"] == f) & (low["n_eigs"] == 2)].iloc[0]
        assert feature.correlation(2) == pytest.approx(row["corr_active"], rel=1e-9, abs=1e-12)
        assert int(feature.lowrank.loc[feature.lowrank["n_eigs"] == 2, "n_active"].iloc[0]) == row["n_active"]
        gates = tables["gates"]
        theirs = gates[gates["out_feature"] == f].sort_values("weight_rank").reset_index(drop=True)
        ours = feature.gates
        assert (ours[["in_a", "in_b"]].to_numpy() == theirs[["in_a", "in_b"]].to_numpy()).all()
        np.testing.assert_allclose(ours["contribution_share"], theirs["contribution_share"], rtol=1e-9, atol=1e-12)


def test_a_whole_layer_in_memory_gives_the_clis_tables(byo):
    from pipelines.schemas import TABLES

    model, tok, sae_in, sae_out, tokens, tables = byo
    whole = bc.Layer(model, sae_in, sae_out, tokens=tokens, tokenizer=tok, config=_config()).tables()
    for name, cli in tables.items():
        if name == "features":
            continue
        order = list(TABLES[name].sort)
        ours = whole[name].sort_values(order).reset_index(drop=True)[cli.columns]
        pd.testing.assert_frame_equal(ours, cli.sort_values(order).reset_index(drop=True), check_dtype=False,
                                      rtol=1e-9)


def test_descriptions_in_memory_are_the_features_commands(byo):
    model, tok, sae_in, sae_out, tokens, tables = byo
    layer = bc.Layer(model, sae_in, sae_out, tokens=tokens, tokenizer=tok, config=_config())
    mine = layer.describe(bc.FeatureConfig(n_rows=16))
    theirs = tables["features"]
    key = ["site", "feature"]
    mine, theirs = (t.sort_values(key).reset_index(drop=True) for t in (mine, theirs))
    assert (mine[key] == theirs[key]).all().all() and len(mine) == 256
    for column in ("frequency", "max_activation", "mean_activation"):
        np.testing.assert_allclose(mine[column], theirs[column], rtol=1e-6)
    assert mine["top_token"].tolist() == theirs["top_token"].tolist()
    assert [list(b) for b in mine["boosted_tokens"]] == [list(b) for b in theirs["boosted_tokens"]]
    f = _active_features(tables, 1)[0]
    feature = layer.feature(f)
    assert feature.description == theirs.query("site == 'mlp_out' and feature == @f")["description"].iloc[0]
    assert feature.contexts and all("[" in c for c in feature.contexts)
    assert feature.top_interactions(3)["a_description"].notna().all()


def test_texts_are_tokenized_padded_and_truncated_on_request(byo):
    model, tok, sae_in, sae_out, tokens, _ = byo
    texts = ["once upon a time there was a little dog. " * 2, "she was not happy."]
    layer = bc.Layer(model, sae_in, sae_out, texts=texts, tokenizer=tok, config=_config())
    # padded with BOS, which is skipped: the analysed positions are every text token but the first
    n = sum(int(b.x.shape[0]) for b in layer.batches()())
    assert n == sum(len(tok.encode(t).ids) for t in texts)  # BOS + ids, less the first position
    long = ["the dog ran and ran " * 40]
    with pytest.raises(ValueError, match=r"texts\[0\] has \d+ tokens, more than the model's context of 64"):
        bc.Layer(model, sae_in, sae_out, texts=long, tokenizer=tok)
    cut = bc.Layer(model, sae_in, sae_out, texts=long, tokenizer=tok, truncate=True)
    assert sum(int(b.x.shape[0]) for b in cut.batches()()) == 63


def test_a_feature_alone_equals_the_whole_layer_in_memory(byo):
    model, tok, sae_in, sae_out, tokens, _ = byo
    layer = bc.Layer(model, sae_in, sae_out, tokens=tokens, tokenizer=tok, config=_config())
    whole = layer.tables()
    f = _active_features(whole, 1)[0]
    alone = layer.feature(f)
    mine = whole["eigen_inputs"][whole["eigen_inputs"]["out_feature"] == f].reset_index(drop=True)
    np.testing.assert_allclose(alone.eigen_reads["cosine"], mine["cosine"], rtol=1e-9, atol=1e-12)
    assert (alone.eigen_reads["in_feature"].to_numpy() == mine["in_feature"].to_numpy()).all()
    judged = layer.feature(f, verdicts=True)  # no labels or descriptions in memory: the gates still get types
    assert len(judged.pair_gates) > 0 and judged.pair_gates["gate_type"].notna().all()
    assert set(judged.pair_gates["out_feature"]) == {f} and judged.verdicts is not None
    ranked = layer.circuits()
    assert ranked["layer_rank"].is_monotonic_increasing or ranked["layer_rank"].isna().any()


def test_bad_arguments_are_named(byo):
    model, tok, sae_in, sae_out, tokens, _ = byo
    with pytest.raises(ValueError, match="pass tokens or texts, not both"):
        bc.Layer(model, sae_in, sae_out, tokens=tokens, texts=["a"], tokenizer=tok)
    with pytest.raises(ValueError, match=r"tokens has rows of 80 tokens"):
        bc.Layer(model, sae_in, sae_out, tokens=np.zeros((2, 80), dtype=np.int64))
    with pytest.raises(ValueError, match="sae_in reads layer 1's mlp_out"):
        bc.Layer(model, sae_out, sae_out)
    with pytest.raises(ValueError, match=r"feature must be an output feature in \[0, 128\), got 500"):
        bc.Layer(model, sae_in, sae_out).feature(500)


def test_a_graph_leaves_the_callers_model_as_it_was(byo):
    model, tok, sae_in, sae_out, _, _ = byo
    before = copy.deepcopy(model.state_dict())
    graph = bc.attribution_graph("she was not happy", model, {LAYER: (sae_in, sae_out)}, tok)
    assert next(model.parameters()).dtype == torch.float32 and model.cfg.dtype == torch.float32
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert 0 < graph.completeness <= 1 + 1e-9 and 0 < graph.replacement <= 1 + 1e-9
    assert set(graph.nodes["kind"]) >= {"token", "logit", "input", "output"}
    path = graph.top_path
    assert path["kind"].iloc[0] == "token" and path["kind"].iloc[-1] == "logit"
    too_long = r"^prompt has \d+ tokens, more than the model.s context of 64: shorten it or pass truncate=True$"
    with pytest.raises(ValueError, match=too_long):
        bc.attribution_graph("the dog " * 30, model, {LAYER: (sae_in, sae_out)}, tok)
    cut = bc.attribution_graph("the dog " * 30, model, {LAYER: (sae_in, sae_out)}, tok, truncate=True)
    assert len(cut.tokens) == 64


def test_a_bad_target_is_refused_by_its_argument_before_any_work(byo, small_demo, monkeypatch):
    import pipelines.graph.build

    model, tok, sae_in, sae_out, _, _ = byo
    copies = _counted(monkeypatch, pipelines.graph.build, "float64_copy")
    bad = bc.GraphConfig(target="zzqqxx unicorn")
    named = r"^config.target 'zzqqxx unicorn' is not a token of the vocabulary \(it splits into \["
    with pytest.raises(ValueError, match=named):
        bc.attribution_graph("she was not", model, {LAYER: (sae_in, sae_out)}, tok, bad)
    with pytest.raises(ValueError, match=named):
        bc.open_run(small_demo).graph("she was not", bad)
    assert copies == []


# ------------------------------------------------------------------ a run folder: the small demo


CIRCUIT_TABLES = ("interactions", "gates", "gate_truth", "eigen", "eigen_inputs", "lowrank", "lowrank_samples")


def _parquet(run, name: str) -> pd.DataFrame:
    frame = pd.read_parquet(run / "tables" / name)
    return frame[(frame["input_site"] == "resid_mid") & (frame["outputs"] == "sae")] if "outputs" in frame else frame


def test_a_runs_feature_is_its_tables_rows(small_demo):
    run = bc.open_run(small_demo)
    lowrank = _parquet(small_demo, "lowrank")
    verdicts = _parquet(small_demo, "gate_verdicts").sort_values(["layer", "circuit_rank"])
    assert len(run.circuits()) == len(verdicts)
    for layer, f in verdicts[["layer", "out_feature"]].head(3).itertuples(index=False):
        feature = run.feature(int(layer), int(f))
        row = lowrank[(lowrank["layer"] == layer) & (lowrank["out_feature"] == f) & (lowrank["n_eigs"] == 2)]
        assert feature.correlation(2) == row["corr_active"].iloc[0]
        assert feature.verdicts["verdict"].tolist() == verdicts[(verdicts["layer"] == layer)
                                                                 & (verdicts["out_feature"] == f)]["verdict"].tolist()
        described = feature.top_interactions(3)
        assert described["a_description"].notna().all() and len(described) == 3
        assert feature.description == pd.read_parquet(small_demo / "tables" / "features").query(
            "layer == @layer and site == 'mlp_out' and feature == @f")["description"].iloc[0]
        for figure in (feature.spectrum_figure(), feature.interactions_figure(), feature.scatter_figure()):
            assert type(figure).__name__ == "Figure" and figure.axes


def test_a_runs_graph_has_the_graph_commands_scores_and_leaves_its_model(small_demo):
    import json

    run = bc.open_run(small_demo)
    saved = json.loads((small_demo / "graphs" / "graph-metadata.json").read_text())["graphs"][0]
    nodes = pd.read_parquet(small_demo / "tables" / "graph_nodes")
    target = nodes[(nodes["prompt"] == saved["slug"]) & (nodes["kind"] == "logit")]["token"].iloc[0]
    graph = run.graph(saved["prompt"], bc.GraphConfig(target=target))
    # float32 attribution (the demo's precision): sums in another order agree to about 1e-7
    assert graph.completeness == pytest.approx(saved["completeness_score"], rel=1e-6)
    assert graph.replacement == pytest.approx(saved["replacement_score"], rel=1e-6)
    mine = nodes[nodes["prompt"] == saved["slug"]].reset_index(drop=True)
    assert sorted(graph.nodes["node_id"]) == sorted(mine["node_id"])  # the table is written in its sort order
    assert next(run.model.parameters()).dtype == torch.float32


def _without_circuit_tables(small_demo, tmp_path, layer: int):
    import shutil

    copy_ = tmp_path / "run"
    shutil.copytree(small_demo, copy_)
    for name in CIRCUIT_TABLES:
        shutil.rmtree(copy_ / "tables" / name / f"layer{layer}")
    for stamp in (copy_ / "tables" / ".stamps").glob(f"circuits-layer{layer}-*"):
        stamp.unlink()
    return copy_


def test_a_feature_without_tables_is_computed_alone_with_the_runs_numbers(small_demo, tmp_path):
    copy_ = _without_circuit_tables(small_demo, tmp_path, 1)
    lowrank = _parquet(small_demo, "lowrank")
    interactions = _parquet(small_demo, "interactions")
    busy = lowrank[(lowrank["layer"] == 1) & (lowrank["n_eigs"] == 2) & lowrank["corr_active"].notna()]
    f = int(busy.sort_values("n_active").iloc[-1]["out_feature"])
    feature = bc.open_run(copy_).feature(1, f)
    assert not (copy_ / "tables" / "interactions" / "layer1").exists()  # nothing written
    expected = busy[busy["out_feature"] == f].iloc[0]
    # float32 math: a lone eigh and a batched one differ in the last digits
    assert feature.correlation(2) == pytest.approx(expected["corr_active"], rel=1e-4, abs=1e-5)
    theirs = interactions[(interactions["layer"] == 1) & (interactions["out_feature"] == f)]
    theirs = theirs.sort_values(["kind", "rank"])
    mine = feature.interactions.sort_values(["kind", "rank"])
    assert (mine[["in_a", "in_b"]].to_numpy() == theirs[["in_a", "in_b"]].to_numpy()).all()
    np.testing.assert_allclose(mine["coefficient"], theirs["coefficient"], rtol=1e-5, atol=1e-6)
    # judged alone: its pairs tested by intervention as the verdicts stage tested them in the whole layer
    pairs = _parquet(small_demo, "pair_gates")
    pairs = pairs[(pairs["layer"] == 1) & (pairs["out_feature"] == f)]
    ours = feature.pair_gates.merge(pairs, on=["in_a", "in_b"], suffixes=("", "_run"))
    assert len(ours) == len(pairs) == len(feature.pair_gates) > 0
    assert (ours["gate_type"] == ours["gate_type_run"]).all()
    # the layer's shortlist (its best candidates across every output) is retested on more tokens: a
    # feature judged alone has another shortlist, so only candidates read on as many tokens compare
    same = ours[ours["iv_tokens"] == ours["iv_tokens_run"]]
    assert len(same) >= len(ours) // 2
    np.testing.assert_allclose(same["causal_score"], same["causal_score_run"], rtol=1e-4, atol=1e-6)
    assert len(feature.verdicts) >= 1 and feature.verdicts["verdict"].notna().all()


def _counted(monkeypatch, module, name: str) -> list:
    """Replace `module.name` by a wrapper that records each call's arguments; the record."""
    calls, real = [], getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def _busy_feature(small_demo, layer: int) -> int:
    lowrank = _parquet(small_demo, "lowrank")
    busy = lowrank[(lowrank["layer"] == layer) & (lowrank["n_eigs"] == 2) & lowrank["corr_active"].notna()]
    return int(busy.sort_values("n_active").iloc[-1]["out_feature"])


def test_a_run_loads_its_saes_tokens_and_graph_model_once(small_demo, tmp_path, monkeypatch):
    """A notebook asks a run for features, layers and graphs again and again: the SAEs, the token
    store and the graphs' float64 model are loaded on the first call, not on every call."""
    import pipelines.graph.build
    import pipelines.inputs
    import pipelines.stages

    copy_ = _without_circuit_tables(small_demo, tmp_path, 1)  # layer 1 computed alone, layer 0 from tables
    saes = _counted(monkeypatch, pipelines.inputs, "load_sae")
    stores = _counted(monkeypatch, pipelines.stages, "ensure_tokens")
    copies = _counted(monkeypatch, pipelines.graph.build, "float64_copy")
    run = bc.open_run(copy_)
    alone, tabled = _busy_feature(small_demo, 1), _busy_feature(small_demo, 0)
    for _ in range(2):
        run.feature(1, alone, verdicts=False)
        run.feature(0, tabled).interactions_figure()  # the figure reads the layer's SAEs
        run.layer(1)
    assert run.layer(1) is run.layer(1)
    assert len(stores) == 1
    assert sorted(str(call[0]) for call in saes) == sorted(str(run.paths.sae(layer, site)) for layer in (0, 1)
                                                           for site in ("resid_mid", "mlp_out"))
    saes.clear()
    for _ in range(2):
        run.graph("she was not")
    assert len(copies) == 1
    assert len(saes) == 4  # both layers' pairs once, as float64 tensors for the graphs


def test_a_runs_cached_results_equal_a_fresh_runs(small_demo, tmp_path):
    copy_ = _without_circuit_tables(small_demo, tmp_path, 1)
    f = _busy_feature(small_demo, 1)
    run = bc.open_run(copy_)
    run.feature(1, f)
    run.graph("she was not")
    again, fresh = run.feature(1, f), bc.open_run(copy_).feature(1, f)
    from bilinear_circuits.run import FEATURE_TABLES

    compared = [name for name in FEATURE_TABLES if fresh.table(name) is not None]
    assert {"interactions", "lowrank", "pair_gates", "gate_verdicts"} <= set(compared)
    for name in FEATURE_TABLES:
        if name in compared:
            pd.testing.assert_frame_equal(again.table(name), fresh.table(name), obj=name)
        else:
            assert again.table(name) is None, name
    pd.testing.assert_frame_equal(run.graph("she was not").nodes, bc.open_run(copy_).graph("she was not").nodes)


def test_a_stage_called_from_python_writes_the_clis_tables(small_demo, tmp_path):
    import json

    copy_ = _without_circuit_tables(small_demo, tmp_path, 0)
    job = bc.CircuitsJob.from_json(json.loads((small_demo / "demo_config.json").read_text())["circuits"])
    computed = bc.run_stage("circuits", copy_, job, runtime=bc.Runtime(threads=1))
    assert computed == ["layer 0 resid_mid-sae"]  # layer 1 was kept
    for name in CIRCUIT_TABLES:
        ours, theirs = (pd.read_parquet(root / "tables" / name / "layer0") for root in (copy_, small_demo))
        pd.testing.assert_frame_equal(ours, theirs, rtol=1e-6)
    with pytest.raises(ValueError, match="stage must be one of circuits, features, verdicts"):
        bc.run_stage("report", copy_)


def test_a_graph_saves_circuit_tracers_files_and_serves_them(byo, tmp_path):
    import json
    import urllib.request

    from circuit_tracer.frontend.graph_models import Model

    model, tok, sae_in, sae_out, _, _ = byo
    graph = bc.attribution_graph("she was not happy", model, {LAYER: (sae_in, sae_out)}, tok)
    path = graph.save(tmp_path)
    data = json.loads(path.read_text())
    assert Model(**data).metadata.slug == graph.slug == path.stem
    assert data["metadata"]["completeness_score"] == graph.completeness
    assert len(pd.read_parquet(tmp_path / "tables" / "graph_edges")) == len(graph.edges)
    viewer = graph.serve(tmp_path)
    try:
        port = viewer.url.split(":")[2].split("/")[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/viewer/graph_data/{graph.slug}.json", timeout=10) as answer:
            assert json.loads(answer.read())["metadata"]["slug"] == graph.slug
    finally:
        viewer.stop()


def test_saving_a_graph_writes_the_frames_it_holds(byo, tmp_path, monkeypatch):
    """`Graph.save` writes the node, edge and AND frames the graph built, not new ones, and not
    what a notebook did to the public frames since."""
    import pipelines.graph.export

    model, tok, sae_in, sae_out, _, tables = byo
    built = {name: _counted(monkeypatch, pipelines.graph.export, name) for name in ("node_frame", "edge_frame",
                                                                                   "and_frame")}
    graph = bc.attribution_graph("she was not happy", model, {LAYER: (sae_in, sae_out)}, tok,
                                 descriptions=tables["features"])
    kept = graph.nodes.copy()
    graph.nodes.drop(graph.nodes.index[1:], inplace=True)  # a notebook's edit: not what the graph saves
    graph.nodes = kept
    edited = graph.edges
    graph.edges = graph.edges.iloc[:0]
    graph.save(tmp_path)
    graph.edges = edited
    assert {name: len(calls) for name, calls in built.items()} == {"node_frame": 1, "edge_frame": 1, "and_frame": 1}
    for name, frame, key in (("graph_nodes", graph.nodes, ["node_id"]), ("graph_edges", graph.edges, ["source", "target"]),
                             ("graph_and_edges", graph.and_edges, ["target", "source_a", "source_b"])):
        written = pd.read_parquet(tmp_path / "tables" / name)[frame.columns]  # written in the table's sort order
        assert len(frame) > 0, name
        pd.testing.assert_frame_equal(written.sort_values(key, ignore_index=True), frame.sort_values(key, ignore_index=True),
                                      check_dtype=False, obj=name)


def test_the_report_and_the_explorer_from_python(small_demo, tmp_path):
    import shutil

    copy_ = tmp_path / "run"
    shutil.copytree(small_demo, copy_)
    shutil.rmtree(copy_ / "report")
    shutil.rmtree(copy_ / "explorer")
    page = bc.report(copy_, bc.ReportConfig(cards_per_layer=1), layers=[1], runtime=bc.Runtime(threads=1))
    assert page == copy_ / "report" / "index.html" and "layer 1" in page.read_text().lower()
    assert list((copy_ / "report").glob("L1_*_scatter.png")) and not list((copy_ / "report").glob("L0_*"))
    index = bc.explore(copy_)
    assert index.is_file() and (copy_ / "explorer" / "data" / "features_L1.js").is_file()
