"""Data-grounded gate statistics (`circuits.gates.pairs.GateStats`, through `analyse_layer`).

Planted layers whose gates are known in advance (an AND, ORs, XORs, built from hand-made
bilinear units on orthonormal input directions) and tokens whose on/off cells are planted in
known numbers; every statistic is recomputed here from the raw tokens, by definition.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from circuits import CircuitConfig, LayerBatch, MLPWeights, Outputs, SAEWeights
from circuits.gates.pairs import CELLS, Candidates, GateStats, co_occurrence
from circuits.gates.ranking import and_score, gate_table_ranks, ranks_within
from pipelines.analysis.circuit_tables import analyse_layer

F64 = torch.float64
D = 10


def signed_basis(n, d, gen):
    """`n` distinct standard basis vectors of R^d with random signs, as rows: orthonormal
    directions whose products are exact, so that an output is inactive exactly where its
    planted formula is zero (no rounding dust)."""
    rows = torch.eye(d, dtype=F64)[torch.randperm(d, generator=gen)[:n]]
    return rows * torch.where(torch.rand(n, 1, generator=gen) < 0.5, -1.0, 1.0).to(F64)


def identity_sae(W_dec, b_dec=None) -> SAEWeights:
    """An SAE whose encoder is its decoder's transpose, no biases unless given, no top-k."""
    n, d = W_dec.shape
    return SAEWeights(W_enc=W_dec.T.clone(), b_enc=torch.zeros(n, dtype=F64), W_dec=W_dec,
                      b_dec=torch.zeros(d, dtype=F64) if b_dec is None else b_dec)


def mlp_from_units(units) -> MLPWeights:
    """A bilinear MLP of hidden units given as (gate vector, in vector, out vector)."""
    gates, ins, outs = (torch.stack(v, 1) for v in zip(*units))
    return MLPWeights(W_gate=gates, W_in=ins, W_out=outs.T.contiguous(),
                      b_in=torch.zeros(len(units), dtype=F64), b_out=torch.zeros(D, dtype=F64),
                      g=torch.ones(D, dtype=F64), eps=1e-5)


def mlp_forward(mlp: MLPWeights, x):
    """The bilinear MLP, written out."""
    return ((x @ mlp.W_gate) * (x @ mlp.W_in) + mlp.b_in) @ mlp.W_out + mlp.b_out


def planted_cells(counts, gen):
    """On/off masks of inputs a and b with exactly `counts` tokens per cell (on_on, on_off,
    off_on, off_off), in shuffled order."""
    cell = torch.cat([torch.full((n,), i) for i, n in enumerate(counts)])
    cell = cell[torch.randperm(len(cell), generator=gen)]
    return (cell == 0) | (cell == 1), (cell == 0) | (cell == 2)


def explicit_qt(mlp: MLPWeights, basis, directions):
    """`Qt = M^T sym(W_gate diag(W_out u) W_in^T) M` for every direction u, by its definition."""
    Q = torch.einsum("ih,nh,jh->nij", mlp.W_gate, directions @ mlp.W_out.T, mlp.W_in)
    Q = 0.5 * (Q + Q.mT)
    return basis.T @ Q @ basis


