"""The gate home's interventions, types and ranking (`circuits.gates`) against their
definitions: removals recomputed from scratch, the cross-term identity of a quadratic form,
planted truth tables, and a ranking worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from circuits.bilinear import interaction_matrices
from circuits.gates.interventions import (REMOVALS, Entries, LayerIntervention, Sides, _popcount, _popcount_shifts,
                                          _unique_rows, bit_words, candidate_tokens, intervention_table, latent_lookup,
                                          member_effects, side_removal)
from circuits.gates.ranking import circuit_ranks, is_split, tiers
from circuits.gates.types import (GateThresholds, causal_bound, causal_score, closed_form, form_shares, gate_types,
                                  keep_errors, keeps, layer_shares, ranking_terms, with_null_tokens)
from circuits.weights import MLPWeights, SAEWeights

F64 = torch.float64
D, H, N_IN, N_OUT = 12, 20, 24, 16


def world(seed: int, k: int | None = 4, relu: bool = True):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    mlp = MLPWeights(W_gate=randn(D, H) / 3, W_in=randn(D, H) / 3, W_out=randn(H, D) / 3, b_in=randn(H) / 5,
                     b_out=randn(D) / 5, g=1 + randn(D).abs() / 2, eps=1e-5)
    sae_out = SAEWeights(W_enc=randn(D, N_OUT), b_enc=randn(N_OUT) / 5, W_dec=randn(N_OUT, D), b_dec=randn(D) / 5,
                         k=k, relu=relu)
    return mlp, randn(N_IN, D), sae_out, randn


def brute(mlp, W_dec, sae_out, site, source, removed):
    """f's pre-activation and activation from the definitions: `removed [d]` leaves the site."""
    if site == "resid_mid":
        r = source - removed
        x = mlp.g * r / torch.sqrt(r.square().mean() + mlp.eps)
    else:
        x = source - removed
    out = ((x @ mlp.W_gate) * (x @ mlp.W_in) + mlp.b_in) @ mlp.W_out + mlp.b_out
    return sae_out.pre(out), sae_out.encode(out)


@pytest.mark.parametrize("site", ["resid_mid", "mlp_in"])
def test_evaluate_equals_the_layer_recomputed_from_its_definition(site):
    mlp, W_dec, sae_out, randn = world(0)
    layer = LayerIntervention(mlp, W_dec, sae_out, site)
    source = randn(6, D) * 2
    token = torch.tensor([0, 1, 1, 3, 5, 5, 2])
    # evaluation 0 removes nothing, 1 one latent, 2 three, ... (entry, member, coef)
    entry = torch.tensor([1, 2, 2, 2, 3, 4, 4, 5, 6])
    member = torch.tensor([3, 0, 5, 23, 7, 1, 1, 2, 9])
    coef = randn(9)
    removed = [(coef[entry == n, None] * W_dec[member[entry == n]]).sum(0) for n in range(len(token))]
    # even evaluations read the output the removal leaves strongest (active), odd ones another
    strongest = [int(brute(mlp, W_dec, sae_out, site, source[t], r)[0].argmax()) for t, r in zip(token, removed)]
    out = torch.tensor([strongest[n] if n % 2 == 0 else (strongest[n] + 5) % N_OUT for n in range(len(token))])
    pre, act = layer.evaluate(source, token, out, entry, member, coef)
    for n in range(len(token)):
        want_pre, want_act = brute(mlp, W_dec, sae_out, site, source[token[n]], removed[n])
        torch.testing.assert_close(pre[n], want_pre[out[n]])
        torch.testing.assert_close(act[n], want_act[out[n]])
    assert (act == 0).any() and (act != 0).any()  # the TopK selection is exercised


def test_synergy_of_a_quadratic_form_is_its_cross_term():
    # on mlp_in with a linear output SAE (no TopK, no ReLU), f is the quadratic form of x
    # plus linear and constant terms: t11 - t10 - t01 + t00 must be 2 x_A^T Q x_B exactly
    mlp, W_dec, sae_out, randn = world(1, k=None, relu=False)
    layer = LayerIntervention(mlp, W_dec, sae_out, "mlp_in")
    Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, sae_out.W_enc.T)  # [n_out, d, d]
    z = torch.zeros(5, N_IN, dtype=F64)
    z[:, [1, 2, 3, 8, 9]] = randn(5, 5).abs() + 0.1
    source = z @ W_dec + randn(5, D) / 4  # an input the SAE does not reconstruct: the rest stays
    sides = Sides.of_groups([3, 3, 11, 0, 6], [[1], [1, 2], [8], [3, 9], [2]], [[2], [8, 9], [1, 3], [1], [9]])
    entries = Entries(cand=torch.arange(5), token=torch.arange(5))
    table = intervention_table(layer, source, z, sides, entries)
    cross = closed_form(table["pre_none"], table["pre_b"], table["pre_a"], table["pre_ab"])["cross"]
    for c in range(5):
        part = lambda members: sum(z[c, m] * W_dec[m] for m in members if m >= 0)  # noqa: E731
        xa, xb = part(sides.a[c].tolist()), part(sides.b[c].tolist())
        want = 2 * xa @ Q[sides.out[c]] @ xb
        np.testing.assert_allclose(cross[c], float(want), rtol=1e-9, atol=1e-12)
    assert np.abs(cross).min() > 1e-4


@pytest.mark.parametrize("n_tokens, block", [(40, 4096), (77, 2)])
def test_candidate_tokens_are_exactly_where_the_output_is_active_and_both_sides_on(n_tokens, block):
    g = torch.Generator().manual_seed(2)
    on = torch.rand(n_tokens, N_IN, generator=g) < 0.5
    active = torch.rand(n_tokens, N_OUT, generator=g) < 0.5
    sides = Sides.of_groups([5, 0, 5, 9, 15], [[1, 2], [0], [3], [4, 5, 6], [7]], [[3], [1], [8, 9], [10], [11]])
    words = lambda table: bit_words(*table.nonzero().T, n_tokens, table.shape[1])  # noqa: E731
    found = candidate_tokens(words(on), words(active), sides, block=block)
    got = list(zip(found.cand.tolist(), found.token.tolist()))
    want = {(c, t) for c in range(5) for t in range(n_tokens)
            if active[t, sides.out[c]] and on[t, sides.a[c][sides.a[c] >= 0]].any()
            and on[t, sides.b[c][sides.b[c] >= 0]].any()}
    assert set(got) == want and len(got) == len(want) and len(want) > 10
    # with a limit, each candidate's first tokens (the sample takes tokens in a seeded order)
    first = candidate_tokens(words(on), words(active), sides, limit=3, block=block)
    firsts = {(c, t) for c in range(5) for t in sorted(t for d, t in want if d == c)[:3]}
    assert set(zip(first.cand.tolist(), first.token.tolist())) == firsts and len(first.cand) == len(firsts)
    nothing = candidate_tokens(words(on), words(active), Sides.of_groups([], [], []))
    assert nothing.cand.shape == nothing.token.shape == (0,)


@pytest.mark.parametrize("limit", [None, 32])
def test_candidate_tokens_of_no_tokens_are_none(limit):
    """Issue 51 item 14: `verdicts --confirm-share 0` (or 1e-9) leaves no confirmation token,
    words of width 0; that is no token for any candidate, not a `range()` step of zero."""
    none = torch.zeros(N_IN, 0, dtype=torch.int64), torch.zeros(N_OUT, 0, dtype=torch.int64)
    found = candidate_tokens(*none, Sides.of_groups([3, 5], [[2], [1]], [[4], [0]]), limit=limit)
    assert found.cand.shape == found.token.shape == (0,)


