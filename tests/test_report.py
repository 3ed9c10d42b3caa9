"""The HTML report on a tiny run: self-contained, escaped, every figure a valid PNG, wording
that follows the labels the corpus has."""

from __future__ import annotations

import re
import shutil

import pandas as pd
import pytest
from PIL import Image

from pipelines.cli import main
from pipelines.engine.tables import table_path, write_table
from pipelines.analysis.features import FEATURE_LABELS_SCHEMA, FEATURES_SCHEMA

pytestmark = pytest.mark.slow

PLANTED = "<b>negation</b> & 'context' \"AND\""  # must reach the page escaped, never as markup
HEADINGS = ["Model and corpus", "SAEs", "Low-rank correlations per layer", "Gate candidates per layer"]
SMALL = ["--scatter-rows", "24", "--dpi", "40"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    base = ["--out", str(out)]
    assert main(["corpus", *base, "--n-stories", "1500", "--seed", "3"]) == 0
    assert main(["train-lm", *base, "--preset", "tiny", "--train-tokens", "40000", "--vocab-size", "600"]) == 0
    assert main(["train-saes", *base, "--train-tokens", "20480", "--batch-size", "1024", "--k", "4"]) == 0
    assert main(["circuits", *base, "--top-n", "8", "--max-rank", "4", "--corr-rows", "48", "--min-active", "3"]) == 0
    assert main(["features", *base, "--rows", "48"]) == 0
    # plant the description on the output feature of layer 0's best gate, which the report shows
    gates = pd.read_parquet(out / "tables" / "gates")
    best = gates[(gates["layer"] == 0) & (gates["layer_rank"] == 1)].iloc[0]
    path = table_path(out / "tables", "features", 0, "mlp_out")
    features = pd.read_parquet(path)
    features.loc[features["feature"] == best["out_feature"], "description"] = PLANTED
    write_table(features, out / "tables", "features", 0, FEATURES_SCHEMA, part="mlp_out")
    return out


@pytest.fixture(scope="module")
def page(run):
    assert main(["report", "--out", str(run), *SMALL]) == 0
    index = run / "report" / "index.html"
    return index, index.read_text(encoding="utf-8")


def test_page_has_every_section_and_the_model_figures(page):
    _, text = page
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in text, heading
    for layer in (0, 1):
        assert f"<h3>Layer {layer}</h3>" in text
    assert "bits per byte" in text and "nats per token" in text and "documents" in text
    assert "nmse" in text and "loss_added" in text
    assert "comes from the corpus&#39;s own labels" in text or "comes from the corpus's own labels" in text


def test_page_is_self_contained(page):
    index, text = page
    assert not re.search(r"https?://", text)
    assert "<script" not in text.lower()
    sources = re.findall(r'src="([^"]*)"', text)
    assert sources
    for src in sources:
        assert (index.parent / src).is_file() and (index.parent / src).parent == index.parent


def test_feature_descriptions_are_escaped(page):
    _, text = page
    assert PLANTED not in text
    assert "&lt;b&gt;negation&lt;/b&gt; &amp;" in text


def test_figures_are_valid_pngs(page):
    index, text = page
    pngs = sorted(index.parent.glob("*.png"))
    assert {p.name for p in pngs} == set(re.findall(r'src="([^"]*)"', text))
    assert any(p.name.endswith("_scatter.png") for p in pngs) and any(p.name.endswith("_interactions.png") for p in pngs)
    for png in pngs:
        with Image.open(png) as image:
            image.verify()
            assert image.format == "PNG"


def test_rewriting_leaves_no_stale_files(run, page):
    index, _ = page
    stale = index.parent / "stale.png"
    stale.write_bytes(b"")
    assert main(["report", "--out", str(run), *SMALL]) == 0
    assert not stale.exists() and index.is_file()


def test_missing_tables_leave_notes(run, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(run, bare)
    for name in ("lowrank", "gates", "gate_truth", "gate_ablation", "features", "feature_labels"):
        shutil.rmtree(bare / "tables" / name)
    assert main(["report", "--out", str(bare), *SMALL]) == 0
    text = (bare / "report" / "index.html").read_text()
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in text
    assert text.count("Not available") >= 3


def test_wording_without_ground_truth(run, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(run, bare)
    for path in (bare / "tables" / "feature_labels").rglob("*.parquet"):
        labels = pd.read_parquet(path)
        write_table(labels[labels["channel"] == "lexicon"], bare / "tables", "feature_labels",
                    int(labels["layer"].iloc[0]), FEATURE_LABELS_SCHEMA, part=path.stem)
    assert main(["report", "--out", str(bare), *SMALL]) == 0
    text = (bare / "report" / "index.html").read_text()
    assert "carries no negation and context labels" in text and "negation gate</th>" not in text