def reference_stats(z, scale, acts, cross, f, a, b, q):
    """Every statistic of candidate (a, b) of output f, from the raw tokens (numpy)."""
    z, scale, acts = z.numpy(), scale.numpy(), acts.numpy()
    act = acts[:, f]
    active = act != 0
    on_a, on_b = z[:, a] != 0, z[:, b] != 0
    contribution = cross * z[:, a] * z[:, b] * scale
    cells = [on_a & on_b, on_a & ~on_b, ~on_a & on_b, ~on_a & ~on_b]
    n_active = active.sum()
    means = [act[c].mean() if c.any() else np.nan for c in cells]
    others = [m for m in means[1:] if not np.isnan(m)]
    and_data = (means[0] - max(others)) / means[0] if cells[0].any() and means[0] > 0 else np.nan
    return {
        "n_active": float(n_active),
        "coactivation": (active & on_a & on_b).sum() / n_active if n_active else np.nan,
        "mean_contribution": contribution[active].sum() / n_active if n_active else np.nan,
        "contribution_share": contribution[active].sum() / act[active].sum() if act[active].sum() != 0 else np.nan,
        "and_data": and_data,
        # P(a and b) / (P(a) P(b)) over every token
        "coactivation_lift": (on_a & on_b).mean() / (on_a.mean() * on_b.mean()) if on_a.any() and on_b.any() else np.nan,
        "cell_tokens": [float(c.sum()) for c in cells],
        "cell_mean": means,
        "cell_active_share": [(active & c).sum() / c.sum() if c.any() else np.nan for c in cells],
        # inverted_cdf: the order statistic ceil(q n), which a histogram resolves; numpy's default
        # interpolates towards the next one, which may lie any distance away in a small cell
        "cell_quantile": [np.quantile(act[c], q, method="inverted_cdf") if c.any() else np.nan for c in cells],
        # the histogram's bin width: the output's activation range, zero included, in n_bins
        "range": max(act[active].max(initial=0), 0) - min(act[active].min(initial=0), 0),
    }


def batches_of(x, z, scale, acts, sizes):
    """The tokens as LayerBatches of the given sizes, in order."""
    bounds = np.cumsum([0] + list(sizes))
    assert bounds[-1] == len(x)
    return [LayerBatch(x=x[s:e], z=z[s:e], scale=scale[s:e], acts=acts[s:e]) for s, e in zip(bounds[:-1], bounds[1:])]


# ---------------------------------------------------------------- a planted AND gate

A, B, C, E, RARE, NEVER = 0, 1, 2, 3, 4, 5  # input features
F_AND, F_TWO, F_SELF, F_FEW, F_SILENT = 0, 1, 2, 3, 4  # output features
CELL_COUNTS = (40, 30, 20, 110)  # tokens with (a, b) on_on, on_off, off_on, off_off
N_RARE = 4  # tokens where input RARE is on: output F_FEW fires on them only


def planted_and(site: str, seed: int = 0):
    """Outputs: F_AND = z_a z_b, F_TWO = z_a z_b + z_c z_e, F_SELF = z_c^2, F_FEW = z_rare^2
    (active on N_RARE tokens) and F_SILENT = z_never^2 (never active); times the per-token
    factor s = 1/rms(r)^2 for an input SAE on resid_mid."""
    gen = torch.Generator().manual_seed(seed)
    dec = signed_basis(6, D, gen)
    enc = signed_basis(5, D, gen)
    mlp = mlp_from_units([
        (dec[A], dec[B], enc[F_AND]), (dec[A], dec[B], enc[F_TWO]), (dec[C], dec[E], enc[F_TWO]),
        (dec[C], dec[C], enc[F_SELF]), (dec[RARE], dec[RARE], enc[F_FEW]), (dec[NEVER], dec[NEVER], enc[F_SILENT]),
    ])
    T = sum(CELL_COUNTS)
    on = torch.zeros(T, 6, dtype=torch.bool)
    on[:, A], on[:, B] = planted_cells(CELL_COUNTS, gen)
    on[:, C] = torch.rand(T, generator=gen) < 0.3
    on[:, E] = torch.rand(T, generator=gen) < 0.4
    on[torch.randperm(T, generator=gen)[:N_RARE], RARE] = True
    z = (0.5 + torch.rand(T, 6, generator=gen, dtype=F64)) * on
    r = z @ dec  # the input SAE's site, built from its latents (b_dec = 0)
    if site == "resid_mid":
        scale = 1 / (r.square().mean(-1) + mlp.eps)
        x = mlp.g * r * scale.sqrt()[:, None]
    else:
        scale = torch.ones(T, dtype=F64)
        x = r
    sae_out = identity_sae(enc)
    acts = (mlp_forward(mlp, x) @ sae_out.W_enc + sae_out.b_enc).relu()
    return mlp, identity_sae(dec), sae_out, x, z, scale, acts