@pytest.mark.parametrize("limit", [1, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 170])
def test_a_limit_keeps_the_first_tokens_across_words(limit):
    # a candidate on at every token: its first `limit` tokens run through whole 64-token words (the sign bit
    # included)
    on, active = torch.ones(170, N_IN, dtype=torch.bool), torch.ones(170, N_OUT, dtype=torch.bool)
    on[[5, 40, 63, 70, 127], 2] = False  # side a's only member is off at five tokens
    words = lambda table: bit_words(*table.nonzero().T, 170, table.shape[1])  # noqa: E731
    found = candidate_tokens(words(on), words(active), Sides.of_groups([3], [[2]], [[4]]), limit=limit)
    want = [t for t in range(170) if t not in (5, 40, 63, 70, 127)][:limit]
    assert sorted(found.token.tolist()) == want and (found.cand == 0).all()


def test_both_ways_of_counting_bits_count_every_bit_of_a_word():
    g = torch.Generator().manual_seed(0)
    words = torch.cat([torch.randint(-(2**63), 2**63 - 1, (500,), generator=g, dtype=torch.long),
                       torch.tensor([0, -1, -(2**63), 2**63 - 1, 1])])
    want = [(w & (2**64 - 1)).bit_count() for w in words.tolist()]  # the word's 64 bits, sign bit too
    assert _popcount(words).tolist() == want and _popcount_shifts(words).tolist() == want
    assert _popcount(words[None, :4]).shape == (1, 4) and max(want) == 64


@pytest.mark.parametrize("k, relu", [(4, True), (4, False), (None, True), (N_OUT, False)])
def test_encode_at_is_the_encoding_read_at_one_latent(k, relu):
    _, _, sae_out, randn = world(4, k=k, relu=relu)
    pre = randn(50, N_OUT)
    latent = torch.randint(0, N_OUT, (50,), generator=torch.Generator().manual_seed(0))
    latent[:10] = pre[:10].argmax(-1)  # some surely selected
    want = (pre.topk(k, -1).values.min(-1).values[:, None] <= pre) * pre if k else pre
    want = want.relu() if relu else want
    got = sae_out.encode_at(pre, latent)
    torch.testing.assert_close(got, want[torch.arange(50), latent])
    assert (got != 0).any() and ((got == 0).any() or k != 4)  # TopK of 4 leaves latents out
    # entries reading shared rows: many entries per row (each row's k-th largest, once) and few
    pre[1, :5] = pre[1, 5]  # ties at the k-th largest decide alike
    want = (pre.topk(k, -1).values.min(-1).values[:, None] <= pre) * pre if k else pre
    want = want.relu() if relu else want
    for n_rows in (3, 50):
        rows = torch.randint(0, n_rows, (200,), generator=torch.Generator().manual_seed(n_rows))
        latent = torch.randint(0, N_OUT, (200,), generator=torch.Generator().manual_seed(1))
        latent[:20] = pre[rows[:20]].argmax(-1)
        latent[20:25] = 0  # a tied latent of row 1
        rows[20:25] = 1
        got = sae_out.encode_at(pre[:n_rows], latent, rows)
        torch.testing.assert_close(got, want[rows, latent])
        torch.testing.assert_close(got, sae_out.encode_at(pre[rows], latent))


@pytest.mark.parametrize("k, relu", [(4, True), (4, False), (8, True), (None, True), (N_OUT, False)])
def test_encode_sparse_is_the_encoding_as_a_sparse_tensor(k, relu):
    """The token cache's sparse encoding: the same activations as `encode`, coalesced, its
    zeros left out (a kept latent that ReLU zeroes included), ties at the k-th as `encode`."""
    _, _, sae, randn = world(5, k=k, relu=relu)
    a = randn(60, D)
    a[1] = a[0]  # two equal rows
    sae.W_enc[:, 3] = sae.W_enc[:, 2]  # two equal latents: ties at every row
    sae.b_enc -= sae.pre(a).median()  # half the pre-activations negative: kept ones among them
    sae.b_enc[3] = sae.b_enc[2]
    got, want = sae.encode_sparse(a), sae.encode(a)
    assert got.is_coalesced() and torch.equal(got.to_dense(), want)
    assert torch.equal(got.indices(), want.to_sparse().indices())
    assert bool((want < 0).any()) != relu


def test_encode_at_counts_wide_rows_a_block_of_entries_at_a_time():
    """Rows of 4,096 latents in float64 are counted 64 entries at a time (2 MB): every block's
    entries are read at their own rows."""
    n = 4096
    sae = SAEWeights(W_enc=torch.zeros(2, n, dtype=F64), b_enc=torch.zeros(n, dtype=F64),
                     W_dec=torch.zeros(n, 2, dtype=F64), b_dec=torch.zeros(2, dtype=F64), k=8, relu=False)
    g = torch.Generator().manual_seed(9)
    pre = torch.randn(190, n, generator=g, dtype=F64)
    rows = torch.randint(0, 190, (200,), generator=g)
    latent = torch.randint(0, n, (200,), generator=g)
    latent[::3] = pre[rows[::3]].argmax(-1)  # a third surely selected
    want = (pre.topk(8, -1).values.min(-1).values[:, None] <= pre) * pre
    got = sae.encode_at(pre, latent, rows)
    torch.testing.assert_close(got, want[rows, latent])
    assert (got[::3] != 0).all() and (got == 0).any()
    torch.testing.assert_close(sae.encode_at(pre[rows], latent), got)


@pytest.mark.parametrize("base, width", [(7, 3), (7, 40), (600, 12), (600, 0)])
def test_unique_rows_groups_equal_rows_as_torch_unique_does(base, width):
    g = torch.Generator().manual_seed(5)
    pool = torch.randint(0, base, (30, width + 1), generator=g)
    pool[:, 0] = torch.randint(0, 1000, (30,), generator=g)  # the first column (a token) is not bounded by base
    rows = pool[torch.randint(0, 30, (200,), generator=g)]  # many repeats
    got = _unique_rows(rows, base)
    # the same numbering (distinct rows in order), so that callers evaluate the same rows in the same order
    assert torch.equal(got, torch.unique(rows, dim=0, return_inverse=True)[1]) and len(got.unique()) < 200


def test_intervention_table_equals_evaluate_entry_by_entry():
    # shared evaluations (rows removing the same latents at a token) and the chunk's projections
    # give what evaluating each entry alone gives, TopK selection included
    mlp, W_dec, sae_out, randn = world(6)
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    z = torch.where(torch.rand(8, N_IN, generator=torch.Generator().manual_seed(1), dtype=F64) < 0.4,
                    randn(8, N_IN).abs(), torch.zeros(8, N_IN, dtype=F64))
    source = z @ W_dec + randn(8, D) / 4
    sides = Sides.of_groups([3, 3, 11, 0, 6, 3], [[1], [1, 2], [8], [3, 9], [2], [1]], [[2], [8, 9], [1, 3], [1], [9], [5]])
    entries = Entries(cand=torch.tensor([0, 0, 1, 2, 3, 4, 5, 5, 1]), token=torch.tensor([0, 1, 1, 2, 3, 4, 1, 7, 7]))
    table = intervention_table(layer, source, z, sides, entries, chunk=4)
    out = sides.out[entries.cand]
    n = torch.bincount(entries.cand, minlength=len(sides)).double()
    members = {"none": torch.full((len(entries.cand), 1), -1), "a": sides.a[entries.cand], "b": sides.b[entries.cand]}
    members["ab"] = torch.cat([members["a"], members["b"]], 1)
    for r, m in members.items():
        pre, act = layer.evaluate(source, entries.token, out, *side_removal(latent_lookup(z)(entries.token, m), m))
        for kind, values in (("pre", pre), ("act", act)):
            mean = torch.zeros(len(sides), dtype=F64).index_add_(0, entries.cand, values) / n
            torch.testing.assert_close(table[f"{kind}_{r}"], mean)
    assert (table["act_ab"] == 0).any() or (table["act_a"] == 0).any() or (table["act_b"] == 0).any()
    # the mean products of the four activations, entry by entry: what the keeps' errors read
    acts = torch.stack([layer.evaluate(source, entries.token, out, *side_removal(latent_lookup(z)(entries.token, m), m))[1]
                        for m in members.values()], 1)  # [E, 4] in REMOVALS order
    second = torch.zeros(len(sides), 4, 4, dtype=F64).index_add_(0, entries.cand, acts[:, :, None] * acts[:, None, :])
    torch.testing.assert_close(table["act_second"], second / n[:, None, None])


