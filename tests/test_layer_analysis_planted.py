"""Planted ground truth: hand-built bilinear layers whose circuits are known in advance."""

from __future__ import annotations

import math

import numpy as np
import torch

from circuits import CircuitConfig, LayerBatch, MLPWeights, Outputs, SAEWeights
from circuits.sae_basis import output_directions
from pipelines.analysis.circuit_tables import analyse_layer

D, N_IN, N_OUT = 16, 12, 8
F64 = torch.float64


def orthonormal(n, d, gen):
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=F64))
    return q[:n]  # rows


def sae(W_dec, b_dec=None, b_enc=None) -> SAEWeights:
    n, d = W_dec.shape
    return SAEWeights(
        W_enc=W_dec.T.clone(),
        b_enc=torch.zeros(n, dtype=F64) if b_enc is None else b_enc,
        W_dec=W_dec,
        b_dec=torch.zeros(d, dtype=F64) if b_dec is None else b_dec,
        apply_b_dec_to_input=True,
    )


def mlp_from_units(units, noise_units, gen) -> MLPWeights:
    """Hidden units given as (gate vector, in vector, out vector), plus small random ones."""
    gates, ins, outs = (torch.stack(v, 1) for v in zip(*units))
    noise = lambda *s: 0.01 * torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    return MLPWeights(
        W_gate=torch.cat([gates, noise(D, noise_units)], 1),
        W_in=torch.cat([ins, noise(D, noise_units)], 1),
        W_out=torch.cat([outs.T, noise(noise_units, D)], 0),
        b_in=torch.zeros(len(units) + noise_units, dtype=F64),
        b_out=torch.zeros(D, dtype=F64),
        g=torch.ones(D, dtype=F64),
        eps=1e-5,
    )


def topk_acts(pre, k):
    top = pre.topk(k, dim=1)
    return torch.zeros_like(pre).scatter_(1, top.indices, top.values.relu())


def test_planted_and_gate_ranks_first_as_cross_term_and_gate():
    gen = torch.Generator().manual_seed(0)
    dec = orthonormal(N_IN, D, gen)  # input features: orthonormal directions
    enc = orthonormal(N_OUT, D, gen)  # output features read orthonormal directions
    a, b, f_and, f_square, c = 3, 9, 2, 5, 7
    # output f_and computes z_a * z_b (a gate on a, the other factor on b); output
    # f_square computes z_c^2, a strong self term that must not look like a gate
    mlp = mlp_from_units(
        [(dec[a], dec[b], enc[f_and]), (dec[c], dec[c], enc[f_square])], noise_units=24, gen=gen
    )
    cfg = CircuitConfig(top_n=10, n_gates=5, block_size=5, chunk_size=3, dtype="float64")
    tables = _weights_only(mlp, sae(dec), sae(enc), cfg)

    inter = tables["interactions"]
    first = _strongest(inter, f_and)
    assert (first.kind, first.in_a, first.in_b, first["rank"]) == ("cross", a, b, 1)
    assert math.isclose(first.coefficient, 1.0, rel_tol=1e-3)  # z_a z_b with coefficient 1
    gates = tables["gates"]
    mine = gates[gates.out_feature == f_and].sort_values("weight_rank")
    top_gate, runner_up = mine.iloc[0], mine.iloc[1]
    assert (top_gate.in_a, top_gate.in_b, top_gate.weight_rank) == (a, b, 1)
    assert math.isclose(top_gate.cross, 1.0, rel_tol=1e-3)
    assert top_gate.and_score > 0.9 and runner_up.and_score < 0.1

    square = _strongest(inter, f_square)
    assert (square.kind, square.in_a, square.in_b) == ("self", c, c)
    assert (gates[gates.out_feature == f_square].and_score < 0.1).all()


def _strongest(interactions, feature):
    """The term with the largest |coefficient| of any kind."""
    rows = interactions[interactions.out_feature == feature]
    return rows.loc[rows.coefficient.abs().idxmax()]


