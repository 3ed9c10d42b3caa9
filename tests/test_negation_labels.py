"""Feature statistics and the negation-gate verdict, on planted activations and tables."""

import pandas as pd
import pytest
import torch

from pipelines.features import _Tracker, describe
from pipelines.negation import label_gates, top_gates


def test_tracker_statistics_and_ground_truth_shares():
    # 6 tokens, 2 features; feature 0 fires only on the negation tokens, feature 1 everywhere
    acts = torch.tensor([[0, 1], [2, 1], [0, 1], [3, 1], [0, 1], [0, 1]], dtype=torch.float32)
    labels = {"negation": torch.tensor([0, 1, 0, 1, 0, 0]),
              "context": torch.tensor([1, 1, -1, -1, 0, 0])}
    tr = _Tracker(n_features=2, n_top=2, labelled=True)
    tr.update(acts[:3], torch.arange(3) + 100, {k: v[:3] for k, v in labels.items()})
    tr.update(acts[3:], torch.arange(3, 6) + 100, {k: v[3:] for k, v in labels.items()})
    assert tr.n_tokens == 6
    assert tr.count.tolist() == [2, 6]
    assert tr.max.tolist() == [3, 1]
    assert tr.top_val[:, 0].tolist() == [3, 2] and tr.top_idx[:, 0].tolist() == [103, 101]
    shares = {k: (v / tr.total).tolist() for k, v in tr.mass.items()}
    assert shares["negation"] == pytest.approx([1.0, 2 / 6])
    assert shares["positive_context"] == pytest.approx([2 / 5, 2 / 6])
    assert shares["negative_context"] == pytest.approx([3 / 5, 2 / 6])


def test_describe_names_roles():
    text = describe({"share_negation": 0.9, "share_positive_context": 0.1, "share_negative_context": 0.8,
                     "top_tokens": ["not"], "valence_boost": -2.0, "boosted_tokens": ["sad"]})
    assert "negation 90%" in text and "negative context 80%" in text
    assert "predicts negative words" in text and "boosts sad" in text


def features_frame(out_boost: float, ctx_negation: float) -> pd.DataFrame:
    def row(site, feature, neg, pos, negc, boost=float("nan")):
        return {"layer": 0, "site": site, "feature": feature, "share_negation": neg,
                "share_positive_context": pos, "share_negative_context": negc,
                "valence_boost": boost, "description": f"{site} {feature}", "boosted_tokens": ["x"]}
    return pd.DataFrame([
        row("resid_mid", 1, 0.9, 0.5, 0.4),  # a negation feature
        row("resid_mid", 2, ctx_negation, 0.85, 0.05),  # a positive-context feature
        row("resid_mid", 3, 0.0, 0.5, 0.5),  # neither
        row("mlp_out", 7, 0.6, 0.8, 0.1, out_boost),
        row("mlp_out", 8, 0.0, 0.5, 0.5, out_boost),
    ])


GATES = pd.DataFrame({"layer": [0, 0, 0], "out_feature": [7, 7, 8], "in_a": [1, 1, 1], "in_b": [2, 3, 3],
                      "and_score": [0.5, 0.1, 0.3], "self_a": [0.0] * 3, "self_b": [0.0] * 3,
                      "cross": [0.5, 0.1, 0.3]})


def test_top_gates_keeps_each_outputs_best_pair_per_layer():
    best = top_gates(GATES, 5)
    assert best[["out_feature", "in_b"]].values.tolist() == [[7, 2], [8, 3]]
    assert len(top_gates(GATES, 1)) == 1


@pytest.mark.parametrize("boost, ctx_negation, expected", [
    (-2.0, 0.1, True),   # negation x positive context -> negative words
    (+2.0, 0.1, False),  # output predicts the same valence as the context
    (-0.5, 0.1, False),  # output barely predicts a valence
    (-2.0, 0.9, False),  # the "context" input is above all a negation feature
])
def test_negation_verdict(boost, ctx_negation, expected):
    labelled = label_gates(top_gates(GATES, 5), features_frame(boost, ctx_negation))
    verdicts = dict(zip(labelled["out_feature"], labelled["is_negation_gate"]))
    assert verdicts[7] is expected
    assert verdicts[8] is False  # its pair has no context feature
    if expected:
        assert labelled.set_index("out_feature").loc[7, "context_valence"] == 1