@pytest.mark.parametrize("site", ["resid_mid", "mlp_in"])
def test_a_pairs_both_sides_removal_derived_from_the_single_ones_equals_its_evaluation(site):
    # u(y - a - b) = u(y - a) + u(y - b) - u(y) + z_a z_b C_ab: every output's pre-activation,
    # so f's activation after TopK is the one a full evaluation gives
    mlp, W_dec, sae_out, randn = world(8)
    layer = LayerIntervention(mlp, W_dec, sae_out, site)
    z = torch.where(torch.rand(10, N_IN, generator=torch.Generator().manual_seed(4), dtype=F64) < 0.5,
                    randn(10, N_IN).abs() * 2, torch.zeros(10, N_IN, dtype=F64))
    source = z @ W_dec + randn(10, D) / 4
    on = (z != 0).nonzero().tolist()
    pairs = [(t, a, b) for t, a in on for u, b in on if t == u and a < b][:60]
    sides = Sides.of_pairs(torch.tensor([(a * 7 + b) % N_OUT for _, a, b in pairs]), torch.tensor([p[1] for p in pairs]),
                           torch.tensor([p[2] for p in pairs]))
    entries = Entries(cand=torch.arange(len(pairs)), token=torch.tensor([p[0] for p in pairs]))
    table = intervention_table(layer, source, z, sides, entries, chunk=16)
    both = torch.cat([sides.a, sides.b], 1)
    pre, act = layer.evaluate(source, entries.token, sides.out, *side_removal(latent_lookup(z)(entries.token, both), both))
    torch.testing.assert_close(table["pre_ab"], pre, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(table["act_ab"], act, rtol=1e-9, atol=1e-9)
    assert (act == 0).any() and (act != 0).any()  # TopK keeps some outputs and drops others


def test_one_member_sides_with_an_empty_side_are_evaluated_not_derived():
    # a group side with no member is padding (-1), not a latent: nothing of it leaves
    mlp, W_dec, sae_out, randn = world(9)
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    z = randn(6, N_IN).abs() * (torch.rand(6, N_IN, generator=torch.Generator().manual_seed(3), dtype=F64) < 0.6)
    z[:, [1, 2, N_IN - 1]] = 1.5  # N_IN - 1: the latent that padding would read as -1
    source = z @ W_dec + randn(6, D) / 4
    sides = Sides.of_groups([3, 5, 7], [[1], [2], [1]], [[2], [], [N_IN - 1]])
    entries = Entries(cand=torch.arange(3).repeat(6), token=torch.arange(6).repeat_interleave(3))
    table = intervention_table(layer, source, z, sides, entries)
    both = torch.cat([sides.a, sides.b], 1)[entries.cand]
    pre, act = layer.evaluate(source, entries.token, sides.out[entries.cand],
                              *side_removal(latent_lookup(z)(entries.token, both), both))
    mean = lambda values: torch.zeros(3, dtype=F64).index_add_(0, entries.cand, values) / 6  # noqa: E731
    torch.testing.assert_close(table["pre_ab"], mean(pre))
    torch.testing.assert_close(table["act_ab"], mean(act))
    torch.testing.assert_close(table["pre_ab"][1], table["pre_a"][1])  # removing both is removing a


def test_a_pair_carrying_most_of_the_residual_is_evaluated_whole_in_float32():
    # the derived removal's terms cancel and the new norm's factor magnifies their rounding:
    # such rows are evaluated whole, so float32 gives what a full evaluation gives
    mlp, W_dec, sae_out, randn = world(8)
    mlp, W_dec, sae_out = mlp.to(torch.float32), W_dec.float(), sae_out.to(torch.float32)
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    z = torch.zeros(40, N_IN)
    z[:, 0], z[:, 1] = 3.0, 2.0
    z[:, 2:6] = randn(40, 4).abs().float() * 0.01
    source = z @ W_dec + randn(40, D).float() * 0.003
    sides = Sides.of_pairs(torch.arange(40) % N_OUT, torch.zeros(40), torch.ones(40))
    entries = Entries(cand=torch.arange(40), token=torch.arange(40))
    table = intervention_table(layer, source, z, sides, entries)
    both = torch.cat([sides.a, sides.b], 1)
    pre, act = layer.evaluate(source, entries.token, sides.out, *side_removal(latent_lookup(z)(entries.token, both), both))
    torch.testing.assert_close(table["pre_ab"], pre.double(), rtol=1e-4, atol=1e-3)
    assert torch.equal(table["act_ab"] != 0, act != 0)


def test_member_effects_find_the_members_that_matter():
    mlp, W_dec, sae_out, randn = world(3, k=None)
    W_dec[5] = 0  # a member whose removal removes nothing
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    z = torch.zeros(3, N_IN, dtype=F64)
    z[:, [1, 2, 5]] = 1.0  # member 7 is never active
    source = z @ W_dec + randn(3, D)
    sides = Sides.of_groups([4], [[1, 5, 7]], [[2]])
    entries = Entries(cand=torch.zeros(3, dtype=torch.long), token=torch.arange(3))
    effect = member_effects(layer, source, z, sides, entries, "a")
    assert effect.shape == (1, 3)
    assert abs(float(effect[0, 0])) > 1e-3 and abs(float(effect[0, 1])) < 1e-9 and float(effect[0, 2]) == 0.0


def test_member_effects_are_the_change_when_each_member_stays_behind():
    # by definition, on tokens where some members are alone on their side (nothing else leaves) and some not
    mlp, W_dec, sae_out, randn = world(7, k=4)
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    g = torch.Generator().manual_seed(7)
    z = (torch.rand(30, N_IN, generator=g, dtype=F64) < 0.4) * (0.5 + torch.rand(30, N_IN, generator=g, dtype=F64))
    source = z @ W_dec + randn(30, D) / 10
    sides = Sides.of_groups([2, 6], [[0, 1, 2], [3, 4]], [[5], [7, 8]])
    entries = Entries(cand=torch.arange(2).repeat(30), token=torch.arange(30).repeat_interleave(2))
    lookup = latent_lookup(z)
    act = lambda members: layer.evaluate(source, entries.token, sides.out[entries.cand],  # noqa: E731
                                         *side_removal(lookup(entries.token, members), members))[1]
    a = sides.a[entries.cand]
    alone = ((lookup(entries.token, a) != 0).sum(1) == 1).sum()
    assert 0 < alone < len(a)  # both kinds of row are tested
    removed, clean = act(a), act(torch.full_like(a[:, :1], -1))
    mean = lambda values: torch.zeros(2, dtype=F64).index_add_(0, entries.cand, values)  # noqa: E731
    want = torch.stack([mean(act(torch.where(torch.arange(3) == k, -1, a)) - removed) for k in range(3)], 1)
    want = want / mean(clean)[:, None]
    want[1, 2] = 0.0  # the second gate's side has two members: its third slot is padding
    torch.testing.assert_close(member_effects(layer, source, z, sides, entries, "a", chunk=16), want)


def test_member_effects_read_the_intervention_tables_activations_at_each_entry():
    """The pruning reads the clean and side-removed activations that the gates' intervention
    table computed at each entry rather than computing them again: they must be those
    evaluations, and give the member effects computed from scratch."""
    mlp, W_dec, sae_out, randn = world(6, k=4)
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    g = torch.Generator().manual_seed(6)
    z = (torch.rand(40, N_IN, generator=g, dtype=F64) < 0.5) * torch.rand(40, N_IN, generator=g, dtype=F64)
    source = z @ W_dec + randn(40, D) / 10
    sides = Sides.of_groups([1, 3, 3], [[0, 1, 2], [4, 5], [6]], [[7, 8], [9, 10, 11], [12, 13]])
    entries = Entries(cand=torch.arange(3).repeat(40), token=torch.arange(40).repeat_interleave(3))
    table = intervention_table(layer, source, z, sides, entries, chunk=32, per_entry=True)
    act = table["entry_act"]
    assert act.shape == (120, 4)
    a, b = sides.a[entries.cand], sides.b[entries.cand]
    for column, members in enumerate([torch.full_like(a[:, :1], -1), a, b, torch.cat([a, b], 1)]):
        want = layer.evaluate(source, entries.token, sides.out[entries.cand],
                              *side_removal(latent_lookup(z)(entries.token, members), members))[1]
        torch.testing.assert_close(act[:, column], want)
        mean = torch.zeros(3, dtype=F64).index_add_(0, entries.cand, want) / 40
        torch.testing.assert_close(table[f"act_{REMOVALS[column]}"], mean)
    for side in ("a", "b"):
        read = member_effects(layer, source, z, sides, entries, side, chunk=32, entry_act=act)
        torch.testing.assert_close(read, member_effects(layer, source, z, sides, entries, side, chunk=32))
        assert (read.abs() > 1e-3).any()


def test_a_wide_side_with_few_active_members_removes_just_those():
    """Rows of a side padded to many slots, few of its members active: the shared evaluation
    reads each row by its active members alone, and must still remove exactly them."""
    mlp, W_dec, sae_out, randn = world(8, k=4)
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    g = torch.Generator().manual_seed(8)
    z = torch.zeros(30, N_IN, dtype=F64)
    for token in range(30):  # one to three of side a's twelve members on, side b's member always
        z[token, torch.randperm(12, generator=g)[: 1 + token % 3]] = torch.rand(1 + token % 3, generator=g, dtype=F64)
    z[:, 12] = 0.5
    source = z @ W_dec + randn(30, D) / 10
    sides = Sides.of_groups([2, 5], [list(range(12)), [3]], [[12], [12, 13]])
    entries = Entries(cand=torch.arange(2).repeat(30), token=torch.arange(30).repeat_interleave(2))
    act = intervention_table(layer, source, z, sides, entries, per_entry=True)["entry_act"]
    a, b = sides.a[entries.cand], sides.b[entries.cand]
    for column, members in ((1, a), (2, b), (3, torch.cat([a, b], 1))):
        want = layer.evaluate(source, entries.token, sides.out[entries.cand],
                              *side_removal(latent_lookup(z)(entries.token, members), members))[1]
        torch.testing.assert_close(act[:, column], want)
    assert (act[:, 1] != act[:, 0]).any()


def test_latent_lookup_reads_a_sparse_cache_as_the_dense_one():
    """Latents of padded sides looked up in a sparse COO cache: a member's latent at its row's
    token, zero where it is off, zero for padding (-1), as the dense table gives."""
    g = torch.Generator().manual_seed(3)
    z = (torch.rand(40, N_IN, generator=g) < 0.2) * torch.rand(40, N_IN, generator=g)
    token = torch.randint(0, 40, (60,), generator=g)
    members = torch.randint(0, N_IN, (60, 5), generator=g)
    members[:, 3:] = -1
    members[::4, :] = -1  # rows of padding only
    want = latent_lookup(z)(token, members)
    assert (want != 0).any() and (want[:, 3:] == 0).all()
    assert torch.equal(latent_lookup(z.to_sparse())(token, members), want)
    assert torch.equal(latent_lookup(torch.zeros(40, N_IN).to_sparse())(token, members), torch.zeros(60, 5))


LIMITS = GateThresholds(need=0.5, cross=0.25, suffice=0.7, matter=0.2, rise=0.1)


@pytest.mark.parametrize("table, expected", [
    # without the layer's form, an activation-level AND is a threshold AND (the bilinear rules: test_types_on_the_form)
    ((1.0, 0.0, 0.0, 0.0), "threshold"),  # t11, t10, t01, t00
    ((1.0, 0.1, 0.2, 0.0), "threshold"),
    ((1.0, 1.0, 1.0, 0.0), "or"),
    ((1.0, 0.5, 0.5, 0.0), "additive"),  # each necessary by the threshold, but no cross term
    ((1.0, 0.6, 0.3, 0.0), "additive"),
    ((1.0, 0.4, 0.45, 0.2), "threshold"),
    ((1.0, 1.0, 0.0, 0.0), "one-sided"),  # A matters, B is a bystander
    ((1.0, 0.0, 0.95, 0.0), "one-sided"),
    ((1.0, 0.0, 0.95, 0.1), "one-sided"),  # B's own term 5% of f without A, 5% with it
    ((1.0, 0.87, 0.66, 0.06), "additive"),  # B hardly matters beside A, but alone it gives 66%: no bystander
    ((1.0, 1.5, 0.0, 0.5), "inhibition"),  # removing B raises f
    ((1.0, 1.5, 1.6, 0.2), "xor-like"),
    ((1.0, 0.95, 0.9, 0.9), "neither"),
    ((0.0, 0.0, 0.0, 0.0), "untested"),
])
def test_gate_types_of_planted_truth_tables(table, expected):
    t11, t10, t01, t00 = table
    k = keeps([t11], [t10], [t01], [t00])
    assert gate_types(k["keep_a"], k["keep_b"], k["keep_ab"], LIMITS)[0] == expected


def test_causal_score_is_high_only_for_a_necessary_cross_term():
    k = keeps([1, 1, 1, 1], [0, 0.5, 1, 1], [0, 0.5, 1, 0], [0, 0, 0, 0])  # and, additive, or, one-sided
    score = causal_score(k["keep_a"], k["keep_b"], k["synergy"])
    np.testing.assert_allclose(score, [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(k["synergy"], [1.0, 0.0, -1.0, 0.0])


def test_keep_errors_are_the_delta_method_errors_of_ratios_of_means():
    # per-token activations with nothing, A, B and both removed; the errors from the mean
    # products equal the delta method computed token by token
    rng = np.random.default_rng(0)
    values = [rng.uniform(0.5, 2.0, (n, 4)) * [1.0, 0.3, 0.4, 0.1] for n in (5, 30)]
    mean = np.stack([v.mean(0) for v in values])
    second = np.stack([(v[:, :, None] * v[:, None, :]).mean(0) for v in values])
    got = keep_errors(np.array([5, 30]), mean, second)
    for i, v in enumerate(values):
        f = v[:, 0]
        for name, y in (("keep_a", v[:, 1]), ("keep_b", v[:, 2]), ("keep_ab", v[:, 3]),
                        ("synergy", v[:, 0] - v[:, 1] - v[:, 2] + v[:, 3])):
            ratio = y.mean() / f.mean()
            want = np.sqrt(np.sum((y - ratio * f) ** 2) / (len(f) - 1) / len(f)) / f.mean()
            np.testing.assert_allclose(got[name][i], want, rtol=1e-9)
    assert np.isnan(keep_errors(np.array([1]), mean[:1], second[:1])["keep_a"]).all()


def test_keep_errors_match_the_spread_of_keeps_over_repeated_samples():
    # planted: f = a b + 0.2 a with noisy inputs; removing A keeps nothing, removing B keeps
    # the own term; across 2,000 samples of 40 tokens the keeps spread as their errors say
    rng = np.random.default_rng(1)
    n, repeats = 40, 2000
    a, b = rng.gamma(2.0, 0.5, (repeats, n)), rng.gamma(4.0, 0.25, (repeats, n))
    v = np.stack([a * b + 0.2 * a, np.zeros_like(a), 0.2 * a, np.zeros_like(a)], -1)  # [repeats, n, 4]
    mean, second = v.mean(1), (v[..., :, None] * v[..., None, :]).mean(1)
    k = keeps(mean[:, 0], mean[:, 2], mean[:, 1], mean[:, 3])
    errors = keep_errors(np.full(repeats, n), mean, second)
    for name in ("keep_b", "synergy"):
        assert np.median(errors[name]) == pytest.approx(np.std(k[name]), rel=0.1)


def test_the_causal_bound_prefers_a_sure_and_to_a_lucky_one():
    # two ands: the first scores higher by its estimate, but its keeps are uncertain
    k = keeps([1.0, 1.0], [0.30, 0.35], [0.30, 0.35], [0.0, 0.0])
    errors = {"keep_a": np.array([0.15, 0.02]), "keep_b": np.array([0.15, 0.02]), "synergy": np.array([0.2, 0.03])}
    score = causal_score(k["keep_a"], k["keep_b"], k["synergy"])
    bound = causal_bound(k, errors, 2.0)
    assert score[0] > score[1] and bound[1] > bound[0]
    np.testing.assert_allclose(causal_bound(k, errors, 0.0), score)
    np.testing.assert_allclose(bound[1], causal_score(0.39, 0.39, k["synergy"][1] - 0.06))
    # a candidate without an error (one token) is bounded only when z asks for it
    unknown = {name: np.array([np.nan, 0.02]) for name in errors}
    assert np.isnan(causal_bound(k, unknown, 2.0)[0])
    np.testing.assert_allclose(causal_bound(k, unknown, 0.0), score)


def _token_statistics(v: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """`(n, mean [4], second [4, 4])` of one candidate's per-token activations `v [n, 4]`."""
    return len(v), v.mean(0), v.T @ v / len(v)


def test_null_tokens_shrink_each_keep_towards_one_by_the_samples_size():
    rng = np.random.default_rng(0)
    f = rng.uniform(1, 2, 30)
    v = np.stack([f, 0.2 * f * rng.uniform(0.5, 1.5, 30), 0.4 * f, 0.1 * f], 1)  # f, f_a, f_b, f_ab
    n, mean, second = _token_statistics(v)
    alone = keeps(mean[0], mean[2], mean[1], mean[3])
    total, shrunk_mean, shrunk_second = with_null_tokens([n], mean[None], second[None], 3.0)
    shrunk = keeps(shrunk_mean[:, 0], shrunk_mean[:, 2], shrunk_mean[:, 1], shrunk_mean[:, 3])
    assert total[0] == 33
    for name in ("keep_a", "keep_b", "keep_ab"):
        np.testing.assert_allclose(shrunk[name], (n * alone[name] + 3) / (n + 3))
    np.testing.assert_allclose(shrunk["synergy"], n * alone["synergy"] / (n + 3))
    # the same as three tokens of no effect (f unchanged by every removal, at the sample's mean f) in the data
    padded = np.concatenate([v, np.full((3, 4), f.mean())])
    _, want_mean, want_second = _token_statistics(padded)
    np.testing.assert_allclose(shrunk_mean[0], want_mean)
    np.testing.assert_allclose(shrunk_second[0], want_second)
    # none added: the sample's own statistics, and the bound of `causal_bound`
    np.testing.assert_allclose(with_null_tokens([n], mean[None], second[None], 0.0)[1], mean[None])
    errors = keep_errors(np.array([n]), mean[None], second[None])
    plain = keeps([mean[0]], [mean[2]], [mean[1]], [mean[3]])
    np.testing.assert_allclose(ranking_terms([n], mean[None], second[None], 2.0, 0.0, LIMITS)["causal_bound"],
                               causal_bound(plain, errors, 2.0))


def test_a_few_tokens_that_all_lose_the_output_do_not_outrank_many_that_nearly_all_do():
    """Where removing either side takes f to exactly 0 on each of 20 tokens, the keeps are 0
    with no spread: with the sample alone its bound is a perfect 1, above a candidate whose
    256 tokens keep about 2% each. With a null token the many tokens rank first."""
    rng = np.random.default_rng(1)
    f = rng.uniform(1, 2, 20)
    few = _token_statistics(np.stack([f, 0 * f, 0 * f, 0 * f], 1))
    g = rng.uniform(1, 2, 256)
    many = _token_statistics(np.stack([g, g * rng.uniform(0, 0.04, 256), g * rng.uniform(0, 0.04, 256),
                                       g * rng.uniform(0, 0.02, 256)], 1))
    n, mean, second = (np.array(x) for x in zip(few, many))
    alone = ranking_terms(n, mean, second, 2.0, 0.0, LIMITS)["causal_bound"]
    assert alone[0] == 1.0 and alone[1] < 1.0
    bound = ranking_terms(n, mean, second, 2.0, 1.0, LIMITS)["causal_bound"]
    assert bound[1] > bound[0]
    assert bound[0] < 0.9 < bound[1]  # the pull is strong on 20 tokens, slight on 256


def test_an_and_just_under_the_need_threshold_is_not_a_sure_one():
    """Two ands by their estimates on 256 tokens, side A necessary in both (removing it keeps
    5%): removing side B keeps about 48% of the output in one, 20% in the other, spread
    uniformly over 90% and 38% of the output between tokens. Only the second stays an and
    with each keep raised by two standard errors."""
    rng = np.random.default_rng(2)
    stats = []
    for keep_b, spread in ((0.48, 0.45), (0.20, 0.19)):
        f = rng.uniform(1, 2, 256)
        stats.append(_token_statistics(np.stack([f, f * 0.05, f * (keep_b + rng.uniform(-spread, spread, 256)), 0 * f], 1)))
    n, mean, second = (np.array(x) for x in zip(*stats))
    plain = keeps(mean[:, 0], mean[:, 2], mean[:, 1], mean[:, 3])
    assert list(gate_types(plain["keep_a"], plain["keep_b"], plain["keep_ab"], LIMITS)) == ["threshold", "threshold"]
    terms = ranking_terms(n, mean, second, 2.0, 1.0, LIMITS)
    assert list(terms["sure_and"]) == [False, True]
    assert list(ranking_terms(n, mean, second, 0.0, 0.0, LIMITS)["sure_and"]) == [True, True]  # the estimates' rule
    assert not ranking_terms(np.array([0]), np.full((1, 4), np.nan), np.full((1, 4, 4), np.nan), 2.0, 1.0,
                             LIMITS)["sure_and"][0]


def test_circuit_ranks_put_each_outputs_best_unsplit_candidate_first_and_outscoring_splits_last():
    out = np.array([0, 0, 0, 1, 1, 2])
    score = np.array([0.9, 0.5, 0.2, 0.7, np.nan, 0.3])
    split = np.array([True, False, False, False, False, True])
    rank = circuit_ranks(out, score, np.zeros(6, dtype=bool), split, np.arange(6))
    # circuit candidates: output 1 (0.7), output 0 (0.5); then the split ones: output 0's split
    # pair that outscores its candidate (0.9) and output 2's only candidate (0.3)
    assert rank.tolist() == [3, 2, 0, 1, 0, 4]


def test_every_and_ranks_before_every_other_type():
    out, score = np.array([0, 1, 2]), np.array([0.2, 0.6, 0.1])
    rank = circuit_ranks(out, score, np.array([True, False, True]), np.zeros(3, dtype=bool), np.arange(3))
    assert rank.tolist() == [1, 3, 2]


def test_a_pair_the_interventions_show_as_and_is_not_split():
    evidence = np.array([True, True, False])
    assert is_split(evidence, np.array(["and", "or", "or"], dtype=object)).tolist() == [False, True, False]


def test_a_square_is_split_whatever_the_evidence_and_a_threshold_and_is_not_protected():
    # the activation-level AND no longer shields a pair with split evidence; a square needs no evidence
    evidence = np.array([True, False, True, False])
    types = np.array(["threshold", "square", "and", "threshold"], dtype=object)
    assert is_split(evidence, types).tolist() == [True, True, False, False]


def test_bilinear_ands_rank_before_sure_threshold_ands_before_the_rest_and_squares_last():
    out = np.arange(6)
    types = np.array(["threshold", "and", "additive", "and", "square", "threshold"], dtype=object)
    sure = np.array([True, False, False, True, True, False])  # the activation-level rule beyond luck
    score = np.array([0.9, 0.1, 0.8, 0.3, 0.95, 0.7])
    uncontradicted = np.array([True, True, True, True, True, True])
    tier = tiers(types, sure, uncontradicted)
    assert tier.tolist() == [1, 2, 0, 2, 1, 0]
    rank = circuit_ranks(out, score, tier, is_split(np.zeros(6, dtype=bool), types), np.arange(6))
    # the two bilinear ands by score, the sure threshold, the rest by score, the square (split) last
    assert rank.tolist() == [3, 2, 4, 1, 6, 5]
    # an and the truth table contradicts drops to the bottom tier
    assert tiers(types, sure, ~np.eye(6, dtype=bool)[1]).tolist() == [1, 0, 0, 2, 1, 0]


def _cache(source, z, eps, acts=None):
    """A LayerCache of `source [T, d]` and latents `z`, with output activations `acts` (every
    output active at every token when None)."""
    from pipelines.analysis.interventions import LayerCache

    T = len(source)
    acts = torch.ones(T, N_OUT, dtype=F64) if acts is None else acts
    return LayerCache(layer=0, site="resid_mid", flat=torch.arange(T), source=source, z=z.to_sparse(),
                      acts=acts.to_sparse(), confirm=torch.zeros(T, dtype=torch.bool),
                      resid_pre=torch.zeros(1, T, D, dtype=F64), tokens=torch.zeros(1, T, dtype=torch.long), n_ctx=T,
                      eps=eps)


def test_groups_are_pruned_to_the_members_that_change_the_result_and_keep_it():
    from pipelines.analysis.interventions import pruned_groups, ranking_entries, side_lists
    from pipelines.analysis.verdicts import VerdictConfig

    mlp, W_dec, sae_out, randn = world(3, k=None, relu=False)
    W_dec[5] = W_dec[9] = 0  # members whose removal removes nothing
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    T = 6
    z = torch.zeros(T, N_IN, dtype=F64)
    z[:, [1, 2, 5, 9]] = 1 + randn(T, 4).abs()  # member 7 is never active
    source = z @ W_dec + randn(T, D) / 4
    cache = _cache(source, z, mlp.eps)
    cfg = VerdictConfig(prune=1e-6)
    # the second gate's side a holds no member that matters alone: it keeps them all
    full = Sides.of_groups([4, 4], [[1, 5, 7], [5, 7]], [[2, 9], [2]])
    pruned, table = pruned_groups(layer, cache, full, cfg)
    assert side_lists(pruned) == {"necessary_a": [[1], [5, 7]], "necessary_b": [[2], [2]]}
    # what the pruned members did not do, pruning does not change: the same tokens, the same results
    before = intervention_table(layer, source, z, full, ranking_entries(cache, full, cfg))
    after = intervention_table(layer, source, z, pruned, ranking_entries(cache, pruned, cfg))
    assert int(after["n_tokens"][0]) == T
    for key, values in before.items():
        torch.testing.assert_close(after[key], values)
        torch.testing.assert_close(table[key], after[key])  # the table returned is the pruned gates' own


def test_members_that_matter_only_together_are_not_pruned():
    from pipelines.analysis.interventions import pruned_groups, ranking_entries, side_lists
    from pipelines.analysis.verdicts import VerdictConfig

    mlp, W_dec, sae_out, randn = world(3, k=None, relu=False)
    small = [3, 4, 5, 6, 7, 8]
    W_dec[small] = 0.15 * W_dec[1]  # each a little of member 1's direction: together nearly as much again
    layer = LayerIntervention(mlp, W_dec, sae_out, "mlp_in")
    T = 6
    z = torch.zeros(T, N_IN, dtype=F64)
    z[:, [1, 2, *small]] = 1 + randn(T, 8).abs()
    source = z @ W_dec + randn(T, D) / 4
    cache = _cache(source, z, mlp.eps)
    nothing = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=F64))
    out = int(layer.evaluate(source, torch.arange(T), None, *nothing)[0].min(0).values.argmax())  # positive throughout
    full = Sides.of_groups([out], [[1, *small]], [[2]])
    entries = ranking_entries(cache, full, VerdictConfig())
    effect = member_effects(layer, source, z, full, entries, "a")[0].abs()
    cfg = VerdictConfig(prune=float(effect[1:].max()) * 1.01)  # each small member alone is below it
    assert float(effect[0]) >= cfg.prune
    # cut to member 1, the gate would keep more than `prune` beyond what the whole side keeps
    only = Sides.of_groups([out], [[1]], [[2]])
    kept = {name: intervention_table(layer, source, z, s, ranking_entries(cache, s, cfg)) for name, s in
            (("whole", full), ("only", only))}
    share = {name: float(t["act_a"][0] / t["act_none"][0]) for name, t in kept.items()}
    assert abs(share["only"] - share["whole"]) > cfg.prune
    pruned, table = pruned_groups(layer, cache, full, cfg)
    assert side_lists(pruned)["necessary_a"] == [[1, *small]]
    for key, values in kept["whole"].items():  # the proposal failed: the table is the whole groups'
        torch.testing.assert_close(table[key], values)


def test_a_candidates_token_sample_does_not_depend_on_the_candidates_sampled_with_it():
    g = torch.Generator().manual_seed(4)
    T = 300
    z = (torch.rand(T, N_IN, generator=g) < 0.4).double() * (1 + torch.rand(T, N_IN, generator=g, dtype=F64))
    acts = (torch.rand(T, N_OUT, generator=g) < 0.5).double()
    cache = _cache(torch.randn(T, D, generator=g, dtype=F64), z, 1e-5, acts)
    every = Sides.of_groups([5, 0, 5, 9, 15], [[1, 2], [0], [3], [4, 5, 6], [7]], [[3], [1], [8, 9], [10], [11]])
    found = cache.sample(every, False, 10, seed=0)
    assert torch.equal(found.token, found.token.sort().values)  # by token: what a token's candidates share runs once
    for c in range(len(every)):
        alone = cache.sample(Sides(every.out[[c]], every.a[[c]], every.b[[c]]), False, 10, seed=0)
        assert torch.equal(alone.token, found.token[found.cand == c]) and len(alone.token) == 10
    eligible = lambda c: {t for t in range(T) if acts[t, every.out[c]] != 0  # noqa: E731
                          and (z[t, every.a[c][every.a[c] >= 0]] != 0).any() and (z[t, every.b[c][every.b[c] >= 0]] != 0).any()}
    assert all(set(found.token[found.cand == c].tolist()) <= eligible(c) for c in range(len(every)))
    assert not torch.equal(cache.sample(every, False, 10, seed=1).token, found.token)


def test_the_shortlist_is_retested_on_more_tokens_and_ranked_again():
    from pipelines.analysis.interventions import IV_COLUMNS, intervention_columns, ranking_entries, retested
    from pipelines.analysis.verdicts import VerdictConfig, rank

    mlp, W_dec, sae_out, randn = world(4, k=None, relu=False)
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    T = 40
    z = torch.where(torch.rand(T, N_IN, generator=torch.Generator().manual_seed(2), dtype=F64) < 0.6,
                    1 + randn(T, N_IN).abs(), torch.zeros(T, N_IN, dtype=F64))
    source = z @ W_dec + randn(T, D) / 4
    cache = _cache(source, z, mlp.eps)
    nothing = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=F64))
    sae_out.b_enc -= layer.evaluate(source, torch.arange(T), None, *nothing)[0].min(0).values - 0.5  # f > 0 throughout
    layer = LayerIntervention(mlp, W_dec, sae_out, "resid_mid")
    sides = Sides.of_pairs(torch.arange(8) % N_OUT, torch.arange(8), torch.arange(8) + 8)
    cfg = VerdictConfig(iv_tokens=5, min_cell=2, shortlist=2, n_ablate=2, retest_tokens=T, seed=3)
    screened = intervention_columns(layer, cache, sides, ranking_entries(cache, sides, cfg), cfg)
    frame = screened.assign(out_feature=sides.out.numpy(), in_a=sides.a[:, 0].numpy(), in_b=sides.b[:, 0].numpy(),
                            and_data=0.9)
    calls = []

    def ranked(f):
        calls.append(1)
        return rank(f, np.zeros(len(f), dtype=bool), ["in_a", "in_b"], cfg)

    first = ranked(frame)
    found = retested(layer, cache, first, sides, ranked, cfg)
    full = intervention_columns(layer, cache, sides, cache.sample(sides, False, T, cfg.seed), cfg)
    assert (screened["iv_tokens"] == 5).all() and (full["iv_tokens"] > 5).all()
    retest = found["iv_tokens"].to_numpy() > 5
    # the first shortlist, and in all at most a shortlist per round, each round ranking again
    assert retest[np.argsort(first["circuit_rank"].to_numpy(dtype=float))[:2]].all()
    assert retest.sum() <= 2 * (len(calls) - 1) and len(calls) - 1 <= 3
    for column in IV_COLUMNS:  # the shortlist has its retest's columns, the others their screening's
        want = np.where(retest, full[column].to_numpy(), screened[column].to_numpy())
        if want.dtype == object:
            assert found[column].tolist() == want.tolist(), column
        else:  # the retest of a few candidates sums their tokens in another order than a test of all
            np.testing.assert_allclose(found[column].to_numpy(dtype=float), want.astype(float), rtol=1e-9, err_msg=column)
    assert found["circuit_rank"].tolist() == ranked(found)["circuit_rank"].tolist()
    if len(calls) - 1 < 3:  # it stopped early: the best two are retested
        assert retest[np.argsort(found["circuit_rank"].to_numpy(dtype=float))[:2]].all()
    assert retested(layer, cache, first, sides, ranked, cfg.replace(shortlist=0)) is first


