"""AND-gate candidates grounded in data: what a pair contributes on real tokens.

The weight-only `and_score` ranks what the SAE bases allow; a pair the model never sees
together can score high. Here each output feature f gets candidate input pairs (a, b) from
two sources: its best weight-ranked pairs, and the pairs among the inputs most often active
when f is active. On real tokens, streamed in batches with memory independent of their
number, each candidate gets

- `coactivation`: share of f's active tokens on which a and b are both active;
- `mean_contribution`: mean over f's active tokens of the cross term's share of the MLP,
  `2 Qt[a,b] z_a z_b s` (s the per-token factor of `circuits.sae_basis.token_scale`), and
  `contribution_share`, its sum over the sum of f's activation on those tokens;
- a truth table over all tokens: four cells by whether a and b are active, each with its
  token count, f's mean activation, the share of tokens where f is active and an upper
  quantile of f's activation (from a histogram of `n_bins` bins per cell);
- `and_data`, an AND score read from the cells: `(m11 - max(m10, m01, m00)) / m11` with
  `m` the mean activations, near 1 for an AND (f needs both inputs), near 0 for an OR
  (either input suffices) and negative for an XOR;
- `coactivation_lift`, `P(a and b) / (P(a) P(b))` over all tokens: 1 when a and b fire
  independently, far above 1 when they fire together (two latents of one concept do);
- `gate_score = contribution_share * clip(and_data, 0, 1)`, only where f was active on at
  least `min_tokens` tokens with both inputs on and each input was on without the other on
  at least as many (two features of one token always fire together: no data can say f
  needs both). Group gates (`circuits.gates.groups`) score the same way.

Candidate pairs are held as `[n_out, G]` index arrays padded with `valid`, so every update
is a few gathers and `index_add`s over the (token, output) pairs where f is active.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CELLS = ("on_on", "on_off", "off_on", "off_off")  # (a, b) active or not; the code is 2*[a off] + [b off]


@dataclass
class Candidates:
    """Input pairs per output feature, `[n_out, G]` each, padded where `valid` is False."""

    in_a: torch.Tensor  # long
    in_b: torch.Tensor  # long, > in_a
    valid: torch.Tensor  # bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.in_a.shape)


def merge_candidates(pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Candidates:
    """Union per output feature of several `(in_a, in_b, valid)` sets of `[n_out, G_i]`,
    each pair once (as a < b)."""
    a = torch.cat([torch.minimum(x, y) for x, y, _ in pairs], 1)
    b = torch.cat([torch.maximum(x, y) for x, y, _ in pairs], 1)
    valid = torch.cat([v & (x != y) for x, y, v in pairs], 1)
    n_out, width = a.shape
    big = int(max(int(b.max()) + 2, 2)) if b.numel() else 2
    key = torch.where(valid, a * big + b, torch.full_like(a, -1))
    key, _ = key.sort(dim=1, descending=True)
    duplicate = torch.zeros_like(valid)
    duplicate[:, 1:] = key[:, 1:] == key[:, :-1]
    key = torch.where(duplicate, torch.full_like(key, -1), key)
    key, _ = key.sort(dim=1, descending=True)
    keep = int((key >= 0).sum(1).max()) if key.numel() else 0
    key = key[:, : max(keep, 1)]
    valid = key >= 0
    safe = key.clamp_min(0)
    return Candidates(safe // big, safe % big, valid)


def coactive_pairs(coactive_counts: torch.Tensor, n_inputs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs among each output feature's `n_inputs` most co-active inputs.

    `coactive_counts [n_out, n_in]`: tokens on which output f and input a are both active.
    Returns `(in_a, in_b, valid)`, each `[n_out, n_inputs * (n_inputs - 1) / 2]`; a pair is
    valid when both of its inputs were ever active with f.
    """
    m = min(n_inputs, coactive_counts.shape[1])
    counts, top = coactive_counts.topk(m, dim=1)
    i, j = torch.triu_indices(m, m, offset=1, device=top.device)
    return top[:, i], top[:, j], (counts[:, i] > 0) & (counts[:, j] > 0)


def pair_coefficients(
    W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor, basis: torch.Tensor,
    directions: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, chunk: int = 4096,
) -> torch.Tensor:
    """`Qt[a, b]` of output `out` for each of P triples, without forming any `Q`.

    `Qt[a, b] = 1/2 sum_h w_h (Pg[a,h] Pi[b,h] + Pg[b,h] Pi[a,h])` with `w = W_out u`,
    `Pg = M^T W_gate`, `Pi = M^T W_in` (M the input basis `[d, n_in + 1]`). Inputs `out, a, b`
    `[P]` (a == b gives the self term `Qt[a, a]`). Returns `[P]`; memory `chunk * d_mlp`.
    """
    Pg, Pi = basis.T @ W_gate, basis.T @ W_in  # [n_in + 1, h]
    # each output's w once: the pairs of one output (a reading set's 28) share it
    outputs, which = out.unique(return_inverse=True)
    w = directions[outputs] @ W_out.T  # [U, h]
    result = torch.empty(out.shape, dtype=W_gate.dtype, device=W_gate.device)
    for start in range(0, out.numel(), chunk):
        s = slice(start, start + chunk)
        both = Pg[a[s]] * Pi[b[s]] + Pg[b[s]] * Pi[a[s]]
        result[s] = 0.5 * (w[which[s]] * both).sum(-1)
    return result