def run(mlp, sae_in, sae_out, tokens, site, sizes=None, **cfg):
    x, z, scale, acts = tokens
    sizes = sizes or [len(x)]
    settings = dict(min_active=10, n_truth=10, n_gates=20, n_coactive=4, dtype="float64")
    settings.update(cfg)
    outputs = Outputs("sae", sae_out.W_enc.T.contiguous(), sae=sae_out)
    return analyse_layer(mlp, sae_in, outputs, lambda: batches_of(x, z, scale, acts, sizes),
                         CircuitConfig(**settings), layer=2, input_site=site)


def gate_row(gates, f, a, b):
    rows = gates[(gates.out_feature == f) & (gates.in_a == a) & (gates.in_b == b)]
    assert len(rows) == 1, (f, a, b)
    return rows.iloc[0]


@pytest.mark.parametrize("site", ["resid_mid", "mlp_in"])
def test_planted_and_gate_statistics_are_exact(site):
    mlp, sae_in, sae_out, x, z, scale, acts = planted_and(site)
    q = 0.9
    tables = run(mlp, sae_in, sae_out, (x, z, scale, acts), site, truth_quantile=q)
    gates, truth = tables["gates"], tables["gate_truth"]
    on_a, on_b = z[:, A] != 0, z[:, B] != 0
    both = on_a & on_b
    product = (z[:, A] * z[:, B] * scale).numpy()  # F_AND's activation, by construction
    np.testing.assert_allclose(acts[:, F_AND].numpy(), product, rtol=1e-12, atol=1e-12)
    assert ((acts[:, F_AND] != 0) == both).all()

    g = gate_row(gates, F_AND, A, B)
    assert math.isclose(g.cross, 1.0, rel_tol=1e-12) and abs(g.self_a) < 1e-12 and abs(g.self_b) < 1e-12
    assert g.n_active == CELL_COUNTS[0]
    assert g.coactivation == 1.0  # the planted share: F_AND fires exactly where both do
    assert math.isclose(g.mean_contribution, product[both.numpy()].mean(), rel_tol=1e-12)
    assert math.isclose(g.contribution_share, 1.0, rel_tol=1e-12)
    assert math.isclose(g.and_data, 1.0, rel_tol=1e-12)
    assert (g.weight_rank, g.data_rank, g.layer_rank) == (1, 1, 1)

    # F_TWO = z_a z_b + z_c z_e: the (a, b) share and co-activation are those planted
    active_two = (acts[:, F_TWO] != 0).numpy()
    two = gate_row(gates, F_TWO, A, B)
    assert two.n_active == active_two.sum()
    assert two.coactivation == both.numpy().sum() / active_two.sum()
    assert math.isclose(two.contribution_share, product.sum() / acts[:, F_TWO].sum().item(), rel_tol=1e-12)
    other = gate_row(gates, F_TWO, C, E)
    np.testing.assert_allclose(two.contribution_share + other.contribution_share, 1.0, rtol=1e-12)
    first = gates[gates.layer_rank == 1]
    assert first[["out_feature", "in_a", "in_b"]].values.tolist() == [[F_AND, A, B]]

    # the truth table of the best pair of the layer
    rows = truth[(truth.out_feature == F_AND) & (truth.in_a == A) & (truth.in_b == B)]
    assert rows.cell.tolist() == list(CELLS) and (rows.layer_rank == 1).all()
    assert rows.n_tokens.tolist() == list(CELL_COUNTS)
    np.testing.assert_allclose(rows.mean_activation, [product[both.numpy()].mean(), 0, 0, 0], rtol=1e-12, atol=1e-15)
    assert rows.active_share.tolist() == [1.0, 0.0, 0.0, 0.0]
    expected = reference_stats(z, scale, acts, 1.0, F_AND, A, B, q)
    bin_width = expected["range"] / CircuitConfig().n_bins
    assert np.all(np.abs(rows.quantile_activation.to_numpy() - expected["cell_quantile"]) <= bin_width)
    assert rows.quantile_activation.tolist()[1:] == [0.0, 0.0, 0.0]

    # outputs with too few or no active tokens get no data rank and NaN correlations
    for f, n in [(F_FEW, N_RARE), (F_SILENT, 0)]:
        mine = gates[gates.out_feature == f]
        assert (mine.n_active == n).all() and mine.data_rank.isna().all() and mine.layer_rank.isna().all()
        low = tables["lowrank"][tables["lowrank"].out_feature == f]
        assert (low.n_active == n).all() and low.corr_active.isna().all()
    assert set(truth.out_feature) <= {F_AND, F_TWO, F_SELF}


