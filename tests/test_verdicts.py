"""The rules of the verdicts stage on planted tables: split pairs and the circuit ranking,
reading sets and label groups, verdicts and the gate tags (the stories' negation gate)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from circuits.gates.ranking import split_evidence
from pipelines.data.story_corpus import NEGATION_GATE
from pipelines.data.tags import tags_of
from pipelines.analysis.verdicts import (InputFacts, VerdictConfig, label_candidates, pair_split_evidence, rank,
                                         reading_sets, to_ablate, verdict_rows)

CFG = VerdictConfig()
KEYS = {"layer": 0, "outputs": "sae", "input_site": "resid_mid"}


def facts(top=None, labels=None, boost=None) -> InputFacts:
    top = top or {1: "not", 2: "happy", 3: "happy", 4: ",", 5: ",", 6: "dog", 7: "cat", 8: "dad", 9: "the"}
    contexts = {8: {"dad", "aunt"}, 9: {"mom", "dad"}}  # 8 and 9 peak on one token: a split too
    return InputFacts(top, contexts, labels or {}, {}, boost or {}, {("in", 1): "a negation cue"})


def feature_labels(shares: dict[tuple[int, str, str], tuple[float, float]]) -> pd.DataFrame:
    """feature_labels rows: (feature, channel, class) -> (share, lift)."""
    return pd.DataFrame([{"layer": 0, "site": "resid_mid", "feature": f, "channel": ch, "class": cl,
                          "kind": "activation_share", "value": v, "lift": lift}
                         for (f, ch, cl), (v, lift) in shares.items()])


def gate(out, a, b, score, cosine=0.1, lift=1.5, gate_type="additive", **extra) -> dict:
    """A pair_gates row whose causal score is `score`."""
    row = {**KEYS, "out_feature": out, "in_a": a, "in_b": b, "gate_score": 0.1, "input_cosine": cosine,
           "coactivation_lift": lift, "contribution_share": 0.2, "coactivation": 0.5, "and_data": 0.9,
           "n_active": 200.0, "n_both": 100.0, "n_a_only": 60.0, "n_b_only": 80.0, "causal_score": score, "causal_bound": score,
           "gate_type": gate_type if np.isfinite(score) else "untested", "keep_a": 0.1, "keep_b": 0.1, "keep_ab": 0.0,
           "synergy": 0.9, "sure_and": gate_type == "and" and np.isfinite(score)}
    return {**row, **extra}


def rank_pairs(pairs: pd.DataFrame, facts: InputFacts, cfg: VerdictConfig) -> pd.DataFrame:
    """The verdicts stage's pair ranking (judge_layer), ranked rows only, best first."""
    same, evidence = pair_split_evidence(pairs, facts, cfg)
    ranked = rank(pairs.assign(same_top_token=same), evidence, ["in_a", "in_b"], cfg)
    return ranked[ranked["circuit_rank"].notna()].sort_values("circuit_rank").reset_index(drop=True)


def test_the_split_pair_rule():
    same = np.array([True, False, False, False, False, False])
    shared = np.array([False, False, False, False, True, True])
    cosine = np.array([0.0, 0.5, 0.5, 0.1, 0.1, 0.1])
    lift = np.array([0.5, 3.0, 1.0, 9.0, 3.0, 1.0])
    # one top token; near-parallel and firing together; near-parallel only; firing together only;
    # a shared top-activating token and firing together; a shared top-activating token only
    assert split_evidence(same, shared, cosine, lift, CFG.split_lift, CFG.split_cosine).tolist() == [
        True, True, False, False, True, False]


