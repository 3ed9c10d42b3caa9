"""One layer's held-out tokens, cached once, and the exact interventions on every gate candidate
(`circuits.gates.interventions`, `circuits.gates.types`), as table columns.

The cache runs the model up to the layer once per row batch and keeps, for the rows' analysed
tokens, the input SAE's site, its latents and the output SAE's activations, and for every row
the residual stream entering the layer (the model-run confirmation starts there). Each token
is either a *ranking* token or a *confirmation* token, by a seeded hash of its position
(`confirm_share` of them are confirmation tokens): the group statistics and the interventions
that rank candidates read only ranking tokens, the model-run ablation that confirms the best
ones only confirmation tokens, so the confirmation is a test on data the ranking never saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from circuits import forward
from circuits.gates.interventions import (REMOVALS, Entries, LayerIntervention, Sides, bit_words, candidate_tokens,
                                          intervention_table, member_effects)
from circuits.gates.types import (FORM_PARTS, GateThresholds, causal_score, form_shares, gate_types, keep_errors, keeps,
                                  layer_shares, ranking_terms)
from circuits.layer import LayerBatch
from circuits.sae_basis import token_scale
from circuits.sites import MLP_OUT
from pipelines.data.tokens import TokenRows
from pipelines.inputs import LayerSAEs

FORM_COLUMNS = ["pre_constant", *(f"form_{p}" for p in FORM_PARTS), "cross_share", "own_a_share", "own_b_share",
                "rest_share", "square_share", "square_fit", "square_part", "layer_cross_share", "layer_own_a_share",
                "layer_own_b_share", "layer_rest_share"]
IV_COLUMNS = ["iv_tokens", *(f"act_{r}" for r in REMOVALS), *(f"pre_{r}" for r in REMOVALS), *FORM_COLUMNS,
              "keep_a", "keep_b", "keep_ab", "synergy", "keep_a_se", "keep_b_se", "synergy_se", "causal_score",
              "causal_bound", "sure_and", "gate_type"]


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each value of `x` (int64, its low 32 bits)."""
    x = x & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _position_hash(flat: torch.Tensor, seed: int) -> torch.Tensor:
    return _mix(flat.long() * 2654435761 + seed * 40503 + 12345)


def confirmation_tokens(flat: torch.Tensor, seed: int, share: float) -> torch.Tensor:
    """Whether each flat position (row * n_ctx + position) is a confirmation token: a seeded
    hash of the position below `share`, the same on every run and for any batching."""
    return _position_hash(flat, seed).double() / 2.0**32 < share


def sample_order(flat: torch.Tensor, seed: int) -> torch.Tensor:
    """`[t]`: the positions `flat` in a seeded order, by a hash of the position independent
    of `confirmation_tokens`'. A candidate's token sample is its first eligible tokens in this
    order: a uniform sample of its tokens that does not depend on which other candidates are
    sampled with it (a pruned group gate sees its own), and that candidates share where
    they can, so what they share at a token is computed once."""
    return torch.argsort(_mix(_position_hash(flat, seed) ^ 0x5BD1E995), stable=True)


