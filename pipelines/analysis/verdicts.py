"""Verdicts on each layer's best gate candidates, from data that any corpus provides.

A candidate (output f, inputs a and b) *behaves as an AND gate* when
- its truth table says f needs both inputs: `and_data >= AND_DATA` (f's mean activation
  where both are active exceeds its mean in every other cell by that share of itself),
  with at least `MIN_CELL` tokens where both are active and as many where each is active
  without the other (inputs that always fire together cannot show an AND); and
- ablating either input alone removes at least `DROP_ONE` of f's activation on the tokens
  where both are active (taking out one input of an AND silences it; of an OR, it does not).

Other outcomes are named for what failed: too few tokens, f fires without both inputs
("OR-like"), or f survives removing an input. With the built-in corpus's labels (a
`negation` channel, `context` classes and a lexicon of the same classes) a candidate is
also labelled a *negation gate* when one input fires mainly within negations, the other
mainly in contexts of one class, and f boosts lexicon words of the other class.
"""

from __future__ import annotations

import pandas as pd

AND_DATA = 0.6  # an equal-weight sum z_a + z_b scores exactly 0.5: an AND must clear it
MIN_CELL = 20
DROP_ONE = 0.5
NEGATION_SHARE = 0.5  # least share of an input's activation within negations
CONTEXT_SHARE = 0.7  # least share of the other input's activation in one context class
BOOST_SD = 1.0  # least boost (sd) of the output towards the other class's words


def circuit_part(frame: pd.DataFrame | None, input_site: str = "resid_mid", outputs: str = "sae") -> pd.DataFrame | None:
    """The rows of a circuit table for one output set and input site (a run may hold several)."""
    if frame is None or "outputs" not in frame.columns:
        return frame
    return frame[(frame["outputs"] == outputs) & (frame["input_site"] == input_site)].reset_index(drop=True)


def best_candidates(gates: pd.DataFrame, n: int, distinct_pairs: bool = True) -> pd.DataFrame:
    """Each layer's `n` best data-ranked candidates, best first: one per output feature and,
    with `distinct_pairs`, one per input pair (a pair that builds several outputs is shown
    with its best one)."""
    ranked = gates[gates["layer_rank"].notna()].sort_values(["layer", "layer_rank"])
    if distinct_pairs:
        ranked = ranked.drop_duplicates(["layer", "in_a", "in_b"])
    return ranked.groupby("layer").head(n).reset_index(drop=True)


def negation_candidates(gates: pd.DataFrame, labels: pd.DataFrame | None, n: int = 1) -> pd.DataFrame:
    """Each layer's `n` best data-ranked candidates that the corpus's labels call negation
    gates (see `_negation_gate`); empty without negation and context labels."""
    ranked = gates[gates["layer_rank"].notna()].sort_values(["layer", "layer_rank"])
    keep = [bool(_negation_gate(labels, (int(g.layer), int(g.out_feature), int(g.in_a), int(g.in_b))))
            for g in ranked.itertuples(index=False)] if len(ranked) else []
    found = ranked[keep] if keep else ranked.iloc[:0]
    return found.groupby("layer").head(n).reset_index(drop=True)


def gate_verdicts(candidates: pd.DataFrame, ablation: pd.DataFrame | None, features: pd.DataFrame | None,
                  labels: pd.DataFrame | None) -> pd.DataFrame:
    """One row per candidate (rows of the gates table): its figures, descriptions, verdicts."""
    rows = []
    described = _index(features, ["layer", "site", "feature"])
    for g in candidates.itertuples(index=False):
        key = (int(g.layer), int(g.out_feature), int(g.in_a), int(g.in_b))
        row = {
            "layer": key[0], "out_feature": key[1], "in_a": key[2], "in_b": key[3], "layer_rank": int(g.layer_rank),
            "gate_score": g.gate_score, "contribution_share": g.contribution_share, "coactivation": g.coactivation,
            "and_score": g.and_score, "and_data": g.and_data, "both_tokens": _count(getattr(g, "n_both", 0)),
            "apart_tokens": min(_count(getattr(g, "n_a_only", 0)), _count(getattr(g, "n_b_only", 0))),
            **_drops(ablation, key),
        }
        row["truth"], row["truth_and"] = _truth_verdict(row)
        row["verdict"], row["is_and"] = _verdict(row)
        row["negation_gate"] = _negation_gate(labels, key)
        for side, site, feature in (("out", "mlp_out", key[1]), ("a", None, key[2]), ("b", None, key[3])):
            row[f"{side}_description"] = _description(described, key[0], site, feature)
        rows.append(row)
    return pd.DataFrame(rows)