def test_circuit_rank_puts_split_pairs_after_every_other_candidate():
    gates = pd.DataFrame([
        gate(10, 4, 5, 0.40),  # ',' x ',': a split pair, the best score of the layer
        gate(10, 1, 6, 0.05),  # the same output's best pair that is not split: its candidate
        gate(11, 2, 3, 0.30),  # 'happy' x 'happy': split, and the output has nothing else
        gate(12, 1, 2, 0.20),
        gate(13, 6, 7, 0.10, cosine=0.6, lift=4.0),  # near-parallel and co-firing: split
        gate(14, 1, 7, np.nan),  # untested: not ranked at all
        gate(15, 8, 9, 0.15, lift=3.0),  # different top tokens, but both peak on "dad" and fire together: split
        gate(16, 2, 3, 0.12, gate_type="and"),  # 'happy' x 'happy', but each is necessary: not split, and first
    ])
    ranked = rank_pairs(gates, facts(), CFG)
    # output 10's split pair outscores its candidate: named and ranked after every other candidate, not dropped
    assert ranked[["out_feature", "in_a", "in_b", "circuit_rank", "split_pair"]].values.tolist() == [
        [16, 2, 3, 1, False], [12, 1, 2, 2, False], [10, 1, 6, 3, False],
        [10, 4, 5, 4, True], [11, 2, 3, 5, True], [15, 8, 9, 6, True], [13, 6, 7, 7, True]]
    assert ranked["same_top_token"].tolist() == [True, False, False, True, True, False, False]


def ablation_rows(keys: dict, drop_a: float, drop_b: float, mlp_keep: tuple[float, float, float] | None = None,
                  logprob_drop: tuple[float, float, float] = (0.5, 0.4, 0.6)) -> list[dict]:
    """gate_ablation rows: the activation's drops, and what the MLP output along the feature
    keeps (`mlp_keep`, a, b, both; by default what the activation keeps), over a constant of -1."""
    mlp_keep = mlp_keep or (1 - drop_a, 1 - drop_b, 0.0)
    return [{**KEYS, **keys, "ablated": ablated, "n_tokens": 50, "activation_before": 2.0,
             "activation_after": 2.0 * (1 - drop), "pre_before": 3.0, "pre_after": -1.0 + 4.0 * keep,
             "pre_constant": -1.0, "logprob_before": -2.0, "logprob_after": -2.0 - lp,
             "share_a": 0.4, "share_b": 0.3, "share_other": 0.2, "share_bias": 0.05, "share_error": 0.05}
            for ablated, drop, keep, lp in zip(("a", "b", "both"), (drop_a, drop_b, 1.0), mlp_keep, logprob_drop)]


def verdict_of(pairs, ablation, labels=None, boost=None, cfg=CFG, tags=(NEGATION_GATE,), chosen=frozenset()
               ) -> pd.Series:
    frame = verdict_rows(rank_pairs(pd.DataFrame(pairs), facts(labels=labels, boost=boost), cfg),
                         pd.DataFrame(columns=["out_feature", "circuit_rank"]), pd.DataFrame(ablation), None,
                         facts(labels=labels, boost=boost), cfg, tags, chosen)
    return frame.set_index("out_feature").iloc[0]


def test_a_clean_and_is_called_an_and():
    v = verdict_of([gate(7, 1, 6, 0.3, gate_type="and")], ablation_rows({"out_feature": 7, "in_a": 1, "in_b": 6},
                                                                         0.9, 0.8))
    assert v["is_and"] and v["verdict"].startswith("behaves as an AND gate") and v["kind"] == "pair"
    assert v["drop_a"] == pytest.approx(0.9) and v["drop_both"] == pytest.approx(1.0)
    assert v["share_a"] == pytest.approx(0.4) and v["ablation_tokens"] == 50
    assert v["members_a"] == [1] and v["members_b"] == [6] and "negation cue" in v["a_description"]