@pytest.mark.parametrize("site", ["resid_mid", "mlp_in"])
def test_the_form_parts_are_an_exact_partition_of_the_pre_activation(site):
    # from the definitions, per token: the MLP input x with the norm's factor of the clean token frozen, split into
    # x_A, x_B (each side's latents through the gain and that factor) and the rest; the parts are the quadratic
    # form's terms, and they add up to the pre-activation less the biases' constant
    mlp, W_dec, sae_out, randn = world(3, k=None, relu=False)
    layer = LayerIntervention(mlp, W_dec, sae_out, site)
    Q = interaction_matrices(mlp.W_gate, mlp.W_in, mlp.W_out, sae_out.W_enc.T)  # [n_out, d, d]
    z = torch.zeros(6, N_IN, dtype=F64)
    z[:, [1, 2, 3, 8, 9, 11]] = randn(6, 6).abs() + 0.1
    source = z @ W_dec + randn(6, D) / 3  # plus what the SAE does not reconstruct: part of the rest
    sides = Sides.of_groups([3, 3, 11, 0, 6, 2], [[1], [1, 2], [8], [3, 9], [2], [11]],
                            [[2], [8, 9], [1, 3], [1], [9], [8]])
    entries = Entries(cand=torch.arange(6), token=torch.arange(6))
    table = intervention_table(layer, source, z, sides, entries)
    for c in range(6):
        r = source[c]
        factor = 1 / torch.sqrt(r.square().mean() + mlp.eps) if site == "resid_mid" else 1.0
        gain = mlp.g if site == "resid_mid" else 1.0
        image = lambda members: sum(z[c, m] * W_dec[m] for m in members if m >= 0) * gain * factor  # noqa: E731
        x = r * gain * factor
        xa, xb = image(sides.a[c].tolist()), image(sides.b[c].tolist())
        rest = x - xa - xb
        q = Q[sides.out[c]]
        want = {"self_a": xa @ q @ xa, "self_b": xb @ q @ xb, "cross": 2 * xa @ q @ xb, "rest": rest @ q @ rest,
                "own_a": xa @ q @ xa + 2 * xa @ q @ rest, "own_b": xb @ q @ xb + 2 * xb @ q @ rest}
        for part, value in want.items():
            np.testing.assert_allclose(table[f"form_{part}"][c], float(value), rtol=1e-9, atol=1e-12, err_msg=part)
        total = sum(float(table[f"form_{p}"][c]) for p in ("own_a", "own_b", "cross", "rest"))
        pre = brute(mlp, W_dec, sae_out, site, r, torch.zeros(D))[0][sides.out[c]]
        np.testing.assert_allclose(total, float(pre - table["pre_constant"][c]), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(float(table["pre_none"][c]), float(pre), rtol=1e-9)
    # the closed form of the four pre-activations with the norm's factor frozen: the same cross and own terms
    frozen = {}
    for removal in REMOVALS:
        values = []
        for c in range(6):
            r = source[c]
            gone = lambda s: sum(z[c, m] * W_dec[m] for m in getattr(sides, s)[c].tolist() if m >= 0)  # noqa: E731
            removed = {"none": 0 * r, "a": gone("a"), "b": gone("b"), "ab": gone("a") + gone("b")}[removal]
            factor = 1 / torch.sqrt(r.square().mean() + mlp.eps) if site == "resid_mid" else 1.0
            x = (r - removed) * (mlp.g if site == "resid_mid" else 1.0) * factor
            values.append(float(sae_out.pre(((x @ mlp.W_gate) * (x @ mlp.W_in) + mlp.b_in) @ mlp.W_out + mlp.b_out)
                                [sides.out[c]]))
        frozen[removal] = np.array(values)
    form = closed_form(frozen["none"], frozen["b"], frozen["a"], frozen["ab"])
    np.testing.assert_allclose(form["cross"], table["form_cross"].numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(form["own_a"], table["form_own_a"].numpy(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(form["own_b"], table["form_own_b"].numpy(), rtol=1e-9, atol=1e-12)
    assert np.abs(table["form_cross"].numpy()).min() > 1e-4 and np.abs(table["form_rest"].numpy()).min() > 1e-4


def test_the_form_parts_of_a_planted_layer():
    # on mlp_in with orthonormal latents e0, e1, e2 and an output 3 x0 x1 + 2 x0^2 + x2 x0: side A = {0}, B = {1}
    e = torch.eye(4, dtype=F64)
    units = [(0, 1, 3.0), (0, 0, 2.0), (2, 0, 1.0)]  # (gate input, in input, weight to the output)
    mlp = MLPWeights(W_gate=torch.stack([e[g] for g, _, _ in units], 1), W_in=torch.stack([e[i] for _, i, _ in units], 1),
                     W_out=torch.tensor([[w, 0, 0, 0] for _, _, w in units], dtype=F64), b_in=torch.zeros(3, dtype=F64),
                     b_out=torch.tensor([0.5, 0, 0, 0], dtype=F64), g=torch.ones(4, dtype=F64), eps=1e-5)
    sae_out = SAEWeights(W_enc=e[:, :2].clone(), b_enc=torch.tensor([-0.2, 0.0], dtype=F64), W_dec=e[:2].clone(),
                         b_dec=torch.zeros(4, dtype=F64))
    layer = LayerIntervention(mlp, e[:3].clone(), sae_out, "mlp_in")
    z = torch.tensor([[1.0, 2.0, 0.5], [0.5, 1.0, 0.0]], dtype=F64)
    source = torch.cat([z, torch.zeros(2, 1, dtype=F64)], 1)
    sides = Sides.of_pairs(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))
    table = intervention_table(layer, source, z, sides, Entries(torch.tensor([0, 0]), torch.tensor([0, 1])))
    x0, x1, x2 = z.T
    want = {"self_a": 2 * x0**2, "self_b": 0 * x0, "cross": 3 * x0 * x1, "own_a": 2 * x0**2 + x2 * x0,
            "own_b": 0 * x0, "rest": 0 * x0}
    for part, value in want.items():
        np.testing.assert_allclose(table[f"form_{part}"][0], float(value.mean()), atol=1e-12, err_msg=part)
    assert float(table["pre_constant"][0]) == pytest.approx(0.3)  # b_out through the encoder, and b_enc


def _types_of(parts: dict, keeps_: tuple[float, float, float] = (0.1, 0.1, 0.0)) -> str:
    """The type of one candidate whose pre-activation less its constant is split as `parts`
    (own_a + own_b + cross + rest, as the layer's form adds them)."""
    full = {"self_a": 0.0, "self_b": 0.0, "own_a": 0.0, "own_b": 0.0, "cross": 0.0, "rest": 0.0, **parts}
    total = full["own_a"] + full["own_b"] + full["cross"] + full["rest"]
    form = form_shares([0.5 + total], [0.5], {k: [v] for k, v in full.items()})
    return gate_types([keeps_[0]], [keeps_[1]], [keeps_[2]], FORM_LIMITS, form)[0]


FORM_LIMITS = GateThresholds(need=0.5, cross=0.25, suffice=0.7, matter=0.2, rise=0.1, bilinear_cross=0.5,
                             bilinear_own=0.2, square=0.8)


@pytest.mark.parametrize("parts, keeps_, expected", [
    ({"cross": 0.95, "rest": 0.05}, (0.1, 0.1, 0.0), "and"),  # the paper's AND: x_a x_b
    ({"cross": 0.6, "own_a": 0.1, "own_b": 0.05, "rest": 0.25}, (0.6, 0.6, 0.3), "and"),  # the layer's AND, whatever the keeps
    # own terms that lower the output leave each side no less necessary
    ({"cross": 1.6, "self_a": -0.1, "own_a": -0.4, "own_b": -0.3, "rest": 0.1}, (0.05, 0.05, 0.0), "and"),
    # two squares added, each side necessary only through the cut-off: a threshold AND
    ({"self_a": 0.5, "own_a": 0.5, "self_b": 0.45, "own_b": 0.45, "cross": 0.0, "rest": 0.05}, (0.1, 0.15, 0.0),
     "threshold"),
    # the same sum read without a cut-off keeps half of f on either side: additive
    ({"self_a": 0.5, "own_a": 0.5, "self_b": 0.45, "own_b": 0.45, "rest": 0.05}, (0.45, 0.5, 0.0), "additive"),
    # one direction as two latents, half of it each: (a + b)^2 = a^2 + b^2 + 2ab, rank one, whatever the keeps
    ({"self_a": 0.25, "own_a": 0.25, "self_b": 0.25, "own_b": 0.25, "cross": 0.5}, (0.1, 0.1, 0.0), "square"),
    ({"self_a": 0.36, "own_a": 0.36, "self_b": 0.16, "own_b": 0.16, "cross": 0.48}, (0.3, 0.5, 0.0), "square"),
    # one input squared, a bystander that overlaps its direction a little: rank one, but not half a concept
    ({"self_a": 0.81, "own_a": 0.81, "self_b": 0.01, "own_b": 0.01, "cross": 0.18}, (0.03, 0.9, 0.0), "one-sided"),
    # two groups that each carry part of one squared direction, their parts unrelated token by token: the square
    # of a sum (semidefinite), not an AND, though the cross term is large and the own terms small
    ({"self_a": 0.5, "own_a": 0.1, "self_b": 0.5, "own_b": 0.1, "cross": 0.55, "rest": 0.25}, (0.4, 0.4, 0.1),
     "threshold"),
    # a large cross term cancelled by own terms that lower the output, the rest carrying it: removing either side
    # raises the pre-activation (1 - 0.6 + 0.7 = 1.1), no AND
    ({"cross": 0.6, "self_a": -0.2, "own_a": -1.0, "self_b": -0.2, "own_b": -1.0, "rest": 2.4}, (1.4, 1.4, 2.4),
     "xor-like"),
    ({"cross": 0.6, "self_a": -0.2, "own_a": -0.7, "self_b": -0.2, "own_b": -0.7, "rest": 1.8}, (1.1, 1.1, 1.8),
     "xor-like"),
    # each removal takes half, but removing both gives it all back (the rest is the whole): not the layer's AND,
    # only the activation's rule (each side necessary, synergy 1), as for any form the bilinear rule refuses
    ({"cross": 1.0, "own_a": -0.5, "own_b": -0.5, "rest": 1.0}, (0.5, 0.5, 1.0), "threshold"),
    # a pre-activation that is a sliver of its large parts: no shares to read (1.0 - 0.5 - 0.49 = 0.01)
    ({"cross": 1.0, "own_a": -0.5, "own_b": -0.49}, (0.1, 0.1, 0.0), "and-unformed"),
    # the activation's AND where the form has no share to read: not claimed to add in the pre-activation
    ({"cross": 0.4, "own_a": -0.3, "own_b": -0.3}, (0.1, 0.1, 0.0), "and-unformed"),
    # a negative square, -(a + b)^2: rank one, but removing either side raises the output
    ({"self_a": -0.3, "own_a": -0.3, "self_b": -0.3, "own_b": -0.3, "cross": -0.6, "rest": 2.2}, (1.9, 1.9, 2.2),
     "xor-like"),
])
def test_types_on_the_form(parts, keeps_, expected):
    assert _types_of(parts, keeps_) == expected


def test_form_shares_are_read_only_on_a_total_not_a_sliver_of_its_parts():
    parts = {"self_a": [0.0, 0.0], "self_b": [0.0, 0.0], "own_a": [-0.5, -0.3], "own_b": [-0.49, -0.2],
             "cross": [1.0, 1.0], "rest": [0.0, 0.0]}
    # totals 0.01 and 0.5 (pre_none less the constant); parts of sizes 1.99 and 1.5
    shares = form_shares([1.01, 1.5], [1.0, 1.0], parts)
    assert np.isnan(shares["cross_share"][0]) and np.isnan(shares["square_share"][0])
    assert shares["cross_share"][1] == pytest.approx(2.0)  # 0.5 is at least a quarter of 1.5


def test_layer_shares_are_the_closed_form_of_the_pre_activations_over_the_output():
    shares = layer_shares([3.0], [1.0], [2.0], [0.5], [-1.0])  # pre_none, pre_a, pre_b, pre_ab, constant
    # t11 = 4, t01 = 2 (A removed), t10 = 3 (B removed), t00 = 1.5
    assert shares["layer_own_a_share"][0] == pytest.approx((3 - 1.5) / 4)
    assert shares["layer_own_b_share"][0] == pytest.approx((2 - 1.5) / 4)
    assert shares["layer_cross_share"][0] == pytest.approx((4 - 3 - 2 + 1.5) / 4)
    assert sum(v[0] for v in shares.values()) == pytest.approx(1.0)
    assert np.isnan(layer_shares([1.0], [1.0], [1.0], [1.0], [2.0])["layer_cross_share"][0])  # nothing to share
