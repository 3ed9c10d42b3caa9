"""Planted ground truth: hand-built bilinear layers whose circuits are known in advance."""

from __future__ import annotations

import math

import torch

from circuits import CircuitConfig, MLPWeights, SAEWeights, analyse_layer

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
    top_gate = gates[gates.out_feature == f_and].iloc[0]
    assert (top_gate.in_a, top_gate.in_b) == (a, b)
    runner_up = gates[gates.out_feature == f_and].iloc[1]
    assert top_gate.and_score > 0.9 and runner_up.and_score < 0.1

    square = _strongest(inter, f_square)
    assert (square.kind, square.in_a, square.in_b) == ("self", c, c)
    assert (gates[gates.out_feature == f_square].and_score < 0.1).all()


def _strongest(interactions, feature):
    """The term with the largest |coefficient| of any kind."""
    rows = interactions[interactions.out_feature == feature]
    return rows.loc[rows.coefficient.abs().idxmax()]


def _weights_only(mlp, sae_in, sae_out, cfg):
    """Weight tables with no tokens: one all-zero activation batch."""
    batch = (torch.zeros(1, D, dtype=F64), torch.zeros(1, sae_out.d_sae, dtype=F64))
    return analyse_layer(mlp, sae_in, sae_out, [batch], cfg, layer=0)


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
    batches = [(x[i : i + 700], acts[i : i + 700]) for i in range(0, 3000, 700)]
    cfg = CircuitConfig(max_rank=3, min_active=10, token_batch=1000, chunk_size=3, dtype="float64")
    low = analyse_layer(mlp, sae(dec), out, batches, cfg, layer=0)["lowrank"]

    corr = low.pivot(index="out_feature", columns="n_eigs", values="corr_active")
    assert math.isclose(corr.loc[f1, 1], 1.0, abs_tol=1e-9)
    assert corr.loc[f2, 1] < 0.99 and math.isclose(corr.loc[f2, 2], 1.0, abs_tol=1e-9)
    n_active = low.groupby("out_feature").n_active.first()
    assert n_active.tolist() == (acts != 0).sum(0).tolist()
    assert n_active[f1] > 100
