"""Cross terms between two input groups: exact identities on random weights, and planted
layers that compute negation XOR context as a cross term, or add the two sides."""

import pytest
import torch

from circuits.bilinear import interaction_matrices, output_constant
from circuits.cross_terms import (best_cross_directions, bilinear_vectors, eigen_pair, group_blocks, orthonormal_span,
                                  part_gram, part_shares, split_by_groups, split_parts)

F = torch.float64  # the identities are checked to 1e-10

NEG, CTX, ONE = 0, 1, 2  # input coordinates: the negation, the context's valence (+-1), a constant 1
D, H, D_OUT = 6, 8, 3


def _units(units: list[tuple[int, int, int, float]]):
    """A bilinear layer from hidden units (gate input, in input, output, weight)."""
    W_gate, W_in, W_out = torch.zeros(D, H, dtype=F), torch.zeros(D, H, dtype=F), torch.zeros(H, D_OUT, dtype=F)
    for h, (g, i, o, w) in enumerate(units):
        W_gate[g, h], W_in[i, h], W_out[h, o] = 1.0, 1.0, w
    return W_gate, W_in, W_out


def planted():
    """Output 0 computes `c (1 - 2 n)`: the context's valence, flipped after a negation, with
    the flip a cross term negation x context. Output 1 adds them (`n + c`, and a square of
    n): each side's own terms, no cross term. Output 2 reads an unrelated input."""
    return _units([(CTX, ONE, 0, 1.0), (NEG, CTX, 0, -2.0),
                   (NEG, ONE, 1, 1.0), (CTX, ONE, 1, 1.0), (NEG, NEG, 1, 0.5),
                   (4, 5, 2, 1.0)])


def tokens(n: int = 400):
    g = torch.Generator().manual_seed(0)
    neg = (torch.rand(n, generator=g, dtype=F) < 0.5).double()
    ctx = torch.where(torch.rand(n, generator=g, dtype=F) < 0.5, 1.0, -1.0)
    x = 0.1 * torch.randn(n, D, generator=g, dtype=F)
    x[:, NEG], x[:, CTX], x[:, ONE] = neg, ctx, 1.0
    x_a, x_b = torch.zeros_like(x), torch.zeros_like(x)
    x_a[:, NEG], x_b[:, CTX] = x[:, NEG], x[:, CTX]
    return x, x_a, x_b, x - x_a - x_b, neg.bool()


def test_weights_find_the_planted_cross_term_and_not_the_sum():
    W_gate, W_in, W_out = planted()
    Q = interaction_matrices(W_gate, W_in, W_out, torch.eye(D_OUT, dtype=F))
    blocks = group_blocks(Q, torch.tensor([NEG]), torch.tensor([CTX]))
    assert blocks.cross_share[0] == pytest.approx(1.0)  # no self term of either side
    assert blocks.cross[0] == pytest.approx(1.0)  # 2 x_n Q_nc x_c = -2 n c
    assert blocks.cross_share[1] == 0 and blocks.self_a[1] == pytest.approx(0.5)
    assert blocks.cross_share[2] == 0 and blocks.self_a[2] == 0  # a form that is zero there
    S = torch.tensor([NEG, CTX])
    top, bottom = eigen_pair(Q[:, S][:, :, S])
    assert (top[0], bottom[0]) == (pytest.approx(1.0), pytest.approx(-1.0))  # the AND/XOR signature
    assert (top[1], bottom[1]) == (pytest.approx(0.5), pytest.approx(0.0))  # no negative eigenvalue
    with pytest.raises(ValueError, match="disjoint"):
        group_blocks(Q, S, torch.tensor([CTX]))


def test_data_find_the_flip_in_the_cross_term_of_the_xor_only():
    W_gate, W_in, W_out = planted()
    x, x_a, x_b, x_rest, negated = tokens()
    parts = split_by_groups(W_gate, W_in, W_out, torch.eye(D_OUT, dtype=F), x_a, x_b, x_rest)
    ctx = x[:, CTX]
    # on negated tokens the XOR's output is -c: the own terms give c, the cross term -2c
    xor = parts.cross[:, 0]
    assert torch.allclose(xor[negated], -2 * ctx[negated]) and torch.all(xor[~negated] == 0)
    assert torch.allclose(parts.total[negated, 0], -ctx[negated])
    assert torch.all(parts.cross[:, 1] == 0)  # the sum has no cross term anywhere
    flipped = negated & (ctx < 0)
    shares = part_shares(parts, flipped)
    assert shares.n_tokens == int(flipped.sum())
    assert shares.cross[0] == pytest.approx(2.0) and shares.own_b[0] == pytest.approx(-1.0)
    assert shares.cross_weight[0] == pytest.approx(2 / 3)
    assert shares.cross[1] == 0 and shares.cross_weight[1] == 0
    ranked = shares.cross_weight.nan_to_num(0).argsort(descending=True)
    assert ranked[0] == 0  # the direction that computes the XOR comes first
    assert shares.own_a[1] + shares.own_b[1] == pytest.approx(1.0)


