"""Every ranking of gate candidates: the gates table's weight and data ranks, the circuit
ranking of pairs and group gates, and the split rule.

The gates table. The weight-only AND score of a pair (a, b) of an output is
`and_score = cross - |self_a| - |self_b|` with `cross = 2 Qt[a,b]`, `self_a = Qt[a,a]`,
`self_b = Qt[b,b]`: high when the pair matters together (large positive cross term) and
neither input alone (small self terms). Among an output's candidates, `weight_rank` ranks by
`and_score` and `data_rank` by `gate_score` (`circuits.gates.pairs`; candidates without one
are not ranked); `layer_rank` ranks the layer's outputs' data-rank-1 pairs by `gate_score`.
All are 1 for the best, with ties in the candidates' order (`ranks_within`).

Split. Two input latents can be one concept written twice (a word and its feature split by
the SAE). Such a *split pair* looks like an AND in correlational statistics: its inputs fire
together. Co-occurrence alone does not make one concept, since the inputs of a real AND can
co-occur too, so a pair is split only when the correlational evidence and the interventions
agree:

- evidence: the inputs have the same top token (`features.top_token`), or they fire together
  more than chance allows (`coactivation_lift >= split_lift`) and either share a token among
  their top-activating contexts' tokens or have near-parallel MLP-input directions
  (`input_cosine >= split_cosine`);
- interventions: the candidate's `gate_type` is not a bilinear `and` (`circuits.gates.types`,
  read on the layer's pre-activation). An untested candidate is judged on the evidence alone.

The layer's own form decides alone when it says one direction squared: a `square` (the 2x2
form on the two sides' self terms and cross term nearly rank one, one direction written as
two latents or two groups) is split whatever the evidence and the activations say. Removing
either half of a square drops the output under the output SAE's cut-off, so the activations
alone would read it as an AND.

A group gate is split when split member pairs carry most of the cross terms between its
groups (`split_share >= 0.5`, evidence as above per member pair), and its type is not `and`,
or when it is a `square`.

Ranking. Candidates are ordered by cause, in tiers (`tiers`): every bilinear `and` the data do
not contradict; then every sure activation-level AND (`sure_and`: each side necessary to the
activation and its cross term carrying the output, beyond the sample's luck; the `threshold`
ands, where the output SAE's cut-off does the AND) the data do not contradict; then every
other candidate. Within a tier by `causal_bound` (the causal score made pessimistic by its
standard errors, `circuits.gates.types`). An `and-unformed` (the activation-level AND where
the layer's form has no shares to read) is in the same tier as a `threshold`, sure or not.
The data contradict an and when the output's truth table on held-out tokens says it fires
about as strongly with one side off (`and_data` below its threshold): the interventions only
see tokens where both sides are on, where inputs that merely interfere with the one the
output reads can look necessary. Each output's *circuit candidate*, among its candidates of
one kind (pairs, or group gates), is its first in that order that is not split (its first split one when it has
no other). `circuit_rank` ranks the circuit candidates of a layer in that order, and after
them the split candidates that come before their output's circuit candidate, so that a reader
finds what was demoted and why. Untested candidates (no score) are not ranked.
"""

from __future__ import annotations

import numpy as np


def and_score(cross, self_a, self_b):
    """The weight-only AND score (module docstring), elementwise on arrays or tensors `[n]`."""
    return cross - abs(self_a) - abs(self_b)


def ranks_within(group: np.ndarray, score: np.ndarray) -> np.ndarray:
    """`[n]` 1-based rank of each `score [n]` among those of its `group [n]`, the largest first
    and equal scores in their order here; 0 where the score is NaN (not ranked)."""
    group, score = np.asarray(group), np.asarray(score, dtype=float)
    ranked = np.flatnonzero(~np.isnan(score))
    order = ranked[np.lexsort((ranked, -score[ranked], group[ranked]))]
    start = np.ones(len(order), dtype=bool)
    start[1:] = group[order][1:] != group[order][:-1]
    position = np.arange(len(order))
    rank = np.zeros(len(score), dtype=np.int64)
    rank[order] = position - np.maximum.accumulate(np.where(start, position, 0)) + 1
    return rank


