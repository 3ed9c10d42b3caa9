"""Top-N interactions, AND-gates by weights, gate candidates and streamed correlations,
against brute force."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from circuits import CircuitConfig, LayerBatch, MLPWeights, Outputs, SAEWeights
from circuits.bilinear import interaction_matrices
from circuits.gates.pairs import coactive_pairs, merge_candidates, pair_coefficients
from circuits.interactions import interaction_kinds, interactions_and_gates
from circuits.sae_basis import project
from circuits.spectra import ActiveCorrelation, lowrank_at
from pipelines.analysis.circuit_tables import analyse_layer

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


def test_pair_coefficients_are_entries_of_the_projected_matrix():
    gen = torch.Generator().manual_seed(4)
    d, h, n_in, n_out = 7, 11, 9, 5
    Wg, Wi, Wo = randn(d, h, gen=gen), randn(d, h, gen=gen), randn(h, d, gen=gen)
    basis = randn(d, n_in + 1, gen=gen)
    directions = randn(n_out, d, gen=gen)
    Qt = basis.T @ interaction_matrices(Wg, Wi, Wo, directions) @ basis  # explicit M^T Q M
    torch.testing.assert_close(project(interaction_matrices(Wg, Wi, Wo, directions), basis), Qt)
    # every (out, a, b), the constant coordinate n_in and a == b (self terms) included
    out, a, b = torch.meshgrid(torch.arange(n_out), torch.arange(n_in + 1), torch.arange(n_in + 1), indexing="ij")
    out, a, b = out.reshape(-1), a.reshape(-1), b.reshape(-1)
    perm = torch.randperm(out.numel(), generator=gen)  # any order, split over chunks of 13
    out, a, b = out[perm], a[perm], b[perm]
    got = pair_coefficients(Wg, Wi, Wo, basis, directions, out, a, b, chunk=13)
    torch.testing.assert_close(got, Qt[out, a, b], rtol=1e-12, atol=1e-12)
    assert pair_coefficients(Wg, Wi, Wo, basis, directions, out[:0], a[:0], b[:0]).shape == (0,)


def pair_sets(c):
    return [{(int(x), int(y)) for x, y, v in zip(c.in_a[f], c.in_b[f], c.valid[f]) if v}
            for f in range(c.in_a.shape[0])]


def test_merge_candidates_dedupes_orders_and_pads():
    long = lambda rows: torch.tensor(rows, dtype=torch.long)  # noqa: E731
    flag = lambda rows: torch.tensor(rows, dtype=torch.bool)  # noqa: E731
    # output 0: (1,4) three times (once reversed), (2,3), an invalid (0,9) and a self pair (5,5)
    # output 1: nothing valid in the first set; (7,2) reversed in the second
    # output 2: all invalid
    first = (long([[1, 3, 0], [5, 6, 8], [0, 1, 2]]), long([[4, 2, 9], [6, 5, 1], [3, 4, 5]]),
             flag([[1, 1, 0], [0, 0, 0], [0, 0, 0]]))
    second = (long([[4, 5, 1], [7, 8, 8], [1, 1, 1]]), long([[1, 5, 4], [2, 1, 1], [2, 2, 2]]),
              flag([[1, 1, 1], [1, 0, 0], [0, 0, 0]]))
    c = merge_candidates([first, second])
    assert pair_sets(c) == [{(1, 4), (2, 3)}, {(2, 7)}, set()]
    assert c.shape == (3, 2)  # as wide as the most pairs of one output, no wider
    assert c.in_a.dtype == torch.long and c.valid.dtype == torch.bool
    assert (c.in_a[c.valid] < c.in_b[c.valid]).all()
    assert c.valid.tolist() == [[True, True], [True, False], [False, False]]  # padding after the pairs

    # random sets against a set-based reference
    gen = torch.Generator().manual_seed(5)
    sets = [(torch.randint(0, 6, (20, w), generator=gen), torch.randint(0, 6, (20, w), generator=gen),
             torch.rand(20, w, generator=gen) < 0.7) for w in (4, 7)]
    c = merge_candidates(sets)
    expected = [{(min(int(x), int(y)), max(int(x), int(y)))
                 for a, b, v in sets for x, y, ok in zip(a[f], b[f], v[f]) if ok and x != y}
                for f in range(20)]
    assert pair_sets(c) == expected
    assert int(c.valid.sum()) == sum(map(len, expected))  # each pair once
    assert c.shape[1] == max(map(len, expected))


def test_coactive_pairs_are_pairs_among_the_most_coactive_inputs():
    counts = torch.tensor([
        [0.0, 5, 1, 9, 0, 3],  # top 3: inputs 3, 1, 5
        [2.0, 0, 0, 0, 0, 0],  # only input 0 ever co-active: no valid pair
        [0.0, 0, 0, 0, 0, 0],
        [4.0, 4.5, 0, 0, 7, 0],  # top 3: 4, 1, 0
    ], dtype=F64)
    a, b, valid = coactive_pairs(counts, 3)
    assert a.shape == b.shape == valid.shape == (4, 3)
    got = [{tuple(sorted((int(x), int(y)))) for x, y, v in zip(a[f], b[f], valid[f]) if v} for f in range(4)]
    assert got == [{(1, 3), (3, 5), (1, 5)}, set(), set(), {(1, 4), (0, 4), (0, 1)}]
    assert (a != b).all()
    # more inputs asked for than exist: all pairs of the inputs
    a, b, valid = coactive_pairs(counts, 10)
    assert a.shape == (4, 15)
    assert {tuple(sorted((int(x), int(y)))) for x, y, v in zip(a[0], b[0], valid[0]) if v} == {
        (i, j) for i in (1, 2, 3, 5) for j in (1, 2, 3, 5) if i < j}


def random_layer(gen, d=10, h=14, n_in=23, n_out=11, t=400):
    mlp = MLPWeights(
        W_gate=randn(d, h, gen=gen), W_in=randn(d, h, gen=gen), W_out=randn(h, d, gen=gen),
        b_in=randn(h, gen=gen), b_out=randn(d, gen=gen),
        g=1 + 0.3 * randn(d, gen=gen), eps=1e-5,
    )
    sae_in = SAEWeights(
        W_enc=randn(d, n_in, gen=gen), b_enc=randn(n_in, gen=gen), W_dec=randn(n_in, d, gen=gen),
        b_dec=randn(d, gen=gen), apply_b_dec_to_input=True, k=4,
    )
    sae_out = SAEWeights(
        W_enc=randn(d, n_out, gen=gen), b_enc=randn(n_out, gen=gen), W_dec=randn(n_out, d, gen=gen),
        b_dec=randn(d, gen=gen), apply_b_dec_to_input=False, k=3,
    )
    r = randn(t, d, gen=gen)
    rms2 = r.square().mean(-1) + mlp.eps
    x = mlp.g * r / rms2.sqrt()[:, None]
    mlp_out = ((x @ mlp.W_gate) * (x @ mlp.W_in) + mlp.b_in) @ mlp.W_out + mlp.b_out
    pre = mlp_out @ sae_out.W_enc + sae_out.b_enc
    top = pre.topk(3, dim=1)
    acts = torch.zeros_like(pre).scatter_(1, top.indices, top.values.relu())
    z = sae_in.encode(r)
    return mlp, sae_in, sae_out, LayerBatch(x=x, z=z, scale=1 / rms2, acts=acts)


def split(batch: LayerBatch, size: int) -> list[LayerBatch]:
    t = batch.x.shape[0]
    return [LayerBatch(**{k: v[i : i + size] for k, v in vars(batch).items()}) for i in range(0, t, size)]


def test_tables_do_not_depend_on_chunking_or_threads():
    mlp, sae_in, sae_out, batch = random_layer(torch.Generator().manual_seed(3))
    outputs = Outputs("sae", sae_out.W_enc.T.contiguous(), sae=sae_out)
    frames = []
    settings = [(100, 100, 10_000, 1, 400), (2, 3, 7, 2, 50), (5, 8, 64, 3, 33), (3, 1, 1000, 0, 1)]
    for chunk, block, token_batch, workers, size in settings:
        cfg = CircuitConfig(
            chunk_size=chunk, block_size=block, token_batch=token_batch,
            max_rank=10, min_active=5, n_truth=20, dtype="float64",
        )
        frames.append(analyse_layer(mlp, sae_in, outputs, lambda: split(batch, size), cfg, layer=3,
                                    workers=max(1, workers), token_threads=max(1, workers)))
    assert set(frames[0]) == {"interactions", "gates", "gate_truth", "eigen", "eigen_inputs", "lowrank", "lowrank_samples"}
    assert len(frames[0]["gate_truth"]) > 0 and frames[0]["gates"].and_data.notna().any()
    for other in frames[1:]:
        for name in frames[0]:
            pd.testing.assert_frame_equal(frames[0][name], other[name], rtol=1e-9, atol=1e-12)
    low = frames[0]["lowrank"]
    full = low[low.n_eigs == 10]  # full rank: the activation itself, up to its offset
    enough = full[full.n_active >= 5]
    assert len(enough) > 0
    np.testing.assert_allclose(enough.corr_active, 1.0, atol=1e-9)
    assert full[full.n_active < 5].corr_active.isna().all()
    assert full.n_active.tolist() == (batch.acts != 0).sum(0).tolist()
    samples = frames[0]["lowrank_samples"]
    top = samples[samples.n_eigs == 10]  # at full rank, plus the offset: the activation exactly
    assert len(top) > 0
    np.testing.assert_allclose(top.approx + top.offset, top.activation, rtol=1e-9, atol=1e-9)


def test_eigen_tables_match_numpy_on_random_weights():
    """Eigenvalues, energy shares and what each eigenvector reads (cosines with the inputs'
    MLP-input directions g * d_b), against numpy on explicitly built Q_u."""
    mlp, sae_in, _, _ = random_layer(torch.Generator().manual_seed(6), t=1)
    directions = randn(5, 10, gen=torch.Generator().manual_seed(7))
    cfg = CircuitConfig(max_rank=4, n_eigen_store=10, n_eigen_inputs=6, chunk_size=2, dtype="float64")
    tables = analyse_layer(mlp, sae_in, Outputs("file:u.npy", directions), None, cfg, layer=0)
    Wg, Wi, Wo = mlp.W_gate.numpy(), mlp.W_in.numpy(), mlp.W_out.numpy()
    inputs = (mlp.g[:, None] * sae_in.W_dec.T).numpy()  # [d, n_in]: g * d_b
    inputs = inputs / np.linalg.norm(inputs, axis=0)
    eigen, reads = tables["eigen"], tables["eigen_inputs"]
    for f, u in enumerate(directions.numpy()):
        Q = Wg @ np.diag(Wo @ u) @ Wi.T
        lam, V = np.linalg.eigh(0.5 * (Q + Q.T))
        order = np.argsort(-np.abs(lam))
        lam, V = lam[order], V[:, order]
        mine = eigen[eigen.out_feature == f].sort_values("rank")
        np.testing.assert_allclose(mine.eigenvalue, lam, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(mine.energy_share, lam**2 / (lam**2).sum(), rtol=1e-9, atol=1e-15)
        for i in range(4):
            cos = V[:, i] @ inputs
            top = np.argsort(-np.abs(cos))[:6]
            listed = reads[(reads.out_feature == f) & (reads.eigen_rank == i + 1)].sort_values("input_rank")
            assert listed.input_rank.tolist() == list(range(1, 7))
            assert listed.in_feature.tolist() == top.tolist()
            sign = np.sign(cos[top[0]])  # numpy's sign is arbitrary; the table's first cosine is positive
            np.testing.assert_allclose(listed.cosine, sign * cos[top], rtol=1e-9, atol=1e-12)