def test_the_model_run_confirms_an_and_by_the_mlp_output_not_the_sae_activation():
    keys = {"out_feature": 7, "in_a": 1, "in_b": 6}
    # the activation drops 90% and 80% (the SAE's cut-off), but the MLP output along the feature keeps 70% and 60%
    v = verdict_of([gate(7, 1, 6, 0.3, gate_type="and")], ablation_rows(keys, 0.9, 0.8, (0.7, 0.6, 0.2)))
    assert not v["is_and"] and "not confirmed" in v["verdict"] and "70% of the MLP output" in v["verdict"]
    assert v["mlp_keep_a"] == pytest.approx(0.7) and v["mlp_keep_both"] == pytest.approx(0.2)
    assert v["sae_confirms"] and not v["mlp_confirms"] and v["mlp_disagrees"]
    # the boosted tokens' log-probability: removing both lowers it by 0.6, a alone 0.5, b alone 0.4 (>= half)
    assert v["logprob_drop_b"] == pytest.approx(0.4) and v["logprob_confirms"] and not v["logprob_disagrees"]
    # the MLP output keeps 30% and 20%: confirmed; a side whose removal moves the log-probability little disagrees
    v = verdict_of([gate(7, 1, 6, 0.3, gate_type="and")],
                   ablation_rows(keys, 0.9, 0.8, (0.3, 0.2, 0.0), logprob_drop=(0.5, 0.1, 0.6)))
    assert v["is_and"] and v["mlp_confirms"] and not v["mlp_disagrees"]
    assert not v["logprob_confirms"] and v["logprob_disagrees"]


def test_a_candidate_not_ablated_has_no_confirmation_columns():
    v = verdict_of([gate(7, 1, 6, 0.3, gate_type="and")], [])
    assert all(pd.isna(v[c]) for c in ("sae_confirms", "mlp_confirms", "logprob_confirms", "mlp_disagrees"))


@pytest.mark.parametrize("change, reason", [
    ({"gate_type": "additive"}, "interventions: additive; model run: removing a keeps 10%"),
    ({"drop_a": 0.2}, "not confirmed: model run removing a keeps 80%"),
    ({"no_ablation": True}, "not ablated in the model"),
    ({"no_ablation": True, "chosen": True}, "not ablated in the model: no confirmation token"),
    ({"gate_type": "untested"}, "untested"),
])
def test_what_fails_is_named(change, reason):
    keys = {"out_feature": 7, "in_a": 1, "in_b": 6}
    ablation = [] if change.get("no_ablation") else ablation_rows(keys, change.get("drop_a", 0.9), 0.8)
    chosen = frozenset({("pair", 7, 1, 6)}) if change.get("chosen") else frozenset()
    v = verdict_of([gate(7, 1, 6, 0.3, gate_type=change.get("gate_type", "and"))], ablation, chosen=chosen)
    assert not v["is_and"] and reason in v["verdict"]
    assert ("no confirmation token" in v["verdict"]) == bool(change.get("chosen"))


@pytest.mark.parametrize("labels, boost, expected", [
    ({1: "negation", 6: "context=positive"}, {7: ("negative", 2.0)}, True),  # negation x positive context -> negative words
    ({1: "negation", 6: "context=positive"}, {7: ("negative", 0.5)}, False),  # barely boosts the other class
    ({1: "negation", 6: "context=positive"}, {7: ("positive", 2.0)}, False),  # boosts the context's own class
    ({1: "context=negative", 6: "context=positive"}, {7: ("negative", 2.0)}, False),  # no negation side
    ({1: "negation"}, {7: ("negative", 2.0)}, False),  # the other side has no context label
    ({1: "lexicon=negation | negation", 6: "context=positive | lexicon=x"}, {7: ("negative", 2.0)}, True),  # merged
    ({1: "lexicon=negation | negation", 6: "context=negative | lexicon=x"}, {7: ("negative", 2.0)}, False),
])
def test_negation_label(labels, boost, expected):
    v = verdict_of([gate(7, 1, 6, 0.3)], [], labels=labels, boost=boost)
    assert v["negation_gate"] == expected


