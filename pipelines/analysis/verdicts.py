"""Which gate candidates are circuits: the verdicts stage's tables from the gate home's rules.

The rules live in `circuits.gates` (one module each): the interventions that test every
candidate (`interventions`), the gate types and the causal score (`types`), the split rule and
the circuit ranking that pairs and group gates share (`ranking`). Here they meet the run's
tables and the feature descriptions.

Pairs are every candidate of the `gates` table. Groups (`circuits.gates.groups`) are formed
per output from what the corpus and the weights give:
- `eigen`: each of the output's `n_eigen` eigenvectors carrying most of its activation
  (`eigen.activation_share`) reads inputs (`eigen_inputs`, |cosine| >= `min_cosine`, at most
  `max_members`); their split into two groups whose cross terms carry most of the output's
  activation is found on held-out tokens;
- `labels`: the inputs mainly in one label class form a group: at least `label_share` of the
  input's activation falls on the class's tokens, at least `label_lift` times the class's
  share of all tokens (`feature_labels`; the features' own label rule, channel by channel,
  so an input of negations in positive contexts is in both the `negation` and the
  `context=positive` group). Two label groups are a candidate of an output when one of its
  eigenvectors above reads members of both or one of its `n_interactions` strongest cross
  terms joins them; an input in both stays in the smaller group only.
Groups are pruned to their *necessary members*: those whose leaving the group changes its
intervention result by at least `prune` of the output, a cut taken only when the pruned gate
keeps what the whole groups kept within `prune` (a 45-input label class is a class; the
members that carry the gate are its sides, unless they carry it only together). The pruned
sides are the ones tested, ranked and confirmed (`pipelines.analysis.interventions.pruned_groups`).

Ranking. Every candidate is screened on `iv_tokens` ranking tokens and ranked by its causal
bound; the `shortlist` best are tested again on up to `retest_tokens` and ranked again
(`pipelines.analysis.interventions.retested`), so that the best are not merely the luckiest.

Verdicts. The `n_ablate` best candidates of each kind per layer by `circuit_rank` (and the
best of each kind that each of the corpus's gate tags marks) are ablated in the model on
confirmation tokens the ranking never read (`pipelines.analysis.ablation`). A candidate
*behaves as an AND gate* when its interventions type it a bilinear `and` and the model run
confirms it without reading through the output SAE's cut-off: removing either side alone keeps
at most `need` of the MLP output along the feature's direction. Beside it, whether the SAE's
activation and the downstream log-probability of the boosted tokens say the same
(`confirmations`). The gate tags the
corpus's labels let speak (`pipelines.data.tags`; the built-in stories' negation gate) each
add their column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from circuits.config import Config, option, seed_option
from circuits.gates.groups import MAX_MEMBERS
from circuits.gates import ranking
from circuits.gates.ranking import circuit_ranks, is_split, split_evidence, tiers
from circuits.sites import OUTPUT_SITE
from pipelines.data.tags import LABEL_JOIN, GateTag, TagFacts

SOURCES = ("eigen", "labels")
# the columns of a candidate's circuit sides: a pair's inputs, a group gate's pruned sides
CIRCUIT_SIDES = {"pair": ("members_a", "members_b"), "group": ("necessary_a", "necessary_b")}


@dataclass(frozen=True)
class VerdictConfig(Config):
    """How gate candidates are ranked, grouped, ablated and judged."""

    rows: int = option(1024, "held-out rows cached for the group statistics, the interventions and the confirmation", low=1)
    groups: tuple[str, ...] = option(SOURCES, "input groups formed: eigen (inputs a top eigenvector reads), labels "
                                              "(inputs mainly in one label class)")
    n_eigen: int = option(2, "eigenvectors per output, by their share of its activation, whose reads form groups", low=1)
    min_cosine: float = option(0.2, "least |cosine| of an input with an eigenvector to count as read by it",
                               low=0.0, high=1.0)
    max_members: int = option(8, "inputs per eigenvector's reading set (its strongest reads; at most the circuits "
                                 "stage's n_eigen_inputs are stored)", low=2, high=MAX_MEMBERS)
    n_interactions: int = option(10, "strongest cross terms per output that can join two label groups", low=0)
    n_self: int = option(4, "inputs of an output's strongest self terms whose pairs are tested too", low=0)
    label_share: float = option(0.5, "an input is in a label class's group with at least this share of its activation "
                                     "on the class's tokens", low=0.0, high=1.0)
    label_lift: float = option(1.5, "... and that share at least this many times the class's share of all tokens",
                               low=1.0)
    split_cosine: float = option(0.4, "a pair whose inputs fire together at least split_lift times as often as "
                                      "chance is a split pair with this input cosine or more (or a shared "
                                      "top-activating token)", low=-1.0, high=1.0)
    split_lift: float = option(2.0, "see split_cosine", low=0.0)
    min_cell: int = option(20, "least tokens with both inputs on, and with each on without the other, for the truth "
                                "table to speak", low=1)
    and_data: float = option(0.6, "least and_data for the truth table to say AND (an equal-weight sum of two inputs "
                                  "scores 0.5)", low=0.0, high=1.0)
    iv_tokens: int = option(32, "ranking tokens per candidate (a seeded sample of those where both sides are on and "
                                "the output is active) on which its sides are removed by exact layer-local "
                                "intervention: the screening that finds the shortlist, which is retested on "
                                "retest_tokens", low=1)
    confirm_share: float = option(0.25, "share of the held-out tokens kept for the model-run confirmation (a seeded "
                                        "hash of the position): the ranking never reads them; from 0 (no "
                                        "confirmation) to below 1", low=0.0)
    need: float = option(0.5, "a side is necessary when removing it keeps at most this share of the output "
                              "(gate types: circuits.gates.types)", low=0.0, high=1.0)
    cross: float = option(0.25, "a threshold (activation-level) and's cross term carries at least this share of the "
                                "output's activation (its synergy)", low=0.0, high=1.0)
    bilinear_cross: float = option(0.5, "a bilinear and's cross term 2 x_A^T Q x_B carries at least this share of the "
                                        "output's pre-activation less its constant, the norm frozen, and removing "
                                        "either side (its cross and own terms) takes at least this share, the rest at "
                                        "most 1 minus it: the paper's strong positive interaction, each side then "
                                        "necessary by `need` before any cut-off (circuits.gates.types)",
                                   low=0.0, high=1.0)
    bilinear_own: float = option(0.2, "... each side's own terms (self term and products with the rest of the input) "
                                      "add at most this share, a side alone below `matter`, and the 2x2 form on the "
                                      "sides is indefinite beyond the square band: the paper's negligible "
                                      "self-interactions and opposite eigenvalue pair", low=0.0, high=1.0)
    square: float = option(0.8, "two sides are one direction squared (a rank-one form; split, ranked last) when their "
                                "cross term lies within this factor of 2 sqrt(self_a self_b) of their self terms, same "
                                "sign, and their 2x2 form adds at least bilinear_cross of the pre-activation",
                           low=0.01, high=1.0)
    suffice: float = option(0.7, "a side alone suffices when removing the other keeps at least this share", low=0.0)
    matter: float = option(0.2, "a side matters when removing it takes away at least this share", low=0.0, high=1.0)
    rise: float = option(0.1, "removing a side inhibits when the output rises by at least this share", low=0.0)
    shortlist: int = option(32, "best candidates of each kind per layer by circuit_rank tested again on up to "
                                "retest_tokens ranking tokens and ranked again, until the n_ablate best are all "
                                "retested (at most 3 rounds; 0: no retest)", low=0)
    retest_tokens: int = option(256, "ranking tokens per shortlisted candidate in its retest (its first in the same "
                                     "seeded order, so the screening sample's among them)", low=1)
    rank_z: float = option(2.0, "standard errors by which each keep is raised and the synergy lowered in the causal "
                                "bound that orders candidates, and in the sure_and test that puts an and first only "
                                "if it stays one so: the best are ANDs beyond their sample's luck (0, with "
                                "null_tokens 0: rank by the estimates)", low=0.0)
    null_tokens: float = option(1.0, "tokens of no effect (every removal keeps the output) added to each candidate's "
                                     "sample in its causal bound and sure_and test: a candidate seen on few tokens "
                                     "ranks as the less certain (circuits.gates.types; 0: none)", low=0.0)
    prune: float = option(0.05, "a group member is necessary when its leaving the group changes the group's "
                                "intervention result by at least this share of the output; the others are pruned "
                                "before the group is tested, ranked and confirmed, when the pruned gate's result "
                                "stays within this share of the whole groups'", low=0.0, high=1.0)
    boost_sd: float = option(1.0, "least boost (sd) of a lexicon class for a gate tag to count an output as boosting "
                                  "it (the stories' negation gate: the other class's words)", low=0.0)
    n_ablate: int = option(8, "best pairs, and best group gates, per layer by circuit_rank confirmed by ablation in "
                              "the model (plus each layer's best of each kind that a gate tag marks)", low=0)
    ablate_tokens: int = option(64, "confirmation tokens per ablated candidate: a seeded sample of those where both "
                                     "sides are on and the output is active", low=1)
    seed: int = seed_option("seeds the token samples and the ranking/confirmation split")

    def check(self) -> None:
        unknown = [g for g in self.groups if g not in SOURCES]
        if unknown:
            raise ValueError(f"VerdictConfig.groups: unknown {unknown[0]!r}; choose from {', '.join(SOURCES)}")
        if self.confirm_share >= 1:
            raise ValueError(f"VerdictConfig.confirm_share must be from 0 to below 1, got {self.confirm_share!r}: at 1 "
                             "every held-out token is a confirmation token and none is left to rank candidates on")
        if self.iv_tokens < self.min_cell:
            raise ValueError(f"--iv-tokens ({self.iv_tokens}) is under --min-cell ({self.min_cell}): a candidate "
                             "tested on fewer than --min-cell tokens stays untested, so none would be ranked; raise "
                             "--iv-tokens or lower --min-cell")
        if self.shortlist and self.retest_tokens <= self.iv_tokens:
            raise ValueError(f"VerdictConfig.retest_tokens ({self.retest_tokens}) must exceed iv_tokens "
                             f"({self.iv_tokens}): a retest reads more tokens than the screening (or set shortlist 0)")


def ranking_rule(first_sentence: bool = False) -> str:
    """The circuit ranking as its home states it: the paragraph of `circuits.gates.ranking`'s
    docstring headed "Ranking.", one line (or its first sentence), so what the report and the
    commands say follows the rule wherever it changes."""
    for paragraph in re.split(r"\n\s*\n", ranking.__doc__ or ""):
        if paragraph.strip().startswith("Ranking."):
            text = " ".join(paragraph.split()[1:])
            return text.split(". ")[0] + "." if first_sentence else text
    raise LookupError("circuits.gates.ranking's docstring has no paragraph headed 'Ranking.' for readers")


# ------------------------------------------------------------------ features of inputs


@dataclass
class InputFacts:
    """What the verdicts read about the input and output features of one layer."""

    top_token: dict[int, str]  # input feature -> its top token
    top_tokens: dict[int, set[str]]  # input feature -> the tokens of its best-activating contexts
    label: dict[int, str]  # input feature -> its label class (labelled ones only)
    classes: dict[str, list[int]]  # label class -> the input features mainly in it (`VerdictConfig.label_share`)
    boost: dict[int, tuple[str, float]]  # output feature -> (lexicon class it boosts most, sd)
    descriptions: dict[tuple[str, int], str]  # ("in" | "out", feature) -> description

    @classmethod
    def of(cls, features: pd.DataFrame | None, labels: pd.DataFrame | None, layer: int, input_site: str,
           cfg: VerdictConfig) -> "InputFacts":
        if features is None or features.empty:
            return cls({}, {}, {}, {}, {}, {})
        mine = features[features["layer"] == layer]
        ins, outs = mine[mine["site"] == input_site], mine[mine["site"] == OUTPUT_SITE]
        text = lambda frame, column: {int(f): str(v) for f, v in zip(frame["feature"], frame[column])  # noqa: E731
                                      if v is not None and not (isinstance(v, float) and np.isnan(v))}
        boost = {int(f): (str(c), float(s)) for f, c, s in zip(outs["feature"], outs["boost_label"], outs["boost_sd"])
                 if isinstance(c, str)}
        descriptions = {("in", f): d for f, d in text(ins, "description").items()}
        descriptions.update({("out", f): d for f, d in text(outs, "description").items()})
        tokens = {int(f): set(v) for f, v in zip(ins["feature"], ins["top_tokens"]) if v is not None}
        return cls(text(ins, "top_token"), tokens, text(ins, "label"), _classes(labels, layer, input_site, cfg),
                   boost, descriptions)

    def same_top_token(self, a, b) -> np.ndarray:
        """Whether inputs a[i] and b[i] have the same `top_token` (never for unknown inputs)."""
        return np.array([self.top_token.get(int(x)) is not None and self.top_token.get(int(x)) == self.top_token.get(int(y))
                         for x, y in zip(a, b)], dtype=bool)

    def shared_top_token(self, a, b) -> np.ndarray:
        """Whether inputs a[i] and b[i] have a token among both's `top_tokens`."""
        return np.array([bool(self.top_tokens.get(int(x), set()) & self.top_tokens.get(int(y), set()))
                         for x, y in zip(a, b)], dtype=bool)

    def group_label(self, members: list[int]) -> str | None:
        """The label held by more than half of a group's members, if any."""
        labels = [self.label.get(m) for m in members]
        best = max(set(labels) - {None}, key=labels.count, default=None)
        return best if best is not None and labels.count(best) * 2 > len(members) else None


