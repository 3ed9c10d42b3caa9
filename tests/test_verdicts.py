"""Gate verdicts on planted tables: the general AND verdict and the negation label."""

from __future__ import annotations

import pandas as pd
import pytest

from pipelines.analysis.verdicts import MIN_CELL, best_candidates, gate_verdicts, negation_candidates


def gates(**change) -> pd.DataFrame:
    row = {"layer": 0, "out_feature": 7, "in_a": 1, "in_b": 2, "layer_rank": 1, "gate_score": 0.28,
           "contribution_share": 0.3, "coactivation": 0.8, "and_score": 0.1, "and_data": 0.95, "n_both": 100,
           "n_a_only": 60, "n_b_only": 80, **change}
    other = {**row, "out_feature": 8, "in_b": 3, "layer_rank": 2, "and_data": 0.2}
    unranked = {**row, "out_feature": 9, "layer_rank": pd.NA}
    return pd.DataFrame([row, other, unranked])


def ablation(drop_a=0.9, drop_b=0.8) -> pd.DataFrame:
    rows = []
    for ablated, drop in (("a", drop_a), ("b", drop_b), ("both", 1.0)):
        rows.append({"layer": 0, "out_feature": 7, "in_a": 1, "in_b": 2, "ablated": ablated,
                     "activation_before": 2.0, "activation_after": 2.0 * (1 - drop), "pre_before": 2.0,
                     "pre_after": 2.0 * (1 - drop), "pre_change_predicted": -2.0 * drop, "logprob_before": -1.0,
                     "logprob_after": -2.0})
    return pd.DataFrame(rows)


def verdict_of(frame: pd.DataFrame, feature: int = 7) -> pd.Series:
    return frame.set_index("out_feature").loc[feature]


def test_best_candidates_are_the_ranked_ones_in_order():
    picked = best_candidates(gates(), 5)
    assert picked["out_feature"].tolist() == [7, 8]
    assert best_candidates(gates(), 1)["out_feature"].tolist() == [7]


def verdicts(frame, ablations, labels=None):
    return gate_verdicts(best_candidates(frame, 5), ablations, None, labels)


def test_a_clean_and_is_called_an_and():
    v = verdict_of(verdicts(gates(), ablation()))
    assert v["is_and"] and v["verdict"] == "behaves as an AND gate"
    assert v["drop_a"] == pytest.approx(0.9) and v["drop_both"] == pytest.approx(1.0)
    assert v["negation_gate"] is None  # no labels: no negation label either way


@pytest.mark.parametrize("change, reason", [
    ({"gates": gates(n_both=MIN_CELL - 1)}, "too few tokens"),
    ({"gates": gates(n_a_only=3)}, "rarely fire apart"),
    ({"ablation": ablation(drop_a=0.2)}, "removing one input keeps 80%"),
    ({"ablation": ablation().iloc[:0]}, "no ablation measured"),
])
def test_what_fails_is_named(change, reason):
    v = verdict_of(verdicts(change.get("gates", gates()), change.get("ablation", ablation())))
    assert not v["is_and"] and reason in v["verdict"]


def test_an_or_like_truth_table_is_not_an_and():
    v = verdict_of(verdicts(gates(), ablation()), 8)
    assert not v["is_and"] and not v["truth_and"] and "OR-like" in v["verdict"]


def labels(neg_a=0.9, ctx_b=0.85, neg_b=0.1, boost_other=2.0, boost_same=-2.0) -> pd.DataFrame:
    rows = []

    def share(feature, channel, cls, value, site="resid_mid"):
        rows.append({"layer": 0, "site": site, "feature": feature, "channel": channel, "class": cls,
                     "kind": "activation_share", "value": value, "n_tokens": None})

    share(1, "negation", "negation", neg_a)
    share(1, "context", "positive", 0.5)
    share(2, "negation", "negation", neg_b)
    share(2, "context", "positive", ctx_b)
    share(2, "context", "negative", 1 - ctx_b)
    for cls, value in (("negative", boost_other), ("positive", boost_same)):
        rows.append({"layer": 0, "site": "mlp_out", "feature": 7, "channel": "lexicon", "class": cls,
                     "kind": "logit_boost", "value": value, "n_tokens": 10})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("kwargs, expected", [
    ({}, True),  # negation x positive context -> boosts negative words
    ({"boost_other": 0.5}, False),  # the output barely boosts the other class
    ({"boost_other": -2.0, "boost_same": 2.0}, False),  # it boosts the context's own class
    ({"neg_a": 0.3}, False),  # no input is a negation feature
    ({"ctx_b": 0.6}, False),  # the other input is not mainly one context
    ({"neg_b": 0.9}, False),  # the "context" input is above all a negation feature
])
def test_negation_label(kwargs, expected):
    v = verdict_of(verdicts(gates(), ablation(), labels(**kwargs)))
    assert v["negation_gate"] == expected
    found = negation_candidates(gates(), labels(**kwargs))
    assert found["out_feature"].tolist() == ([7] if expected else [])
