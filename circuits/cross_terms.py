"""How much of an output's quadratic form is a cross term between two groups of inputs.

A bilinear layer computes an AND (or an XOR of two signed inputs) of input groups A and B as a
cross term: for an output direction u, the form `x^T Q_u x` restricted to A and B is

    [x_A, x_B]^T [[Q_AA, Q_AB], [Q_BA, Q_BB]] [x_A, x_B]
      = x_A^T Q_AA x_A + x_B^T Q_BB x_B + 2 x_A^T Q_AB x_B,

and the paper's AND signature is a large cross block `Q_AB` with small self blocks: then the
form is `[[0, K], [K^T, 0]]`, whose eigenvalues come in opposite-sign pairs `+-sigma_i(K)`.
A layer that *adds* the two sides instead has the self blocks (and each side's products with
the rest of the input) and no cross block. Two readings, both here:

- from the weights (`group_blocks`, `eigen_pair`): the blocks' Frobenius norms, the share of
  the 2-group form's energy in its cross blocks, `2 |Q_AB|^2 / |Q_SS|^2` with `S = A + B`
  (1 for a pure cross form, 0 for a sum of the two sides), and its extreme eigenvalues;
- on data (`split_by_groups`): with the MLP input split as `x = x_A + x_B + x_rest` (the parts
  the two groups write, and everything else: other inputs, biases, the SAE's error), the
  output's quadratic part splits exactly into side A's own terms `x_A^T Q x_A + 2 x_A^T Q
  x_rest`, side B's, the cross term `2 x_A^T Q x_B` and the rest `x_rest^T Q x_rest`, computed
  from the factored weights for many directions at once, no `Q_u` built.

The split is made once, here: `part_gram` gives the form's Gram matrix of any parts of the
input and `split_parts` reads the four parts off the Gram matrix of `(x_A, x_B, x_rest)`. The
gate interventions (`circuits.gates.interventions`, one output per token) use both; the
model-run confirmation (`pipelines.analysis.ablation`) reads each of its five parts' share as a
row sum of `part_gram`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupBlocks:
    """The 2-group form's blocks of each of `c` output directions, each `[c]`."""

    self_a: torch.Tensor  # |Q_AA|_F
    self_b: torch.Tensor  # |Q_BB|_F
    cross: torch.Tensor  # |Q_AB|_F (the block appears twice in the form)
    cross_share: torch.Tensor  # 2 |Q_AB|^2 / (|Q_AA|^2 + |Q_BB|^2 + 2 |Q_AB|^2), 0 where the form is 0