def _classes(labels: pd.DataFrame | None, layer: int, input_site: str, cfg: VerdictConfig) -> dict[str, list[int]]:
    """Label class -> the input features mainly in it (see the module docstring)."""
    if labels is None or labels.empty:
        return {}
    mine = labels[(labels["layer"] == layer) & (labels["site"] == input_site) & (labels["kind"] == "activation_share")
                  & (labels["value"] >= cfg.label_share) & (labels["lift"] >= cfg.label_lift)]
    found: dict[str, list[int]] = {}
    for channel, cls, feature in sorted(zip(mine["channel"], mine["class"], mine["feature"])):
        found.setdefault(cls if cls == channel else f"{channel}={cls}", []).append(int(feature))
    # classes of the same inputs (a lexicon class and a sentiment class of the same words) are one group
    names: dict[tuple[int, ...], list[str]] = {}
    for name, members in found.items():
        names.setdefault(tuple(members), []).append(name)
    return dict(sorted((LABEL_JOIN.join(sorted(n)), list(m)) for m, n in names.items()))


# ------------------------------------------------------------------ pairs


PAIR_COLUMNS = ["out_feature", "in_a", "in_b", "gate_score", "and_data", "contribution_share", "coactivation",
                "coactivation_lift", "input_cosine", "n_both", "n_a_only", "n_b_only"]


