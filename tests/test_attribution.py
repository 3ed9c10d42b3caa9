"""Exact attribution graphs (circuits.attribution) on random bilinear models, in float64.

What is checked against the model itself, not against the attribution's own arithmetic:
- the frozen model (patterns and norm scales taken from the real forward pass) reproduces the
  real forward pass: residual streams, MLP outputs, logits;
- every target's incoming edges plus its constant equal its value, the SAE pre-activation
  computed from the real activations (or the demeaned logit), on the demo's shape and on a
  paper-size model (d_model 512);
- removing one residual writer's vector (an embedding, an output feature, an error) from the
  frozen model, MLPs replaced by their nodes, changes every input feature and logit by its edge;
- inside an MLP, removing input parts changes an output feature's pre-activation as the
  partition says: the four-point synergy of two parts equals their AND term.
"""

from __future__ import annotations

import pytest
import torch

from circuits.attribution import (INPUT, INPUT_ERROR, LOGIT, OUTPUT, OUTPUT_ERROR, TOKEN, LayerSAETensors,
                                  attention_constant, attention_linear, attribute, frozen_forward, frozen_from_cache,
                                  model_tensors, mlp_forward, prune, scores, strongest_path)
from circuits.weights import SAEWeights
from pipelines.lm.model import PRESETS, build_model

D = torch.float64


def _model(preset: str, **changes):
    cfg = PRESETS[preset].replace(**changes)
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # nonzero biases and gains, so every constant path is exercised
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith(("b_V", "b_O", "b_in", "b_out", "b_U")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            if name.endswith(".w"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model.to(D).eval()


def _sae(d: int, d_sae: int, k: int, seed: int, relu: bool = True) -> SAEWeights:
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.randn(d_sae, d, generator=g, dtype=D)
    W_dec /= W_dec.norm(dim=1, keepdim=True)
    return SAEWeights(W_enc=W_dec.T.clone() + 0.1 * torch.randn(d, d_sae, generator=g, dtype=D),
                      b_enc=0.05 * torch.randn(d_sae, generator=g, dtype=D), W_dec=W_dec,
                      b_dec=0.1 * torch.randn(d, generator=g, dtype=D), k=k, relu=relu)


def _setup(preset: str, n: int, sites=("resid_mid",), skip=(), d_sae_mult=4, k=8, seed=0, **changes):
    model = _model(preset, **changes)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.d_vocab, (n,), generator=g)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens.unsqueeze(0))
    m = model_tensors(model)
    f = frozen_from_cache(tokens, cache, model.cfg.n_layers)
    d = model.cfg.d_model
    saes = {layer: LayerSAETensors(_sae(d, d_sae_mult * d, k, 10 + layer), sites[layer % len(sites)],
                                   _sae(d, d_sae_mult * d, k, 100 + layer, relu=layer % 2 == 0))
            for layer in range(model.cfg.n_layers) if layer not in skip}
    return model, m, f, saes, logits[0], cache