def _weights_only(mlp, sae_in, sae_out, cfg):
    """Weight tables only: no tokens."""
    outputs = Outputs("sae", output_directions(sae_out.W_enc), sae=sae_out)
    return analyse_layer(mlp, sae_in, outputs, None, cfg, layer=0)


def _batches(x, sae_in, acts, size, site="mlp_in", eps=1e-5):
    """LayerBatches of MLP inputs `x` (taken as the input site itself, unit gain)."""
    z = sae_in.encode(x)
    scale = torch.ones(len(x), dtype=F64) if site == "mlp_in" else 1 / (x.square().mean(-1) + eps)
    return lambda: [LayerBatch(x=x[i : i + size], z=z[i : i + size], scale=scale[i : i + size],
                               acts=acts[i : i + size]) for i in range(0, len(x), size)]


def test_planted_rank_one_feature_correlates_exactly_at_rank_one():
    gen = torch.Generator().manual_seed(1)
    dec = torch.randn(N_IN, D, generator=gen, dtype=F64)
    enc = orthonormal(N_OUT, D, gen)
    v = orthonormal(3, D, gen)
    f1, f2 = 1, 4
    # f1: rank one, 2 (v0.x)^2; f2: rank two, (v1.x)^2 - 0.7 (v2.x)^2;
    # every other output feature gets a random unit of its own
    extra = [(torch.randn(D, generator=gen, dtype=F64), torch.randn(D, generator=gen, dtype=F64),
              enc[f]) for f in range(N_OUT) if f not in (f1, f2)]
    mlp = mlp_from_units(
        [(v[0], 2 * v[0], enc[f1]), (v[1], v[1], enc[f2]), (v[2], -0.7 * v[2], enc[f2])] + extra,
        noise_units=0, gen=gen,
    )
    b_enc = torch.randn(N_OUT, generator=gen, dtype=F64)
    out = sae(enc, b_dec=torch.randn(D, generator=gen, dtype=F64), b_enc=b_enc)

    x = torch.randn(3000, D, generator=gen, dtype=F64)
    mlp_out = ((x @ mlp.W_gate) * (x @ mlp.W_in) + mlp.b_in) @ mlp.W_out + mlp.b_out
    acts = topk_acts((mlp_out - out.b_dec) @ out.W_enc + out.b_enc, k=3)
    cfg = CircuitConfig(max_rank=3, min_active=10, token_batch=1000, chunk_size=3, dtype="float64")
    outputs = Outputs("sae", output_directions(out.W_enc), sae=out)
    low = analyse_layer(mlp, sae(dec), outputs, _batches(x, sae(dec), acts, 700), cfg, layer=0,
                        input_site="mlp_in")["lowrank"]

    corr = low.pivot(index="out_feature", columns="n_eigs", values="corr_active")
    assert math.isclose(corr.loc[f1, 1], 1.0, abs_tol=1e-9)
    assert corr.loc[f2, 1] < 0.99 and math.isclose(corr.loc[f2, 2], 1.0, abs_tol=1e-9)
    n_active = low.groupby("out_feature").n_active.first()
    assert n_active.tolist() == (acts != 0).sum(0).tolist()
    assert n_active[f1] > 100


