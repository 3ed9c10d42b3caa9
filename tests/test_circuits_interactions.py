"""Top-N interactions, AND-gates and streamed correlations against brute force."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from circuits import CircuitConfig, MLPWeights, SAEWeights, analyse_layer
from circuits.interactions import interaction_kinds, interactions_and_gates
from circuits.spectra import ActiveCorrelation, lowrank_at

F64 = torch.float64


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=F64)


def brute_force(Qt: torch.Tensor, top_n: int, n_gates: int):
    """Top terms of each kind and top gates of one `Qt [n+1, n+1]`, from the definitions."""
    last = Qt.shape[0] - 1
    terms = {"self": [], "cross": [], "linear": [], "constant": []}
    for b in range(last + 1):
        for c in range(b, last + 1):
            coefficient = Qt[b, c].item() * (1 if b == c else 2)
            a_idx, b_idx = (-1 if b == last else b), (-1 if c == last else c)
            if b == last:
                kind = "constant"
            else:
                kind = "linear" if c == last else "self" if b == c else "cross"
            terms[kind].append((abs(coefficient), a_idx, b_idx, coefficient))
    gates = [
        (2 * Qt[b, c].item() - abs(Qt[b, b].item()) - abs(Qt[c, c].item()), b, c)
        for b in range(last)
        for c in range(b + 1, last)
    ]
    top = {kind: sorted(found, reverse=True)[:top_n] for kind, found in terms.items()}
    return top, sorted(gates, reverse=True)[:n_gates]


@pytest.mark.parametrize("block_size", [1, 4, 7, 40])
def test_top_interactions_and_gates_match_brute_force(block_size):
    gen = torch.Generator().manual_seed(block_size)
    d, n_in, c = 6, 17, 3
    A = randn(c, d, d, gen=gen)
    Q = A + A.mT
    basis = randn(d, n_in + 1, gen=gen)
    Qt = basis.T @ Q @ basis
    inter, gates = interactions_and_gates(Q, basis, 12, 9, block_size)
    kinds = interaction_kinds(inter.in_a, inter.in_b)
    width = inter.in_a.shape[1]
    for f in range(c):
        terms, best_gates = brute_force(Qt[f], 12, 9)
        assert inter.valid[f].all() and gates.valid[f].all()
        for kind, expected in terms.items():
            cols = [i for i in range(width) if kinds[f * width + i] == kind]
            assert inter.rank[f, cols].tolist() == list(range(1, len(expected) + 1))
            got = list(zip(inter.in_a[f, cols].tolist(), inter.in_b[f, cols].tolist()))
            assert got == [t[1:3] for t in expected], kind
            coefficients = [t[3] for t in expected]
            np.testing.assert_allclose(inter.coefficient[f, cols], coefficients, rtol=1e-12)
        pairs = list(zip(gates.in_a[f].tolist(), gates.in_b[f].tolist()))
        assert pairs == [g[1:] for g in best_gates]
        np.testing.assert_allclose(gates.and_score[f], [g[0] for g in best_gates], rtol=1e-12)
        a, b = gates.in_a[f], gates.in_b[f]
        torch.testing.assert_close(gates.cross[f], 2 * Qt[f, a, b])
        torch.testing.assert_close(gates.self_a[f], Qt[f, a, a])
        torch.testing.assert_close(gates.self_b[f], Qt[f, b, b])


def test_zero_terms_are_not_reported():
    basis = torch.cat([torch.eye(5, dtype=F64), torch.zeros(5, 1, dtype=F64)], 1)
    Q = torch.zeros(1, 5, 5, dtype=F64)
    Q[0, 1, 3] = Q[0, 3, 1] = 0.5
    inter, gates = interactions_and_gates(Q, basis, 10, 20, block_size=2)
    assert inter.valid.sum() == 1 and inter.coefficient[inter.valid].item() == 1.0
    assert interaction_kinds(inter.in_a[inter.valid], inter.in_b[inter.valid]) == ["cross"]
    assert gates.valid.sum() == 10  # all 5*4/2 pairs exist, even with zero scores
    assert (gates.in_a[0, 0].item(), gates.in_b[0, 0].item()) == (1, 3)


def test_lowrank_at_matches_explicit_sum():
    gen = torch.Generator().manual_seed(1)
    t, d, n, R = 30, 7, 5, 4
    x, lam, V = randn(t, d, gen=gen), randn(n, R, gen=gen), randn(n, d, R, gen=gen)
    token = torch.randint(0, t, (60,), generator=gen)
    feature = torch.randint(0, n, (60,), generator=gen)
    got = lowrank_at(x, lam, V, token, feature)
    for p in range(60):
        proj = x[token[p]] @ V[feature[p]]
        expected = torch.cumsum(lam[feature[p]] * proj**2, 0)
        torch.testing.assert_close(got[p], expected)


def test_streamed_correlation_matches_numpy_on_all_pairs():
    gen = torch.Generator().manual_seed(2)
    n, R, p = 4, 3, 500
    feature = torch.randint(0, n, (p,), generator=gen)
    approx = randn(p, R, gen=gen) + 100  # an offset, to catch cancellation
    act = approx[:, 0] * 0.5 + randn(p, gen=gen) + 100
    stats = ActiveCorrelation(n, R)
    for chunk in torch.arange(p).split(37):
        stats.update(approx[chunk], act[chunk], feature[chunk])
    count, corr = stats.result(min_count=1)
    for f in range(n):
        mask = (feature == f).numpy()
        assert count[f] == mask.sum()
        for r in range(R):
            expected = np.corrcoef(approx[mask, r].numpy(), act[mask].numpy())[0, 1]
            assert abs(corr[f, r].item() - expected) < 1e-12
    count, corr = stats.result(min_count=int(count.max()) + 1)
    assert torch.isnan(corr).all()


def random_layer(gen, d=10, h=14, n_in=23, n_out=11):
    mlp = MLPWeights(
        W_gate=randn(d, h, gen=gen), W_in=randn(d, h, gen=gen), W_out=randn(h, d, gen=gen),
        b_in=randn(h, gen=gen), b_out=randn(d, gen=gen),
        g=1 + 0.3 * randn(d, gen=gen), eps=1e-5,
    )
    sae_in = SAEWeights(
        W_enc=randn(d, n_in, gen=gen), b_enc=randn(n_in, gen=gen), W_dec=randn(n_in, d, gen=gen),
        b_dec=randn(d, gen=gen), apply_b_dec_to_input=True,
    )
    sae_out = SAEWeights(
        W_enc=randn(d, n_out, gen=gen), b_enc=randn(n_out, gen=gen), W_dec=randn(n_out, d, gen=gen),
        b_dec=randn(d, gen=gen), apply_b_dec_to_input=False,
    )
    x = randn(400, d, gen=gen)
    pre = (((x @ mlp.W_gate) * (x @ mlp.W_in) + mlp.b_in) @ mlp.W_out + mlp.b_out) @ sae_out.W_enc
    top = (pre + sae_out.b_enc).topk(3, dim=1)
    acts = torch.zeros_like(pre).scatter_(1, top.indices, top.values.relu())
    return mlp, sae_in, sae_out, x, acts


def test_tables_do_not_depend_on_chunking_or_threads():
    mlp, sae_in, sae_out, x, acts = random_layer(torch.Generator().manual_seed(3))
    frames = []
    for chunk, block, token_batch, workers in [(100, 100, 10_000, 1), (2, 3, 7, 2), (5, 8, 64, 3)]:
        cfg = CircuitConfig(
            chunk_size=chunk, block_size=block, token_batch=token_batch, n_workers=workers,
            max_rank=10, min_active=5, dtype="float64",
        )
        batches = [(x[i : i + 50], acts[i : i + 50]) for i in range(0, 400, 50)]
        frames.append(analyse_layer(mlp, sae_in, sae_out, batches, cfg, layer=3))
    for other in frames[1:]:
        for name in frames[0]:
            pd.testing.assert_frame_equal(frames[0][name], other[name], rtol=1e-9)
    low = frames[0]["lowrank"]
    full = low[low.n_eigs == 10]  # full rank: the activation itself, up to its offset
    enough = full[full.n_active >= 5]
    assert len(enough) > 0
    np.testing.assert_allclose(enough.corr_active, 1.0, atol=1e-9)
    assert full[full.n_active < 5].corr_active.isna().all()