def _count(value) -> int:
    """A token count from the gates table; missing (a table without data statistics) is 0."""
    return 0 if value is None or pd.isna(value) else int(value)


def _truth_verdict(row: dict) -> tuple[str, bool]:
    """What the truth table says, from the counts and `and_data` of the gates table."""
    if row["both_tokens"] < MIN_CELL:
        return f"too few tokens with both inputs active ({row['both_tokens']})", False
    if row["apart_tokens"] < MIN_CELL:
        return (f"the inputs rarely fire apart ({row['apart_tokens']} tokens with one but not the other): "
                "the truth table cannot tell an AND"), False
    if not row["and_data"] >= AND_DATA:
        return f"fires without both inputs (and_data {row['and_data']:.2f}): OR-like, not an AND", False
    return f"needs both inputs (and_data {row['and_data']:.2f})", True


def _verdict(row: dict) -> tuple[str, bool]:
    if not row["truth_and"]:
        return row["truth"], False
    weaker = min(row.get("drop_a", float("nan")), row.get("drop_b", float("nan")))
    if weaker != weaker:
        return "truth table says AND; no ablation measured", False
    if weaker < DROP_ONE:
        return f"truth table says AND, but removing one input keeps {1 - weaker:.0%} of the output", False
    return "behaves as an AND gate", True


def _drops(ablation: pd.DataFrame | None, key: tuple) -> dict:
    """Share of f's activation removed by each ablation, and how far the weights predicted it."""
    out = {}
    if ablation is None or ablation.empty:
        return out
    sel = ablation[(ablation["layer"] == key[0]) & (ablation["out_feature"] == key[1]) & (ablation["in_a"] == key[2])
                   & (ablation["in_b"] == key[3])]
    for r in sel.itertuples(index=False):
        if r.activation_before:
            out[f"drop_{r.ablated}"] = (r.activation_before - r.activation_after) / r.activation_before
        out[f"pre_change_{r.ablated}"] = r.pre_after - r.pre_before
        out[f"pre_change_predicted_{r.ablated}"] = r.pre_change_predicted
        out[f"logprob_change_{r.ablated}"] = r.logprob_after - r.logprob_before
    return out


def _index(frame: pd.DataFrame | None, keys: list[str]):
    return None if frame is None or frame.empty else frame.set_index(keys).sort_index()


def _description(features, layer: int, site: str | None, feature: int) -> str:
    if features is None:
        return ""
    sites = [site] if site else ["resid_mid", "mlp_in"]
    for s in sites:
        if (layer, s, feature) in features.index:
            return str(features.loc[(layer, s, feature), "description"])
    return ""


class _Labels:
    """The feature_labels table as lookups: activation shares of input features by class and
    logit boosts of output features by lexicon class."""

    def __init__(self, labels: pd.DataFrame):
        shares = labels[labels["kind"] == "activation_share"]
        self.share = {(r.layer, r.feature, r.channel, r["class"]): r.value
                      for _, r in shares[shares["site"] != "mlp_out"].iterrows()}
        boosts = labels[(labels["kind"] == "logit_boost") & (labels["site"] == "mlp_out")]
        self.boost = {(r.layer, r.feature, r["class"]): r.value for _, r in boosts.iterrows()}
        self.contexts = sorted(labels.loc[labels["channel"] == "context", "class"].unique())


_LABELS: dict[int, _Labels] = {}


def _lookups(labels: pd.DataFrame) -> _Labels:
    if id(labels) not in _LABELS:
        _LABELS.clear()
        _LABELS[id(labels)] = _Labels(labels)
    return _LABELS[id(labels)]


def _negation_gate(labels: pd.DataFrame | None, key: tuple) -> bool | None:
    """The negation-gate label, or None when the corpus has no negation and context labels."""
    if labels is None or labels.empty or not {"negation", "context"} <= set(labels["channel"].unique()):
        return None
    table = _lookups(labels)
    layer, f, a, b = key
    for neg, ctx in ((a, b), (b, a)):
        if table.share.get((layer, neg, "negation", "negation"), 0.0) < NEGATION_SHARE:
            continue
        negation_share = table.share.get((layer, ctx, "negation", "negation"), 0.0)
        for context in table.contexts:
            share = table.share.get((layer, ctx, "context", context), 0.0)
            if share >= CONTEXT_SHARE and share > negation_share:
                others = [c for c in table.contexts if c != context]
                if any(table.boost.get((layer, f, c), float("-inf")) >= BOOST_SD for c in others):
                    return True
    return False