def pair_candidates(gates: pd.DataFrame, interactions: pd.DataFrame | None, cfg: VerdictConfig) -> pd.DataFrame:
    """The pairs to test: every pair of `gates`, and per output the pairs of its
    `n_interactions` strongest cross terms and of the inputs of its `n_self` strongest self
    terms (an OR or an inhibition has a negative cross term, an additive output none: the
    gates' AND-minded candidates miss them). Columns `PAIR_COLUMNS`, null where `gates` has
    no row."""
    found = [gates[PAIR_COLUMNS]]
    if interactions is not None and len(interactions):
        cross = interactions[(interactions["kind"] == "cross") & (interactions["rank"] <= cfg.n_interactions)]
        found.append(pd.DataFrame({"out_feature": cross["out_feature"], "in_a": cross[["in_a", "in_b"]].min(axis=1),
                                   "in_b": cross[["in_a", "in_b"]].max(axis=1)}))
        own = interactions[(interactions["kind"] == "self") & (interactions["rank"] <= cfg.n_self)]
        both = own.merge(own, on="out_feature")
        both = both[both["in_a_x"] < both["in_a_y"]]
        found.append(pd.DataFrame({"out_feature": both["out_feature"], "in_a": both["in_a_x"], "in_b": both["in_a_y"]}))
    pairs = pd.concat(found, ignore_index=True).drop_duplicates(["out_feature", "in_a", "in_b"])
    return pairs.astype({"out_feature": "int64", "in_a": "int64", "in_b": "int64"}).reset_index(drop=True)