def test_a_gate_tag_is_a_column_only_where_the_corpus_labels_carry_its_channels():
    labelled = {1: "negation", 6: "context=positive"}
    assert "negation_gate" not in verdict_of([gate(7, 1, 6, 0.3)], [], labels=labelled, boost={7: ("negative", 2.0)},
                                             tags=()).index
    stories = feature_labels({(1, "negation", "negation"): (0.9, 6.0), (6, "context", "positive"): (0.8, 2.0),
                              (6, "sentiment", "positive"): (0.8, 2.0)})
    assert tags_of(stories, (NEGATION_GATE,)) == (NEGATION_GATE,)
    # a corpus with a context (or a document class) but no negation channel, or no labels at all: no tag
    assert tags_of(stories[stories["channel"] != "negation"], (NEGATION_GATE,)) == ()
    assert tags_of(None, (NEGATION_GATE,)) == ()


def test_reading_sets_take_the_eigenvectors_that_carry_the_activation():
    eigen = pd.DataFrame({"out_feature": [0, 0, 0, 1, 1], "rank": [1, 2, 3, 1, 2],
                          "activation_share": [-0.1, 0.7, 0.2, np.nan, 0.5]})
    rows = []
    for out, k, reads in [(0, 1, [(9, 0.9), (8, 0.8)]), (0, 2, [(1, 0.5), (2, -0.4), (3, 0.1)]),
                          (0, 3, [(4, 0.3), (5, 0.3)]), (1, 2, [(6, 0.6), (7, 0.05)])]:
        rows += [{"out_feature": out, "eigen_rank": k, "input_rank": i + 1, "in_feature": f, "cosine": c}
                 for i, (f, c) in enumerate(reads)]
    sets = reading_sets(eigen, pd.DataFrame(rows), CFG.replace(n_eigen=2, min_cosine=0.2))
    # output 0: eigenvectors 2 and 3 (1 takes activation away); |cosine| 0.1 is not a read;
    # output 1: eigenvector 2 reads one input only, no set
    assert sets.values.tolist() == [[0, 2, [1, 2]], [0, 3, [4, 5]]]
    assert reading_sets(eigen, pd.DataFrame(rows), CFG.replace(n_eigen=1, max_members=2)).values.tolist() == [
        [0, 2, [1, 2]]]


def test_label_groups_are_the_inputs_mainly_in_a_class_channel_by_channel():
    labels = feature_labels({
        (1, "negation", "negation"): (0.9, 6.0), (1, "context", "positive"): (0.8, 2.0),  # both: a conjunction
        (2, "negation", "negation"): (0.6, 4.0), (2, "context", "positive"): (0.4, 1.0),
        (5, "context", "positive"): (0.7, 1.8), (6, "context", "negative"): (0.9, 2.2),
        (7, "context", "negative"): (0.6, 1.2),  # its class's share of all tokens is 0.5: no lift
        (8, "negation", "negation"): (0.45, 9.0),  # under half of its activation
    })
    features = pd.DataFrame({"layer": 0, "site": "resid_mid", "feature": [1, 2], "top_token": ["not", "never"],
                             "top_tokens": [["not"], ["never"]], "label": ["negation", "negation"],
                             "description": ["", ""], "boost_label": None, "boost_sd": np.nan})
    classes = InputFacts.of(features, labels, 0, "resid_mid", CFG).classes
    assert classes == {"context=negative": [6], "context=positive": [1, 5], "negation": [1, 2]}


def test_label_classes_with_the_same_inputs_are_one_group():
    labels = feature_labels({
        (1, "lexicon", "negative"): (0.9, 3.0), (1, "sentiment", "negative"): (0.9, 3.0),
        (2, "lexicon", "negative"): (0.8, 2.0), (2, "sentiment", "negative"): (0.7, 2.0),
        (3, "lexicon", "positive"): (0.9, 3.0),
    })
    features = pd.DataFrame({"layer": 0, "site": "resid_mid", "feature": [1], "top_token": ["bad"],
                             "top_tokens": [["bad"]], "label": [None], "description": [""], "boost_label": None,
                             "boost_sd": np.nan})
    classes = InputFacts.of(features, labels, 0, "resid_mid", CFG).classes
    assert classes == {"lexicon=negative | sentiment=negative": [1, 2], "lexicon=positive": [3]}


