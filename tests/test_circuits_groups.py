"""Group gates (`circuits.gates.groups`): every statistic against its definition on random tokens,
and a planted AND between two groups found as the best split of a reading set."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from circuits.gates.pairs import pair_coefficients
from circuits.gates.groups import GroupStats, ReadSetStats, pair_slots, splits
from circuits.sae_basis import input_basis
from circuits.weights import MLPWeights

F64 = torch.float64


def random_layer(seed: int, d=8, h=12, n_in=10, n_out=5, T=400):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    mlp = MLPWeights(W_gate=randn(d, h), W_in=randn(d, h), W_out=randn(h, d), b_in=randn(h), b_out=randn(d),
                     g=1 + 0.3 * randn(d), eps=1e-5)
    basis = input_basis(randn(n_in, d), randn(d), mlp.g)
    directions = randn(n_out, d)
    on = torch.rand(T, n_in, generator=gen) < 0.35
    z = (0.2 + torch.rand(T, n_in, generator=gen, dtype=F64)) * on
    scale = 0.5 + torch.rand(T, generator=gen, dtype=F64)
    acts = randn(T, n_out).relu() * (torch.rand(T, n_out, generator=gen) < 0.6)
    return mlp, basis, directions, z, scale, acts


def qt(mlp, basis, directions):
    """`Qt [n_out, n_in + 1, n_in + 1]` by its definition."""
    Q = torch.einsum("ih,nh,jh->nij", mlp.W_gate, directions @ mlp.W_out.T, mlp.W_in)
    return basis.T @ (0.5 * (Q + Q.mT)) @ basis


def reference(z, scale, acts, Qt, f, A, B):
    """The statistics of the group gate (f, A, B), by definition (numpy)."""
    z, scale, act = z.numpy(), scale.numpy(), acts[:, f].numpy()
    on_a, on_b = (z[:, A] != 0).any(1), (z[:, B] != 0).any(1)
    active = act != 0
    cells = [on_a & on_b, on_a & ~on_b, ~on_a & on_b, ~on_a & ~on_b]
    cross = sum(2 * Qt[f, a, b].item() * z[:, a] * z[:, b] for a in A for b in B) * scale
    return {"cell_tokens": [c.sum() for c in cells], "cell_sum": [act[c].sum() for c in cells],
            "cell_active": [(c & active).sum() for c in cells], "contribution": cross[active].sum(),
            "act_sum": act[active].sum(), "n_active": active.sum()}


def check(result, i, expected):
    for name, value in expected.items():
        got = getattr(result, name)[i].numpy()
        np.testing.assert_allclose(got, value, rtol=1e-10, atol=1e-10, err_msg=name)


def best_groups(mlp, basis, direction, members: list[int], z, acts) -> tuple[list[set], object]:
    """The best split of one reading set of output 0 (`direction [1, d]`) over tokens `z`:
    its two groups, the one holding the smallest input first, and their statistics."""
    members = torch.tensor([members])
    i, j = pair_slots(members.shape[1])
    cross = 2 * pair_coefficients(mlp.W_gate, mlp.W_in, mlp.W_out, basis, direction,
                                  torch.zeros(len(i), dtype=torch.long), members[0, i], members[0, j])
    stats = ReadSetStats(torch.tensor([0]), members, cross[None], z.shape[1])
    stats.update(z, torch.ones(len(z), dtype=F64), acts)
    sides_a, sides_b, best = stats.best_splits()
    found = [{x for slot, x in enumerate(members[0].tolist()) if side[0] >> slot & 1} for side in (sides_a, sides_b)]
    return sorted(found, key=min), best


def test_group_stats_match_their_definitions():
    mlp, basis, directions, z, scale, acts = random_layer(0)
    n_in = z.shape[1]
    groups = [[0, 3], [1, 2, 7], [5], [4, 6, 8, 9]]
    membership = torch.zeros(n_in, len(groups), dtype=torch.bool)
    for g, members in enumerate(groups):
        membership[members, g] = True
    gates = [(0, 0, 1), (3, 0, 1), (1, 2, 3), (4, 1, 3)]  # (output, group a, group b)
    out, ga, gb = (torch.tensor(c) for c in zip(*gates))
    Qt = qt(mlp, basis, directions)
    for token_chunk in (2048, 13):  # a batch in one piece, and in pieces
        stats = GroupStats(out, ga, gb, membership, basis, mlp.W_gate, mlp.W_in, directions @ mlp.W_out.T)
        for s in range(0, len(z), 97):  # batches of any size
            stats.update(z[s:s + 97], scale[s:s + 97], acts[s:s + 97], token_chunk=token_chunk)
        result = stats.result()
        for i, (f, a, b) in enumerate(gates):
            check(result, i, reference(z, scale, acts, Qt, f, groups[a], groups[b]))


def test_every_split_of_a_reading_set_matches_its_definition():
    mlp, basis, directions, z, scale, acts = random_layer(1)
    sets = [(2, [0, 4, 7, 9]), (0, [1, 3, 5, -1]), (2, [6, 8, -1, -1])]  # -1: padding
    outputs = torch.tensor([f for f, _ in sets])
    members = torch.tensor([m for _, m in sets])
    i, j = pair_slots(4)
    valid = (members[:, i] >= 0) & (members[:, j] >= 0)
    cross = 2 * pair_coefficients(mlp.W_gate, mlp.W_in, mlp.W_out, basis, directions,
                                  outputs[:, None].expand_as(valid).reshape(-1),
                                  members[:, i].clamp_min(0).reshape(-1), members[:, j].clamp_min(0).reshape(-1))
    stats = ReadSetStats(outputs, members, torch.where(valid, cross.view(valid.shape), 0.0), z.shape[1], token_chunk=50)
    stats.update(z[:150], scale[:150], acts[:150])
    stats.update(z[150:], scale[150:], acts[150:])
    Qt = qt(mlp, basis, directions)
    sides_a, sides_b, best = stats.best_splits()
    for row, (f, m) in enumerate(sets):
        real = [x for x in m if x >= 0]
        # the chosen groups, by definition
        A = [x for slot, x in enumerate(m) if sides_a[row] >> slot & 1 and x >= 0]
        B = [x for slot, x in enumerate(m) if sides_b[row] >> slot & 1 and x >= 0]
        assert A and B and not set(A) & set(B)
        check(best, row, reference(z, scale, acts, Qt, f, A, B))
        # co-activation counts read off the code histogram
        single, pairs, total = stats.coactive()
        on = (z[:, real] != 0).numpy()
        np.testing.assert_array_equal(single[row, : len(real)].numpy(), on.sum(0))
        assert total[row] == len(z)
        for p, (s, t) in enumerate(zip(i.tolist(), j.tolist())):
            if t < len(real):
                assert pairs[row, p] == (on[:, s] & on[:, t]).sum()
    assert len(splits(4)) == 7  # every split of 4 slots into two non-empty sides, once


def test_a_planted_and_between_groups_is_the_best_split():
    """Output = (z_a1 + z_a2)(z_b1 + z_b2 + z_b3) over orthonormal directions, with two
    distractors read by the same set: the best groups are exactly the two planted ones (the
    distractors left out), their truth table says AND and the cross terms carry all of the
    output."""
    gen = torch.Generator().manual_seed(5)
    d, T = 8, 3000
    dirs = torch.eye(d, dtype=F64)
    p, q = dirs[0] + dirs[1], dirs[2] + dirs[3] + dirs[4]
    mlp = MLPWeights(W_gate=p[:, None], W_in=q[:, None], W_out=dirs[:1], b_in=torch.zeros(1, dtype=F64),
                     b_out=torch.zeros(d, dtype=F64), g=torch.ones(d, dtype=F64), eps=1e-5)
    basis = input_basis(dirs[:7], torch.zeros(d, dtype=F64), None)  # inputs 0..6 along the axes, mlp_in
    on = torch.zeros(T, 7, dtype=torch.bool)
    kind_a = torch.randint(0, 3, (T,), generator=gen)  # group A: one of two cues, or none
    on[:, 0], on[:, 1] = kind_a == 1, kind_a == 2
    on[:, 2:5] = torch.rand(T, 3, generator=gen) < 0.3  # group B: any of three
    on[:, 5:7] = torch.rand(T, 2, generator=gen) < 0.4  # distractors
    z = (0.5 + torch.rand(T, 7, generator=gen, dtype=F64)) * on
    x = z @ dirs[:7]
    acts = ((x @ p) * (x @ q))[:, None].relu()
    found, best = best_groups(mlp, basis, dirs[:1], [5, 2, 0, 6, 3, 1, 4], z, acts)  # the reads, in no helpful order
    assert found == [{0, 1}, {2, 3, 4}]  # the distractors 5 and 6 left out
    scores = best.scores(20)
    assert float(scores["and_data"][0]) == pytest.approx(1.0)
    assert float(scores["contribution_share"][0]) == pytest.approx(1.0)


def test_the_split_follows_the_cross_terms_when_a_cue_never_comes_without_its_context():
    """Output = z_a (z_b + z_c): cue a never occurs without context b or c (the co-occurrence
    of a real AND, which the truth table cannot read: its "a without context" cell is empty).
    The best split is still {a} | {b, c}, where the cross terms carry all of the output. Chosen
    by the truth table's gate_score, a distractor joined the cue instead, only because it
    fills that empty cell."""
    gen = torch.Generator().manual_seed(7)
    d, T = 6, 3000
    dirs = torch.eye(d, dtype=F64)
    mlp = MLPWeights(W_gate=dirs[0][:, None], W_in=(dirs[1] + dirs[2])[:, None], W_out=dirs[:1],
                     b_in=torch.zeros(1, dtype=F64), b_out=torch.zeros(d, dtype=F64), g=torch.ones(d, dtype=F64),
                     eps=1e-5)
    basis = input_basis(dirs[:4], torch.zeros(d, dtype=F64), None)  # inputs 0..3 along the axes, mlp_in
    on = torch.zeros(T, 4, dtype=torch.bool)
    context = torch.randint(0, 3, (T,), generator=gen)  # none, b or c
    on[:, 1], on[:, 2] = context == 1, context == 2
    on[:, 0] = (context > 0) & (torch.rand(T, generator=gen) < 0.5)  # the cue: only in a context
    on[:, 3] = torch.rand(T, generator=gen) < 0.4  # a distractor
    z = (0.5 + torch.rand(T, 4, generator=gen, dtype=F64)) * on
    x = z @ dirs[:4]
    acts = ((x @ mlp.W_gate) * (x @ mlp.W_in)).relu()
    found, best = best_groups(mlp, basis, dirs[:1], [2, 0, 3, 1], z, acts)
    assert found == [{0}, {1, 2}]
    assert float(best.contribution_share[0]) == pytest.approx(1.0)
    assert best.cell_tokens[0, 1] == 0  # the truth table never saw the cue alone


def test_reading_sets_are_bounded():
    with pytest.raises(ValueError, match="at most"):
        ReadSetStats(torch.tensor([0]), torch.zeros(1, 11, dtype=torch.long), torch.zeros(1, 55), 20)


def test_a_group_is_never_padding_alone():
    """A set of three members in four slots, cross terms that only take away:
    each side still holds a member (the padding slot is no group)."""
    mlp, basis, directions, z, scale, acts = random_layer(3)
    members = torch.tensor([[0, 1, 2, -1]])
    stats = ReadSetStats(torch.tensor([0]), members, torch.tensor([[-1.0, -1.0, 0.0, -1.0, 0.0, 0.0]]), z.shape[1])
    stats.update(z, scale, acts)
    sides_a, sides_b, _ = stats.best_splits()
    for side in (int(sides_a[0]), int(sides_b[0])):
        assert side & 0b0111 and not side & 0b1000


def test_splits_whose_shares_differ_only_in_rounding_are_chosen_alike():
    """Member 2 of a set carries almost nothing: the splits that put it on either side have
    the same share but for the last bit of a float sum. Which of them wins must not depend
    on which negligible term happens to round up (it flipped 3 of 5,644 demo groups between
    two orders of summation)."""
    chosen = []
    for negligible in ((3e-17, 8e-17), (8e-17, 3e-17)):  # 0.5 + 8e-17 rounds one ulp up, 0.5 + 3e-17 not
        stats = ReadSetStats(torch.tensor([0]), torch.tensor([[0, 1, 2]]), torch.ones(1, 3, dtype=F64), 3)
        stats.sum[0, 1:] = 1.0  # f's activation: the shares' denominator
        stats.pair_sum[0] = torch.tensor([0.5, *negligible], dtype=F64)  # pairs (0, 1), (0, 2), (1, 2)
        side_a, side_b, _ = stats.best_splits()
        chosen.append((int(side_a[0]), int(side_b[0])))
    assert chosen[0] == chosen[1]
    assert sorted(chosen[0]) == [0b001, 0b010]  # member 2 left out, 0 and 1 on either side


def test_a_reading_sets_split_share_is_the_part_of_its_cut_cross_terms_that_split_pairs_carry():
    from pipelines.analysis.group_gates import _eigen_frame
    from pipelines.analysis.verdicts import InputFacts, VerdictConfig

    # three sets with planted cross coefficients; every member on at every token, f active everywhere, so each
    # member pair's contribution is its coefficient times the token count
    members = torch.tensor([[0, 1, 2, 3], [2, 4, 5, -1], [1, 4, -1, -1]])
    cross = torch.zeros(3, 6, dtype=F64)  # pair_slots(4) order: (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
    cross[0] = torch.tensor([0.2, 1.0, 2.0, 3.0, 4.0, 0.1], dtype=F64)  # best cut: {0, 1} | {2, 3}
    cross[1, [0, 1, 3]] = torch.tensor([1.0, 1.0, 0.5], dtype=F64)  # members 2, 4, 5: best cut {2} | {4, 5}
    stats = ReadSetStats(torch.tensor([0, 1, 2]), members, cross, n_in=6)
    T = 50
    stats.update(torch.ones(T, 6, dtype=F64), torch.ones(T, dtype=F64), torch.ones(T, 3, dtype=F64))
    sets = pd.DataFrame({"out_feature": [0, 1, 2], "eigen_rank": [1, 1, 1],
                         "members": [[0, 1, 2, 3], [2, 4, 5], [1, 4]]})
    # inputs 0 and 2 share a top token: their pair is split evidence; no other pair is
    facts = InputFacts({0: "x", 2: "x", 1: "a", 3: "b", 4: "c", 5: "d"}, {}, {}, {}, {}, {})
    basis = torch.cat([torch.eye(6, dtype=F64), torch.zeros(6, 1, dtype=F64)], 1)  # orthogonal inputs: cosine 0
    frame = _eigen_frame(stats, sets, basis, facts, VerdictConfig())
    cuts = [{frozenset(a), frozenset(b)} for a, b in zip(frame["members_a"], frame["members_b"])]
    assert cuts == [{frozenset({0, 1}), frozenset({2, 3})}, {frozenset({2}), frozenset({4, 5})},
                    {frozenset({1}), frozenset({4})}]
    # set 0 cuts (0,2) (0,3) (1,2) (1,3): 1 + 2 + 3 + 4, of which the split pair (0,2) carries 1
    np.testing.assert_allclose(frame["split_share"][0], 1.0 / 10.0, rtol=1e-12)
    assert frame["split_share"][1] == 0.0  # cut pairs, none of them split
    assert np.isnan(frame["split_share"][2])  # its only pair carries no cross term: no share
    assert frame["split_pair"].tolist() == [False, False, False]