def pair_split_evidence(frame: pd.DataFrame, facts: InputFacts, cfg: VerdictConfig) -> tuple[np.ndarray, np.ndarray]:
    """`same_top_token` and the split rule's correlational evidence (`circuits.gates.ranking`)
    of the pairs `in_a, in_b` of `frame`, with their `input_cosine` and `coactivation_lift`."""
    same = facts.same_top_token(frame["in_a"], frame["in_b"])
    evidence = split_evidence(same, facts.shared_top_token(frame["in_a"], frame["in_b"]),
                              frame["input_cosine"].to_numpy(dtype=float),
                              frame["coactivation_lift"].to_numpy(dtype=float), cfg.split_lift, cfg.split_cosine)
    return same, evidence


def rank(frame: pd.DataFrame, evidence: np.ndarray, tiebreak: list[str], cfg: VerdictConfig) -> pd.DataFrame:
    """`split_pair` and `circuit_rank` (null when not ranked) of one layer's candidates of one
    kind, by the gate home's rule (`circuits.gates.ranking`; an and is contradicted by
    `and_data < cfg.and_data`)."""
    gate_type = frame["gate_type"].to_numpy(dtype=object)
    split = is_split(evidence, gate_type)
    order = np.empty(len(frame), dtype=np.int64)  # each row's place in the order of the tiebreak columns
    order[np.lexsort([frame[c].to_numpy() for c in reversed(tiebreak)])] = np.arange(len(frame))
    uncontradicted = ~(frame["and_data"].to_numpy(dtype=float) < cfg.and_data)
    sure = frame["sure_and"].eq(True).to_numpy()  # NaN (a row from elsewhere) is not sure
    ranks = circuit_ranks(frame["out_feature"].to_numpy(), frame["causal_bound"].to_numpy(dtype=float),
                          tiers(gate_type, sure, uncontradicted), split, order)
    return frame.assign(split_pair=split, circuit_rank=pd.array(np.where(ranks > 0, ranks, None), dtype="Int64"))


