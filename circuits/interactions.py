"""Top interactions and AND-gate candidates of output features, read from `Qt = M^T Q M`.

An output feature's quadratic form in the input latents `z' = [z, 1]` (see `sae_basis`) is

    z'^T Qt z' = sum_b Qt[b,b] z_b^2 + sum_{b<c} 2 Qt[b,c] z_b z_c
                 + sum_b 2 Qt[b,last] z_b + Qt[last,last],

so each term has a coefficient of one of four kinds: `self` (Qt[b,b]), `cross` (2 Qt[b,c],
b < c), `linear` (2 Qt[b,last]) and `constant` (Qt[last,last]). The constant coordinate
(index n_in of `Qt`) is written as -1: a linear term is (b, -1), the constant (-1, -1).
Per output feature the top N terms of each kind are kept, ranked by |coefficient| within
the kind, so strong self terms cannot crowd out the cross terms (sort by |coefficient| for
one ranking over all kinds).

The AND-gate candidates of an output are its pairs b < c with the best weight-only AND score
(`circuits.gates.ranking.and_score`), searched over every pair, not only the top interactions.

`Qt` is `(n_in+1)^2` numbers per output feature, so it is never held whole: it is computed
in blocks over the upper triangle (symmetry halves the work), and each block gives up only
its best candidates, found by reading only the rows with the best row maxima.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from circuits.gates.ranking import and_score

CONSTANT = -1  # index of the constant coordinate z'_{n_in} = 1 in the tables
KINDS = ("self", "cross", "linear", "constant")


@dataclass
class TopInteractions:
    """Per output feature of a chunk, the top N terms of each kind by |coefficient|.

    Each `[c, K]` with `K <= 3N + 1`: the self, cross, linear and constant terms one after
    the other. `valid` is False on zero coefficients, which are never reported (they only
    pad features with fewer than N nonzero terms of a kind).
    """

    in_a: torch.Tensor  # long; CONSTANT for the constant term
    in_b: torch.Tensor  # long; == in_a for self terms, CONSTANT for linear and constant terms
    coefficient: torch.Tensor
    rank: torch.Tensor  # long, 1-based rank by |coefficient| among the terms of the same kind
    valid: torch.Tensor  # bool


@dataclass
class TopGates:
    """Per output feature of a chunk, the pairs b < c with the best AND-gate score.

    Each `[c, G]`, sorted by `and_score` descending.
    """

    in_a: torch.Tensor  # long, b
    in_b: torch.Tensor  # long, c > b
    and_score: torch.Tensor  # `circuits.gates.ranking.and_score`
    self_a: torch.Tensor  # Qt[b,b]
    self_b: torch.Tensor  # Qt[c,c]
    cross: torch.Tensor  # 2 Qt[b,c]
    valid: torch.Tensor  # bool; False only when there are fewer than G pairs


def interaction_kinds(in_a: torch.Tensor, in_b: torch.Tensor) -> list[str]:
    """The kind of each term, from its indices (see the module docstring)."""
    codes = torch.where(
        in_a == CONSTANT, 3, torch.where(in_b == CONSTANT, 2, torch.where(in_a == in_b, 0, 1))
    )
    return [KINDS[i] for i in codes.reshape(-1).tolist()]


def interactions_and_gates(
    Q: torch.Tensor, basis: torch.Tensor, top_n: int, n_gates: int, block_size: int
) -> tuple[TopInteractions, TopGates]:
    """Top terms of each kind and AND-gates of `Qt = basis^T Q basis` for a chunk of outputs.

    `Q [c, d, d]` symmetric, `basis [d, n_in + 1]` from `sae_basis.input_basis`.
    Memory: `c * (n_in + 1) * d` for `M^T Q` plus `c * block_size^2` per block.
    """
    c = Q.shape[0]
    n_in = basis.shape[1] - 1
    MQ = basis.T @ Q  # [c, n_in+1, d]
    diagonal = (MQ * basis.T).sum(-1)  # [c, n_in+1], Qt[b, b]
    last_column = MQ @ basis[:, n_in]  # [c, n_in+1], Qt[b, last]
    self_terms = diagonal[:, :n_in]
    half_abs_self = 0.5 * self_terms.abs()

    cross_parts, gate_parts = [], []
    starts = range(0, n_in, block_size)
    for r0 in starts:
        r1 = min(r0 + block_size, n_in)
        # copied once here, so that each block below is one plain matrix product
        rows = MQ[:, r0:r1].reshape(-1, MQ.shape[-1])
        for s0 in starts[r0 // block_size :]:
            s1 = min(s0 + block_size, n_in)
            block = (rows @ basis[:, s0:s1]).view(c, r1 - r0, s1 - s0)  # Qt[r0:r1, s0:s1]
            below = _on_or_below_diagonal(r1 - r0, Q.device) if r0 == s0 else None
            cross_parts.append(_block_top_cross(block, below, top_n, r0, s0))
            gate_parts.append(_block_top_gates(block, below, half_abs_self, n_gates, r0, s0))

    interactions = _merge_interactions(cross_parts, self_terms, 2 * last_column[:, :n_in],
                                       diagonal[:, n_in], top_n)
    gates = _merge_gates(gate_parts, MQ, basis, self_terms, n_gates)
    return interactions, gates


def _on_or_below_diagonal(n: int, device) -> torch.Tensor:
    """Mask of the entries (i, j) with `i >= j` of an `n x n` block on the diagonal of Qt."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _top_entries(block: torch.Tensor, row_key: torch.Tensor, k: int, score_rows) -> tuple:
    """The k best entries of `score_rows(block rows)`, reading only k rows of `block [c, R, C]`.

    `row_key [c, R]` is each row's best score. If an entry is in the top k, fewer than k
    other rows can have a better maximum (each would hold an entry beating it), so the
    k rows with the best keys hold all of the top k. Returns scores, rows, columns and the
    raw block values of the selected entries, each `[c, k']` with `k' <= k`.
    """
    c, n_rows, n_cols = block.shape
    rows = row_key.topk(min(k, n_rows), dim=1).indices  # [c, k_rows]
    picked = block.gather(1, rows.unsqueeze(-1).expand(-1, -1, n_cols)).reshape(c, -1)
    scores = score_rows(picked.reshape(c, -1, n_cols), rows).reshape(c, -1)
    top, flat = scores.topk(min(k, scores.shape[1]), dim=1)
    return top, rows.gather(1, flat // n_cols), flat % n_cols, picked.gather(1, flat)


def _block_top_cross(block, below, k, r0, s0):
    """Best cross terms of one block by |Qt[b,c]|; entries with b >= c are zeroed, dropped later."""
    if below is not None:
        block.masked_fill_(below, 0)
    low, high = torch.aminmax(block, dim=-1)
    _, rows, cols, values = _top_entries(block, torch.maximum(high, -low), k, lambda v, _: v.abs())
    return rows + r0, cols + s0, 2 * values


def _block_top_gates(block, below, half_abs_self, k, r0, s0):
    """Best pairs of one block by half the AND-gate score; overwrites `block`."""
    block.sub_(half_abs_self[:, None, s0 : s0 + block.shape[2]])
    if below is not None:
        block.masked_fill_(below, float("-inf"))
    row_penalty = half_abs_self[:, r0 : r0 + block.shape[1]]
    key = block.amax(-1) - row_penalty
    half_scores, rows, cols, _ = _top_entries(
        block, key, k, lambda v, rows: v - row_penalty.gather(1, rows).unsqueeze(-1)
    )
    return rows + r0, cols + s0, half_scores


def _merge_interactions(cross_parts, self_terms, linear, constant, k) -> TopInteractions:
    c, n_in = self_terms.shape
    cross = torch.cat([p[2] for p in cross_parts], 1)
    top_cross = cross.abs().topk(min(k, cross.shape[1]), dim=1).indices
    top_self = self_terms.abs().topk(min(k, n_in), dim=1).indices
    top_linear = linear.abs().topk(min(k, n_in), dim=1).indices
    constant_index = torch.full((c, 1), CONSTANT, dtype=torch.long, device=self_terms.device)
    kinds = [  # (in_a, in_b, coefficient), each sorted by |coefficient| descending
        (top_self, top_self, self_terms.gather(1, top_self)),
        (
            torch.cat([p[0] for p in cross_parts], 1).gather(1, top_cross),
            torch.cat([p[1] for p in cross_parts], 1).gather(1, top_cross),
            cross.gather(1, top_cross),
        ),
        (top_linear, torch.full_like(top_linear, CONSTANT), linear.gather(1, top_linear)),
        (constant_index, constant_index, constant.unsqueeze(1)),
    ]
    ranks = [
        torch.arange(1, t[0].shape[1] + 1, device=self_terms.device).expand(c, -1) for t in kinds
    ]
    coefficient = torch.cat([t[2] for t in kinds], 1)
    return TopInteractions(
        in_a=torch.cat([t[0] for t in kinds], 1),
        in_b=torch.cat([t[1] for t in kinds], 1),
        coefficient=coefficient,
        rank=torch.cat(ranks, 1),
        valid=coefficient != 0,
    )


def _merge_gates(gate_parts, MQ, basis, self_terms, k) -> TopGates:
    half_scores = torch.cat([p[2] for p in gate_parts], 1)
    top, order = half_scores.topk(min(k, half_scores.shape[1]), dim=1)
    in_a = torch.cat([p[0] for p in gate_parts], 1).gather(1, order)
    in_b = torch.cat([p[1] for p in gate_parts], 1).gather(1, order)
    # recomputed rather than recovered from the scores, which lost precision in the subtraction
    rows_a = MQ.gather(1, in_a.unsqueeze(-1).expand(-1, -1, MQ.shape[-1]))  # (M^T Q)[a, :]
    entries = (rows_a * basis.T[in_b]).sum(-1)
    cross = 2 * entries
    self_a, self_b = self_terms.gather(1, in_a), self_terms.gather(1, in_b)
    return TopGates(
        in_a=in_a,
        in_b=in_b,
        and_score=and_score(cross, self_a, self_b),
        self_a=self_a,
        self_b=self_b,
        cross=cross,
        valid=torch.isfinite(top),
    )
