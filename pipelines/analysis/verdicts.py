"""Find negation AND-gates among the top gate candidates, judged by the corpus's ground truth.

A candidate is a negation gate when, for its output feature's best gate pair, one
input feature fires mostly within negations (cue up to the flipped word), the other mostly in contexts of one valence,
and the output feature pushes the logits towards sentiment words of the other valence.
Nothing is hand-picked: the candidates are the gates table's best `and_score`s.
"""

from __future__ import annotations

import pandas as pd

NEGATION_SHARE = 0.5  # least share of activation on negation cues for a "negation" feature
CONTEXT_SHARE = 0.7  # least share of activation in one valence for a "context" feature
BOOST_SD = 1.0  # least |valence_boost| (sd) for an output feature that predicts a valence


def top_gates(gates: pd.DataFrame, n: int) -> pd.DataFrame:
    """The `n` best gate candidates of each layer: each output feature's best pair.

    Per layer, because coefficient scales differ between layers: a global ranking would
    show only the layer with the largest weights.
    """
    best = gates.sort_values("and_score", ascending=False).drop_duplicates(["layer", "out_feature"])
    return best.groupby("layer", sort=True).head(n).sort_values(
        ["layer", "and_score"], ascending=[True, False]).reset_index(drop=True)


def _valence(row: pd.Series) -> int:
    """+1 / -1 when the input feature is mainly a context feature of one valence, else 0.

    Mainly: its share in that valence's contexts passes `CONTEXT_SHARE` and exceeds its
    share inside negations, so a feature that is above all a negation feature is not taken
    for the context side of a pair.
    """
    negation = row.get("share_negation", 0)
    for valence, column in ((1, "share_positive_context"), (-1, "share_negative_context")):
        share = row.get(column, 0)
        if share >= CONTEXT_SHARE and share > negation:
            return valence
    return 0


def label_gates(candidates: pd.DataFrame, features: pd.DataFrame) -> pd.DataFrame:
    """Candidates with their features' descriptions and an `is_negation_gate` verdict."""
    inputs = features[features["site"] == "resid_mid"].set_index(["layer", "feature"])
    outputs = features[features["site"] == "mlp_out"].set_index(["layer", "feature"])
    rows = []
    for g in candidates.itertuples(index=False):
        a, b = inputs.loc[(g.layer, g.in_a)], inputs.loc[(g.layer, g.in_b)]
        out = outputs.loc[(g.layer, g.out_feature)]
        verdict, context = False, 0
        for neg, ctx in ((a, b), (b, a)):
            if neg.get("share_negation", 0) >= NEGATION_SHARE and _valence(ctx) != 0:
                context = _valence(ctx)
                boost = out.get("valence_boost", float("nan"))
                verdict = boost * context <= -BOOST_SD  # predicts the other valence
                break
        rows.append({
            **g._asdict(),
            "in_a_description": a["description"], "in_b_description": b["description"],
            "out_description": out["description"],
            "out_boosted": list(out["boosted_tokens"]),
            "context_valence": context,
            "is_negation_gate": bool(verdict),
        })
    return pd.DataFrame(rows)


def with_rank2_correlation(gates: pd.DataFrame, lowrank: pd.DataFrame) -> pd.DataFrame:
    """Adds each output feature's rank-2 active-only correlation and active-token count."""
    r2 = lowrank[lowrank["n_eigs"] == 2][["layer", "out_feature", "corr_active", "n_active"]]
    return gates.merge(r2.rename(columns={"corr_active": "corr_rank2"}), on=["layer", "out_feature"], how="left")