def gate_table_ranks(out: np.ndarray, and_scores: np.ndarray, gate_score: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`weight_rank, data_rank, layer_rank [n]` of a layer's candidates (module docstring),
    from their output `out [n]`, `and_score [n]` and `gate_score [n]`; 0 where not ranked."""
    data_rank = ranks_within(out, gate_score)
    best = np.where(data_rank == 1, np.asarray(gate_score, dtype=float), np.nan)
    return ranks_within(out, and_scores), data_rank, ranks_within(np.zeros(len(best), dtype=np.int64), best)


def split_evidence(same_token: np.ndarray, shared_token: np.ndarray, cosine: np.ndarray, lift: np.ndarray,
                   split_lift: float, split_cosine: float) -> np.ndarray:
    """The correlational half of the split rule (module docstring), elementwise."""
    together = np.nan_to_num(lift, nan=0.0) >= split_lift
    return same_token | (together & (shared_token | (np.nan_to_num(cosine, nan=-2.0) >= split_cosine)))


def is_split(evidence: np.ndarray, gate_type: np.ndarray) -> np.ndarray:
    """Split when the type is `square`, or the evidence says so and the layer does not
    compute a bilinear AND (module docstring)."""
    gate_type = np.asarray(gate_type, dtype=object)
    return (gate_type == "square") | (np.asarray(evidence, dtype=bool) & (gate_type != "and"))


def tiers(gate_type: np.ndarray, sure: np.ndarray, uncontradicted: np.ndarray) -> np.ndarray:
    """`[n]` tier of each candidate (module docstring), the highest ranked first: 2 for a
    bilinear `and`, 1 for a sure activation-level AND (`sure`), each where the data do not
    contradict it (`uncontradicted`), else 0."""
    gate_type, uncontradicted = np.asarray(gate_type, dtype=object), np.asarray(uncontradicted, dtype=bool)
    tier = np.where(gate_type == "and", 2, np.where(np.asarray(sure, dtype=bool), 1, 0))
    return np.where(uncontradicted, tier, 0)


def circuit_ranks(out: np.ndarray, score: np.ndarray, tier: np.ndarray, split: np.ndarray,
                  tiebreak: np.ndarray) -> np.ndarray:
    """`circuit_rank` of every candidate of one layer and kind, 0 for those not ranked
    (module docstring). `out, score, tier, split [n]`: candidates of a higher `tier` (`tiers`;
    a bool marks tier 1) rank before all of a lower one; `tiebreak [n]` integer order among
    equal scores (e.g. the input index), so ties rank the same way on every run."""
    out, split, tiebreak = np.asarray(out), np.asarray(split, dtype=bool), np.asarray(tiebreak)
    # one key: every candidate of a tier above every one of a lower tier (scores lie in [0, 1])
    score = np.asarray(score, dtype=float)
    key = np.nan_to_num(score, nan=-np.inf) + 2.0 * np.asarray(tier, dtype=float)
    order = np.lexsort((tiebreak, -key, split, out))  # per output: unsplit first, best score first
    first = np.ones(len(order), dtype=bool)
    first[1:] = out[order][1:] != out[order][:-1]
    chosen = np.zeros(len(out), dtype=bool)
    chosen[order[first]] = True
    bar = dict(zip(out[order[first]], key[order[first]]))
    demoted = split & ~chosen & (key > np.array([bar[o] for o in out]))
    ranked = np.flatnonzero((chosen | demoted) & np.isfinite(score))
    final = ranked[np.lexsort((tiebreak[ranked], out[ranked], -key[ranked], split[ranked]))]
    rank = np.zeros(len(out), dtype=np.int64)
    rank[final] = np.arange(1, len(final) + 1)
    return rank