# ------------------------------------------------------------------ groups


def reading_sets(eigen: pd.DataFrame, eigen_inputs: pd.DataFrame, cfg: VerdictConfig) -> pd.DataFrame:
    """Per output, the inputs each of its `n_eigen` eigenvectors with the largest positive
    activation share reads: columns out_feature, eigen_rank, members (list)."""
    shares = eigen[eigen["activation_share"] > 0].sort_values(["out_feature", "activation_share"],
                                                              ascending=[True, False])
    top = shares.groupby("out_feature").head(cfg.n_eigen)[["out_feature", "rank"]].rename(columns={"rank": "eigen_rank"})
    reads = eigen_inputs[eigen_inputs["cosine"].abs() >= cfg.min_cosine].merge(top, on=["out_feature", "eigen_rank"])
    reads = reads.sort_values(["out_feature", "eigen_rank", "input_rank"])
    sets = reads.groupby(["out_feature", "eigen_rank"])["in_feature"].agg(lambda s: [int(x) for x in s][: cfg.max_members])
    sets = sets.reset_index().rename(columns={"in_feature": "members"})
    return sets[sets["members"].map(len) >= 2].reset_index(drop=True)


def label_candidates(groups: dict[str, list[int]], sets: pd.DataFrame, interactions: pd.DataFrame | None,
                     cfg: VerdictConfig) -> pd.DataFrame:
    """(out_feature, label_a, label_b) for each pair of label groups (`InputFacts.classes`)
    an output's reading sets or strongest cross terms join."""
    group_of: dict[int, list[str]] = {}
    for label, members in groups.items():
        for m in members:
            group_of.setdefault(m, []).append(label)
    found = set()

    def join(out: int, inputs_a, inputs_b) -> None:
        for a, b in zip(inputs_a, inputs_b):
            for la in group_of.get(a, ()):
                for lb in group_of.get(b, ()):
                    if la != lb:
                        found.add((out, *sorted((la, lb))))

    for out, members in zip(sets["out_feature"], sets["members"]):
        pairs = [(a, b) for i, a in enumerate(members) for b in members[i + 1:]]
        join(int(out), [p[0] for p in pairs], [p[1] for p in pairs])
    if interactions is not None and cfg.n_interactions:
        cross = interactions[(interactions["kind"] == "cross") & (interactions["rank"] <= cfg.n_interactions)]
        for out, frame in cross.groupby("out_feature"):
            join(int(out), frame["in_a"].tolist(), frame["in_b"].tolist())
    return pd.DataFrame(sorted(found), columns=["out_feature", "label_a", "label_b"])


