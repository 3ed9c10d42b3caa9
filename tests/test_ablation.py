"""Gate ablations inside the model: with an input SAE that reconstructs its input exactly, the
change of the output's pre-activation the weights predict equals the one measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from circuits.layer import Outputs
from circuits.weights import SAEWeights, from_hooked_transformer
from pipelines.analysis.ablation import gate_ablations
from pipelines.data.tokens import TokenRows
from pipelines.lm.model import PRESETS, build_model
from sae.io import LoadedSAE
from pipelines.stages import LayerSAEs

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


@pytest.mark.parametrize("site", ["resid_mid", "mlp_in"])
def test_predicted_change_equals_measured_when_the_reconstruction_is_exact(model, site):
    layer = 1
    g = torch.Generator().manual_seed(0)
    out_sae = SAEWeights(W_enc=torch.randn(D, 20, generator=g), b_enc=torch.zeros(20),
                         W_dec=torch.randn(20, D, generator=g), b_dec=torch.zeros(D), k=20, relu=False)
    saes = LayerSAEs(layer, LoadedSAE(exact_sae(), Path("exact"), "test", (layer, site)), site,
                     LoadedSAE(out_sae, Path("out"), "test", (layer, "mlp_out")))
    mlp = from_hooked_transformer(model, layer)
    outputs = Outputs("sae", out_sae.W_enc.T, sae=out_sae)
    candidates = pd.DataFrame({"layer": [layer] * 3, "out_feature": [0, 3, 7], "in_a": [0, 2, 5],
                               "in_b": [1, 40, 38], "layer_rank": [1, 2, 3]})
    table = gate_ablations(model, layer, saes, mlp, outputs, candidates, {}, rows(), 16)
    assert len(table) == 9 and (table["n_tokens"] > 20).all()
    measured = table["pre_after"] - table["pre_before"]
    np.testing.assert_allclose(table["pre_change_predicted"], measured, rtol=1e-3, atol=1e-4)
    assert (measured.abs() > 1e-3).all()  # the ablations really changed something
    both = table.set_index("ablated").loc["both"]
    assert both["n_tokens"].min() > 0


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
