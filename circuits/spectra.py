"""Eigen-spectra of interaction matrices and how well few eigenvectors explain a feature.

`Q_u = sum_i lambda_i v_i v_i^T`, ordered by |lambda| descending, so `x^T Q_u x =
sum_i lambda_i (v_i . x)^2` and the rank-r approximation keeps the first r terms. On the
tokens where an output feature is active its TopK activation equals its pre-activation,
`x^T Q_u x + offset`, so at full rank the active-only correlation is exactly 1; the question
is how small an r already gets close.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def eigh_by_magnitude(Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of symmetric `Q [c, d, d]`, ordered by |eigenvalue| descending.

    Returns `lam [c, d]` and `V [c, d, d]` with eigenvectors as columns.
    """
    lam, V = torch.linalg.eigh(Q)
    order = lam.abs().argsort(dim=-1, descending=True)
    return lam.gather(-1, order), V.gather(-1, order.unsqueeze(-2).expand_as(V))


def lowrank_at(
    x: torch.Tensor,
    lam: torch.Tensor,
    V: torch.Tensor,
    token: torch.Tensor,
    feature: torch.Tensor,
) -> torch.Tensor:
    """Rank-1..R approximations of feature `feature[p]` at token `token[p]`. Returns `[p, R]`.

    `x [t, d]` MLP inputs, `lam [n, R]` and `V [n, d, R]` the top eigenpairs of each feature;
    entry (p, r-1) is `sum_{i<=r} lam[f, i] (V[f, :, i] . x[t])^2` for (t, f) = pair p.
    Only the given pairs are computed (grouped by feature, one small product each), which
    for sparse activations is far cheaper than projecting every token on every feature.
    """
    order = torch.argsort(feature, stable=True)
    sorted_features = feature[order]
    sorted_tokens = token[order]
    counts = torch.bincount(sorted_features, minlength=lam.shape[0]).tolist()
    proj = torch.empty(len(order), lam.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for f, count in enumerate(counts):
        if count:
            # gathered per feature: small enough to stay in cache and reuse freed memory
            inputs = x.index_select(0, sorted_tokens[start : start + count])
            torch.mm(inputs, V[f], out=proj[start : start + count])
            start += count
    approx = torch.empty_like(proj)
    approx[order] = (lam[sorted_features] * proj.square()).cumsum(-1)
    return approx


def group_positions(sorted_group: torch.Tensor) -> torch.Tensor:
    """0-based position of each entry within its group: `sorted_group [p]` int64, each
    group's entries adjacent and the groups ascending; returns `[p]` int64."""
    counts = torch.bincount(sorted_group)
    starts = counts.cumsum(0) - counts
    return torch.arange(len(sorted_group), device=sorted_group.device) - starts[sorted_group]


def smallest_per_group(group: torch.Tensor, key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` smallest keys of each group: with random keys, a random sample of
    at most `k` members per group. `group [p]` int64 (non-negative), `key [p]` in [0, 1);
    returns `[m]` indices, ordered by group, then key."""
    order = torch.argsort(group.double() + key.double())
    return order[group_positions(group[order]) < k]


class ActiveCorrelation:
    """Pearson correlation per (feature, rank) over the pairs seen, streamed.

    Keeps counts, means, and centred second moments in float64 and merges each update with
    the pairwise formula of Chan, Golub and LeVeque, so no token is held and long streams
    lose no precision to cancellation. Memory `O(n_features * R)`.
    """

    def __init__(self, n_features: int, n_ranks: int, device: torch.device | str | None = None):
        per_rank = torch.zeros(n_features, n_ranks, dtype=torch.float64, device=device)
        per_feature = torch.zeros(n_features, dtype=torch.float64, device=device)
        self.count = per_feature.clone()
        self.mean_a, self.mean_y = per_rank.clone(), per_feature.clone()
        self.m2_a, self.m2_y = per_rank.clone(), per_feature.clone()
        self.c_ay = per_rank

    def update(self, approx: torch.Tensor, act: torch.Tensor, feature: torch.Tensor) -> None:
        """Add pairs: `approx [p, R]`, `act [p]`, `feature [p]` (which feature each pair is of)."""
        approx, act = approx.double(), act.double()
        n = self.count.shape[0]
        count = torch.bincount(feature, minlength=n).double()
        safe = count.clamp_min(1)
        mean_a = torch.zeros_like(self.mean_a).index_add_(0, feature, approx) / safe[:, None]
        mean_y = torch.zeros_like(self.mean_y).index_add_(0, feature, act) / safe
        da = approx - mean_a[feature]
        dy = act - mean_y[feature]
        m2_a = torch.zeros_like(self.m2_a).index_add_(0, feature, da.square())
        m2_y = torch.zeros_like(self.m2_y).index_add_(0, feature, dy.square())
        c_ay = torch.zeros_like(self.c_ay).index_add_(0, feature, da * dy[:, None])

        total = self.count + count
        share = torch.where(total > 0, count / total.clamp_min(1), 0)  # weight of the new pairs
        weight = self.count * share  # n_old n_new / (n_old + n_new)
        delta_a = mean_a - self.mean_a
        delta_y = mean_y - self.mean_y
        self.m2_a += m2_a + delta_a.square() * weight[:, None]
        self.m2_y += m2_y + delta_y.square() * weight
        self.c_ay += c_ay + delta_a * (delta_y * weight)[:, None]
        self.mean_a += delta_a * share[:, None]
        self.mean_y += delta_y * share
        self.count = total

    def result(self, min_count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`count [n]` (int64) and `corr [n, R]`; NaN below `min_count` pairs or zero variance."""
        denom = (self.m2_a * self.m2_y[:, None]).sqrt()
        corr = self.c_ay / denom
        corr[(self.count < min_count)[:, None] | (denom == 0)] = float("nan")
        return self.count.long(), corr


def rebatch(batches: Iterable, size: int, dtype: torch.dtype, device) -> Iterator:
    """Regroup token-level batches (dataclasses of tensors `[t, ...]`) into about `size`
    tokens each, cast to `dtype` on `device`, so that small input batches do not pay the
    per-feature loop of `lowrank_at` once each."""
    held, count = [], 0
    for batch in batches:
        held.append(batch)
        count += next(iter(vars(batch).values())).shape[0]
        if count >= size:
            yield _concat(held, dtype, device)
            held, count = [], 0
    if held:
        yield _concat(held, dtype, device)


def _concat(batches: list, dtype: torch.dtype, device):
    first = batches[0]
    merged = {name: torch.cat([getattr(b, name) for b in batches]).to(device=device, dtype=dtype)
              for name in vars(first)}
    return type(first)(**merged)