# ------------------------------------------------------------------ verdicts


NOT_MEASURED = ("not measured: the circuits stage measures the truth tables of the gates table's pairs, and this "
                "pair was tested for its cross or self terms (interactions)")


def truth_verdict(both: float, apart: float, and_data: float, cfg: VerdictConfig) -> tuple[str, bool | None]:
    """What the truth table says, from the tokens with both sides on, the fewer of those
    with one side on alone, and `and_data`; `NOT_MEASURED` and None for a pair without a
    truth table (its counts null)."""
    if both is None or pd.isna(both):
        return NOT_MEASURED, None
    both, apart = _count(both), _count(apart)
    if both < cfg.min_cell:
        return f"too few tokens with both inputs on ({both})", False
    if apart < cfg.min_cell:
        return (f"the inputs rarely fire apart ({apart} tokens with one but not the other): the truth table cannot "
                "tell an AND"), False
    if not and_data >= cfg.and_data:
        return f"fires without both inputs (and_data {and_data:.2f}): OR-like, not an AND", False
    return f"needs both inputs (and_data {and_data:.2f})", True


def verdict(gate_type: str, drop_a: float, drop_b: float, cfg: VerdictConfig, no_tokens: bool = False,
            mlp_keep_a: float = float("nan"), mlp_keep_b: float = float("nan")) -> tuple[str, bool]:
    """The verdict from the interventions' gate type and the model-run ablation: the drops of
    the SAE's activation, and what the MLP output along f's direction keeps with no TopK
    (`mlp_keep_*`, which confirm an AND); `no_tokens`: the candidate was chosen for the
    ablation but found no confirmation token."""
    if not isinstance(gate_type, str) or gate_type == "untested":
        return "untested: no ranking token with both sides on and the output active", False
    said = f"interventions: {gate_type}"
    if np.isnan(drop_a) or np.isnan(drop_b):
        if no_tokens:
            return (f"{said}; not ablated in the model: no confirmation token (the ranking's held-out share) has "
                    "both sides on and the output active"), False
        return f"{said}; not ablated in the model", False
    kept = (f"removing a keeps {1 - drop_a:.0%} of the activation, {_share(mlp_keep_a)} of the MLP output; "
            f"b {1 - drop_b:.0%}, {_share(mlp_keep_b)}")
    if gate_type != "and":
        return f"{said}; model run: {kept}", False
    if not max(mlp_keep_a, mlp_keep_b) <= cfg.need:  # NaN: not confirmed
        return f"{said}, not confirmed: model run {kept}", False
    return f"behaves as an AND gate (model run: {kept})", True


def _share(value: float) -> str:
    return "-" if np.isnan(value) else f"{value:.0%}"


CONFIRM_COLUMNS = ["sae_confirms", "mlp_confirms", "logprob_confirms", "mlp_disagrees", "logprob_disagrees"]