def test_parts_add_up_to_the_mlp_output_on_random_weights():
    g = torch.Generator().manual_seed(1)
    d, h, d_out, t, c = 7, 11, 5, 13, 4
    W_gate, W_in, W_out = (torch.randn(*s, generator=g, dtype=F) for s in ((d, h), (d, h), (h, d_out)))
    b_in, b_out = torch.randn(h, generator=g, dtype=F), torch.randn(d_out, generator=g, dtype=F)
    U = torch.randn(c, d_out, generator=g, dtype=F)
    x_a, x_b, x_rest = (torch.randn(t, d, generator=g, dtype=F) for _ in range(3))
    x = x_a + x_b + x_rest
    mlp = ((x @ W_gate) * (x @ W_in) + b_in) @ W_out + b_out
    parts = split_by_groups(W_gate, W_in, W_out, U, x_a, x_b, x_rest)
    expected = (mlp - output_constant(W_out, b_in, b_out)) @ U.T
    assert torch.allclose(parts.total, expected, atol=1e-10)
    Q = interaction_matrices(W_gate, W_in, W_out, U)
    assert torch.allclose(parts.cross, 2 * torch.einsum("td,cde,te->tc", x_a, Q, x_b), atol=1e-10)
    assert torch.allclose(bilinear_vectors(W_gate, W_in, W_out, x_a, x_b),
                          bilinear_vectors(W_gate, W_in, W_out, x_b, x_a), atol=1e-12)


def test_best_cross_directions_beat_every_other_direction():
    g = torch.Generator().manual_seed(2)
    d, h, d_out = 9, 12, 6
    W_gate, W_in, W_out = (torch.randn(*s, generator=g, dtype=F) for s in ((d, h), (d, h), (h, d_out)))
    M_a, M_b = torch.randn(d, 3, generator=g, dtype=F), torch.randn(d, 2, generator=g, dtype=F)
    best, norms = best_cross_directions(W_gate, W_in, W_out, M_a, M_b, 2)
    cross = lambda U: (M_a.T @ interaction_matrices(W_gate, W_in, W_out, U) @ M_b).square().sum((-1, -2)).sqrt()  # noqa: E731
    assert torch.allclose(cross(best), norms, atol=1e-10) and norms[0] >= norms[1]
    random = torch.randn(200, d_out, generator=g, dtype=F)
    assert torch.all(cross(random / random.norm(dim=1, keepdim=True)) <= norms[0] + 1e-10)
    # on the planted layer the best direction is the XOR's own output
    W_gate, W_in, W_out = planted()
    best, _ = best_cross_directions(W_gate, W_in, W_out, torch.eye(D, dtype=F)[:, [NEG]], torch.eye(D, dtype=F)[:, [CTX]], 1)
    assert best[0].abs().tolist() == pytest.approx([1.0, 0.0, 0.0])


def test_orthonormal_span_keeps_the_form_of_a_rotated_basis():
    g = torch.Generator().manual_seed(3)
    M = torch.randn(6, 3, generator=g, dtype=F) @ torch.randn(3, 4, generator=g, dtype=F)  # four columns of rank 3
    P = orthonormal_span(M)
    assert P.shape == (6, 3) and torch.allclose(P.T @ P, torch.eye(3, dtype=F), atol=1e-12)
    assert torch.allclose(P @ (P.T @ M), M, atol=1e-10)


@pytest.mark.parametrize("per_row", [True, False])
def test_the_gram_of_parts_and_its_split_are_the_brute_force_forms_of_a_random_symmetric_matrix(per_row):
    # any symmetric Q = V diag(lam) V^T is a bilinear layer with W_gate = W_in = V reading lam: the parts'
    # products with Q itself, one matrix per row (or per direction), must equal what the factored form gives
    g = torch.Generator().manual_seed(4)
    d, t, c = 6, 9, 3
    Q = torch.randn(t if per_row else c, d, d, generator=g, dtype=F)
    Q = Q + Q.transpose(1, 2)
    lam, V = torch.linalg.eigh(Q)  # [n, d], [n, d, d]
    x_a, x_b, x_rest = (torch.randn(t, d, generator=g, dtype=F) for _ in range(3))
    parts = torch.stack([x_a, x_b, x_rest], 1)  # [t, 3, d]
    if per_row:  # row s has its own Q_s: project each row on its own eigenvectors
        gram = part_gram(torch.bmm(parts, V), torch.bmm(parts, V), lam)
        brute = torch.einsum("tid,tde,tje->tij", parts, Q, parts)
        form = lambda p, q: torch.einsum("td,tde,te->t", p, Q, q)  # noqa: E731
    else:  # c matrices read at every row: one shared projection (V of each stacked side by side)
        W = torch.cat(list(V), 1)  # [d, c d]
        read = torch.block_diag(*lam[:, None, :])  # [c, c d]: direction u reads only its own eigenvectors' units
        gram = part_gram(parts @ W, parts @ W, read[None])
        brute = torch.einsum("tid,cde,tje->tcij", parts, Q, parts)
        form = lambda p, q: torch.einsum("td,cde,te->tc", p, Q, q)  # noqa: E731
    assert torch.allclose(gram, brute, atol=1e-10)
    split = split_parts(gram)
    want = {"self_a": form(x_a, x_a), "self_b": form(x_b, x_b), "cross": 2 * form(x_a, x_b),
            "own_a": form(x_a, x_a) + 2 * form(x_a, x_rest), "own_b": form(x_b, x_b) + 2 * form(x_b, x_rest),
            "rest": form(x_rest, x_rest)}
    for name, value in want.items():
        assert torch.allclose(getattr(split, name), value, atol=1e-10), name
    x = x_a + x_b + x_rest
    assert torch.allclose(split.total, form(x, x), atol=1e-10)  # the partition is whole
