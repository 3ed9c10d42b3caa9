"""Gate ablations inside the model: with an input SAE that reconstructs its input exactly, the
change of the output's pre-activation the weights predict equals the one measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from circuits.weights import SAEWeights, from_hooked_transformer
from pipelines.analysis.ablation import PARTS, Target, ablations
from pipelines.data.tokens import TokenRows
from pipelines.lm.model import PRESETS, build_model
from sae.io import LoadedSAE
from pipelines.inputs import LayerSAEs

D = 32


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    model = build_model(PRESETS["tiny"].replace(d_vocab=100)).eval()
    with torch.no_grad():  # a norm gain that is not 1, so a forgotten gain would show
        model.blocks[1].ln2.w.uniform_(0.5, 1.5)
    return model


def exact_sae() -> SAEWeights:
    """Latents [relu(x), relu(-x)]: decoding gives x back exactly, for any x."""
    eye = torch.eye(D)
    return SAEWeights(W_enc=torch.cat([eye, -eye], 1), b_enc=torch.zeros(2 * D), W_dec=torch.cat([eye, -eye]),
                      b_dec=torch.zeros(D), k=D)


def rows() -> TokenRows:
    tokens = np.random.default_rng(0).integers(4, 100, size=(16, 64))
    tokens[:, 0] = 1
    return TokenRows(tokens, np.arange(16), {}, 1)


def layer_saes(model, site: str, seed: int, layer: int = 1):
    """An exact input SAE on `site` and a random raw-TopK output SAE, with the layer's MLP."""
    g = torch.Generator().manual_seed(seed)
    out_sae = SAEWeights(W_enc=torch.randn(D, 20, generator=g), b_enc=torch.zeros(20),
                         W_dec=torch.randn(20, D, generator=g), b_dec=torch.zeros(D), k=20, relu=False)
    saes = LayerSAEs(layer, LoadedSAE(exact_sae(), Path("exact"), "test", (layer, site)), site,
                     LoadedSAE(out_sae, Path("out"), "test", (layer, "mlp_out")))
    return saes, out_sae, from_hooked_transformer(model, layer)


@pytest.mark.parametrize("site", ["resid_mid", "mlp_in"])
def test_predicted_change_equals_measured_when_the_reconstruction_is_exact(model, site):
    layer = 1
    saes, out_sae, mlp = layer_saes(model, site, seed=0)
    # a pair, and two groups of inputs
    targets = [Target(0, (0,), (1,), (("out_feature", 0), ("in_a", 0), ("in_b", 1))),
               Target(3, (2,), (40,), (("out_feature", 3), ("in_a", 2), ("in_b", 40))),
               Target(7, (5, 6, 9), (38, 50), (("out_feature", 7), ("group_a", 0), ("group_b", 1)))]
    table = ablations(model, layer, saes, mlp, out_sae.W_enc.T, targets, boosted={}, rows=rows(), n_rows=16,
                      max_tokens=100, seed=0)
    assert len(table) == 9 and (table["n_tokens"] > 20).all() and (table["n_tokens"] <= 100).all()
    measured = table["pre_after"] - table["pre_before"]
    np.testing.assert_allclose(table["pre_change_predicted"], measured, rtol=1e-3, atol=1e-4)
    assert (measured.abs() > 1e-3).all()  # the ablations really changed something
    # the parts of the MLP input split the output's quadratic form exactly; with an exact SAE
    # there is no reconstruction error and no b_dec
    shares = table[[f"share_{p}" for p in PARTS]]
    np.testing.assert_allclose(shares.sum(1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(table[["share_bias", "share_error"]], 0.0, atol=1e-5)


def test_ablation_tokens_are_a_seeded_sample_of_the_eligible_ones(model):
    layer = 1
    saes, out_sae, mlp = layer_saes(model, "resid_mid", seed=1)
    target = [Target(0, (0,), (1,), (("out_feature", 0), ("in_a", 0), ("in_b", 1)))]
    run = lambda seed, n: ablations(model, layer, saes, mlp, out_sae.W_enc.T, target, boosted={}, rows=rows(), n_rows=16,  # noqa: E731
                                    max_tokens=n, seed=seed)
    everything = run(0, 10_000)
    few, same, other = run(0, 30), run(0, 30), run(1, 30)
    assert (few["n_tokens"] == 30).all() and everything["n_tokens"].iloc[0] > 30
    pd.testing.assert_frame_equal(few, same)
    assert not np.allclose(few["activation_before"], other["activation_before"])


def test_only_the_mlp_input_changes(model):
    """Removing an input from the MLP's input leaves the residual stream that bypasses the
    MLP as it was: resid_post changes exactly by the change of mlp_out."""
    from pipelines.analysis.ablation import _run

    layer, site = 1, "resid_mid"
    tokens = torch.from_numpy(rows().tokens[:4])
    clean = _run(model, layer, tokens, site, model.blocks[layer].ln2.w, float(model.cfg.eps), None)
    removal = torch.zeros_like(clean["input"])
    removal[:, 5:9] = 0.7 * clean["input"][:, 5:9]
    changed = _run(model, layer, tokens, site, model.blocks[layer].ln2.w, float(model.cfg.eps), removal)
    assert torch.equal(changed["resid_mid"], clean["resid_mid"])  # the MLP's input changed, not resid_mid
    untouched = torch.ones(tokens.shape, dtype=torch.bool)
    untouched[:, 5:9] = False
    torch.testing.assert_close(changed["mlp_out"][untouched], clean["mlp_out"][untouched])
    assert not torch.allclose(changed["mlp_out"][:, 5:9], clean["mlp_out"][:, 5:9])
