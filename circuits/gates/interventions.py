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
`y = g * r` and `P = (g * D) W_gate` computed once per layer (and `P' = (g * D) W_in`, and
`D` itself for `r'`, in one table): a removal costs a gather per removed latent, not a
product with W_gate; only `W_out` and the output SAE's encoder are applied per
intervention, with the biases after the product folded into one vector of pre-activations.

For a pair the removal of both sides is not evaluated but derived, exactly: before the norm's
factor and the biases, `u(y) = ((y W_gate) * (y W_in)) W_out W_enc` is a quadratic form in
`y`, so with `a = z_a g d_a`, `b = z_b g d_b`,
`u(y - a - b) = u(y - a) + u(y - b) - u(y) + z_a z_b C_ab`,
`C_ab = ((g d_a W_gate) * (g d_b W_in) + (g d_b W_gate) * (g d_a W_in)) W_out W_enc` once per
pair; every output's pre-activation follows with the norm's factor of `r - z_a d_a - z_b d_b`,
so the TopK selection is the one a full evaluation makes (a test checks it). The three terms
cancel where the pair carries most of the residual, and the new norm's factor then magnifies
their rounding: rows whose factor grows more than `EXACT_GROWTH`-fold are evaluated whole.

The pre-activation's exact parts (`LayerIntervention.form_parts`). With the norm's factor
frozen at the clean token's, `pre - bias = rho^2 u(y)`, and `y = a + b + r` (side A's part,
side B's, and the rest of the input, the other latents, `b_dec` and the SAE's error) splits
`u(y)` into `u(a)` and `u(b)` (the self terms), `2 a^T Q b` (the cross term), `2 a^T Q r` and
`2 b^T Q r` (each side's products with the rest) and `u(r)`, each a dot product of the
hidden units' products with f's read-out `W_out W_enc[:, f]` (the Gram matrix of `a, b, r` under
the form, `circuits.cross_terms.part_gram`, read by `split_parts`): the parts the gate types read
(`circuits.gates.types`), summed per candidate beside the truth table.

Per candidate four means over its tokens make its *intervention truth table*: `f` with both
sides present (t11), `f_a` with A removed (t01: only B left), `f_b` with B removed (t10), and
`f_ab` with both removed (t00); `circuits.gates.types` reads gates off it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from circuits.cross_terms import GroupParts, part_gram, split_parts
from circuits.gates.types import FORM_PARTS
from circuits.sites import RESID_MID, check_input_site, input_gain
from circuits.weights import MLPWeights, SAEWeights

REMOVALS = ("none", "a", "b", "ab")  # what leaves the MLP input: nothing, side A, side B, both
# a pair's both-sides removal is derived while the norm's factor grows at most this much with it
# (its rounding grows as the factor does: 16 keeps it near a whole evaluation's in float32)
EXACT_GROWTH = 16.0
REMOVAL_BLOCK = 2048  # removals gathered at once in `evaluate` (memory reused, not faulted in: see there)
WORD = 64  # tokens per int64 word of `bit_words`


@dataclass
class Sides:
    """Candidate gates: output `out [C]` and the members of each side, `a [C, Ma]` and
    `b [C, Mb]` (input latents, -1 pads a side with fewer members)."""

    out: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor

    def __len__(self) -> int:
        return len(self.out)

    def subset(self, at: torch.Tensor) -> "Sides":
        """Candidates `at` (indices) of these, in that order."""
        return Sides(self.out[at], self.a[at], self.b[at])

    def to(self, device: torch.device | str) -> "Sides":
        return Sides(self.out.to(device), self.a.to(device), self.b.to(device))

    @classmethod
    def of_pairs(cls, out: torch.Tensor, in_a: torch.Tensor, in_b: torch.Tensor) -> "Sides":
        return cls(out.long(), in_a.long()[:, None], in_b.long()[:, None])

    @classmethod
    def of_groups(cls, out: list[int], members_a: list[list[int]], members_b: list[list[int]],
                  device: torch.device | str = "cpu") -> "Sides":
        return cls(torch.tensor(out, dtype=torch.long), padded(members_a), padded(members_b)).to(device)


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
        self.mlp, self.sae_out, self.site = mlp, sae_out, check_input_site(site)
        gain = input_gain(site, mlp.g)
        self.gain = torch.ones_like(mlp.g) if gain is None else gain
        # one row per input latent, what its removal takes from [x W_gate | x W_in | r] (r on resid_mid
        # only): one gather and one sum per removal, not three
        taken = [(W_dec * self.gain) @ mlp.W_gate, (W_dec * self.gain) @ mlp.W_in]
        self.taken = torch.cat(taken + ([W_dec] if site == RESID_MID else []), 1)  # [n_in, 2 d_mlp (+ d)]
        # the biases after the product, through W_out and the encoder: pre = ((h W_out) * rho^2) W_enc + bias
        self.bias = sae_out.pre(mlp.b_in @ mlp.W_out + mlp.b_out)  # [n_out]
        self.read = (mlp.W_out @ sae_out.W_enc).T.contiguous()  # [n_out, d_mlp]: each output's read of the hidden units
        self._buffers = ()  # both_of_pairs' work space, grown as needed
        self._form_buffers = ()  # form_parts' work space, grown as needed

    def project(self, source: torch.Tensor) -> torch.Tensor:
        """`[U, 2 d_mlp (+ d)]`: `y W_gate`, `y W_in` (`y = g * source`, before the norm's
        factor) and on resid_mid `source` itself, of the site's values `source [U, d]`: what
        `evaluate` starts from at a token."""
        y = source * self.gain
        return torch.cat([y @ self.mlp.W_gate, y @ self.mlp.W_in] + ([source] if self.site == RESID_MID else []), 1)

    def factor(self, r: torch.Tensor) -> torch.Tensor:
        """`[N]`: the norm's factor squared, `1 / (mean(r^2) + eps)`, of residual rows `r [N, d]`
        (1 on mlp_in, where there is no norm to recompute)."""
        if self.site != RESID_MID:
            return r.new_ones(len(r))
        return (r.square().mean(-1) + self.mlp.eps).reciprocal()

    @torch.no_grad()
    def evaluate(self, source: torch.Tensor, token: torch.Tensor, out: torch.Tensor | None, entry: torch.Tensor,
                 member: torch.Tensor, coef: torch.Tensor, projected: torch.Tensor | None = None, factor: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """f's pre-activation and activation `[N]` each after removals (every output's
        pre-activation, `[N, n_out]`, and None when `out` is None; with `factor`, the norm's
        factor squared `[N]` in place of None).

        `source [U, d]`: the input SAE's site at U tokens; `token [N]`, `out [N]`: the token
        and output of each evaluation; `entry, member, coef [K]`: evaluation `entry[k]` loses
        `coef[k] * d_member[k]` (no entry: nothing removed); `projected`: `project(source)`,
        when the caller evaluates the same tokens several times.
        """
        N = len(token)
        if projected is None:  # only the tokens evaluated
            unique, token = token.unique(return_inverse=True)
            projected = self.project(source[unique])
        kept = projected.index_select(0, token)
        # the removals a block at a time: at the demo's chunk all at once is a [8192, 1152] table, past
        # glibc's 32 MB ceiling for reusing freed memory, so every call faulted its pages in anew
        for start in range(0, len(member), REMOVAL_BLOCK):
            at = slice(start, start + REMOVAL_BLOCK)
            kept.index_add_(0, entry[at], self.taken.index_select(0, member[at]).mul_(
                coef[at, None].to(self.taken.dtype)), alpha=-1)
        d_mlp = self.mlp.W_gate.shape[1]
        scale = self.factor(kept[:, 2 * d_mlp :])
        product = ((kept[:, :d_mlp] * kept[:, d_mlp : 2 * d_mlp]) @ self.mlp.W_out).mul_(scale[:, None])
        pre = torch.addmm(self.bias, product, self.sae_out.W_enc)
        if out is None:
            return pre, (scale if factor else None)
        return pre[torch.arange(N, device=out.device), out], self.sae_out.encode_at(pre, out)

    @torch.no_grad()
    def form_parts(self, projected: torch.Tensor, token: torch.Tensor, out: torch.Tensor, members_a: torch.Tensor,
                   coef_a: torch.Tensor, members_b: torch.Tensor, coef_b: torch.Tensor) -> GroupParts:
        """The exact parts of f's pre-activation less `bias[f]` with the norm's factor frozen
        (module docstring), `[N]` each: `self_a`, `self_b`, `cross`, `own_a` (self plus the
        products with the rest), `own_b`, `rest` (`circuits.cross_terms.split_parts`); `own_a +
        own_b + cross + rest` is the clean pre-activation less the bias. `projected [U, 2 d_mlp
        (+ d)]`: `project` of U tokens, `token [N]` each row's among them; `out [N]`: the output;
        `members_a [N, Ma]`, `members_b [N, Mb]` (-1 padding) and their latents there `coef_a, coef_b`."""
        d_mlp, N = self.mlp.W_gate.shape[1], len(token)
        # the parts a, b and r = y - a - b side by side [N, 3, 2 d_mlp], and their `x W_in` times f's read-out,
        # in buffers kept between calls: tens of MB at the demo's chunks, faulted in page by page when fresh
        # (as in both_of_pairs)
        if not self._form_buffers or self._form_buffers[0].shape[0] < N:
            self._form_buffers = (projected.new_empty(N, 3, 2 * d_mlp), projected.new_empty(N, 3, d_mlp),
                                  projected.new_empty(N, d_mlp))
        inputs, weighted, read = (buffer[:N] for buffer in self._form_buffers)
        inputs[:, :2].zero_()
        for slot, (members, coef) in enumerate(((members_a, coef_a), (members_b, coef_b))):
            entry, member, c = side_removal(coef, members)
            inputs[:, slot].index_add_(0, entry, self.taken.index_select(0, member)[:, : 2 * d_mlp]
                                       * c[:, None].to(self.taken.dtype))
        torch.index_select(projected[:, : 2 * d_mlp], 0, token, out=inputs[:, 2])
        inputs[:, 2].sub_(inputs[:, 0]).sub_(inputs[:, 1])
        torch.index_select(self.read, 0, out, out=read)
        read.mul_(self.factor(projected[:, 2 * d_mlp :].index_select(0, token))[:, None])
        return split_parts(part_gram(inputs[:, :, :d_mlp], inputs[:, :, d_mlp:], read, work=weighted))

    @torch.no_grad()
    def pair_cross(self, a: torch.Tensor, b: torch.Tensor, block: int = 4096) -> torch.Tensor:
        """`C_ab [P, n_out]` of input latent pairs `a, b [P]` (module docstring): what removing
        both latents of a pair adds to the two single removals, per unit of each latent."""
        d_mlp = self.mlp.W_gate.shape[1]
        found = []
        for start in range(0, len(a), block):
            ta, tb = self.taken[a[start : start + block]], self.taken[b[start : start + block]]
            cross = ta[:, :d_mlp] * tb[:, d_mlp : 2 * d_mlp] + tb[:, :d_mlp] * ta[:, d_mlp : 2 * d_mlp]
            found.append(cross @ self.mlp.W_out @ self.sae_out.W_enc)
        return torch.cat(found) if found else self.taken.new_zeros(0, self.sae_out.W_enc.shape[1])

    def evaluate_shared(self, source: torch.Tensor, coef: torch.Tensor, token: torch.Tensor, out: torch.Tensor,
                        members: torch.Tensor, projected: torch.Tensor | None = None, full: bool = False
                        ) -> tuple[torch.Tensor, ...]:
        """`evaluate` of each row removing its `members [N, M]` (-1 padding) at its token, whose
        latents there are `coef [N, M]` (`latent_lookup`); rows that remove the same active
        latents at the same token (candidates of other outputs, or sharing a side) are computed
        once, for every output, and read at their own. With `full`, also what was computed:
        every output's pre-activation `[R, n_out]` and the norm's factor squared `[R]` of the R
        distinct rows, and each row's place among them `[N]`."""
        active = torch.where(coef != 0, members, torch.full_like(members, -1)).sort(1)
        coef = coef.gather(1, active.indices)
        active = active.values
        # the sort puts padding first: a column of padding in every row says nothing, and without those
        # a group gate's rows (53 slots in the demo, a few active) are read as one number each below
        width = int((active >= 0).sum(1).max()) if active.numel() else 0
        active, coef = active[:, active.shape[1] - width :], coef[:, coef.shape[1] - width :]
        inverse = _unique_rows(torch.cat([token[:, None], active + 1], 1), int(active.max()) + 2 if active.numel() else 2)
        first = _first_of(inverse)
        pre, scale = self.evaluate(source, token[first], None, *side_removal(coef[first], active[first]),
                                   projected=projected, factor=full)
        found = (pre[inverse, out], self.sae_out.encode_at(pre, out, inverse))
        return found + (pre, scale, inverse) if full else found

    def both_of_pairs(self, projected: torch.Tensor, token: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      coef_a: torch.Tensor, coef_b: torch.Tensor, cross: torch.Tensor,
                      single: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Every output's pre-activation `[N, n_out]` with both latents `a, b [N]` of a pair
        removed, derived from the clean and the single removals (module docstring).
        `projected [U, 2 d_mlp (+ d)]`: `project` of U tokens, `token [N]` each row's among them;
        `coef_a, coef_b [N]`: the latents there; `cross [N, n_out]`: the pair's `pair_cross`; `single`: for "none", "a"
        and "b", what `evaluate_shared(..., full=True)` computed (every output's pre-activation
        and the norm's factor squared of its distinct rows) and each row's place among them."""
        coef_a, coef_b = coef_a.to(cross.dtype), coef_b.to(cross.dtype)
        unscaled = {}  # the single removals' tables, each once (A's and B's are one table when evaluated together)
        for pre, scale, _ in single.values():
            if id(pre) not in unscaled:
                unscaled[id(pre)] = (pre - self.bias) / scale[:, None]
        u = {r: (unscaled[id(pre)], place) for r, (pre, _, place) in single.items()}
        # in place on [N, n_out], in buffers kept between calls: these passes over memory, not
        # the arithmetic, are the cost, and a fresh buffer this large is faulted in page by page
        if not self._buffers or self._buffers[0].shape[0] < len(cross):
            self._buffers = (torch.empty_like(cross), torch.empty_like(cross))
        both, part = (buffer[: len(cross)] for buffer in self._buffers)
        torch.index_select(u["a"][0], 0, u["a"][1], out=both)
        both += torch.index_select(u["b"][0], 0, u["b"][1], out=part)
        both -= torch.index_select(u["none"][0], 0, u["none"][1], out=part)
        both.addcmul_(cross, (coef_a * coef_b)[:, None])
        r = 2 * self.mlp.W_gate.shape[1]  # where the residual's columns start (resid_mid only)
        residual = (projected[token, r:] - coef_a[:, None] * self.taken[a, r:]
                    - coef_b[:, None] * self.taken[b, r:])
        factor = self.factor(residual)
        pre = both.mul_(factor[:, None]).add_(self.bias)
        # the three terms are as large as the residual and cancel: where the pair carries most of
        # it, the new norm's factor magnifies their rounding, so those rows are evaluated whole
        clean = single["none"][1].index_select(0, single["none"][2])
        whole = (factor > EXACT_GROWTH * clean).nonzero()[:, 0]
        if len(whole):
            removed = torch.arange(len(whole), device=whole.device).repeat(2)
            pre[whole] = self.evaluate(None, token[whole], None, removed, torch.cat([a[whole], b[whole]]),
                                       torch.cat([coef_a[whole], coef_b[whole]]), projected=projected)[0]
        return pre


@dataclass
class Entries:
    """Sampled tokens of candidates: candidate `cand [E]` at row `token [E]` of a token cache."""

    cand: torch.Tensor
    token: torch.Tensor


def candidate_tokens(on_words: torch.Tensor, active_words: torch.Tensor, sides: Sides, limit: int | None = None,
                     block: int = 64, spans: int = 16) -> Entries:
    """The (candidate, token)s where the output is active and both sides are on (a side is on
    where any member is active): every one, or with `limit` each candidate's first `limit`
    tokens in the words' order. `on_words [n_in, w]`, `active_words [n_out, w]`: the tokens
    each input and output is on at, as bits (`bit_words`), so a candidate costs a few word
    operations per 64 tokens, not one per active token of its output, and only the words
    holding its first tokens are unpacked; `block` candidates at a time bound the memory.
    With `limit`, the words are read in `spans` spans and a candidate that has its `limit`
    tokens reads no further (in the demo a third of the pairs have 256 tokens or more, and
    their first 32 lie in the first few spans). In no particular order."""
    on_words = torch.cat([on_words, on_words.new_zeros(1, on_words.shape[1])])  # the padding member (-1) is never on
    n_words = on_words.shape[1]
    none = torch.zeros(0, dtype=torch.long, device=on_words.device)
    if n_words == 0:  # no token at all (say, no confirmation token): spans of 0 words would never advance
        return Entries(none, none)
    step = n_words if limit is None else max(1, -(-n_words // spans))
    # each span's words in tables of their own (rows of a slice are gathered at a stride, slowly), and as
    # many candidates at a time as `block` of all the words hold
    parts = [(start, on_words[:, start : start + step].contiguous(), active_words[:, start : start + step].contiguous())
             for start in range(0, n_words, step)]
    block = block * (n_words // step)
    cands, tokens = [], []
    for first in range(0, len(sides), block):
        mine = torch.arange(first, min(first + block, len(sides)), device=on_words.device)
        before = torch.zeros(len(mine), dtype=torch.long, device=on_words.device)  # tokens found in earlier spans
        for start, on_part, active_part in parts:
            if limit is not None:
                open_ = before < limit
                mine, before = mine[open_], before[open_]
                if not len(mine):
                    break
            side = lambda members: _or_rows(on_part, torch.where(members >= 0, members, len(on_part) - 1))  # noqa: E731
            both = active_part.index_select(0, sides.out[mine]) & side(sides.a[mine]) & side(sides.b[mine])
            count = _popcount(both)  # [c, words]
            ahead = count.cumsum(1) - count + before[:, None]  # the candidate's tokens in its earlier words
            cand, word = ((count > 0) if limit is None else (count > 0) & (ahead < limit)).nonzero(as_tuple=True)
            bits = _unpacked(both[cand, word])  # [n, WORD]
            if limit is not None:  # a word that holds more than the candidate still takes gives its first only
                room = limit - ahead[cand, word]
                over = (count[cand, word] > room).nonzero()[:, 0]
                bits[over] = bits[over] & (bits[over].cumsum(1) <= room[over, None])
            hit, at = bits.nonzero(as_tuple=True)
            cands.append(mine[cand[hit]])
            tokens.append((word[hit] + start) * WORD + at)
            before = before + count.sum(1)
    return Entries(torch.cat([none, *cands]), torch.cat([none, *tokens]))


def _unpacked(words: torch.Tensor) -> torch.Tensor:
    """`[n, WORD]` uint8: the bits of words `[n]`, token order. A byte at a time: a table of
    bytes, not of int64 words shifted 64 times, is an eighth of the memory to pass over (the
    bytes taken by shifts, not by viewing the words' memory, whose order is the host's)."""
    shift = torch.arange(0, WORD, 8, device=words.device)
    byte = ((words[:, None] >> shift) & 0xFF).to(torch.uint8)[:, :, None]  # [n, WORD / 8, 1], low byte first
    return ((byte >> torch.arange(8, dtype=torch.uint8, device=words.device)) & 1).view(len(words), WORD)


def _popcount(words: torch.Tensor) -> torch.Tensor:
    """`[...]` int64: the set bits of each 64-bit word."""
    if words.device.type == "cpu":
        # numpy's count uses the CPU's popcount instruction: 25 times faster than the shifts below at the
        # demo's [30686 candidates, 188 words] spans, where those took a third of each sample's time
        return torch.from_numpy(np.bitwise_count(words.numpy().view(np.uint64))).long()
    return _popcount_shifts(words)


def _popcount_shifts(words: torch.Tensor) -> torch.Tensor:
    """`_popcount` in bitwise operations any device has: bits summed in pairs, nibbles, then
    bytes, with no product that could overflow."""
    x = words - ((words >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return x & 0x7F


def bit_words(token: torch.Tensor, column: torch.Tensor, n_tokens: int, n_columns: int) -> torch.Tensor:
    """`[n_columns, ceil(n_tokens / 64)]` int64: the tokens at which each column is on, as
    bits, 64 tokens a word (the 64th is the sign bit), from the (token, column) positions that
    are on (each once), such as a sparse table's indices: no dense `[tokens, columns]` table
    is made. A word's distinct bits are summed, which is their bitwise or."""
    words = -(-n_tokens // WORD)
    found = torch.zeros(n_columns * words, dtype=torch.long, device=token.device)
    found.index_add_(0, column * words + token // WORD, torch.ones_like(token) << (token % WORD))
    return found.view(n_columns, words)


def _or_rows(words: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`[c, w]`: the bitwise or of rows `index [c, M]` of `words [n, w]`."""
    # index_select: ten times faster than indexing with a tensor for these wide int64 rows
    found = words.index_select(0, index[:, 0])
    for slot in range(1, index.shape[1]):
        found |= words.index_select(0, index[:, slot])
    return found


def side_removal(coef: torch.Tensor, members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The removal of one side per evaluation, as (entry, member, coef) triples for
    `LayerIntervention.evaluate`. `members [N, M]` (-1 padding) and their latents `coef [N, M]`
    at each evaluation's token (`latent_lookup`; a zero leaves its member in place)."""
    entry, slot = (coef != 0).nonzero(as_tuple=True)
    return entry, members[entry, slot], coef[entry, slot]


def intervention_table(layer: LayerIntervention, source: torch.Tensor, z: torch.Tensor, sides: Sides,
                       entries: Entries, chunk: int = 4096, per_entry: bool = False) -> dict[str, torch.Tensor]:
    """Per candidate `[C]`: `n_tokens` and the means of f's pre-activation and activation over
    its entries with nothing, A, B and both removed (`pre_none`, `act_a`, ... `REMOVALS`),
    `pre_constant` (f's bias, `LayerIntervention.bias`), the means of the pre-activation's
    exact parts (`form_self_a`, ... `circuits.gates.types.FORM_PARTS`, `form_parts`), and
    `act_second [C, 4, 4]`, the mean products of the four activations (in `REMOVALS` order;
    what the keeps' standard errors need, `circuits.gates.types.keep_errors`); with
    `per_entry`, also `entry_act [E, 4]`, the four activations at each entry, in the
    layer's precision (what `member_effects` would compute again).
    `source [T, d]`, `z [T, n_in]` (dense or sparse COO): the token cache the entries index."""
    C = len(sides)
    device = source.device
    sums = {f"{kind}_{r}": torch.zeros(C, dtype=torch.float64, device=device) for kind in ("pre", "act")
            for r in REMOVALS}
    sums.update({f"form_{p}": torch.zeros(C, dtype=torch.float64, device=device) for p in FORM_PARTS})
    second = torch.zeros(C, len(REMOVALS) ** 2, dtype=torch.float64, device=device)
    latents = latent_lookup(z)
    # pairs (one latent a side, no padding): both sides' removal derived, not evaluated
    pairs = sides.a.shape[1] == sides.b.shape[1] == 1 and bool((sides.a >= 0).all() and (sides.b >= 0).all())
    cross = layer.pair_cross(sides.a[:, 0], sides.b[:, 0]) if pairs else None
    each = []
    for start in range(0, len(entries.cand), chunk):
        cand, token = entries.cand[start : start + chunk], entries.token[start : start + chunk]
        out = sides.out[cand]
        a, b = sides.a[cand], sides.b[cand]
        coef_a, coef_b = latents(token, a), latents(token, b)  # both sides' latents, read once for every removal
        n = len(cand)
        nobody = cand.new_full((n, 1), -1)
        # sides A and B removed in one call: a latent that is A of one candidate and B of another at a
        # token (a pair's inputs are each other candidates' other side) is evaluated there once
        width = max(a.shape[1], b.shape[1])
        widened = lambda table, fill: F.pad(table, (0, width - table.shape[1]), value=fill)  # noqa: E731
        one_side = (torch.cat([widened(a, -1), widened(b, -1)]), torch.cat([widened(coef_a, 0), widened(coef_b, 0)]))
        removals = {"none": (nobody, torch.zeros(nobody.shape, dtype=coef_a.dtype, device=device)), "a|b": one_side,
                    "ab": (torch.cat([a, b], 1), torch.cat([coef_a, coef_b], 1))}
        unique, token_of = token.unique(return_inverse=True)  # the chunk's tokens, projected once for every removal
        mine = source[unique]
        projected = layer.project(mine)
        done, single = {}, {}
        for r, (members, coef) in removals.items():
            if r == "ab" and pairs:  # derived once per distinct (token, a, b), read at each entry's output
                place = _unique_rows(torch.cat([token_of[:, None], a, b], 1), int(max(a.max(), b.max())) + 1)
                first = _first_of(place)
                pre = layer.both_of_pairs(projected, token_of[first], a[first, 0], b[first, 0], coef_a[first, 0],
                                          coef_b[first, 0], cross.index_select(0, cand[first]),
                                          {k: (v[0], v[1], v[2][first]) for k, v in single.items()})
                done[r] = pre[place, out], layer.sae_out.encode_at(pre, out, place)
                continue
            times = len(members) // n
            pre, act, *full = layer.evaluate_shared(mine, coef, token_of.repeat(times), out.repeat(times), members,
                                                    projected, full=pairs)
            for part, name in enumerate(r.split("|")):
                rows = slice(part * n, (part + 1) * n)
                done[name] = pre[rows], act[rows]
                if pairs:
                    single[name] = (full[0], full[1], full[2][rows])
        parts = layer.form_parts(projected, token_of, out, a, coef_a, b, coef_b)
        for p in FORM_PARTS:
            sums[f"form_{p}"].index_add_(0, cand, getattr(parts, p).double())
        acts = []
        for r in REMOVALS:
            pre, act = done[r]
            sums[f"pre_{r}"].index_add_(0, cand, pre.double())
            sums[f"act_{r}"].index_add_(0, cand, act.double())
            acts.append(act)
        acts = torch.stack(acts, 1)
        if per_entry:
            each.append(acts)
        acts = acts.double()
        second.index_add_(0, cand, (acts[:, :, None] * acts[:, None, :]).flatten(1))
    n = torch.bincount(entries.cand, minlength=C).double()
    per = torch.where(n > 0, 1 / n.clamp_min(1), torch.full_like(n, float("nan")))  # no tokens: NaN means
    found = {"n_tokens": n, **{k: v * per for k, v in sums.items()},
             "pre_constant": layer.bias.index_select(0, sides.out).double() + 0 * per,  # NaN without tokens
             "act_second": (second * per[:, None]).view(C, len(REMOVALS), len(REMOVALS))}
    if per_entry:
        found["entry_act"] = torch.cat(each) if each else source.new_zeros(0, len(REMOVALS))
    return found


def member_effects(layer: LayerIntervention, source: torch.Tensor, z: torch.Tensor, sides: Sides, entries: Entries,
                   side: str, chunk: int = 4096, entry_act: torch.Tensor | None = None) -> torch.Tensor:
    """`[C, M]`: per candidate and member slot of `side` ("a" or "b"), how much f's mean
    activation over the candidate's entries changes when that member leaves the side (the
    side's other members removed, it kept), as a share of f's mean activation there. A member
    never active on those tokens changes nothing (0). Evaluations are shared
    (`evaluate_shared`): the clean one once per token, a removal once per token for every
    candidate whose side removes the same active latents there; where the member is its side's
    only active one, nothing leaves and the clean activation is read. `entry_act [E, 4]`: the
    `intervention_table(per_entry=True)` of the same sides and entries, whose clean and
    side-removed activations are read rather than computed again (the same evaluations;
    where the table batched them with other rows, equal up to that batch's rounding)."""
    members = getattr(sides, side)
    C, M = members.shape
    change = torch.zeros(C * M, dtype=torch.float64, device=source.device)
    base = torch.zeros(C, dtype=torch.float64, device=source.device)
    latents = latent_lookup(z)
    slots = torch.arange(M, device=source.device)
    for start in range(0, len(entries.cand), chunk):
        cand, token = entries.cand[start : start + chunk], entries.token[start : start + chunk]
        mine, out = members[cand], sides.out[cand]
        coef = latents(token, mine)
        unique, token = token.unique(return_inverse=True)  # the chunk's tokens, projected once
        rows = source[unique]
        projected = layer.project(rows)
        if entry_act is None:
            nobody = cand.new_full((len(cand), 1), -1)
            clean = layer.evaluate_shared(rows, coef.new_zeros(nobody.shape), token, out, nobody, projected)[1]
            removed = layer.evaluate_shared(rows, coef, token, out, mine, projected)[1]
        else:
            clean, removed = entry_act[start : start + chunk, [0, REMOVALS.index(side)]].unbind(1)
        base.index_add_(0, cand, clean.double())
        # only a member active at the entry's token can change anything there
        entry, slot = (coef != 0).nonzero(as_tuple=True)
        for s in range(0, len(entry), chunk):
            e, k = entry[s : s + chunk], slot[s : s + chunk]
            left = torch.where(slots == k[:, None], torch.zeros_like(coef[e]), coef[e])  # member k stays
            # where k is the side's only active member, nothing leaves: the clean activation, not evaluated
            # again (a third of the rows in the demo's group pruning); `clean[e]` is a copy, `clean` stays
            kept = clean[e]
            some = (left != 0).any(1).nonzero()[:, 0]
            es = e[some]
            kept[some] = layer.evaluate_shared(rows, left[some], token[es], out[es], mine[es], projected)[1]
            change.index_add_(0, cand[e] * M + k, (kept - removed[e]).double())
    return change.view(C, M) / base.clamp_min(1e-30)[:, None]


def _first_of(inverse: torch.Tensor) -> torch.Tensor:
    """`[R]`: a row holding each of the R distinct rows that `inverse [N]` (`_unique_rows`) names."""
    return torch.zeros(int(inverse.max()) + 1 if len(inverse) else 0, dtype=torch.long,
                       device=inverse.device).scatter_(0, inverse, torch.arange(len(inverse), device=inverse.device))


def _unique_rows(rows: torch.Tensor, base: int) -> torch.Tensor:
    """The index of each row of `rows [N, W]` (non-negative, columns after the first below
    `base`) among the distinct rows, as `torch.unique(dim=0)`'s `inverse`: rows read as
    numbers in base `base`, a column at a time; where the next column would not fit in 63
    bits, the columns read so far are first replaced by their rank among their distinct
    values (order kept). Sorting numbers is much cheaper than sorting rows: the group gates'
    rows of ten latents and more went through `torch.unique(dim=0)` before."""
    if not len(rows):
        return torch.zeros(0, dtype=torch.long, device=rows.device)
    key = rows[:, 0].clone()
    bound = int(key.max()) + 1  # every key is below it
    for column in range(1, rows.shape[1]):
        if math.log2(bound) + math.log2(base) >= 62:
            key = key.unique(return_inverse=True)[1]
            bound = int(key.max()) + 1
        key = key * base + rows[:, column]
        bound *= base
    return key.unique(return_inverse=True)[1]


def latent_lookup(z: torch.Tensor):
    """A function of `token [N]` and `members [N, M]` (-1 padding) giving `[N, M]`: each
    member's latent at the row's token (0 for padding), from a dense or sparse COO `z [T,
    n_in]`; a sparse one is searched by its sorted (token, latent) keys, not made dense."""
    if not z.is_sparse:
        return lambda token, members: z[token[:, None], members.clamp_min(0)] * (members >= 0)
    z = z.coalesce()
    n_in = z.shape[1]
    keys, values = z.indices()[0] * n_in + z.indices()[1], z.values()

    def at(token: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        found = values.new_zeros(members.shape)
        real = members >= 0
        if not len(keys):
            return found
        # only the members searched: a group gate's sides are padded to the widest one's
        want = (token[:, None] * n_in + members)[real]
        i = torch.searchsorted(keys, want).clamp_max(len(keys) - 1)
        found[real] = torch.where(keys[i] == want, values[i], values.new_zeros(()))
        return found

    return at