def test_label_groups_are_joined_by_what_an_output_reads():
    groups = {"context=negative": [6], "context=positive": [1, 5], "negation": [1, 2]}
    sets = pd.DataFrame({"out_feature": [3], "eigen_rank": [1], "members": [[2, 5, 9]]})
    interactions = pd.DataFrame({"out_feature": [4, 4, 8], "kind": ["cross", "self", "cross"], "rank": [1, 1, 30],
                                 "in_a": [2, 6, 1], "in_b": [6, 6, 5]})
    found = label_candidates(groups, sets, interactions, CFG)
    # output 3 reads negation and positive context; output 4's top cross term joins negation and
    # negative context; output 8's joining term ranks beyond n_interactions
    assert found.values.tolist() == [[3, "context=positive", "negation"], [4, "context=negative", "negation"]]


def test_group_ranking_takes_each_outputs_best_and_puts_splits_last():
    gates = pd.DataFrame({"out_feature": [1, 1, 2, 3, 4], "group_a": [0, 1, 2, 3, 4], "group_b": [5, 6, 7, 8, 9],
                          "causal_bound": [0.2, 0.4, 0.5, np.nan, 0.3],
                          "gate_type": ["additive", "and", "additive", "untested", "and"]})
    evidence = np.array([False, False, True, False, True])  # output 4's evidence is outweighed: it is an and
    ranked = rank(gates.assign(and_data=0.9, sure_and=gates["gate_type"] == "and"), evidence, ["group_a", "group_b"], CFG)
    assert ranked["circuit_rank"].tolist() == [pd.NA, 1, 3, pd.NA, 2]
    assert ranked["split_pair"].tolist() == [False, False, True, False, False]


def test_candidates_rank_by_their_causal_bound_not_their_estimate():
    # output 1's and scores higher by its estimate but is less sure than output 2's
    gates = pd.DataFrame({"out_feature": [1, 2], "group_a": [0, 1], "group_b": [2, 3], "causal_score": [0.5, 0.4],
                          "causal_bound": [0.1, 0.3], "gate_type": ["and", "and"], "sure_and": True, "and_data": 0.9})
    ranked = rank(gates, np.zeros(2, dtype=bool), ["group_a", "group_b"], CFG)
    assert ranked["circuit_rank"].tolist() == [2, 1]


def test_a_sure_and_ranks_before_an_and_that_may_be_its_samples_luck():
    # output 1's activation-level and has the higher bound, but with its keeps raised by their errors it is no
    # longer one
    gates = pd.DataFrame({"out_feature": [1, 2], "group_a": [0, 1], "group_b": [2, 3], "causal_bound": [0.4, 0.2],
                          "gate_type": ["threshold", "threshold"], "sure_and": [False, True], "and_data": 0.9})
    ranked = rank(gates, np.zeros(2, dtype=bool), ["group_a", "group_b"], CFG)
    assert ranked["circuit_rank"].tolist() == [2, 1]


def test_the_candidates_to_ablate():
    verdicts = pd.DataFrame({"kind": ["pair"] * 4 + ["group"], "circuit_rank": [1, 2, 3, 4, 1],
                             "out_feature": [0, 1, 2, 3, 0], "in_a": [1, 1, 2, 3, pd.NA], "in_b": [2, 3, 4, 5, pd.NA],
                             "group_a": [pd.NA] * 4 + [0], "group_b": [pd.NA] * 4 + [1],
                             "negation_gate": [False, False, False, True, False]})
    assert to_ablate(verdicts, "pair", 2, ())["out_feature"].tolist() == [0, 1]
    assert to_ablate(verdicts, "pair", 2, (NEGATION_GATE,))["out_feature"].tolist() == [0, 1, 3]
    assert to_ablate(verdicts, "group", 2, (NEGATION_GATE,))["out_feature"].tolist() == [0]


def test_an_input_in_two_label_groups_stays_in_the_smaller():
    from pipelines.analysis.group_gates import _disjoint

    assert _disjoint([1, 2], [1, 5, 6]) == ([1, 2], [5, 6])
    assert _disjoint([1, 5, 6], [1, 2]) == ([5, 6], [1, 2])


