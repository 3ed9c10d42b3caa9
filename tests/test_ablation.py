"""The model-run confirmation: at the layer it equals the exact layer-local intervention (with
an input SAE that reconstructs exactly, and with one that does not); its tokens are disjoint
from the ranking's; only the MLP input changes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from circuits import forward
from circuits.bilinear import interaction_matrices
from circuits.weights import SAEWeights, from_hooked_transformer
from circuits.gates.interventions import Sides
from pipelines.analysis.ablation import PARTS, confirm
from pipelines.analysis.interventions import LayerCache
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


def random_sae(seed: int) -> SAEWeights:
    """An input SAE that does not reconstruct its input: the interventions must not rely on it."""
    g = torch.Generator().manual_seed(seed)
    return SAEWeights(W_enc=torch.randn(D, 48, generator=g), b_enc=torch.zeros(48),
                      W_dec=torch.randn(48, D, generator=g) / 4, b_dec=torch.randn(D, generator=g) / 4, k=12)


def cache_of(model, saes, seed=0, share=0.5):
    return LayerCache.build(model, rows(), 16, saes, seed, share)


TARGETS = Sides.of_groups([0, 3, 7], [[0], [2], [5, 6, 9]], [[1], [40], [38, 50]])
NAMES = [{"out_feature": 0, "in_a": 0, "in_b": 1}, {"out_feature": 3, "in_a": 2, "in_b": 40},
         {"out_feature": 7, "group_a": 0, "group_b": 1}]


@pytest.mark.parametrize("site, exact", [("resid_mid", True), ("mlp_in", True), ("resid_mid", False)])
def test_the_model_run_at_the_layer_equals_the_layer_local_intervention(model, site, exact):
    layer = 1
    saes, out_sae, mlp = layer_saes(model, site, seed=0)
    if not exact:
        saes = LayerSAEs(layer, LoadedSAE(random_sae(1), Path("random"), "test", (layer, site)), site, saes.sae_out)
        targets = Sides.of_groups([0, 3], [[0], [2, 5]], [[1], [7, 11]])
    else:
        targets = TARGETS
    cache = cache_of(model, saes)
    table = confirm(model, cache, saes, mlp, targets, NAMES, boosted={}, max_tokens=100, seed=0)
    assert len(table) == 3 * len(targets) and (table["n_tokens"] > 5).all() and (table["n_tokens"] <= 100).all()
    measured = table["pre_after"] - table["pre_before"]
    np.testing.assert_allclose(table["pre_change_predicted"], measured, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(table["activation_local"], table["activation_after"], rtol=1e-4, atol=1e-4)
    assert (measured.abs() > 1e-3).all()  # the ablations really changed something
    # the parts of the MLP input split the output's quadratic form exactly
    shares = table[[f"share_{p}" for p in PARTS]]
    np.testing.assert_allclose(shares.sum(axis=1), 1.0, rtol=1e-6)
    if exact:  # no reconstruction error and no b_dec
        np.testing.assert_allclose(table[["share_bias", "share_error"]], 0.0, atol=1e-5)


def test_the_cache_holds_each_sae_encoding_of_every_token_across_row_batches(model):
    saes, out_sae, mlp = layer_saes(model, "resid_mid", seed=2)
    saes = LayerSAEs(1, LoadedSAE(random_sae(3), Path("random"), "test", (1, "resid_mid")), "resid_mid", saes.sae_out)
    cache = LayerCache.build(model, rows(), 16, saes, 0, 0.5, batch_rows=3)  # six row batches, the last short
    assert cache.z.is_coalesced() and cache.acts.is_coalesced()
    assert torch.equal(cache.z.coalesce().indices(), cache.z.indices())  # marked coalesced: truly in order
    np.testing.assert_allclose(cache.z.to_dense(), saes.sae_in.weights.encode(cache.source), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        _, found = forward.run(model, torch.as_tensor(rows().tokens), [(1, "mlp_out")])
    kept = rows().keep(torch.as_tensor(rows().tokens))
    np.testing.assert_allclose(cache.acts.to_dense(), out_sae.encode(found[1, "mlp_out"][kept]), rtol=1e-5, atol=1e-5)


def test_confirmation_and_ranking_tokens_are_disjoint_seeded_samples(model):
    saes, out_sae, mlp = layer_saes(model, "resid_mid", seed=1)
    cache = cache_of(model, saes, seed=0, share=0.3)
    share = float(cache.confirm.double().mean())
    assert 0.2 < share < 0.4
    assert torch.equal(cache.confirm, cache_of(model, saes, seed=0, share=0.3).confirm)
    assert not torch.equal(cache.confirm, cache_of(model, saes, seed=1, share=0.3).confirm)
    ranking, confirming = cache.sample(TARGETS, False, 30, 0), cache.sample(TARGETS, True, 30, 0)
    assert not cache.confirm[ranking.token].any() and cache.confirm[confirming.token].all()
    assert torch.bincount(ranking.cand).max() == 30
    again, other = cache.sample(TARGETS, False, 30, 0), cache.sample(TARGETS, False, 30, 1)
    assert torch.equal(again.token, ranking.token) and not torch.equal(other.token, ranking.token)


def test_the_downstream_log_probability_is_measured(model):
    saes, out_sae, mlp = layer_saes(model, "resid_mid", seed=0)
    table = confirm(model, cache_of(model, saes), saes, mlp, TARGETS, NAMES, boosted={0: [5, 6], 7: [9]},
                    max_tokens=50, seed=0)
    mine = table[table["out_feature"].isin([0, 7])]
    assert mine["logprob_before"].notna().all() and (mine["logprob_after"] != mine["logprob_before"]).all()
    assert table[table["out_feature"] == 3]["logprob_before"].isna().all()


@torch.no_grad()
def test_only_the_mlp_input_changes(model):
    """Removing an input from the MLP's input leaves the residual stream that bypasses the
    MLP as it was: resid_post changes exactly by the change of mlp_out."""
    from circuits import forward
    from pipelines.analysis.ablation import _mlp_input_edit

    saes, _, _ = layer_saes(model, "resid_mid", seed=0)
    cache = cache_of(model, saes)
    resid = cache.resid_pre[:4]
    points = [(1, "resid_mid"), (1, "mlp_out")]
    clean = forward.blocks(model, resid, 1, 2, points)[1]
    removal = torch.zeros_like(resid)
    removal[:, 5:9] = 0.7 * clean[1, "resid_mid"][:, 5:9]
    changed = forward.blocks(model, resid, 1, 2, points, edits={1: _mlp_input_edit(cache, model.blocks[1].ln2.w,
                                                                                     removal)})[1]
    assert torch.equal(changed[1, "resid_mid"], clean[1, "resid_mid"])  # the MLP's input changed, not resid_mid
    untouched = torch.ones(resid.shape[:2], dtype=torch.bool)
    untouched[:, 5:9] = False
    assert torch.equal(changed[1, "mlp_out"][untouched], clean[1, "mlp_out"][untouched])
    assert not torch.allclose(changed[1, "mlp_out"][:, 5:9], clean[1, "mlp_out"][:, 5:9])


@pytest.mark.parametrize("site", ["resid_mid", "mlp_in"])
def test_the_log_probabilities_after_ablation_are_those_of_whole_passes(model, site):
    """Each (candidate, row) ablated in a whole pass from the layer's cached stream, by hand:
    the confirmation's mean log-probabilities after each ablation are those."""
    from circuits import forward

    layer, boosted = 0, {0: [5, 6], 3: [7], 7: [9, 11, 13]}
    saes, _, mlp = layer_saes(model, site, seed=2, layer=layer)
    cache = cache_of(model, saes)
    table = confirm(model, cache, saes, mlp, TARGETS, NAMES, boosted=boosted, max_tokens=40, seed=0)
    entries = cache.sample(TARGETS, True, 40, 0)
    z, W_dec, gain = cache.z.to_dense(), saes.sae_in.weights.W_dec, model.blocks[layer].ln2.w
    for c in range(len(TARGETS)):
        mine = entries.token[entries.cand == c]
        flat = cache.flat[mine]
        for ablated, sides in (("a", [TARGETS.a[c]]), ("b", [TARGETS.b[c]]), ("both", [TARGETS.a[c], TARGETS.b[c]])):
            members = torch.cat(sides)
            members = members[members >= 0]
            found = []
            for row in (flat // cache.n_ctx).unique().tolist():
                here = flat // cache.n_ctx == row
                removal = torch.zeros(1, cache.n_ctx, D)
                removal[0, flat[here] % cache.n_ctx] = z[mine[here]][:, members] @ W_dec[members]
                if site == "resid_mid":
                    edit = lambda resid_mid, mlp_in: forward.rms_norm(resid_mid - removal, gain, cache.eps)  # noqa: E731
                else:
                    edit = lambda resid_mid, mlp_in: mlp_in - removal  # noqa: E731
                with torch.no_grad():
                    final, _ = forward.blocks(model, cache.resid_pre[row][None], layer, 2, edits={layer: edit})
                    logprob = forward.unembed(model, final[0, flat[here] % cache.n_ctx]).double().log_softmax(-1)
                found.append(logprob[:, boosted[int(TARGETS.out[c])]].mean(-1))
            expected = float(torch.cat(found).mean())
            measured = table[(table["out_feature"] == int(TARGETS.out[c])) & (table["ablated"] == ablated)]
            assert len(measured) == 1 and measured["n_tokens"].item() == len(mine)
            assert measured["logprob_after"].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)
            assert abs(measured["logprob_after"].item() - measured["logprob_before"].item()) > 1e-4


