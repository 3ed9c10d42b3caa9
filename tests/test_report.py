"""The HTML report on a tiny run: self-contained, escaped, every figure a valid PNG."""

from __future__ import annotations

import re
import shutil
from dataclasses import asdict

import pytest
import torch
from PIL import Image

from circuits.layer import CircuitConfig
from circuits.tables import read_table, write_table
from pipelines.corpus import load_corpus, write_story_corpus
from pipelines.features import FeatureConfig
from pipelines.model import PRESETS, ModelConfig, build_model, load_model, save_model
from pipelines.paths import RunPaths
from pipelines.report import ReportConfig, write_report
from pipelines.stages import ensure_circuits, ensure_features, ensure_saes, token_rows
from pipelines.stories import StoryConfig
from pipelines.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer
from sae.config import SAETrainConfig

PLANTED = "<b>negation</b> & 'context' \"AND\""  # must reach the page escaped, never as markup
SAE_CFG = SAETrainConfig(train_tokens=2048, batch_size=512, eval_seqs=4, shard_tokens=1024,
                         buffer_tokens=1024)
CIRCUIT_CFG = CircuitConfig(top_n=10, n_gates=4, max_rank=4, n_eigen_store=8, min_active=5)
HEADINGS = ["Summary", "Low-rank correlations per layer", "Distribution of rank-2 correlations",
            "Approximation versus activation", "AND-gate candidates"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run through the real stages: story corpus, untrained tiny LM, briefly trained
    SAEs, circuit and feature tables."""
    run = RunPaths(tmp_path_factory.mktemp("run"))
    corpus = str(write_story_corpus(StoryConfig(n_stories=200, seed=1), run.root))
    tok = train_tokenizer(load_corpus(corpus)["text"], TokenizerConfig(vocab_size=256))
    torch.manual_seed(0)
    model_cfg = ModelConfig(**{**asdict(PRESETS["tiny"]), "d_vocab": tok.get_vocab_size()})
    model = build_model(model_cfg).eval()
    save_model(model, model_cfg, run.lm)
    tok.save(str(run.lm / "tokenizer.json"))

    layers, sites = [0, 1], ["resid_mid", "mlp_out"]
    ensure_saes(run, model, tok, corpus, layers, sites, SAE_CFG)
    ensure_circuits(run, model, tok, corpus, layers, CIRCUIT_CFG, corr_rows=32)
    features = ensure_features(run, model, tok, corpus, layers, sites, FeatureConfig(n_rows=16))
    # plant the description on the first input of the best gate, which the report must show
    best = read_table(run.tables, "gates").sort_values("and_score").iloc[-1]
    planted = ((features["layer"] == best["layer"]) & (features["site"] == "resid_mid")
               & (features["feature"] == best["in_a"]))
    features.loc[planted, "description"] = PLANTED
    layer = int(best["layer"])
    write_table(features[features["layer"] == layer], run.tables, "features", layer=layer)
    return run


@pytest.fixture(scope="module")
def page(run):
    cfg = ReportConfig(n_gates=3, gates_per_layer=3, n_scatter=2, scatter_rows=24, dpi=50)
    index = write_report(run, cfg)
    return index, index.read_text(encoding="utf-8")


def test_page_has_every_section(page):
    _, text = page
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in text
    assert "nmse" in text and "loss_added" in text
    assert "Rank-2 active-only correlation" in text


def test_page_is_self_contained(page):
    index, text = page
    assert not re.search(r"https?://", text)
    assert "<script" not in text.lower()
    sources = re.findall(r'(?:src|href)="([^"]*)"', text)
    assert sources
    for src in sources:
        assert (index.parent / src).is_file() and (index.parent / src).parent == index.parent


def test_feature_descriptions_are_escaped(page):
    _, text = page
    assert PLANTED not in text
    assert "&lt;b&gt;negation&lt;/b&gt; &amp; &#x27;context&#x27; &quot;AND&quot;" in text


def test_figures_are_valid_pngs(page):
    index, text = page
    pngs = sorted(index.parent.glob("*.png"))
    assert {p.name for p in pngs} == set(re.findall(r'src="([^"]*)"', text))
    assert any(p.name.startswith("scatter_") for p in pngs)
    for png in pngs:
        with Image.open(png) as image:
            image.verify()
            assert image.format == "PNG"


def test_rewriting_leaves_no_stale_files(run, page):
    index, _ = page
    stale = index.parent / "stale.png"
    stale.write_bytes(b"")
    write_report(run, ReportConfig(n_gates=1, gates_per_layer=2, n_scatter=1, scatter_rows=8, dpi=40))
    assert not stale.exists() and index.is_file()


def test_explicit_model_tokens_and_saes(run, tmp_path):
    """Bring-your-own inputs: a run folder with tables only, model, tokens and SAEs passed in."""
    bare = RunPaths(tmp_path / "bare")
    shutil.copytree(run.tables, bare.tables)
    shutil.copytree(run.saes, tmp_path / "elsewhere")
    model, _ = load_model(run.lm)
    _, held_out = token_rows(str(run.corpus), load_tokenizer(run.lm), model.cfg.n_ctx)
    sae_paths = {layer: (tmp_path / "elsewhere" / f"layer{layer}_resid_mid",
                         tmp_path / "elsewhere" / f"layer{layer}_mlp_out") for layer in (0, 1)}
    cfg = ReportConfig(n_gates=1, gates_per_layer=2, n_scatter=1, scatter_rows=8, dpi=40)
    text = write_report(bare, cfg, held_out.tokens, model=model, sae_paths=sae_paths).read_text()
    assert "Not available" not in text and 'src="scatter_' in text and "d_model" in text


def test_missing_tables_leave_notes(run, tmp_path):
    bare = RunPaths(tmp_path / "bare")
    shutil.copytree(run.tables / "sae_metrics", bare.tables / "sae_metrics")
    text = write_report(bare).read_text()
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in text
    assert text.count("Not available") >= 5