def confirmations(frame: pd.DataFrame, cfg: VerdictConfig) -> pd.DataFrame:
    """`CONFIRM_COLUMNS` of verdict rows with the model-run columns of `drops` (null where not
    ablated, or where a measure is undefined): whether each measure says both sides are
    necessary, on the confirmation tokens.

    - `sae_confirms`: the SAE's activation, after its TopK: removing either side keeps at most
      `need` of it (`drop_* >= 1 - need`);
    - `mlp_confirms`: the MLP output along the feature's encoder direction, no TopK: removing
      either side keeps at most `need` of it (`mlp_keep_*`), what the layer computes;
    - `logprob_confirms`: the boosted tokens' log-probability downstream: removing both sides
      lowers it, and removing either side alone takes at least `1 - need` of that drop;
    - `mlp_disagrees`, `logprob_disagrees`: that measure says otherwise than `sae_confirms`
      (a side necessary only through the SAE's cut-off shows as an mlp disagreement)."""
    num = lambda c: frame[c].to_numpy(dtype=float) if c in frame else np.full(len(frame), np.nan)  # noqa: E731

    def said(values: list[np.ndarray], holds: np.ndarray) -> pd.array:
        known = np.all([np.isfinite(v) for v in values], axis=0) if values else np.ones(len(frame), dtype=bool)
        return pd.array(np.where(known, holds, None), dtype="boolean")

    with np.errstate(invalid="ignore"):
        drop_a, drop_b = num("drop_a"), num("drop_b")
        sae = said([drop_a, drop_b], np.maximum(1 - drop_a, 1 - drop_b) <= cfg.need)
        keep_a, keep_b = num("mlp_keep_a"), num("mlp_keep_b")
        mlp = said([keep_a, keep_b], np.maximum(keep_a, keep_b) <= cfg.need)
        lp = {k: num(f"logprob_drop_{k}") for k in ("a", "b", "both")}
        logprob = said(list(lp.values()), (lp["both"] > 0) & (np.minimum(lp["a"], lp["b"]) >= (1 - cfg.need) * lp["both"]))
    return pd.DataFrame({"sae_confirms": sae, "mlp_confirms": mlp, "logprob_confirms": logprob,
                         "mlp_disagrees": mlp != sae, "logprob_disagrees": logprob != sae}, index=frame.index)


def _count(value) -> int:
    return 0 if value is None or pd.isna(value) else int(value)


def drops(ablation: pd.DataFrame | None, keys: list[str]) -> pd.DataFrame:
    """Per candidate (`keys`), the share of the output's activation each ablation removed
    (`drop_a`, `drop_b`, `drop_both`), the share of the MLP output along its direction each
    kept with no TopK (`mlp_keep_*`: pre-activations less `pre_constant`, null where the
    clean one is not positive), the drop of the boosted tokens' log-probability
    (`logprob_drop_*`), and where its quadratic form came from (`share_*`)."""
    measures = [f"{m}_{k}" for m in ("drop", "mlp_keep", "logprob_drop") for k in ("a", "b", "both")]
    columns = keys + measures + ["ablation_tokens", "share_a", "share_b", "share_other", "share_bias", "share_error"]
    if ablation is None or ablation.empty:
        return pd.DataFrame(columns=columns)
    clean = ablation["pre_before"] - ablation["pre_constant"]
    frame = ablation.assign(drop=(ablation["activation_before"] - ablation["activation_after"])
                            / ablation["activation_before"].where(ablation["activation_before"] != 0),
                            mlp_keep=(ablation["pre_after"] - ablation["pre_constant"]) / clean.where(clean > 0),
                            logprob_drop=ablation["logprob_before"] - ablation["logprob_after"])
    wide = pd.concat([frame.pivot_table(index=keys, columns="ablated", values=m, aggfunc="first", dropna=False)
                      .reindex(columns=["a", "b", "both"]).add_prefix(f"{m}_")
                      for m in ("drop", "mlp_keep", "logprob_drop")], axis=1).reset_index()
    shares = frame.drop_duplicates(keys)[keys + ["n_tokens", "share_a", "share_b", "share_other", "share_bias",
                                                 "share_error"]].rename(columns={"n_tokens": "ablation_tokens"})
    return wide.merge(shares, on=keys)[columns]


VERDICT_KEYS = ["layer", "outputs", "input_site", "out_feature"]