def test_the_shares_of_the_parts_are_their_forms_with_the_whole_input(model):
    # from the definition, with the output's whole interaction matrix: on each sampled token the MLP input
    # x = img(a) + img(b) + img(other) + img(b_dec) + img(error), and part p's share is sum img(p)^T Q x over
    # the candidate's tokens, relative to sum x^T Q x. Groups padded with -1 beside latent 0 included.
    layer, site = 1, "resid_mid"
    saes, out_sae, mlp = layer_saes(model, site, seed=0)
    saes = LayerSAEs(layer, LoadedSAE(random_sae(1), Path("random"), "test", (layer, site)), site, saes.sae_out)
    sae_in = saes.sae_in.weights
    targets = Sides.of_groups([0, 3], [[0], [2, 5]], [[1], [7, 11, 12]])
    cache = cache_of(model, saes)
    entries = cache.sample(targets, True, 100, 0)
    table = confirm(model, cache, saes, mlp, targets, NAMES, boosted={}, max_tokens=100, seed=0)
    Q = interaction_matrices(mlp.W_gate.double(), mlp.W_in.double(), mlp.W_out.double(),
                             out_sae.W_enc.T.double())  # [n_out, d, d]
    for c in range(len(targets)):
        source = cache.source[entries.token[entries.cand == c]].double()
        z = sae_in.encode(source.float()).double()
        side = lambda members: z[:, [m for m in members if m >= 0]] @ sae_in.W_dec.double()[[m for m in members if m >= 0]]  # noqa: E731
        part_a, part_b = side(targets.a[c].tolist()), side(targets.b[c].tolist())
        decoded = z @ sae_in.W_dec.double() + sae_in.b_dec.double()
        b_dec = sae_in.b_dec.double().expand_as(source)
        image = lambda v: v * mlp.g.double() / torch.sqrt(source.square().mean(1, keepdim=True) + mlp.eps)  # noqa: E731
        x = image(source)
        q = Q[int(targets.out[c])]
        forms = torch.stack([(image(p) @ q * x).sum() for p in (part_a, part_b, decoded - b_dec - part_a - part_b,
                                                                  b_dec, source - decoded)])
        mine = table[(table["out_feature"] == int(targets.out[c]))]
        want = (forms / (x @ q * x).sum()).numpy()
        np.testing.assert_allclose(mine[[f"share_{p}" for p in PARTS]].to_numpy(), np.tile(want, (3, 1)), rtol=1e-4,
                                   atol=1e-5)
    assert (table[["share_a", "share_b", "share_bias", "share_error"]].abs() > 1e-3).all().all()  # every part counts