def test_planted_rank_two_feature_eigen_tables():
    """Q_f = 2 d_p d_p^T - 1.2 d_q d_q^T on two input directions, and Q_h = 1.5 v1 v1^T +
    0.5 v2 v2^T with v1 = 0.8 d_p - 0.6 d_r, v2 = 0.6 d_p + 0.8 d_r (input SAE on mlp_in)."""
    gen = torch.Generator().manual_seed(2)
    dec = orthonormal(N_IN, D, gen)
    enc = orthonormal(N_OUT, D, gen)
    p, q, r = 2, 7, 10
    f, h = 3, 6
    v1, v2 = 0.8 * dec[p] - 0.6 * dec[r], 0.6 * dec[p] + 0.8 * dec[r]
    others = [(torch.randn(D, generator=gen, dtype=F64), torch.randn(D, generator=gen, dtype=F64), enc[o])
              for o in range(N_OUT) if o not in (f, h)]
    mlp = mlp_from_units(
        [(dec[p], 2 * dec[p], enc[f]), (dec[q], -1.2 * dec[q], enc[f]), (v1, 1.5 * v1, enc[h]), (v2, 0.5 * v2, enc[h])]
        + others, noise_units=0, gen=gen,
    )
    T = 600
    z = torch.rand(T, N_IN, generator=gen, dtype=F64) * (torch.rand(T, N_IN, generator=gen) < 0.35)
    x = z @ dec  # the input SAE on mlp_in writes the MLP input
    out = sae(enc)
    acts = (((x @ mlp.W_gate) * (x @ mlp.W_in)) @ mlp.W_out @ out.W_enc).relu()
    cfg = CircuitConfig(max_rank=3, n_eigen_store=5, n_eigen_inputs=4, min_active=10, token_batch=128,
                        chunk_size=4, dtype="float64")
    outputs = Outputs("sae", output_directions(out.W_enc), sae=out)
    tables = analyse_layer(mlp, sae(dec), outputs, _batches(x, sae(dec), acts, 250), cfg, layer=1,
                           input_site="mlp_in")
    eigen = tables["eigen"].set_index(["out_feature", "rank"])
    assert len(tables["eigen"]) == N_OUT * 5

    # eigenvalues and energy shares lambda^2 / sum lambda^2, exactly
    np.testing.assert_allclose(eigen.loc[f].eigenvalue.iloc[:2], [2.0, -1.2], rtol=1e-12)
    np.testing.assert_allclose(eigen.loc[f].eigenvalue.iloc[2:], 0, atol=1e-12)
    np.testing.assert_allclose(eigen.loc[f].energy_share, [4 / 5.44, 1.44 / 5.44, 0, 0, 0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(eigen.loc[h].eigenvalue.iloc[:2], [1.5, 0.5], rtol=1e-12)
    np.testing.assert_allclose(eigen.loc[h].energy_share.iloc[:2], [2.25 / 2.5, 0.25 / 2.5], rtol=1e-12)

    # activation shares: sum over active tokens of lambda_i (v_i . x)^2 over the summed activation
    active = acts[:, f] != 0
    total = acts[active, f].sum()
    expected = [(2 * z[active, p] ** 2).sum() / total, (-1.2 * z[active, q] ** 2).sum() / total, 0.0]
    np.testing.assert_allclose(eigen.loc[f].activation_share.iloc[:3], expected, rtol=1e-10, atol=1e-12)
    assert eigen.loc[f].activation_share.iloc[3:].isna().all()  # beyond max_rank: not measured
    assert math.isclose(eigen.loc[f].activation_share.iloc[:2].sum(), 1.0, rel_tol=1e-10)
    active = acts[:, h] != 0
    total = acts[active, h].sum()
    expected = [(1.5 * (x[active] @ v1) ** 2).sum() / total, (0.5 * (x[active] @ v2) ** 2).sum() / total]
    np.testing.assert_allclose(eigen.loc[h].activation_share.iloc[:2], expected, rtol=1e-10)

    # what the eigenvectors read: the planted inputs first, with the planted cosines; each
    # eigenvector (whose sign is arbitrary) oriented so that its first input reads positively
    reads = tables["eigen_inputs"].set_index(["out_feature", "eigen_rank", "input_rank"])
    for rank, planted in [(1, p), (2, q)]:
        first = reads.loc[(f, rank, 1)]
        assert first.in_feature == planted and math.isclose(first.cosine, 1.0, rel_tol=1e-12)
        assert abs(reads.loc[(f, rank, 2)].cosine) < 1e-10
    for rank, planted in [(1, [(p, 0.8), (r, -0.6)]), (2, [(r, 0.8), (p, 0.6)])]:
        listed = [reads.loc[(h, rank, i)] for i in (1, 2)]
        assert [int(row.in_feature) for row in listed] == [i for i, _ in planted]
        np.testing.assert_allclose([row.cosine for row in listed], [c for _, c in planted], rtol=1e-10)

    # the activation is exactly the rank-2 form on active tokens: correlation 1 at rank 2
    corr = tables["lowrank"].pivot(index="out_feature", columns="n_eigs", values="corr_active")
    assert corr.loc[f, 1] < 0.99
    np.testing.assert_allclose(corr.loc[[f, h], 2], 1.0, atol=1e-12)


def test_lowrank_samples_reach_the_activation_at_the_planted_rank():
    """The stored per-token samples: approximation plus offset equals the activation exactly
    at the feature's true rank (one for f1, two for f2) and not below it; at most
    `n_samples` distinct active tokens per feature, the same whatever the token batch."""
    gen = torch.Generator().manual_seed(1)
    enc = orthonormal(N_OUT, D, gen)
    v = orthonormal(3, D, gen)
    f1, f2 = 1, 4
    extra = [(torch.randn(D, generator=gen, dtype=F64), torch.randn(D, generator=gen, dtype=F64),
              enc[f]) for f in range(N_OUT) if f not in (f1, f2)]
    mlp = mlp_from_units([(v[0], 2 * v[0], enc[f1]), (v[1], v[1], enc[f2]), (v[2], -0.7 * v[2], enc[f2])] + extra,
                         noise_units=0, gen=gen)
    out = sae(enc, b_dec=torch.randn(D, generator=gen, dtype=F64), b_enc=torch.randn(N_OUT, generator=gen, dtype=F64))
    dec = torch.randn(N_IN, D, generator=gen, dtype=F64)
    x = torch.randn(3000, D, generator=gen, dtype=F64)
    mlp_out = ((x @ mlp.W_gate) * (x @ mlp.W_in) + mlp.b_in) @ mlp.W_out + mlp.b_out
    acts = topk_acts((mlp_out - out.b_dec) @ out.W_enc + out.b_enc, k=3)
    outputs = Outputs("sae", output_directions(out.W_enc), sae=out)
    frames = []
    for token_batch in (1000, 256):
        cfg = CircuitConfig(max_rank=3, n_samples=40, token_batch=token_batch, chunk_size=3, dtype="float64")
        frames.append(analyse_layer(mlp, sae(dec), outputs, _batches(x, sae(dec), acts, 700), cfg, layer=0,
                                    input_site="mlp_in")["lowrank_samples"])
    samples = frames[0]
    keys = ["out_feature", "sample", "n_eigs", "activation", "offset"]
    assert samples[keys].equals(frames[1][keys])  # the same tokens (products may differ in the last bits)
    assert np.allclose(samples.approx, frames[1].approx, rtol=1e-12, atol=1e-12)
    per_feature = samples[samples.n_eigs == 1].groupby("out_feature").size()
    active = (acts != 0).sum(0)
    assert per_feature.to_dict() == {f: min(40, int(n)) for f, n in enumerate(active.tolist()) if n}
    fitted = samples.approx + samples.offset
    exact = lambda f, r: np.allclose(fitted[(samples.out_feature == f) & (samples.n_eigs == r)],  # noqa: E731
                                     samples.activation[(samples.out_feature == f) & (samples.n_eigs == r)],
                                     rtol=0, atol=1e-9)
    assert exact(f1, 1) and exact(f2, 2) and not exact(f2, 1)
    for f in (f1, f2):
        mine = samples[(samples.out_feature == f) & (samples.n_eigs == 1)]
        assert set(mine.activation).issubset(set(acts[:, f][acts[:, f] != 0].tolist()))
        assert mine.activation.nunique() == len(mine)  # distinct tokens