def pair_terms(
    W_gate: torch.Tensor, W_in: torch.Tensor, W_out: torch.Tensor, basis: torch.Tensor,
    directions: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight terms of candidates `(out, a, b) [P]` (`pair_coefficients`), each `[P]`: the
    cross coefficient `2 Qt[a, b]` and the self coefficients `Qt[a, a]` and `Qt[b, b]`."""
    term = lambda i, j: pair_coefficients(W_gate, W_in, W_out, basis, directions, out, i, j)  # noqa: E731
    return 2 * term(a, b), term(a, a), term(b, b)


class GateStats:
    """Streamed data statistics of candidate pairs (see the module docstring)."""

    def __init__(self, candidates: Candidates, cross: torch.Tensor, max_activation: torch.Tensor,
                 min_activation: torch.Tensor, n_in: int, n_bins: int = 64):
        """`cross [n_out, G]`: the candidates' cross coefficients `2 Qt[a, b]`;
        `max_activation/min_activation [n_out]`: the range of each output's activation
        (from an earlier pass), which fixes the histogram bins."""
        self.c = candidates
        self.cross = cross
        # padded candidates read the zero column n_in of the inputs (`gather_padded`); int32, its index dtype
        self.a_index = torch.where(candidates.valid, candidates.in_a, n_in).int()
        self.b_index = torch.where(candidates.valid, candidates.in_b, n_in).int()
        device, n_out, width = cross.device, *cross.shape
        self.low = torch.minimum(min_activation, torch.zeros_like(min_activation)).double()
        high = torch.maximum(max_activation, torch.zeros_like(max_activation)).double()
        self.width = (high - self.low).clamp_min(1e-30) / n_bins
        self.n_bins = n_bins
        self.n_tokens = 0
        zeros = dict(dtype=torch.float64, device=device)
        self.input_count = torch.zeros(n_in, **zeros)  # tokens where each input is active
        self.co_count = torch.zeros(n_in, n_in, **zeros)  # tokens where two inputs are both active
        self.active = torch.zeros(n_out, **zeros)  # tokens where f is active
        self.act_sum = torch.zeros(n_out, **zeros)
        self.contribution = torch.zeros(n_out, width, **zeros)
        self.cell_sum = torch.zeros(n_out, width, 4, **zeros)  # activation sum per cell (f active)
        # f active: tokens per cell and bin; counted in int64, so a batch's counts add without conversion
        self.histogram = torch.zeros(n_out * width * 4 * n_bins, dtype=torch.long, device=device)
        # where each candidate's four cells start in `cell_sum` and in `histogram`, `[n_out, G]`
        cells = (torch.arange(n_out, device=device)[:, None] * width + torch.arange(width, device=device)) * 4
        self.cell_start = cells.to(index_dtype(n_out * width * 4 * n_bins))

    @torch.no_grad()
    def update(self, z: torch.Tensor, scale: torch.Tensor, acts: torch.Tensor, token_chunk: int = 2048) -> None:
        """Add tokens: input latents `z [t, n_in]`, per-token factor `scale [t]`, output
        activations `acts [t, n_out]`.

        A batch is reduced in its own precision (float32 inputs: float32, exact for its
        counts) and added to float64 totals. The `[pairs, G]` gathers and index arithmetic
        dominate the cost: they read a copy of z with a zero column that padded candidates
        point to, instead of being masked afterwards, and index in int32 where the sizes
        allow (half the memory traffic of int64; the counts are the same). They take
        `token_chunk` tokens at a time, so that each `[pairs, G]` table stays below glibc's
        32 MB mapping threshold: the demo's 12,001-token batches made tables of 37 MB, each
        mapped and faulted in afresh (layer 0 on one thread: 440-469 -> 217-277 ms a batch).
        """
        dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
        z, scale, acts = z.to(dtype), scale.to(dtype), acts.to(dtype)
        n_out, width = self.cross.shape
        self.n_tokens += len(z)
        inputs, co = co_occurrence(z)
        self.input_count += inputs.double()
        self.co_count += co.double()
        batch = dict(dtype=dtype, device=z.device)
        sums = torch.zeros(n_out, width, **batch), torch.zeros(n_out * width * 4, **batch), self.cross.to(dtype)
        for start in range(0, len(z), token_chunk):
            chunk = slice(start, start + token_chunk)
            self._add_active(z[chunk], scale[chunk], acts[chunk], *sums)
        self.contribution += sums[0].double()
        self.cell_sum.view(-1).add_(sums[1].double())

    def _add_active(self, z: torch.Tensor, scale: torch.Tensor, acts: torch.Tensor, contribution: torch.Tensor,
                    cell_sum: torch.Tensor, cross: torch.Tensor) -> None:
        """Add the tokens' (token, f) entries where f is active: to the totals, and to the
        batch's sums in its precision, `contribution [n_out, G]` and `cell_sum [n_out * G * 4]`
        (`cross`: the cross coefficients in that precision)."""
        token, f = (acts != 0).nonzero(as_tuple=True)
        if token.numel() == 0:
            return
        act = acts[token, f]
        self.active += torch.bincount(f, minlength=len(self.active)).double()
        self.act_sum.index_add_(0, f, act.double())
        za, zb = gather_padded(z, token, self.a_index[f], self.b_index[f])  # [p, G]
        # [p, G] products and codes in place: each pass over them costs as much as the arithmetic
        contribution.index_add_(0, f, cross[f].mul_(za).mul_(zb).mul_(scale[token, None]))
        flat = self.cell_start[f].add_(za == 0, alpha=2).add_(zb == 0)
        cell_sum.index_add_(0, flat.reshape(-1), act[:, None].expand_as(flat).reshape(-1))
        bins = ((act.double() - self.low[f]) / self.width[f]).long().clamp(0, self.n_bins - 1)  # [p]
        key = flat.mul_(self.n_bins).add_(bins.to(flat.dtype)[:, None]).reshape(-1)
        self.histogram.index_add_(0, key, torch.ones_like(key, dtype=self.histogram.dtype))

    @property
    def cell_active(self) -> torch.Tensor:
        """Tokens per cell where f is active `[n_out, G, 4]`: the histogram's bins summed."""
        n_out, width = self.cross.shape
        return self.histogram.view(n_out, width, 4, self.n_bins).sum(-1).double()

    def cell_counts(self) -> torch.Tensor:
        """Tokens per cell `[n_out, G, 4]`, over all tokens (from input co-occurrence)."""
        a, b = self.c.in_a, self.c.in_b
        n_a, n_b = self.input_count[a], self.input_count[b]
        n11 = self.co_count[a, b]
        counts = torch.stack([n11, n_a - n11, n_b - n11, self.n_tokens - n_a - n_b + n11], -1)
        return counts * self.c.valid[..., None]

    def cell_quantile(self, q: float) -> torch.Tensor:
        """Upper quantile `q` of f's activation per cell `[n_out, G, 4]`, zeros (f inactive)
        included; resolved to the histogram's bin width."""
        n_out, width = self.cross.shape
        hist = self.histogram.view(n_out, width, 4, self.n_bins).double()
        counts = self.cell_counts()
        zero_bin = ((-self.low) / self.width).long().clamp(0, self.n_bins - 1)  # [n_out]
        inactive = (counts - self.cell_active).clamp_min(0)
        index = zero_bin[:, None, None, None].expand(n_out, width, 4, 1)
        hist.scatter_add_(-1, index, inactive[..., None])
        cumulative = hist.cumsum(-1)
        target = q * counts[..., None]
        position = (cumulative < target).sum(-1).clamp(max=self.n_bins - 1)  # first bin reaching q
        centre = self.low[:, None, None] + (position.double() + 0.5) * self.width[:, None, None]
        # a bin holding the zeros stands for exactly zero, not for its centre
        centre = torch.where(position == zero_bin[:, None, None], torch.zeros_like(centre), centre)
        return torch.where(counts > 0, centre, torch.full_like(centre, float("nan")))

    def result(self, q: float = 0.9, min_tokens: int = 1) -> dict[str, torch.Tensor]:
        """Per candidate `[n_out, G]` (cells `[n_out, G, 4]`): see the module docstring."""
        active = self.active[:, None]
        counts, cell_active = self.cell_counts(), self.cell_active
        both = cell_active[..., 0]  # f active, a and b active
        means = cell_means(self.cell_sum, counts)
        and_data = and_from_cells(means)
        nan = torch.full_like(self.contribution, float("nan"))
        n_a, n_b = self.input_count[self.c.in_a], self.input_count[self.c.in_b]
        lift = self.co_count[self.c.in_a, self.c.in_b] * self.n_tokens / (n_a * n_b)
        share = torch.where(self.act_sum[:, None] != 0, self.contribution / self.act_sum[:, None], nan)
        return {
            "n_active": active.expand_as(self.contribution),
            "coactivation": torch.where(active > 0, both / active.clamp_min(1), nan),
            "mean_contribution": torch.where(active > 0, self.contribution / active.clamp_min(1), nan),
            "contribution_share": share,
            "and_data": and_data,
            "gate_score": gate_score(share, and_data, both, counts, min_tokens),
            "coactivation_lift": torch.where((n_a > 0) & (n_b > 0) & self.c.valid, lift, nan),
            "cell_tokens": counts,
            "cell_mean": means,
            "cell_active_share": torch.where(counts > 0, cell_active / counts.clamp_min(1),
                                             torch.full_like(means, float("nan"))),
            "cell_quantile": self.cell_quantile(q),
        }


def co_occurrence(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens on which each input is active `[n_in]` and on which two inputs both are
    `[n_in, n_in]` (int64), of latents `z [t, n_in]`. A sparse code (at most k active of
    n_in, k^2 <= n_in) counts the pairs of its active inputs, k^2 per token, instead of the
    dense product's n_in^2; the counts are the same."""
    n_tokens, n_in = z.shape
    on = z != 0
    token, latent = on.nonzero(as_tuple=True)  # ordered by token
    per_token = torch.bincount(token, minlength=n_tokens)
    k = int(per_token.max()) if n_tokens else 0
    if k * k > n_in:
        dense = on.to(torch.float64 if n_tokens >= 2**24 else torch.float32)
        return on.sum(0), (dense.T @ dense).round().long()
    slot = torch.arange(len(token), device=z.device) - (per_token.cumsum(0) - per_token)[token]
    table = torch.full((n_tokens, k), n_in, dtype=torch.long, device=z.device)  # n_in: an empty slot
    table[token, slot] = latent
    pairs = table[:, :, None] * (n_in + 1) + table[:, None, :]
    co = torch.bincount(pairs.reshape(-1), minlength=(n_in + 1) ** 2).view(n_in + 1, n_in + 1)[:n_in, :n_in]
    return torch.bincount(latent, minlength=n_in), co


def gather_padded(z: torch.Tensor, token: torch.Tensor, *columns: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`z[token[i], c[i, j]]` for each `c [p, M]` of `columns`, column n_in (padding) reading
    zero; `z [t, n_in]`, `token [p]`. One flat `index_select` per `c` from a copy of z with a
    zero column: a padded slot needs no mask afterwards, and the values read are only these
    (not z converted whole); indices in int32 where the sizes allow (half the traffic)."""
    n_tokens, n_in = z.shape
    padded = torch.cat([z, z.new_zeros(n_tokens, 1)], 1).reshape(-1)
    row = (token * (n_in + 1)).to(index_dtype(padded.numel()))[:, None]
    return tuple(padded.index_select(0, (row + c.to(row.dtype)).reshape(-1)).view(c.shape) for c in columns)


def index_dtype(size: int) -> torch.dtype:
    """int32 for indices into `size` elements where it holds them, else int64."""
    return torch.int32 if size < 2**31 else torch.int64


def cell_means(cell_sum: torch.Tensor, cell_tokens: torch.Tensor) -> torch.Tensor:
    """f's mean activation per truth-table cell, NaN for an empty cell: `[..., 4]` each."""
    return torch.where(cell_tokens > 0, cell_sum / cell_tokens.clamp_min(1), torch.full_like(cell_sum, float("nan")))


def and_from_cells(means: torch.Tensor) -> torch.Tensor:
    """`and_data = (m11 - max(m10, m01, m00)) / m11` from cell means `[..., 4]` (`CELLS`
    order) -> `[...]`; NaN where m11 is unknown or not positive, or no other cell has
    tokens (then nothing says whether f needs both sides)."""
    m11, rest = means[..., 0], means[..., 1:]
    best_other = torch.nan_to_num(rest, nan=float("-inf")).amax(-1)
    known = torch.isfinite(m11) & (m11 > 0) & torch.isfinite(best_other)
    return torch.where(known, (m11 - best_other) / m11, torch.full_like(m11, float("nan")))


def gate_score(share: torch.Tensor, and_data: torch.Tensor, both_active: torch.Tensor, cell_tokens: torch.Tensor,
               min_tokens: int) -> torch.Tensor:
    """`share * clip(and_data, 0, 1)` `[...]` where f was active on `min_tokens` tokens with
    both sides on (`both_active`) and each side was on alone on as many (`cell_tokens[..., 1:3]`
    of `[..., 4]`); NaN elsewhere."""
    usable = ((both_active >= min_tokens) & (cell_tokens[..., 1] >= min_tokens) & (cell_tokens[..., 2] >= min_tokens)
              & torch.isfinite(and_data))
    return torch.where(usable, share * and_data.clamp(0, 1), torch.full_like(share, float("nan")))


def quadratic_form(Q: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`y_t^T Q y_t` for each row: `[d, d], [t, d] -> [t]`."""
    return ((y @ Q) * y).sum(-1)