def group_blocks(Qt: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> GroupBlocks:
    """Self and cross blocks of symmetric forms `Qt [c, m, m]` on index groups `a [p]`, `b [q]`
    (disjoint, int64). `Qt` is each output's form in an input basis (its coordinates): the SAE
    basis of `circuits.sae_basis`, or orthonormal bases of two subspaces side by side."""
    if set(a.tolist()) & set(b.tolist()):
        raise ValueError("group_blocks: the two groups share inputs; give disjoint groups")
    aa = Qt[:, a][:, :, a].square().sum((-1, -2))
    bb = Qt[:, b][:, :, b].square().sum((-1, -2))
    ab = Qt[:, a][:, :, b].square().sum((-1, -2))
    total = aa + bb + 2 * ab
    share = torch.where(total > 0, 2 * ab / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(total))
    return GroupBlocks(aa.sqrt(), bb.sqrt(), ab.sqrt(), share)


def eigen_pair(form: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest and the most negative eigenvalue of symmetric `form [c, s, s]`, each `[c]`.

    A cross form `[[0, K], [K^T, 0]]` has them equal and opposite; a form that adds two
    positive sides has no negative one. The eigenvalues are the input space's only when the
    coordinates are orthonormal (`orthonormal_span`)."""
    lam = torch.linalg.eigvalsh(form)
    return lam[:, -1], lam[:, 0]


def orthonormal_span(M: torch.Tensor, rtol: float = 1e-6) -> torch.Tensor:
    """An orthonormal basis `[d, r]` of the span of the columns of `M [d, s]` (r its rank)."""
    U, S, _ = torch.linalg.svd(M, full_matrices=False)
    return U[:, S > rtol * S.max().clamp_min(torch.finfo(M.dtype).tiny)]


def bilinear_vectors(W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor, p: torch.Tensor,
                     q: torch.Tensor) -> torch.Tensor:
    """The MLP's symmetric bilinear map of every token's pair of inputs, `[t, d_out]`: entry
    (t, o) is `p_t^T Q_o q_t` (symmetrised, as `circuits.bilinear.interaction_matrices`), so
    `mlp(x) - b_const` is its value at (x, x). `p, q [t, d]`."""
    return (0.5 * ((p @ W_gate) * (q @ W_in) + (q @ W_gate) * (p @ W_in))) @ W_out


@dataclass
class GroupParts:
    """The exact split of `x^T Q x` with `x = x_A + x_B + x_rest`, each part `[...]` (per row,
    and per direction where there are several)."""

    self_a: torch.Tensor  # x_A^T Q x_A
    self_b: torch.Tensor  # x_B^T Q x_B
    own_a: torch.Tensor  # x_A^T Q x_A + 2 x_A^T Q x_rest
    own_b: torch.Tensor  # x_B^T Q x_B + 2 x_B^T Q x_rest
    cross: torch.Tensor  # 2 x_A^T Q x_B
    rest: torch.Tensor  # x_rest^T Q x_rest

    @property
    def total(self) -> torch.Tensor:
        """`x^T Q x`, the output's quadratic part."""
        return self.own_a + self.own_b + self.cross + self.rest


def part_gram(gate: torch.Tensor, inp: torch.Tensor, read: torch.Tensor, work: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The form's Gram matrix of k parts `p_1..p_k` of an MLP input: entry (i, j) is `p_i^T Q p_j`,
    `Q` symmetrised (as `circuits.bilinear.interaction_matrices`), so `x^T Q x` of `x = sum_i p_i`
    is the sum of its entries and `p_i^T Q x` the sum of its row i.

    `gate, inp [N, k, h]`: the parts times `W_gate` and times `W_in` (2k products with the
    weights, whatever k); `read`: the output's read of the hidden units, `W_out u`, either one
    per row, `[N, h]` -> `[N, k, k]`, or `c` read at every row, `[1, c, h]` -> `[N, c, k, k]`.
    `work [N, k, h]`, per-row reads only: where `inp * read` is written (a caller that makes
    many calls keeps it between them rather than fault in a fresh table each time)."""
    if read.dim() == 2:  # one output per row: the k x k hidden products at once in one batched product
        weighted = torch.mul(inp, read[:, None, :], out=work)
        dots = torch.bmm(gate, weighted.transpose(1, 2))
        return 0.5 * (dots + dots.transpose(1, 2))
    # outputs read at every row: each of the k (k + 1) / 2 distinct products of hidden units once, then all c reads
    N, k, h = gate.shape
    i, j = torch.triu_indices(k, k, device=gate.device)
    hidden = 0.5 * (gate[:, i] * inp[:, j] + gate[:, j] * inp[:, i])  # [N, k (k + 1) / 2, h]
    upper = hidden @ read[0].T  # [N, k (k + 1) / 2, c]
    gram = upper.new_empty(N, read.shape[1], k, k)
    gram[:, :, i, j] = upper.transpose(1, 2)
    gram[:, :, j, i] = upper.transpose(1, 2)
    return gram


def split_parts(gram: torch.Tensor) -> GroupParts:
    """The split of `x^T Q x` (`GroupParts`) from the Gram matrix `[..., 3, 3]` of the parts
    `(x_A, x_B, x_rest)` (`part_gram`)."""
    g = lambda i, j: gram[..., i, j]  # noqa: E731
    return GroupParts(self_a=g(0, 0), self_b=g(1, 1), own_a=g(0, 0) + 2 * g(0, 2), own_b=g(1, 1) + 2 * g(1, 2),
                      cross=2 * g(0, 1), rest=g(2, 2))


def split_by_groups(W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor, U: torch.Tensor,
                    x_a: torch.Tensor, x_b: torch.Tensor, x_rest: torch.Tensor) -> GroupParts:
    """Split `x^T Q_u x` with `x = x_a + x_b + x_rest` (each `[t, d]`) for every direction
    `U [c, d_out]` into the two sides' own terms, their cross term and the rest, each `[t, c]`.
    Exact: the parts add up to `u . (mlp(x) - b_const)` for the MLP input x (the norm's factor
    is inside each part)."""
    parts = torch.stack([x_a, x_b, x_rest], 1)  # [t, 3, d]
    gram = part_gram(parts @ W_gate, parts @ W_in, (W_out @ U.T).T[None])
    return split_parts(gram)


def best_cross_directions(W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor, M_a: torch.Tensor,
                          M_b: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` unit output directions whose cross block `M_a^T Q_u M_b` is largest in Frobenius
    norm, and those norms: `[k, d_out]`, `[k]` (descending).

    The cross block is linear in u: `vec(M_a^T Q_u M_b) = L u` with
    `L[(i,j), o] = sum_h 1/2 (G_a[i,h] I_b[j,h] + I_a[i,h] G_b[j,h]) W_out[h,o]`, `G_a = M_a^T W_gate`
    etc., so the best directions are L's top right singular vectors: no output direction of the
    layer has a larger cross term between the two groups (per unit norm) than the first.
    `M_a [d, p]`, `M_b [d, q]`: the groups' input directions. Memory `p q h`."""
    Ga, Ia, Gb, Ib = M_a.T @ W_gate, M_a.T @ W_in, M_b.T @ W_gate, M_b.T @ W_in
    K = 0.5 * (Ga[:, None, :] * Ib[None] + Ia[:, None, :] * Gb[None])  # [p, q, h]
    L = K.reshape(-1, K.shape[-1]) @ W_out  # [p q, d_out]
    _, S, Vh = torch.linalg.svd(L, full_matrices=False)
    return Vh[:k], S[:k]


@dataclass
class PartShares:
    """Each part's mean over a set of tokens, per direction, each `[c]`."""

    n_tokens: int
    total: torch.Tensor  # mean x^T Q x
    own_a: torch.Tensor  # mean own_a / mean |total|, signed
    own_b: torch.Tensor
    cross: torch.Tensor
    rest: torch.Tensor
    cross_weight: torch.Tensor  # mean |cross| / (sum of the four parts' mean |.|): in [0, 1]


def part_shares(parts: GroupParts, where: torch.Tensor | None = None) -> PartShares:
    """Shares of the parts on the tokens `where [t]` (bool; all of them without): each part's
    mean relative to the mean |x^T Q x|, so they add up to `mean total / mean |total|` (1 where
    the output keeps its sign); NaN without tokens or where the output is 0 on all of them."""
    pick = (lambda v: v) if where is None else (lambda v: v[where])  # noqa: E731
    total = pick(parts.total)
    n = len(total)
    scale = total.abs().mean(0) if n else torch.full(total.shape[1:], float("nan"))
    scale = torch.where(scale > 0, scale, torch.full_like(scale, float("nan")))
    own_a, own_b, cross, rest = (pick(v) for v in (parts.own_a, parts.own_b, parts.cross, parts.rest))
    sizes = [v.abs().mean(0) for v in (own_a, own_b, cross, rest)]
    return PartShares(n, total.mean(0), own_a.mean(0) / scale, own_b.mean(0) / scale, cross.mean(0) / scale,
                      rest.mean(0) / scale, sizes[2] / torch.stack(sizes).sum(0))