@pytest.mark.parametrize("site", ["resid_mid", "mlp_in"])
def test_every_candidate_statistic_matches_brute_force(site):
    """Random weights (gain and b_dec included) and random tokens: each gate row and truth
    cell against the definitions."""
    gen = torch.Generator().manual_seed(11)
    d, h, n_in, n_out, T = D, 16, 9, 6, 300
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    mlp = MLPWeights(W_gate=randn(d, h), W_in=randn(d, h), W_out=randn(h, d), b_in=randn(h), b_out=randn(d),
                     g=1 + 0.3 * randn(d), eps=1e-5)
    sae_in = SAEWeights(W_enc=randn(d, n_in), b_enc=randn(n_in) - 0.5, W_dec=randn(n_in, d), b_dec=randn(d), k=4)
    sae_out = SAEWeights(W_enc=randn(d, n_out), b_enc=randn(n_out), W_dec=randn(n_out, d), b_dec=randn(d),
                         k=3, relu=False)  # raw TopK: negative activations too
    r = randn(T, d)
    z = sae_in.encode(r)
    if site == "resid_mid":
        scale = 1 / (r.square().mean(-1) + mlp.eps)
        x = mlp.g * r * scale.sqrt()[:, None]
    else:
        scale, x = torch.ones(T, dtype=F64), r
    acts = sae_out.encode(mlp_forward(mlp, x))
    assert (acts < 0).any()
    q = 0.75
    tables = run(mlp, sae_in, sae_out, (x, z, scale, acts), site, sizes=[100, 1, 199], n_gates=5,
                 n_truth=n_out, truth_quantile=q, n_bins=32, min_active=3)
    gates, truth = tables["gates"], tables["gate_truth"]
    basis = torch.cat([sae_in.W_dec, sae_in.b_dec[None]]).T
    if site == "resid_mid":
        basis = mlp.g[:, None] * basis
    Qt = explicit_qt(mlp, basis, sae_out.W_enc.T)
    assert len(gates) >= n_out * 5 and len(truth) > 0
    for g in gates.itertuples():
        f, a, b = int(g.out_feature), int(g.in_a), int(g.in_b)
        assert a < b < n_in
        np.testing.assert_allclose([g.cross, g.self_a, g.self_b], [2 * Qt[f, a, b], Qt[f, a, a], Qt[f, b, b]],
                                   rtol=1e-10, atol=1e-10)
        expected = reference_stats(z, scale, acts, 2 * Qt[f, a, b].item(), f, a, b, q)
        for name in ("n_active", "coactivation", "coactivation_lift", "mean_contribution", "contribution_share",
                     "and_data"):
            np.testing.assert_allclose(getattr(g, name), expected[name], rtol=1e-10, atol=1e-12, err_msg=name)
        # the cosine of the two inputs' directions as the MLP reads them (times the gain on resid_mid)
        da, db = basis[:, a], basis[:, b]
        np.testing.assert_allclose(g.input_cosine, (da @ db / (da.norm() * db.norm())).item(), rtol=1e-10)
    for (f, a, b), rows in truth.groupby(["out_feature", "in_a", "in_b"]):
        f, a, b = int(f), int(a), int(b)
        expected = reference_stats(z, scale, acts, 2 * Qt[f, a, b].item(), f, a, b, q)
        assert rows.cell.tolist() == list(CELLS)
        assert rows.n_tokens.tolist() == expected["cell_tokens"]
        np.testing.assert_allclose(rows.mean_activation, expected["cell_mean"], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(rows.active_share, expected["cell_active_share"], rtol=1e-12)
        width = expected["range"] / 32
        assert np.all(np.abs(rows.quantile_activation.to_numpy() - expected["cell_quantile"]) <= width * (1 + 1e-9))
    # candidates: the weight pairs plus the pairs among each output's most co-active inputs
    on_in, on_out = (z != 0).double(), (acts != 0).double()
    coactive = (on_out.T @ on_in).numpy()  # [n_out, n_in]
    for f in range(n_out):
        listed = set(zip(gates[gates.out_feature == f].in_a, gates[gates.out_feature == f].in_b))
        ranked = np.sort(coactive[f])[::-1]
        clear = [i for i in range(n_in) if coactive[f, i] > ranked[4] and coactive[f, i] > 0]  # n_coactive = 4
        assert {(i, j) for i in clear for j in clear if i < j} <= listed, f
        weight_pairs = gates[(gates.out_feature == f)].nlargest(5, "and_score")
        by_weights = sorted(((2 * Qt[f, i, j] - Qt[f, i, i].abs() - Qt[f, j, j].abs()).item(), i, j)
                            for i in range(n_in) for j in range(i + 1, n_in))[::-1][:5]
        assert list(zip(weight_pairs.in_a, weight_pairs.in_b)) == [(i, j) for _, i, j in by_weights]
    # data ranks: by gate_score = contribution_share * and_data within each output, among pairs
    # seen together and apart on at least min_active tokens each
    usable = gates[(gates.n_active >= 3) & ((gates.coactivation * gates.n_active).round() >= 3)
                   & (gates.n_a_only >= 3) & (gates.n_b_only >= 3) & gates.and_data.notna()]
    assert len(usable) > 0
    for f, mine in usable.groupby("out_feature"):
        score = mine.contribution_share * mine.and_data.clip(0, 1)
        np.testing.assert_allclose(mine.gate_score, score, rtol=1e-12)
        first = mine[mine.data_rank == 1]
        assert len(first) == 1 and first.gate_score.iloc[0] == pytest.approx(score.max(), rel=1e-12)  # ties: either
    layer_best = gates[gates.data_rank == 1].sort_values("layer_rank")
    assert layer_best.layer_rank.tolist() == list(range(1, len(layer_best) + 1))
    assert layer_best.gate_score.is_monotonic_decreasing
    assert (gates[~gates.index.isin(usable.index)].data_rank.isna()).all()


# ---------------------------------------------------------------- OR and XOR are not AND


def test_or_and_xor_patterns_do_not_score_as_and():
    """Binary inputs a, b (latent 1 when on); outputs built with linear terms through the
    constant coordinate (input SAE on mlp_in with b_dec a unit direction n, so x . n = 1)."""
    gen = torch.Generator().manual_seed(3)
    basis_vectors = signed_basis(7, D, gen)
    dec, n = basis_vectors[:6], basis_vectors[6]
    enc = signed_basis(5, D, gen)
    a, b = 1, 4
    AND, OR, SUM, SOFT_XOR, XOR = range(5)
    mlp = mlp_from_units([
        (dec[a], dec[b], enc[AND]),  # z_a z_b
        (dec[a], n, enc[OR]), (dec[b], n, enc[OR]), (dec[a], -dec[b], enc[OR]),  # z_a + z_b - z_a z_b
        (dec[a], n, enc[SUM]), (dec[b], 1.5 * n, enc[SUM]),  # z_a + 1.5 z_b
        (dec[a], n, enc[SOFT_XOR]), (dec[b], n, enc[SOFT_XOR]), (dec[a], -1.5 * dec[b], enc[SOFT_XOR]),
        (dec[a], n, enc[XOR]), (dec[b], n, enc[XOR]), (dec[a], -2 * dec[b], enc[XOR]),
    ])
    counts = (25, 35, 30, 60)
    T = sum(counts)
    on = torch.rand(T, 6, generator=gen) < 0.3  # other inputs: noise the outputs do not read
    on[:, a], on[:, b] = planted_cells(counts, gen)
    z = torch.where(on, 1.0, 0.0).to(F64)
    z[:, [0, 2, 3, 5]] *= 0.5 + torch.rand(T, 4, generator=gen, dtype=F64)
    x = z @ dec + n
    sae_in, sae_out = identity_sae(dec, b_dec=n), identity_sae(enc)
    acts = (mlp_forward(mlp, x) @ sae_out.W_enc).relu()
    scale = torch.ones(T, dtype=F64)
    tables = run(mlp, sae_in, sae_out, (x, z, scale, acts), "mlp_in", min_active=5)
    gates = tables["gates"]
    # cell means (on_on, on_off, off_on, off_off) and and_data = (m11 - max(others)) / m11
    planted = {AND: ([1, 0, 0, 0], 1.0), OR: ([1, 1, 1, 0], 0.0), SUM: ([2.5, 1, 1.5, 0], 0.4),
               SOFT_XOR: ([0.5, 1, 1, 0], -1.0), XOR: ([0, 1, 1, 0], float("nan"))}
    for f, (means, and_data) in planted.items():
        cells = [(z[:, a] == i) & (z[:, b] == j) for i, j in [(1, 1), (1, 0), (0, 1), (0, 0)]]
        np.testing.assert_allclose([acts[c, f].mean().item() for c in cells], means, atol=1e-12)
        g = gate_row(gates, f, a, b)
        np.testing.assert_allclose(g.and_data, and_data, atol=1e-12)
        if f != AND:
            assert not g.and_data >= 0.5, f
    assert gate_row(gates, AND, a, b).layer_rank == 1
    truth = tables["gate_truth"]
    rows = truth[(truth.out_feature == AND) & (truth.layer_rank == 1)]
    assert (rows.in_a.tolist()[0], rows.in_b.tolist()[0]) == (a, b)
    assert rows.n_tokens.tolist() == list(counts) and rows.mean_activation.tolist() == [1.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- streaming


def test_gate_statistics_do_not_depend_on_batching():
    mlp, sae_in, sae_out, x, z, scale, acts = planted_and("resid_mid", seed=4)
    T = len(x)
    runs = [run(mlp, sae_in, sae_out, (x, z, scale, acts), "resid_mid", sizes=sizes, token_batch=tb)
            for sizes, tb in [([T], 10_000), ([1] * 13 + [T - 13], 1), ([37] * 5 + [T - 185], 50), ([T - 1, 1], 7)]]
    for other in runs[1:]:
        for name in ("gates", "gate_truth", "lowrank", "eigen"):
            pd.testing.assert_frame_equal(runs[0][name], other[name], rtol=1e-12, atol=1e-14)


def test_gate_stats_updates_in_any_split_agree_with_one_update():
    gen = torch.Generator().manual_seed(9)
    T, n_in, n_out = 120, 7, 4
    z = torch.rand(T, n_in, generator=gen, dtype=F64) * (torch.rand(T, n_in, generator=gen) < 0.4)
    acts = torch.randn(T, n_out, generator=gen, dtype=F64) * (torch.rand(T, n_out, generator=gen) < 0.5)
    scale = torch.rand(T, generator=gen, dtype=F64) + 0.5
    candidates = Candidates(
        in_a=torch.tensor([[0, 1, 2], [3, 0, 0], [1, 2, 0], [0, 4, 5]]),
        in_b=torch.tensor([[1, 6, 3], [4, 2, 0], [5, 6, 0], [2, 5, 6]]),
        valid=torch.tensor([[True, True, True], [True, True, False], [True, True, False], [True, True, True]]),
    )
    cross = torch.randn(n_out, 3, generator=gen, dtype=F64)
    act_max = acts.where(acts != 0, torch.tensor(-np.inf, dtype=F64)).amax(0)
    act_min = acts.where(acts != 0, torch.tensor(np.inf, dtype=F64)).amin(0)

    def stats(splits):
        s = GateStats(candidates, cross, act_max, act_min, n_in, n_bins=16)
        for part in torch.arange(T).split(splits):
            s.update(z[part], scale[part], acts[part])
        return s.result(0.8)

    whole = stats(T)
    for splits in (1, 7, [50, 0, 70]):
        for key, value in stats(splits).items():
            torch.testing.assert_close(value, whole[key], rtol=1e-12, atol=1e-14, equal_nan=True, msg=key)
    width = (act_max.clamp_min(0) - act_min.clamp_max(0)) / 16
    for f in range(n_out):
        for slot in range(3):
            if not candidates.valid[f, slot]:
                assert (whole["cell_tokens"][f, slot] == 0).all()
                continue
            a, b = int(candidates.in_a[f, slot]), int(candidates.in_b[f, slot])
            expected = reference_stats(z, scale, acts, cross[f, slot].item(), f, a, b, 0.8)
            for key in ("n_active", "coactivation", "mean_contribution", "contribution_share", "and_data"):
                np.testing.assert_allclose(whole[key][f, slot].item(), expected[key], rtol=1e-12, atol=1e-14)
            for key in ("cell_tokens", "cell_mean", "cell_active_share"):
                np.testing.assert_allclose(whole[key][f, slot].numpy(), expected[key], rtol=1e-12, atol=1e-14)
            got = whole["cell_quantile"][f, slot].numpy()
            assert np.all(np.abs(got - expected["cell_quantile"]) <= width[f].item() * (1 + 1e-9)), (f, slot)


def test_a_float32_batch_taken_a_few_tokens_at_a_time_sums_as_one_batch():
    """`GateStats.update` reduces a batch in its own precision, a chunk of tokens at a time:
    the chunk size must not change one bit of what it adds (float32 sums are order-sensitive,
    so this checks the chunks add in the order one pass would)."""
    gen = torch.Generator().manual_seed(3)
    T, n_in, n_out = 300, 9, 5
    z = (torch.rand(T, n_in, generator=gen) * (torch.rand(T, n_in, generator=gen) < 0.4)).float()
    acts = (torch.randn(T, n_out, generator=gen) * (torch.rand(T, n_out, generator=gen) < 0.5)).float()
    scale = (torch.rand(T, generator=gen) + 0.5).float()
    a = torch.randint(0, n_in, (n_out, 4), generator=gen)
    candidates = Candidates(in_a=a, in_b=(a + 1 + torch.randint(0, n_in - 1, a.shape, generator=gen)) % n_in,
                            valid=torch.rand(n_out, 4, generator=gen) < 0.8)
    cross = torch.randn(n_out, 4, generator=gen, dtype=F64)

    def state(token_chunk):
        s = GateStats(candidates, cross, acts.amax(0).double(), acts.amin(0).double(), n_in, n_bins=8)
        s.update(z, scale, acts, token_chunk=token_chunk)
        return s

    whole = state(T)
    for token_chunk in (1, 7, 64):
        chunked = state(token_chunk)
        for name in ("histogram", "cell_sum", "contribution", "active", "act_sum", "input_count", "co_count"):
            assert torch.equal(getattr(chunked, name), getattr(whole, name)), (token_chunk, name)


@pytest.mark.parametrize("active", [3, 40])  # k^2 <= n_in: pairs of active inputs; else the dense product
def test_co_occurrence_counts_equal_the_dense_product(active):
    gen = torch.Generator().manual_seed(active)
    T, n_in = 300, 64
    pre = torch.rand(T, n_in, generator=gen, dtype=F64)
    keep = pre.topk(active, dim=1).indices
    z = torch.zeros_like(pre).scatter(1, keep, pre.gather(1, keep))
    z[5] = 0  # a token with no active input
    z[7, keep[7, :2]] = 0  # and one with fewer than the rest
    on = (z != 0).double()
    for dtype in (torch.float32, torch.float64):
        inputs, co = co_occurrence(z.to(dtype))
        assert torch.equal(inputs, on.sum(0).long())
        assert torch.equal(co, (on.T @ on).long())
    inputs, co = co_occurrence(z[:0])
    assert not inputs.any() and co.shape == (n_in, n_in) and not co.any()


def test_min_active_threshold_is_inclusive_for_coactive_tokens():
    """An output active on 22 tokens with the pair (a, b) both on in exactly min_active = 15
    of them, and each input alone on 15 more, is ranked (15/22*22 is 14.999... in floating
    point)."""
    gen = torch.Generator().manual_seed(5)
    dec, enc = signed_basis(4, D, gen), signed_basis(1, D, gen)
    a, b, c, e = 0, 1, 2, 3
    mlp = mlp_from_units([(dec[a], dec[b], enc[0]), (dec[c], dec[e], enc[0])])  # z_a z_b + z_c z_e
    on = torch.zeros(60, 4, dtype=torch.bool)
    on[:15, [a, b]] = True  # (a, b) both on: 15 tokens
    on[15:22, [c, e]] = True  # (c, e) both on: 7 more tokens where the output fires
    on[22:37, a] = True  # a alone
    on[37:52, b] = True  # b alone
    z = (0.5 + torch.rand(60, 4, generator=gen, dtype=F64)) * on
    x = z @ dec
    sae_out = identity_sae(enc)
    acts = (mlp_forward(mlp, x) @ sae_out.W_enc).relu()
    assert int((acts[:, 0] != 0).sum()) == 22
    scale = torch.ones(60, dtype=F64)
    gates = run(mlp, identity_sae(dec), sae_out, (x, z, scale, acts), "mlp_in", min_active=15)["gates"]
    g = gate_row(gates, 0, a, b)
    assert g.n_active == 22 and g.coactivation * g.n_active == pytest.approx(15)
    assert (g.n_both, g.n_a_only, g.n_b_only) == (15, 15, 15)
    assert g.data_rank == 1 and g.layer_rank == 1
    # one co-active token fewer than min_active: not ranked
    gates = run(mlp, identity_sae(dec), sae_out, (x, z, scale, acts), "mlp_in", min_active=16)["gates"]
    assert gates.data_rank.isna().all()


def _brute_ranks(group, score) -> list[int]:
    """1 + the candidates of the same group that beat each one: a larger score, or the same
    score earlier; 0 for a NaN score."""
    n = len(score)
    return [0 if math.isnan(score[i]) else 1 + sum(
        group[j] == group[i] and not math.isnan(score[j]) and (score[j] > score[i] or (score[j] == score[i] and j < i))
        for j in range(n)) for i in range(n)]


def test_ranks_within_each_group_take_the_largest_first_and_ties_in_order():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        group = rng.integers(0, 4, n)
        score = rng.integers(-2, 3, n).astype(float)  # few values: many ties
        score[rng.random(n) < 0.2] = np.nan
        assert ranks_within(group, score).tolist() == _brute_ranks(group.tolist(), score.tolist())


def test_the_gates_table_ranks():
    out = np.array([0, 0, 0, 1, 1, 2, 2])
    cross = np.array([1.0, 3.0, 2.0, 1.0, 1.0, 0.5, 4.0])
    self_a = np.array([0.0, -2.5, 0.0, 0.0, 0.5, 0.0, 0.0])
    self_b = np.zeros(7)
    gate = np.array([0.1, 0.3, np.nan, 0.2, 0.2, np.nan, np.nan])
    score = and_score(cross, self_a, self_b)
    np.testing.assert_array_equal(score, [1.0, 0.5, 2.0, 1.0, 0.5, 0.5, 4.0])
    weight, data, layer = gate_table_ranks(out, score, gate)
    assert weight.tolist() == [2, 3, 1, 1, 2, 2, 1]
    assert data.tolist() == [2, 1, 0, 1, 2, 0, 0]  # output 2 has no gate_score: no data rank
    assert layer.tolist() == [0, 1, 0, 2, 0, 0, 0]  # each output's data-rank-1 pair, by gate_score
    assert and_score(torch.tensor(cross), torch.tensor(self_a), torch.tensor(self_b)).tolist() == score.tolist()