def test_label_classes_with_the_same_members_make_one_gate():
    from pipelines.analysis.group_gates import _one_row_per_gate

    # lexicon=negative and sentiment=negative hold the same input: the gates they make with the
    # context group (and with negation, on the other side by name order) are one gate each
    labelled = pd.DataFrame({
        "out_feature": [3, 3, 3, 3, 4],
        "label_a": ["context=positive", "context=positive", "lexicon=negative", "negation", "context=positive"],
        "label_b": ["lexicon=negative", "sentiment=negative", "negation", "sentiment=negative", "sentiment=negative"],
        "members_a": [[1, 2], [1, 2], [9], [5], [1, 2]], "members_b": [[9], [9], [5], [9], [9]]})
    rows = _one_row_per_gate(labelled).values.tolist()
    assert rows == [[3, "context=positive", "lexicon=negative | sentiment=negative", [1, 2], [9]],
                    [3, "lexicon=negative | sentiment=negative", "negation", [9], [5]],
                    [4, "context=positive", "sentiment=negative", [1, 2], [9]]]


def test_a_gate_found_twice_is_kept_once():
    from pipelines.analysis.group_gates import _one_row_per_pair_of_groups

    # output 3: a label gate and the same groups as an eigenvector's split (sides swapped), and
    # two eigenvectors split into the same groups; output 4's gate between the same groups stays
    gates = pd.DataFrame({"out_feature": [3, 3, 3, 3, 4], "group_a": [0, 1, 2, 2, 0], "group_b": [1, 0, 5, 5, 1],
                          "source": ["labels", "eigen", "eigen", "eigen", "eigen"],
                          "eigen_rank": [pd.NA, 1, 3, 2, 1]})
    kept = _one_row_per_pair_of_groups(gates)
    assert kept[["out_feature", "group_a", "group_b", "source", "eigen_rank"]].values.tolist() == [
        [3, 0, 1, "labels", pd.NA], [3, 2, 5, "eigen", 2], [4, 0, 1, "eigen", 1]]


def test_the_printed_group_gate_names_its_pruned_sides_as_plain_numbers(capsys):
    # the sides of a table read back are numpy arrays: printed as they are, they read np.int64(116)
    import numpy as np

    from pipelines import summary

    row = dict(layer=0, kind="group", circuit_rank=1, out_feature=336, in_a=None, in_b=None,
               members_a=np.array([3, 116, 29]), members_b=np.array([249, 59]), necessary_a=np.array([116]),
               necessary_b=np.array([249]), label_a="context=positive", label_b="negation", gate_type="and", cross_share=0.6,
               causal_score=0.7, causal_bound=0.6, keep_a=0.2, keep_b=0.1, keep_ab=0.1, synergy=0.9, gate_score=0.0, split_pair=False,
               drop_a=np.nan, drop_b=np.nan, drop_both=np.nan, verdict="v", share_a=np.nan, out_description="",
               a_description="", b_description="", is_and=False, negation_gate=False)
    summary.verdicts(pd.DataFrame([row]), 1)
    out = capsys.readouterr().out
    assert "groups [116] of 3 (context=positive) x [249] of 2 (negation), pruned" in out and "np." not in out


def test_prune_is_a_share_of_the_output_and_refuses_more_than_all_of_it():
    # above 1 no member could ever be necessary, so every side would keep all its members silently
    from pipelines.analysis.verdicts import VerdictConfig

    with pytest.raises(ValueError, match="prune must be at most 1.0"):
        VerdictConfig(prune=1.5)
    assert VerdictConfig(prune=1.0).prune == 1.0


def test_a_retest_must_read_more_tokens_than_the_screening():
    with pytest.raises(ValueError, match="retest_tokens .* must exceed iv_tokens"):
        VerdictConfig(iv_tokens=64, retest_tokens=64)
    assert VerdictConfig(iv_tokens=64, retest_tokens=64, shortlist=0).shortlist == 0