@pytest.mark.parametrize("preset,n,sites,skip", [
    ("demo", 12, ("resid_mid",), ()),
    ("demo", 10, ("resid_mid", "mlp_in"), (2,)),
])
def test_frozen_forward_and_completeness(preset, n, sites, skip):
    model, m, f, saes, logits, cache = _setup(preset, n, sites, skip)
    fwd = frozen_forward(m, f)
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(fwd["resid_mid"][layer], cache[f"blocks.{layer}.hook_resid_mid"][0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(fwd["mlp_out"][layer], cache[f"blocks.{layer}.hook_mlp_out"][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fwd["logits"], logits, rtol=1e-10, atol=1e-10)

    targets = logits[-1].topk(3).indices
    graph = attribute(m, f, saes, targets, edge_dtype=D, chunk=7)
    assert {int(k) for k in graph.kind.unique()} == {TOKEN, INPUT, INPUT_ERROR, OUTPUT, OUTPUT_ERROR, LOGIT}
    for i in torch.nonzero(graph.kind == INPUT).squeeze(1).tolist():  # the graph's own value is the real one
        layer, pos, index = int(graph.layer[i]), int(graph.pos[i]), int(graph.index[i])
        s = saes[layer]
        act = cache[f"blocks.{layer}.hook_resid_mid"][0, pos] if s.site == "resid_mid" else \
            cache[f"blocks.{layer}.ln2.hook_normalized"][0, pos] * model.blocks[layer].ln2.w
        assert torch.isclose(graph.value[i], s.sae_in.pre(act)[index], rtol=1e-9, atol=1e-9)
    for i in torch.nonzero(graph.kind == OUTPUT).squeeze(1).tolist():
        layer, pos, index = int(graph.layer[i]), int(graph.pos[i]), int(graph.index[i])
        assert torch.isclose(graph.value[i], saes[layer].sae_out.pre(cache[f"blocks.{layer}.hook_mlp_out"][0, pos])[index],
                             rtol=1e-9, atol=1e-9)
    logit_rows = graph.kind == LOGIT
    torch.testing.assert_close(graph.value[logit_rows], (logits[-1] - logits[-1].mean())[targets])
    _check_complete(graph)


def _check_complete(graph, tol=1e-4):
    t = graph.targets
    total = graph.adjacency[t].sum(1) + graph.constant[t]
    scale = graph.adjacency[t].abs().sum(1) + graph.constant[t].abs()
    err = (total - graph.value[t]).abs() / scale
    assert err.max() <= tol, f"largest relative completeness error {err.max():.2e}"
    assert (graph.adjacency[~t] == 0).all()  # sources have no incoming edges


def test_completeness_paper_size():
    _, m, f, saes, logits, _ = _setup("paper", 6, ("resid_mid",), (), d_sae_mult=4, k=30)
    graph = attribute(m, f, saes, logits[-1].topk(2).indices, edge_dtype=D)
    assert m.W_E.shape[1] == 512
    _check_complete(graph, tol=1e-4)
    # the edges of a large float64 graph are exact far beyond the acceptance tolerance
    _check_complete(graph, tol=1e-9)


def _cut_forward(m, f, mlp_outs, remove_slot, remove_pos, vector):
    """resid_mid of every layer and the final residual with MLP outputs fixed to `mlp_outs` and
    `vector` removed from resid_pre of `remove_slot` at `remove_pos`."""
    r = m.W_E[f.tokens].clone()
    mids = []
    for layer in range(m.n_layers + 1):
        if layer == remove_slot:
            r[remove_pos] -= vector
        if layer == m.n_layers:
            break
        r = r + attention_linear(r, m, f, layer) + attention_constant(m, layer)
        mids.append(r)
        r = r + mlp_outs[layer]
    return mids, r


def test_removing_a_writer_changes_each_direct_target_by_its_edge():
    model, m, f, saes, logits, cache = _setup("demo", 9, ("resid_mid",), (1,))
    targets = logits[-1].topk(2).indices
    graph = attribute(m, f, saes, targets, edge_dtype=D)
    fwd = frozen_forward(m, f)
    base_mids, base_final = _cut_forward(m, f, fwd["mlp_out"], -1, 0, 0)
    out_rows = torch.nonzero(graph.kind == OUTPUT).squeeze(1)
    err_rows = torch.nonzero(graph.kind == OUTPUT_ERROR).squeeze(1)
    chosen = [2, int(out_rows[5]), int(out_rows[-1]), int(err_rows[3]), int(err_rows[9 + 4])]  # layer 1 has no SAEs
    for src in chosen:
        kind, layer, pos, index = int(graph.kind[src]), int(graph.layer[src]), int(graph.pos[src]), int(graph.index[src])
        if kind == TOKEN:
            slot, vector = 0, m.W_E[index]
        elif kind == OUTPUT:
            slot, vector = layer + 1, graph.value[src] * saes[layer].sae_out.W_dec[index]
        else:
            sae = saes.get(layer)
            recon = 0 if sae is None else sae.sae_out.decode(sae.sae_out.encode(fwd["mlp_out"][layer][pos]))
            slot, vector = layer + 1, fwd["mlp_out"][layer][pos] - recon
        mids, final = _cut_forward(m, f, fwd["mlp_out"], slot, pos, vector)
        for t in torch.nonzero(graph.kind == INPUT).squeeze(1).tolist():
            tl, tp, ti = int(graph.layer[t]), int(graph.pos[t]), int(graph.index[t])
            sae = saes[tl].sae_in
            change = sae.pre(mids[tl][tp])[ti] - sae.pre(base_mids[tl][tp])[ti]
            assert torch.isclose(-change, graph.adjacency[t, src], rtol=1e-8, atol=1e-9)
        x = final[-1] * m.g_final / f.scale_final[-1]
        x0 = base_final[-1] * m.g_final / f.scale_final[-1]
        for j, t in enumerate(torch.nonzero(graph.kind == LOGIT).squeeze(1).tolist()):
            w = m.W_U[:, targets[j]] - m.W_U.mean(1)
            assert torch.isclose(-(x - x0) @ w, graph.adjacency[t, src], rtol=1e-8, atol=1e-9)


def test_mlp_partition_matches_removing_parts_and_and_terms_are_synergies():
    _, m, f, saes, logits, cache = _setup("demo", 7, ("resid_mid",), ())
    graph = attribute(m, f, saes, logits[-1].topk(1).indices, edge_dtype=D, n_and=400)
    fwd = frozen_forward(m, f)
    layer, pos = 2, 5
    sae_in, sae_out, mlp = saes[layer].sae_in, saes[layer].sae_out, m.mlps[layer]
    scale = mlp.g / f.scale2[layer][pos]
    z = sae_in.encode(fwd["resid_mid"][layer][pos])
    x = fwd["mlp_in"][layer][pos]

    def pre(x_):
        return sae_out.pre(mlp_forward(x_, mlp))

    rows = torch.nonzero((graph.kind == INPUT) & (graph.layer == layer) & (graph.pos == pos)).squeeze(1)
    part = {int(r): scale * z[graph.index[r]] * sae_in.W_dec[graph.index[r]] for r in rows}
    targets = torch.nonzero((graph.kind == OUTPUT) & (graph.layer == layer) & (graph.pos == pos)).squeeze(1)
    assert len(targets) > 0 and len(rows) > 2
    a, b = list(part)[:2]
    for t in targets.tolist():
        fi = int(graph.index[t])
        # removing a part p changes x^T Q x by -(2 x_p^T Q x - x_p^T Q x_p) = -(2 edge - self term)
        only = pre(part[a] + 0 * x)[fi] - pre(torch.zeros_like(x))[fi]  # x_a^T Q x_a
        assert torch.isclose(pre(x)[fi] - pre(x - part[a])[fi], 2 * graph.adjacency[t, a] - only, rtol=1e-8, atol=1e-9)
        synergy = pre(x)[fi] - pre(x - part[a])[fi] - pre(x - part[b])[fi] + pre(x - part[a] - part[b])[fi]
        hit = (graph.and_target == t) & (((graph.and_a == a) & (graph.and_b == b)) | ((graph.and_a == b) & (graph.and_b == a)))
        assert hit.sum() == 1
        assert torch.isclose(graph.and_weight[hit][0], synergy, rtol=1e-8, atol=1e-9)


def test_capped_features_fold_into_errors_and_stay_exact():
    _, m, f, saes, logits, _ = _setup("tiny", 8)
    full = attribute(m, f, saes, logits[-1].topk(2).indices, edge_dtype=D)
    n_features = int(((full.kind == INPUT) | (full.kind == OUTPUT)).sum())
    capped = attribute(m, f, saes, logits[-1].topk(2).indices, edge_dtype=D, max_features=n_features // 3)
    assert int(((capped.kind == INPUT) | (capped.kind == OUTPUT)).sum()) <= n_features // 3 + 2
    _check_complete(capped, tol=1e-9)
    torch.testing.assert_close(capped.value[capped.kind == LOGIT], full.value[full.kind == LOGIT])


def test_pruning_scores_and_paths_on_a_planted_chain():
    """A hand-made graph: token 0 -> feature 2 -> logit 5 carries almost everything; token 1 ->
    error 3 -> logit 5 a little; feature 4 feeds only the error-free side weakly."""
    from circuits.attribution import AttributionGraph

    kind = torch.tensor([TOKEN, TOKEN, INPUT, OUTPUT_ERROR, OUTPUT, LOGIT])
    A = torch.zeros(6, 6, dtype=D)
    A[2, 0] = 10.0
    A[5, 2] = 9.0
    A[5, 3] = 1.0
    A[4, 1] = 1.0
    A[5, 4] = 0.01
    empty = torch.zeros(0, dtype=torch.long)
    graph = AttributionGraph(kind=kind, layer=torch.tensor([-1, -1, 0, 0, 1, 2]), pos=torch.zeros(6, dtype=torch.long),
                             index=torch.arange(6), value=torch.zeros(6, dtype=D), constant=torch.zeros(6, dtype=D),
                             adjacency=A, probability=torch.tensor([0, 0, 0, 0, 0, 1.0], dtype=D),
                             and_target=empty, and_a=empty, and_b=empty, and_weight=torch.zeros(0, dtype=D))
    nodes, edges, cumulative = prune(graph, 0.8, 0.98)
    assert nodes.tolist() == [True, True, True, False, False, True]
    assert edges[2, 0] and edges[5, 2] and not edges[5, 3]
    replacement, completeness = scores(graph)
    # tokens: influence 9/10.01 and 0.01/10.01 through the features; the error (no inputs): 1/10.01
    assert replacement == pytest.approx(9.01 / 10.01, rel=1e-9)
    # only the logit's input holds error: weight 1 (its logit weight), non-error share 9.01/10.01
    inf = torch.tensor([9 / 10.01, 0.01 / 10.01, 9 / 10.01, 1 / 10.01, 0.01 / 10.01, 1.0], dtype=D)
    non_error = torch.tensor([1, 1, 1, 1, 1, 9.01 / 10.01], dtype=D)
    assert completeness == pytest.approx(float((non_error * inf).sum() / inf.sum()), rel=1e-9)
    assert strongest_path(graph, [0], 5) == ([0, 2, 5], pytest.approx(9 / 10.01))
    assert strongest_path(graph, [1], 5) == ([1, 4, 5], pytest.approx(0.01 / 10.01))
    assert strongest_path(graph, [0, 1], 5)[0] == [0, 2, 5]
    assert strongest_path(graph, [3], 0) == ([], 0.0)
