"""Exact layer-local interventions: an output's activation with a side of its gate removed.

A candidate gate is an output f and two sides A and B, each a set of input SAE latents (one
latent for a pair). On a token where both sides are on and f is active, side S's part of the
input SAE's reconstruction, `delta_S = sum_{m in S} z_m d_m`, leaves the MLP's input and the
layer is recomputed exactly:

- input SAE on resid_mid: `r' = r - delta_S`, `x' = g * r' / sqrt(mean(r'^2) + eps)` (the
  norm's per-token factor changes with the removal);
- input SAE on mlp_in: `x' = x - delta_S`;
- `mlp_out' = ((x' W_gate) * (x' W_in) + b_in) W_out + b_out`, encoded by the output SAE,
  TopK selection included, so f's activation is the one the model computes at the layer
  when its residual stream carries `r'` (the model-run confirmation of
  `pipelines.analysis.ablation` checks this).

Because the layer is bilinear in x, `x' W_gate = rho' (y W_gate - sum_m z_m P_m)` with
`y = g * r` and `P = (g * D) W_gate` computed once per layer: a removal costs a gather per
removed latent, not a product with W_gate; only `W_out` and the output SAE's encoder are
applied per intervention.

Per candidate four means over its tokens make its *intervention truth table*: `f` with both
sides present (t11), `f_a` with A removed (t01: only B left), `f_b` with B removed (t10), and
`f_ab` with both removed (t00); `circuits.gates.types` reads gates off it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from circuits.sites import RESID_MID, check_input_site, input_gain
from circuits.weights import MLPWeights, SAEWeights

REMOVALS = ("none", "a", "b", "ab")  # what leaves the MLP input: nothing, side A, side B, both


@dataclass
class Sides:
    """Candidate gates: output `out [C]` and the members of each side, `a [C, Ma]` and
    `b [C, Mb]` (input latents, -1 pads a side with fewer members)."""

    out: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor

    def __len__(self) -> int:
        return len(self.out)

    @classmethod
    def of_pairs(cls, out: torch.Tensor, in_a: torch.Tensor, in_b: torch.Tensor) -> "Sides":
        return cls(out.long(), in_a.long()[:, None], in_b.long()[:, None])

    @classmethod
    def of_groups(cls, out: list[int], members_a: list[list[int]], members_b: list[list[int]]) -> "Sides":
        return cls(torch.tensor(out, dtype=torch.long), padded(members_a), padded(members_b))


def padded(groups: list[list[int]]) -> torch.Tensor:
    """`[len(groups), max size]` int64, -1 after each group's members."""
    width = max([len(g) for g in groups] + [1])
    out = torch.full((len(groups), width), -1, dtype=torch.long)
    for row, members in enumerate(groups):
        out[row, : len(members)] = torch.tensor(members, dtype=torch.long)
    return out