def test_a_pair_without_a_truth_table_says_not_measured(capsys):
    """Issue 51 item 20: a pair tested because of its cross term (from `interactions`, not a
    candidate of `gates`) has no truth table; its row must not claim 0 tokens with both
    inputs on beside interventions and a model run that found it an AND."""
    from pipelines.analysis.verdicts import pair_candidates

    gates = pd.DataFrame([gate(8, 2, 4, 0.1)])
    interactions = pd.DataFrame([{"out_feature": 7, "in_a": 1, "in_b": 6, "kind": "cross", "rank": 1}])
    pairs = pair_candidates(gates, interactions, CFG)
    tested = {"causal_score": 0.6, "causal_bound": 0.5, "gate_type": "and", "keep_a": 0.1, "keep_b": 0.1,
              "keep_ab": 0.0, "synergy": 0.9, "sure_and": True, "same_top_token": False}
    row = pairs[pairs["out_feature"] == 7].iloc[0].to_dict() | KEYS | tested
    assert np.isnan(row["n_both"]) and np.isnan(row["gate_score"])  # what pair_candidates gives it
    v = verdict_of([row], ablation_rows({"out_feature": 7, "in_a": 1, "in_b": 6}, 0.9, 0.8))
    assert v["is_and"] and v["circuit_rank"] == 1 and v["ablation_tokens"] == 50
    assert "not measured" in v["truth"] and "too few" not in v["truth"], v["truth"]
    assert pd.isna(v["both_tokens"]) and pd.isna(v["apart_tokens"]) and pd.isna(v["truth_and"])
    from pipelines import summary

    summary.verdicts(v.to_frame().T.reset_index(names="out_feature"), 1)
    printed = capsys.readouterr().out
    assert "gate_score not measured" in printed and "nan" not in printed, printed
    # a pair of `gates` seen on no token with both inputs on was measured: 0 is its count
    measured = verdict_of([gate(7, 1, 6, 0.3, gate_type="and", n_both=0.0, gate_score=np.nan, and_data=np.nan)],
                          ablation_rows({"out_feature": 7, "in_a": 1, "in_b": 6}, 0.9, 0.8))
    assert measured["both_tokens"] == 0 and "too few tokens with both inputs on (0)" in measured["truth"]
    assert measured["truth_and"] == False  # noqa: E712


def test_a_screening_sample_under_min_cell_is_refused_naming_both_flags():
    """Issue 51 item 10: a candidate tested on fewer than min_cell tokens is untested, so
    `--iv-tokens` under `--min-cell` ranked nothing and wrote 0 verdicts without a word."""
    with pytest.raises(ValueError, match="--iv-tokens .*4.* --min-cell .*20"):
        VerdictConfig(iv_tokens=4, min_cell=20)
    assert VerdictConfig(iv_tokens=20, min_cell=20).iv_tokens == 20


@pytest.mark.parametrize("share", [1.0, 1.5])
def test_a_confirmation_share_leaving_no_ranking_token_is_refused_with_the_range(share):
    """Issue 51 item 14: at --confirm-share 1 every token confirms and none ranks."""
    with pytest.raises(ValueError, match=r"confirm_share must be .*0.* below 1"):
        VerdictConfig(confirm_share=share)
    assert VerdictConfig(confirm_share=0.0).confirm_share == 0.0


def test_the_printed_ranking_is_the_rule_where_it_lives(capsys):
    """Issue 51 item 24: the commands' summary describes the ranking in the words of
    `circuits.gates.ranking`, not a copy of its own."""
    import circuits.gates.ranking as home
    from pipelines import summary
    from pipelines.analysis.verdicts import ranking_rule

    summary.verdicts(pd.DataFrame(columns=["layer", "kind", "circuit_rank"]), 1)
    out = " ".join(capsys.readouterr().out.split())
    first = ranking_rule(first_sentence=True)
    assert first.startswith("Candidates are ordered by cause") and first.endswith(".") and first in out
    assert first in " ".join(home.__doc__.split())