@dataclass
class LayerCache:
    """One layer's analysed held-out tokens (`[T, ...]`, sparse COO latents) and its rows'
    residual stream entering the layer (`resid_pre [rows, n_ctx, d]`)."""

    layer: int
    site: str
    flat: torch.Tensor  # [T] row * n_ctx + position
    source: torch.Tensor  # [T, d] the input SAE's site
    z: torch.Tensor  # [T, n_in] input latents
    acts: torch.Tensor  # [T, n_out] output SAE activations
    confirm: torch.Tensor  # [T] bool: a confirmation token
    resid_pre: torch.Tensor  # [rows, n_ctx, d]
    tokens: torch.Tensor  # [rows, n_ctx] token ids
    n_ctx: int
    eps: float
    # `_bits` of the ranking and the confirmation tokens, made at the first sample: the tensors above stay as built
    _words: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    @torch.no_grad()
    def build(cls, model, rows: TokenRows, n_rows: int, saes: LayerSAEs, seed: int, confirm_share: float,
              batch_rows: int = 32, streams: forward.Streams | None = None) -> "LayerCache":
        """The cache of layer `saes.layer` over the first `n_rows` rows; `streams` (keyed by
        each batch's first row) carries the rows' residual streams from an earlier layer's cache."""
        streams = forward.Streams(model, keep=False) if streams is None else streams
        layer, site = saes.layer, saes.input_site
        sae_in, sae_out = saes.sae_in.weights, saes.sae_out.weights
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("flat", "source", "z", "acts", "resid_pre", "tokens")}
        for part, tokens in tqdm(rows.iter_batches(batch_rows, n_rows), desc=f"layer {layer} cache", unit="batch",
                                 total=-(-min(n_rows, len(rows)) // batch_rows)):
            resid_pre, found = streams.layer(part.start, tokens, layer, [(layer, site), (layer, MLP_OUT)])
            where = rows.keep(tokens).to(resid_pre.device)
            n_ctx = tokens.shape[1]
            flat = (torch.arange(part.start, part.stop)[:, None] * n_ctx + torch.arange(n_ctx)).to(where.device)
            source = found[layer, site][where].to(sae_in.W_dec.dtype)
            parts["flat"].append(flat[where])
            parts["source"].append(source)
            parts["z"].append(sae_in.encode_sparse(source))
            parts["acts"].append(sae_out.encode_sparse(found[layer, MLP_OUT][where].to(sae_out.W_enc.dtype)))
            parts["resid_pre"].append(resid_pre)
            parts["tokens"].append(tokens)
        flat = torch.cat(parts["flat"])
        return cls(layer, site, flat, torch.cat(parts["source"]), _stacked(parts["z"]),
                   _stacked(parts["acts"]), confirmation_tokens(flat, seed, confirm_share),
                   torch.cat(parts["resid_pre"]), torch.cat(parts["tokens"]), rows.n_ctx, float(model.cfg.eps))

    def batches(self, confirm: bool = False, size: int = 8192):
        """A callable giving fresh `LayerBatch`es of the ranking (or confirmation) tokens."""
        index = torch.nonzero(self.confirm == confirm)[:, 0]

        def batches():
            for start in range(0, len(index), size):
                mine = index[start : start + size]
                source = self.source[mine]
                yield LayerBatch(x=source, z=self.z.index_select(0, mine).to_dense(),
                                 scale=token_scale(source, self.eps, self.site),
                                 acts=self.acts.index_select(0, mine).to_dense())

        return batches

    def sample(self, sides: Sides, confirm: bool, max_tokens: int, seed: int) -> Entries:
        """At most `max_tokens` tokens per candidate where its output is active and both sides
        are on, among the ranking (or confirmation) tokens: its first in `sample_order`.
        Ordered by token, then candidate."""
        index, on_words, active_words = self._bits(confirm, seed)
        found = candidate_tokens(on_words, active_words, sides, limit=max_tokens)
        token = index[found.token]
        order = torch.argsort(token * max(len(sides), 1) + found.cand)
        return Entries(found.cand[order], token[order])

    def _bits(self, confirm: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ranking (or confirmation) tokens' cache rows `[t]` in `sample_order`, and at
        which of them each input latent is on and each output active, as `bit_words`: kept
        for the cache's life, `(n_in + n_out) * t / 8` bytes (about 12 MB for the demo's layer)."""
        if (confirm, seed) not in self._words:
            index = torch.nonzero(self.confirm == confirm)[:, 0]
            index = index[sample_order(self.flat[index], seed)]
            position = _positions(index, len(self.flat))

            def words(table: torch.Tensor) -> torch.Tensor:
                token, column = table.indices()
                at = position[token]
                keep = (at >= 0) & (table.values() != 0)
                return bit_words(at[keep], column[keep], len(index), table.shape[1])

            self._words[(confirm, seed)] = (index, words(self.z), words(self.acts))
        return self._words[(confirm, seed)]


def _stacked(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Coalesced sparse row blocks `[t_i, n]` one after another `[sum t_i, n]`: already in
    coalesced order, so marked so rather than sorted again (a sort of millions of entries
    for nothing)."""
    table = torch.cat(blocks)
    return torch.sparse_coo_tensor(table._indices(), table._values(), table.shape, is_coalesced=True,
                                   check_invariants=False)


def thresholds(cfg) -> GateThresholds:
    """The type rule's thresholds from a `VerdictConfig`."""
    return GateThresholds(need=cfg.need, cross=cfg.cross, suffice=cfg.suffice, matter=cfg.matter, rise=cfg.rise,
                          bilinear_cross=cfg.bilinear_cross, bilinear_own=cfg.bilinear_own, square=cfg.square)


def ranking_entries(cache: LayerCache, sides: Sides, cfg) -> Entries:
    """The ranking tokens of every candidate the interventions read (`VerdictConfig.iv_tokens`
    of them, seeded): one sample for the intervention columns and the necessary members."""
    return cache.sample(sides, False, cfg.iv_tokens, cfg.seed)


def intervention_columns(layer: LayerIntervention, cache: LayerCache, sides: Sides, entries: Entries, cfg
                         ) -> pd.DataFrame:
    """`IV_COLUMNS` of every candidate, one row each, in the order of `sides`, on its
    `ranking_entries`."""
    return columns_of(intervention_table(layer, cache.source, cache.z, sides, entries), cfg)


def columns_of(table: dict[str, torch.Tensor], cfg) -> pd.DataFrame:
    """`IV_COLUMNS` of the candidates of an `intervention_table`, one row each."""
    table = {k: v.cpu() for k, v in table.items()}
    second = table.pop("act_second").numpy()
    frame = pd.DataFrame({"iv_tokens": table["n_tokens"].numpy().astype(np.int64),
                          **{k: table[k].numpy() for k in table if k != "n_tokens"}})
    frame = frame.assign(**typed(frame, second, cfg))
    # a few tokens make a type by chance: a candidate tested on fewer than min_cell is untested
    few = frame["iv_tokens"] < cfg.min_cell
    frame.loc[few, "gate_type"], frame.loc[few, ["causal_score", "causal_bound"]] = "untested", np.nan
    frame.loc[few, "sure_and"] = False
    return frame[IV_COLUMNS]


def retested(layer: LayerIntervention, cache: LayerCache, frame: pd.DataFrame, sides: Sides, rank, cfg,
             rounds: int = 3) -> pd.DataFrame:
    """`frame` (one layer's candidates of one kind, in the order of `sides`, ranked by `rank`,
    a function of the frame giving it ranked again) with its shortlist retested.

    Ranked on `iv_tokens` each, the best of a thousand candidates are partly the luckiest:
    their screening sample is the one they won on. The `shortlist` best by circuit_rank are
    tested again on up to `retest_tokens` ranking tokens (their first in `sample_order`, so
    the screening tokens are a quarter of a full retest: the estimate that ranked them weighs
    less, and the error shrinks by half), their intervention columns replaced, and all ranked
    again; until the `n_ablate` best are all retested, at most `rounds` times. A candidate
    with no more tokens than it was screened on gets the same result again."""
    done = np.zeros(len(frame), dtype=bool)
    for _ in range(rounds if cfg.shortlist else 0):
        ranks = frame["circuit_rank"].to_numpy(dtype=float, na_value=np.nan)
        order = np.argsort(ranks, kind="stable")
        order = order[np.isfinite(ranks[order])]
        if done[order[: cfg.n_ablate]].all():
            break
        pick = np.array([i for i in order if not done[i]][: cfg.shortlist], dtype=np.int64)
        mine = sides.subset(torch.from_numpy(pick).to(sides.out.device))
        found = intervention_columns(layer, cache, mine, cache.sample(mine, False, cfg.retest_tokens, cfg.seed), cfg)
        frame = frame.copy()
        for column in IV_COLUMNS:
            values = frame[column].to_numpy().copy()
            values[pick] = found[column].to_numpy()
            frame[column] = values
        done[pick] = True
        frame = rank(frame)
    return frame


def typed(frame: pd.DataFrame, second: np.ndarray, cfg) -> dict[str, np.ndarray]:
    """The form's shares (`form_shares`, `layer_shares`), `keep_*`, `synergy`, their standard
    errors, `causal_score`, `causal_bound`, `sure_and` and `gate_type` from the `pre_*`,
    `form_*` and `act_*` columns and the activations' mean products `second [C, 4, 4]`."""
    k = keeps(frame["act_none"], frame["act_b"], frame["act_a"], frame["act_ab"])
    n, mean = frame["iv_tokens"].to_numpy(), frame[[f"act_{r}" for r in REMOVALS]].to_numpy()
    errors = keep_errors(n, mean, second)
    form = form_shares(frame["pre_none"], frame["pre_constant"], {p: frame[f"form_{p}"] for p in FORM_PARTS})
    return {**form, **layer_shares(*(frame[f"pre_{r}"] for r in REMOVALS), frame["pre_constant"]),
            **k, **{f"{name}_se": errors[name] for name in ("keep_a", "keep_b", "synergy")},
            "causal_score": causal_score(k["keep_a"], k["keep_b"], k["synergy"]),
            **ranking_terms(n, mean, second, cfg.rank_z, cfg.null_tokens, thresholds(cfg)),
            "gate_type": gate_types(k["keep_a"], k["keep_b"], k["keep_ab"], thresholds(cfg), form)}


def necessary_members(layer: LayerIntervention, cache: LayerCache, sides: Sides, entries: Entries, cfg,
                      entry_act: torch.Tensor | None = None) -> dict[str, list[list[int]]]:
    """Per group gate, the members of each side whose leaving changes the side's intervention
    result by at least `prune` of the output, on its `ranking_entries`; a side where no member
    does so alone keeps every member (their effect is collective: none can be named).
    `entry_act`: the sides' `intervention_table(per_entry=True)` on those entries, if made."""
    found = side_lists(sides)
    for side in ("a", "b"):
        effect = member_effects(layer, cache.source, cache.z, sides, entries, side, entry_act=entry_act).abs()
        members = found[f"necessary_{side}"]
        kept = [[m for m, keep in zip(row, mask) if keep] for row, mask in zip(members, (effect >= cfg.prune).tolist())]
        found[f"necessary_{side}"] = [k if k else row for k, row in zip(kept, members)]
    return found


def pruned_groups(layer: LayerIntervention, cache: LayerCache, sides: Sides, cfg, rounds: int = 4
                  ) -> tuple[Sides, dict[str, torch.Tensor]]:
    """Group gates cut to their necessary members, keeping the gate's intervention result.

    Each round proposes every side cut to its `necessary_members` and tests the proposal
    again (a pruned side is on at fewer tokens, so it gets its own `ranking_entries`). A gate
    takes the proposal only if what removing A, B and both keeps stays within `prune` of
    what it kept for the whole groups: members that matter only together (each small, jointly
    large) stay, since pruning them would change the result, not simplify the gate. A gate
    whose proposal fails, or that loses no member, stops; at most `rounds` rounds. A 45-input
    label class is a class; the members that carry the gate where it works are its sides.
    Returns the pruned sides and their `intervention_table` on their `ranking_entries` (a
    candidate's sample depends on its own sides only, so the test that accepted a proposal
    is that table's row, not computed again; so are the next round's entries, and the
    activations at them that `member_effects` reads)."""
    entries = ranking_entries(cache, sides, cfg)
    table = intervention_table(layer, cache.source, cache.z, sides, entries, per_entry=True)
    entry_act = table.pop("entry_act")
    whole = _kept(table)
    lists = side_lists(sides)
    a, b = lists["necessary_a"], lists["necessary_b"]
    outputs = sides.out.tolist()  # read once: an element of a GPU tensor is a wait for the device
    mine = list(range(len(sides)))  # the open gates; `entries` and `entry_act` are theirs, numbered in this order
    for _ in range(rounds):
        open_sides = sides.subset(torch.tensor(mine, dtype=torch.long, device=sides.out.device))
        found = necessary_members(layer, cache, open_sides, entries, cfg, entry_act)
        proposed = [(i, na, nb) for i, na, nb in zip(mine, found["necessary_a"], found["necessary_b"])
                    if na != a[i] or nb != b[i]]
        if not proposed:
            break
        trial = Sides.of_groups([outputs[i] for i, _, _ in proposed], [na for _, na, _ in proposed],
                                [nb for _, _, nb in proposed], sides.out.device)
        trial_entries = ranking_entries(cache, trial, cfg)
        tried = intervention_table(layer, cache.source, cache.z, trial, trial_entries, per_entry=True)
        trial_act = tried.pop("entry_act")
        same = ((_kept(tried) - whole[[i for i, _, _ in proposed]]).abs() <= cfg.prune).all(1)  # NaN never the same
        taken = [j for j, ok in enumerate(same.tolist()) if ok]
        for j in taken:
            i, na, nb = proposed[j]
            a[i], b[i] = na, nb
            for name, values in table.items():
                values[i] = tried[name][j]
        sides = Sides.of_groups(outputs, a, b, sides.out.device)
        if not taken:
            break
        # the gates that took their proposal stay open, in the same order: the trial's entries are theirs
        entries, keep = _renumbered(trial_entries, torch.tensor(taken, dtype=torch.long, device=sides.out.device),
                                    len(trial))
        entry_act, mine = trial_act[keep], [proposed[j][0] for j in taken]
    return sides, table


def _renumbered(entries: Entries, index: torch.Tensor, n: int) -> tuple[Entries, torch.Tensor]:
    """The entries of candidates `index` (increasing) of `n`, numbered in that order, and
    which of `entries` they are `[E]` (bool)."""
    position = _positions(index, n)
    keep = position[entries.cand] >= 0
    return Entries(position[entries.cand[keep]], entries.token[keep]), keep


def _positions(index: torch.Tensor, n: int) -> torch.Tensor:
    """`[n]`: where each of `n` items stands in `index` (distinct items), -1 where it is not there."""
    position = torch.full((n,), -1, dtype=torch.long, device=index.device)
    position[index] = torch.arange(len(index), device=index.device)
    return position


def _kept(table: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[C, 3]`: the share of f's mean activation kept with A, B and both removed."""
    return torch.stack([table[f"act_{r}"] for r in ("a", "b", "ab")], 1) / table["act_none"][:, None]


def side_lists(sides: Sides) -> dict[str, list[list[int]]]:
    """`necessary_a, necessary_b`: each side's members as lists, without padding."""
    return {f"necessary_{side}": [[m for m in row if m >= 0] for row in getattr(sides, side).tolist()]
            for side in ("a", "b")}
