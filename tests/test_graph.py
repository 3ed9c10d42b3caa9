"""`bilinear-circuits graph` on a tiny trained run: circuit-tracer's schemas accept every file,
the tables add up (every target's incoming edges plus constant equal its value), the links
name kept nodes, and bad input gets a one-line error."""

from __future__ import annotations

import json

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
    data = json.loads((run / "graphs" / "she-was-not.json").read_text())
    assert [n["clerp"] for n in data["nodes"] if n["feature_type"] == "logit"][0].startswith('Output "happy"')
    capsys.readouterr()
    for args, message in [
        (["--prompt", "   "], "--prompt is empty"),
        (["--prompt", "she was " * 80], "more than the model's context of 64"),
        (["--prompt", "she was not", "--target", "zzqqxx unicorn"], "is not a token of the vocabulary"),
        (["--prompt", "she was not", "--node-threshold", "1.5"], "node_threshold"),
    ]:
        assert main(["graph", *base, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err, err
    # SAEs of another model: an SAE of another width, recorded as reading layer 0
    from sae.topk import TopKSAE, save_sae_lens

    other = save_sae_lens(TopKSAE(16, 64, 4), tmp_path / "other", {"hook_name": "blocks.0.hook_resid_mid"})
    assert main(["graph", *base, "--prompt", "she was not", "--layer", "0", "--sae-in", str(other),
                 "--sae-out", str(run / "saes" / "layer0_mlp_out")]) == 2
    err = capsys.readouterr().err
    assert "reads width 16 but the model's d_model is 32" in err


def test_explicit_saes_of_one_layer(run):
    out = ["--out", str(run), "--threads", "1"]
    assert main(["graph", *out, "--prompt", "The dog was happy", "--layer", "1", "--sae-in",
                 str(run / "saes" / "layer1_resid_mid"), "--sae-out", str(run / "saes" / "layer1_mlp_out")]) == 0
    nodes = schemas.read(run / "tables", "graph_nodes")
    nodes = nodes[nodes["prompt"] == "the-dog-was-happy"]
    features = nodes[nodes["kind"].isin(["input", "output"])]
    assert set(features["layer"]) == {1}
    # layer 0's MLP is one error node per position, holding its whole output
    assert (nodes[(nodes["layer"] == 0)]["kind"] == "output_error").all()
    assert len(nodes[nodes["layer"] == 0]) == len(nodes[nodes["kind"] == "token"])
    assert torch.isfinite(torch.tensor(pd.to_numeric(nodes["value"]).to_numpy())).all()