def verdict_rows(pairs: pd.DataFrame, groups: pd.DataFrame, pair_ablation: pd.DataFrame | None,
                 group_ablation: pd.DataFrame | None, facts: InputFacts, cfg: VerdictConfig,
                 tags: tuple[GateTag, ...] = (), chosen: frozenset = frozenset()) -> pd.DataFrame:
    """The `gate_verdicts` rows: the ranked pairs and group gates (`circuit_rank` not null),
    with a column for each of `tags` (the corpus's gate tags whose channels its labels carry).
    `chosen`: the candidates chosen for the model-run ablation, as `ablation_key`s."""
    frames = []
    pairs = pairs[pairs["circuit_rank"].notna()] if len(pairs) else pairs
    if len(pairs):
        pair_rows = pairs.merge(drops(pair_ablation, VERDICT_KEYS + ["in_a", "in_b"]), how="left",
                                on=VERDICT_KEYS + ["in_a", "in_b"])
        frames.append(pair_rows.assign(
            kind="pair", group_a=pd.NA, group_b=pd.NA, necessary_a=None, necessary_b=None,
            members_a=[[int(a)] for a in pair_rows["in_a"]], members_b=[[int(b)] for b in pair_rows["in_b"]],
            label_a=[facts.label.get(int(a)) for a in pair_rows["in_a"]],
            label_b=[facts.label.get(int(b)) for b in pair_rows["in_b"]]))
    best = groups[groups["circuit_rank"].notna()] if len(groups) else groups
    if len(best):
        group_rows = best.merge(drops(group_ablation, VERDICT_KEYS + ["group_a", "group_b"]), how="left",
                                on=VERDICT_KEYS + ["group_a", "group_b"])
        frames.append(group_rows.assign(kind="group", in_a=pd.NA, in_b=pd.NA, same_top_token=pd.NA,
                                        input_cosine=np.nan, coactivation_lift=np.nan))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    out = []
    for r in rows.to_dict("records"):
        apart = min(_num(r.get("n_a_only")), _num(r.get("n_b_only")))
        truth, truth_and = truth_verdict(r.get("n_both"), apart, _num(r.get("and_data")), cfg)
        text, is_and = verdict(r.get("gate_type"), _num(r.get("drop_a")), _num(r.get("drop_b")), cfg,
                               ablation_key(r) in chosen and np.isnan(_num(r.get("ablation_tokens"))),
                               _num(r.get("mlp_keep_a")), _num(r.get("mlp_keep_b")))
        f = int(r["out_feature"])
        describe = lambda members: "; ".join(f"#{m} {facts.descriptions.get(('in', m), '')}".strip()  # noqa: E731
                                             for m in members)
        labels = {k: (r.get(k) if isinstance(r.get(k), str) else None) for k in ("label_a", "label_b")}
        members = {k: [int(m) for m in r[k]] for k in ("members_a", "members_b")}
        measured = truth_and is not None  # else the counts are unknown, not 0
        out.append({**r, **labels, **members, "both_tokens": _count(r.get("n_both")) if measured else None,
                    "apart_tokens": _count(apart) if measured else None,
                    "truth": truth,
                    "truth_and": truth_and, "verdict": text, "is_and": is_and,
                    "out_description": facts.descriptions.get(("out", f), ""),
                    "a_description": describe(r["members_a"]), "b_description": describe(r["members_b"])})
    frame = pd.DataFrame(out)
    if len(frame):
        frame = frame.assign(**confirmations(frame, cfg))
    for tag in tags if len(frame) else ():
        frame[tag.column] = tag.rule(frame, TagFacts(facts.boost, cfg.boost_sd))
    for column in ("circuit_rank", "in_a", "in_b", "group_a", "group_b", "both_tokens", "apart_tokens"):
        if column in frame:
            frame[column] = frame[column].astype("Int64")
    if "truth_and" in frame:  # null where not measured: one dtype whether or not a row is
        frame["truth_and"] = frame["truth_and"].astype("boolean")
    return frame


def ablation_key(row: dict) -> tuple:
    """A candidate's kind, output and sides' names (a pair's inputs, a group gate's groups)."""
    a, b = ("in_a", "in_b") if row["kind"] == "pair" else ("group_a", "group_b")
    return row["kind"], int(row["out_feature"]), int(row[a]), int(row[b])


def _num(value) -> float:
    return float("nan") if value is None or pd.isna(value) else float(value)


def to_ablate(verdicts: pd.DataFrame, kind: str, n: int, tags: tuple[GateTag, ...]) -> pd.DataFrame:
    """The candidates of one kind worth ablating: the `n` best by circuit_rank, and the best
    that each of `tags` marks."""
    mine = verdicts[verdicts["kind"] == kind].sort_values("circuit_rank")
    chosen = [mine.head(n)] + [mine[mine[tag.column]].head(1) for tag in tags]
    return pd.concat(chosen).drop_duplicates(["out_feature", "in_a", "in_b", "group_a", "group_b"])
