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

AND_DATA = 0.5
MIN_CELL = 20
DROP_ONE = 0.5
NEGATION_SHARE = 0.5  # least share of an input's activation within negations
CONTEXT_SHARE = 0.7  # least share of the other input's activation in one context class
BOOST_SD = 1.0  # least boost (sd) of the output towards the other class's words


def best_candidates(gates: pd.DataFrame, n: int) -> pd.DataFrame:
    """Each layer's `n` best data-ranked candidates (one per output feature), best first."""
    ranked = gates[gates["layer_rank"].notna() & (gates["layer_rank"] <= n)]
    return ranked.sort_values(["layer", "layer_rank"]).reset_index(drop=True)


def gate_verdicts(gates: pd.DataFrame, truth: pd.DataFrame | None, ablation: pd.DataFrame | None,
                  features: pd.DataFrame | None, labels: pd.DataFrame | None, n: int) -> pd.DataFrame:
    """One row per checked candidate: its figures, the descriptions and the verdicts."""
    rows = []
    described = _index(features, ["layer", "site", "feature"])
    for g in best_candidates(gates, n).itertuples(index=False):
        key = (int(g.layer), int(g.out_feature), int(g.in_a), int(g.in_b))
        cells = _cells(truth, key)
        drops = _drops(ablation, key)
        row = {
            "layer": key[0], "out_feature": key[1], "in_a": key[2], "in_b": key[3], "layer_rank": int(g.layer_rank),
            "contribution_share": g.contribution_share, "coactivation": g.coactivation, "and_score": g.and_score,
            "and_data": g.and_data, "both_tokens": cells.get("on_on", 0),
            "apart_tokens": min(cells.get("on_off", 0), cells.get("off_on", 0)), **drops,
        }
        row["verdict"], row["is_and"] = _verdict(row)
        row["negation_gate"] = _negation_gate(labels, features, key)
        for side, site, feature in (("out", "mlp_out", key[1]), ("a", None, key[2]), ("b", None, key[3])):
            row[f"{side}_description"] = _description(described, key[0], site, feature)
        rows.append(row)
    return pd.DataFrame(rows)


def _verdict(row: dict) -> tuple[str, bool]:
    if row["both_tokens"] < MIN_CELL:
        return f"too few tokens with both inputs active ({row['both_tokens']})", False
    if row["apart_tokens"] < MIN_CELL:
        return (f"the inputs rarely fire apart ({row['apart_tokens']} tokens with one but not the other): "
                "the truth table cannot tell an AND"), False
    if not row["and_data"] >= AND_DATA:
        return f"fires without both inputs (and_data {row['and_data']:.2f}): OR-like, not an AND", False
    weaker = min(row.get("drop_a", float("nan")), row.get("drop_b", float("nan")))
    if weaker != weaker:
        return "truth table says AND; no ablation measured", False
    if weaker < DROP_ONE:
        return f"truth table says AND, but removing one input keeps {1 - weaker:.0%} of the output", False
    return "behaves as an AND gate", True


def _cells(truth: pd.DataFrame | None, key: tuple) -> dict:
    if truth is None or truth.empty:
        return {}
    sel = truth[(truth["layer"] == key[0]) & (truth["out_feature"] == key[1]) & (truth["in_a"] == key[2])
                & (truth["in_b"] == key[3])]
    return dict(zip(sel["cell"], sel["n_tokens"].astype(int)))


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


def _share(labels: pd.DataFrame, layer: int, sites: list[str], feature: int, channel: str, cls: str) -> float:
    sel = labels[(labels["layer"] == layer) & labels["site"].isin(sites) & (labels["feature"] == feature)
                 & (labels["channel"] == channel) & (labels["class"] == cls) & (labels["kind"] == "activation_share")]
    return float(sel["value"].iloc[0]) if len(sel) else 0.0


def _negation_gate(labels: pd.DataFrame | None, features: pd.DataFrame | None, key: tuple) -> bool | None:
    """The negation-gate label, or None when the corpus has no negation and context labels."""
    if labels is None or labels.empty or not {"negation", "context"} <= set(labels["channel"]):
        return None
    layer, f, a, b = key
    contexts = sorted(labels.loc[labels["channel"] == "context", "class"].unique())
    inputs = ["resid_mid", "mlp_in"]
    boosts = labels[(labels["layer"] == layer) & (labels["site"] == "mlp_out") & (labels["feature"] == f)
                    & (labels["kind"] == "logit_boost")].set_index("class")["value"]
    for neg, ctx in ((a, b), (b, a)):
        if _share(labels, layer, inputs, neg, "negation", "negation") < NEGATION_SHARE:
            continue
        negation_share = _share(labels, layer, inputs, ctx, "negation", "negation")
        for context in contexts:
            share = _share(labels, layer, inputs, ctx, "context", context)
            if share >= CONTEXT_SHARE and share > negation_share:
                others = [c for c in contexts if c != context and c in boosts.index]
                if any(boosts[c] >= BOOST_SD for c in others):
                    return True
    return False