class LayerIntervention:
    """One layer's MLP and output SAE, ready to recompute f after removals (module docstring)."""

    def __init__(self, mlp: MLPWeights, W_dec: torch.Tensor, sae_out: SAEWeights, site: str):
        """`W_dec [n_in, d_model]`: the input SAE's decoder on `site` (resid_mid or mlp_in)."""
        self.mlp, self.sae_out, self.site, self.W_dec = mlp, sae_out, check_input_site(site), W_dec
        gain = input_gain(site, mlp.g)
        self.gain = torch.ones_like(mlp.g) if gain is None else gain
        self.P_gate = (W_dec * self.gain) @ mlp.W_gate  # [n_in, d_mlp]
        self.P_in = (W_dec * self.gain) @ mlp.W_in

    def project(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`y W_gate` and `y W_in` `[U, d_mlp]` each of the site's values `source [U, d]`
        (`y = g * source`), before the norm's factor: what `evaluate` starts from at a token."""
        y = source * self.gain
        return y @ self.mlp.W_gate, y @ self.mlp.W_in

    @torch.no_grad()
    def evaluate(self, source: torch.Tensor, token: torch.Tensor, out: torch.Tensor | None, entry: torch.Tensor,
                 member: torch.Tensor, coef: torch.Tensor, projected: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """f's pre-activation and activation `[N]` each after removals (every output's
        pre-activation, `[N, n_out]`, and None when `out` is None).

        `source [U, d]`: the input SAE's site at U tokens; `token [N]`, `out [N]`: the token
        and output of each evaluation; `entry, member, coef [K]`: evaluation `entry[k]` loses
        `coef[k] * d_member[k]` (no entry: nothing removed); `projected`: `project(source)`,
        when the caller evaluates the same tokens several times.
        """
        N = len(token)
        removed = lambda table: torch.zeros(N, table.shape[1], dtype=table.dtype, device=table.device).index_add_(  # noqa: E731
            0, entry, coef[:, None].to(table.dtype) * table[member])
        if projected is None:  # only the tokens evaluated
            unique, token_of = token.unique(return_inverse=True)
            projected, source = self.project(source[unique]), source[unique]
        else:
            token_of = token
        gate = projected[0][token_of] - removed(self.P_gate)  # [N, d_mlp]
        lin = projected[1][token_of] - removed(self.P_in)
        if self.site == RESID_MID:
            r = source[token_of] - removed(self.W_dec)
            factor = torch.rsqrt(r.square().mean(-1) + self.mlp.eps)[:, None]
            gate, lin = gate * factor, lin * factor
        pre = self.sae_out.pre((gate * lin + self.mlp.b_in) @ self.mlp.W_out + self.mlp.b_out)
        if out is None:
            return pre, None
        return pre[torch.arange(N, device=out.device), out], self.sae_out.encode_at(pre, out)

    def evaluate_shared(self, source: torch.Tensor, z: torch.Tensor, token: torch.Tensor, out: torch.Tensor,
                        members: torch.Tensor, projected: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """`evaluate` of each row removing its `members [N, M]` (-1 padding) at its token, with
        the latents `z [N, n_in]` there; rows that remove the same active latents at the same
        token (candidates of other outputs, or sharing a side) are computed once, for every
        output, and read at their own."""
        coef = _coefficients(z, members)
        active = torch.where(coef != 0, members, torch.full_like(members, -1)).sort(1).values
        inverse = _unique_rows(torch.cat([token[:, None], active + 1], 1), z.shape[1] + 1)
        first = torch.zeros(int(inverse.max()) + 1 if len(inverse) else 0, dtype=torch.long,
                            device=token.device).scatter_(0, inverse, torch.arange(len(token), device=token.device))
        pre = self.evaluate(source, token[first], None, *side_removal(z[first], active[first]), projected=projected)[0]
        pre = pre[inverse]
        return pre[torch.arange(len(out), device=out.device), out], self.sae_out.encode_at(pre, out)


@dataclass
class Entries:
    """Sampled tokens of candidates: candidate `cand [E]` at row `token [E]` of a token cache."""

    cand: torch.Tensor
    token: torch.Tensor


def candidate_tokens(on: torch.Tensor, active: torch.Tensor, sides: Sides, block: int = 4096) -> Entries:
    """Every (candidate, token) where the output is active and both sides are on (a side is
    on where any member is active), ordered by token, then output, then candidate. `on [t,
    n_in]`, `active [t, n_out]` bool. Tokens are packed as bits (`_bit_words`), so a
    candidate costs a few word operations per 32 tokens, not one per active token of its
    output; `block` candidates at a time bound the memory."""
    words = _bit_words(on)
    on_words = torch.cat([words, words.new_zeros(1, words.shape[1])])  # the padding member (-1) is never on
    active_words = _bit_words(active)
    side_words = lambda members: _or_rows(on_words, torch.where(members >= 0, members, on.shape[1]))  # noqa: E731
    bit = torch.arange(32, device=on.device)
    cands, tokens = [], []
    for first in range(0, len(sides), block):
        rows = slice(first, first + block)
        both = active_words[sides.out[rows]] & side_words(sides.a[rows]) & side_words(sides.b[rows])  # [c, words]
        cand, word = both.nonzero(as_tuple=True)
        hit, at = ((both[cand, word][:, None] >> bit) & 1).nonzero(as_tuple=True)
        cands.append(cand[hit] + first)
        tokens.append(word[hit] * 32 + at)
    cand, token = torch.cat(cands), torch.cat(tokens)
    order = torch.argsort((token * active.shape[1] + sides.out[cand]) * len(sides) + cand)
    return Entries(cand[order], token[order])


def _bit_words(table: torch.Tensor) -> torch.Tensor:
    """`[n, ceil(t / 32)]` int64: column j of a bool `table [t, n]` as bits, 32 tokens a word."""
    t, n = table.shape
    words = -(-t // 32)
    padded = torch.zeros(words * 32, n, dtype=torch.long, device=table.device)
    padded[:t] = table.long()
    shift = torch.arange(32, device=table.device)[None, :, None]
    return (padded.view(words, 32, n) << shift).sum(1).T.contiguous()


def _or_rows(words: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`[c, w]`: the bitwise or of rows `index [c, M]` of `words [n, w]`."""
    found = words[index[:, 0]]
    for slot in range(1, index.shape[1]):
        found |= words[index[:, slot]]
    return found


def side_removal(z: torch.Tensor, members: torch.Tensor, drop_slot: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The removal of one side per evaluation, as (entry, member, coef) triples for
    `LayerIntervention.evaluate`. `z [N, n_in]`: the latents at each evaluation's token;
    `members [N, M]` (-1 padding); `drop_slot [N]`: a slot kept out of the removal (-1: none)."""
    M = members.shape[1]
    coef = _coefficients(z, members)
    if drop_slot is not None:
        coef = torch.where(torch.arange(M, device=z.device) == drop_slot[:, None], torch.zeros_like(coef), coef)
    entry, slot = (coef != 0).nonzero(as_tuple=True)
    return entry, members[entry, slot], coef[entry, slot]


def intervention_table(layer: LayerIntervention, source: torch.Tensor, z: torch.Tensor, sides: Sides,
                       entries: Entries, chunk: int = 4096) -> dict[str, torch.Tensor]:
    """Per candidate `[C]`: `n_tokens` and the means of f's pre-activation and activation over
    its entries with nothing, A, B and both removed (`pre_none`, `act_a`, ... `REMOVALS`).
    `source [T, d]`, `z [T, n_in]` (dense or sparse COO): the token cache the entries index."""
    C = len(sides)
    device = source.device
    sums = {f"{kind}_{r}": torch.zeros(C, dtype=torch.float64, device=device) for kind in ("pre", "act")
            for r in REMOVALS}
    for start in range(0, len(entries.cand), chunk):
        cand, token = entries.cand[start : start + chunk], entries.token[start : start + chunk]
        zt = _rows(z, token)
        out = sides.out[cand]
        removals = {"none": cand.new_full((len(cand), 1), -1), "a": sides.a[cand], "b": sides.b[cand]}
        removals["ab"] = torch.cat([removals["a"], removals["b"]], 1)
        unique, token = token.unique(return_inverse=True)  # the chunk's tokens, projected once for every removal
        mine = source[unique]
        projected = layer.project(mine)
        for r, members in removals.items():
            pre, act = layer.evaluate_shared(mine, zt, token, out, members, projected)
            sums[f"pre_{r}"].index_add_(0, cand, pre.double())
            sums[f"act_{r}"].index_add_(0, cand, act.double())
    n = torch.bincount(entries.cand, minlength=C).double()
    means = {k: torch.where(n > 0, v / n.clamp_min(1), torch.full_like(v, float("nan"))) for k, v in sums.items()}
    return {"n_tokens": n, **means}


def member_effects(layer: LayerIntervention, source: torch.Tensor, z: torch.Tensor, sides: Sides, entries: Entries,
                   side: str, chunk: int = 4096) -> torch.Tensor:
    """`[C, M]`: per candidate and member slot of `side` ("a" or "b"), how much f's mean
    activation over the candidate's entries changes when that member leaves the side (the
    side's other members removed, it kept), as a share of f's mean activation there. A member
    never active on those tokens changes nothing (0)."""
    members = getattr(sides, side)
    C, M = members.shape
    change = torch.zeros(C * M, dtype=torch.float64, device=source.device)
    base = torch.zeros(C, dtype=torch.float64, device=source.device)
    nothing = lambda t: (t.new_zeros(0), t.new_zeros(0), source.new_zeros(0))  # noqa: E731
    for start in range(0, len(entries.cand), chunk):
        cand, token = entries.cand[start : start + chunk], entries.token[start : start + chunk]
        zt, mine, out = _rows(z, token), members[cand], sides.out[cand]
        unique, token = token.unique(return_inverse=True)  # the chunk's tokens, projected once
        rows = source[unique]
        projected = layer.project(rows)
        base.index_add_(0, cand, layer.evaluate(rows, token, out, *nothing(cand), projected)[1].double())
        removed = layer.evaluate(rows, token, out, *side_removal(zt, mine), projected)[1]
        # only a member active at the entry's token can change anything there
        entry, slot = (_coefficients(zt, mine) != 0).nonzero(as_tuple=True)
        for s in range(0, len(entry), chunk):
            e, k = entry[s : s + chunk], slot[s : s + chunk]
            kept = layer.evaluate(rows, token[e], out[e], *side_removal(zt[e], mine[e], k), projected)[1]
            change.index_add_(0, cand[e] * M + k, (kept - removed[e]).double())
    return change.view(C, M) / base.clamp_min(1e-30)[:, None]


def _unique_rows(rows: torch.Tensor, base: int) -> torch.Tensor:
    """The index of each row of `rows [N, W]` (non-negative, columns after the first below
    `base`) among the distinct rows, as `torch.unique(dim=0)`'s `inverse`: rows read as
    numbers in base `base` where they fit in 63 bits (a 1-d unique is much cheaper than
    sorting rows), compared whole otherwise."""
    width = rows.shape[1] - 1
    if len(rows) and math.log2(int(rows[:, 0].max()) + 1) + width * math.log2(base) < 62:
        key = rows[:, 0].clone()
        for column in range(1, width + 1):
            key = key * base + rows[:, column]
        return key.unique(return_inverse=True)[1]
    return torch.unique(rows, dim=0, return_inverse=True)[1]


def _coefficients(z: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """`[N, M]`: each member's latent at the row's token (0 for padding)."""
    return torch.cat([z, z.new_zeros(len(z), 1)], 1).gather(1, torch.where(members >= 0, members, z.shape[1]))


def _rows(z: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Dense rows `[N, n_in]` of a dense or sparse COO `z`."""
    return z.index_select(0, token).to_dense() if z.is_sparse else z[token]
