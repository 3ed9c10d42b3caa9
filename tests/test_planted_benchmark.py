"""The planted-circuit benchmark, small (`benchmarks/bench_planted_circuits.py` runs it in
full): a one-layer bilinear LM with known ANDs between input groups and pairs, an OR, an
XOR, split concepts and confounders (an additive output of two inputs that nearly always
co-occur, a one-sided output with a co-occurring bystander, an inhibition, a threshold AND
the output SAE's cut-off makes, a square of one direction written as two latents) in
superposition with distractors, through the circuits, features and verdicts code paths."""

from __future__ import annotations

import pytest

from circuits.layer import CircuitConfig
from pipelines.runtime import intra_op_threads
from pipelines.analysis.features import FeatureConfig
from pipelines.analysis.verdicts import VerdictConfig
from pipelines.planted import PlantedConfig, analyse, build_world, score

ROWS = 256


@pytest.fixture(scope="module")
def found():
    # one thread while building and analysing, then the session's own setting back for the modules after this one
    with intra_op_threads(1):
        world = build_world(PlantedConfig(rows=ROWS))
        tables = analyse(world, CircuitConfig(), FeatureConfig(n_rows=ROWS),
                         VerdictConfig(rows=ROWS, groups=("eigen",), n_ablate=len(world.gates)))
        return world, tables, *score(world, tables)


def test_the_planted_ands_fill_the_top_of_the_ranking(found):
    world, tables, frame, summary = found
    assert summary["planted ANDs"] == 4 and summary["planted pair ANDs"] == 2
    assert summary["pairs: recall in top 2"] == 1.0 and summary["pairs: precision in top 2"] == 1.0
    # the planted ANDs are the four best group gates, each an and
    groups = tables["gate_verdicts"][tables["gate_verdicts"]["kind"] == "group"].sort_values("circuit_rank")
    best = groups.head(4)
    planted = {g.output for g in world.gates if g.is_and}
    assert set(best["out_feature"]) == planted and (best["gate_type"] == "and").all()
    assert summary["groups: precision in top 4"] == 1.0 and summary["groups: recall in top 4"] == 1.0
    # the planted pair ANDs are the best pairs, ahead of the additive, one-sided and inhibition
    # confounders whose inputs occur together as often
    pairs = frame[frame["planted"].str.startswith("pair AND")]
    assert sorted(pairs["pair rank"]) == [1, 2] and pairs["pair AND"].all()


def test_a_distractor_output_reads_its_input_and_nothing_any_planted_input_writes():
    # the world's own answer: a distractor output is the square of one input, with no cross term with a planted
    # input (a square read along the whole direction would AND it with every planted input that overlaps it)
    world = build_world(PlantedConfig(rows=8))
    directions = world.saes.sae_in.weights.W_dec  # [n_inputs, d]: where each input writes
    mlp = world.model.blocks[0].mlp
    planted = [m for g in world.gates if g.kind != "distractor" for m in g.side_a + g.side_b]
    distractors = [g for g in world.gates if g.kind == "distractor"]
    units = range(mlp.W_gate.shape[1] - len(distractors), mlp.W_gate.shape[1])  # the last hidden units are theirs
    for g, unit in zip(distractors, units):
        for weights in (mlp.W_gate, mlp.W_in):
            read = directions @ weights[:, unit].detach()  # [n_inputs]: what the unit reads of each input
            assert read[planted].abs().max() < 1e-5 and read[g.side_a[0]] > 0.3
        assert (world.model.blocks[0].mlp.W_out[unit] @ world.saes.sae_out.weights.W_dec.T).argmax() == g.output


def test_a_residual_too_narrow_for_the_distractors_is_refused():
    # 30 planted inputs fill most of a 32-dimensional stream: a distractor's square would be read along nearly nothing
    with pytest.raises(ValueError, match="d_model 32 leaves distractor 1"):
        build_world(PlantedConfig(d_model=32, rows=8))


def test_the_gate_types_of_the_planted_outputs(found):
    world, tables, frame, summary = found
    assert summary["gate_type right (share of planted outputs)"] >= 0.9, frame[["planted", "gate_type"]]
    confounders = frame.set_index("planted")["gate_type"]
    assert confounders["additive"] == "additive" and confounders["one-sided"] == "one-sided"
    assert confounders["inhibition"] == "inhibition"
    # each side necessary only through the output SAE's cut-off, while the layer adds them
    assert confounders["threshold AND"] == "threshold" and confounders["square"] == "square"
    assert (frame.loc[frame["kind"] == "and", "gate_type"] == "and").all()


def test_the_confounders_fool_the_activations_but_not_the_layers_form(found):
    # removing either side drops each confounder's activation (the output SAE's cut-off): the activations alone
    # would call both an AND; the pre-activation's form says the layer adds two squares, or squares one direction
    world, tables, frame, summary = found
    pairs = tables["pair_gates"]

    def planted(g):
        a, b = sorted((g.side_a[0], g.side_b[0]))
        (row,) = pairs[(pairs["out_feature"] == g.output) & (pairs["in_a"] == a) & (pairs["in_b"] == b)].to_dict("records")
        return row

    for name in ("threshold AND", "square"):
        row = planted(next(g for g in world.gates if g.name == name))
        assert max(row["keep_a"], row["keep_b"]) <= 0.5 and row["synergy"] >= 0.25, name
        assert row["cross_share"] < 0.5 if name == "threshold AND" else abs(row["square_fit"] - 1) < 0.05, name
    for g in (g for g in world.gates if g.kind == "and" and len(g.side_a) == 1):
        row = planted(g)
        assert row["cross_share"] >= 0.8 and abs(row["own_a_share"]) < 0.1 and abs(row["own_b_share"]) < 0.1


def test_split_concepts_are_flagged_and_never_ranked_as_gates(found):
    world, tables, frame, summary = found
    assert summary["pairs: no split concept among the top 4 as a gate"]
    assert summary["groups: no split concept among the top 8 as a gate"]
    splits = frame[frame["kind"].isin(["split", "square"])]
    assert splits["pair found"].str.endswith("(split)").all()
    n = len(frame) + len([g for g in world.gates if g.kind == "distractor"])
    assert (splits["pair rank"] > n - len(splits) - 1).all()  # after every other output's candidate


def test_group_ablation_confirms_the_ands_and_rejects_the_rest(found):
    world, tables, frame, summary = found
    assert summary["group ablation confirms every planted AND"]
    assert summary["group ablation rejects every other planted output"]
    assert summary["pair ablation rejects every other planted output"]


def test_recall_counts_each_planted_and_once_and_groups_are_matched_by_their_pruned_sides():
    # a planted pair AND found twice in the top k is one AND recalled, a pair of a group AND's
    # inputs is not a planted pair AND, and a group gate whose full sides mix the planted ones
    # but whose pruned sides do not is a match
    import pandas as pd

    from pipelines.planted import Gate, PlantedWorld, score

    gates = [Gate("pair AND 1", "and", 0, (1,), (2,)), Gate("pair AND 2", "and", 1, (3,), (4,)),
             Gate("group AND", "and", 2, (5, 6), (7, 8))]
    world = PlantedWorld.__new__(PlantedWorld)
    world.gates = gates
    row = dict(circuit_rank=1, split_pair=False, is_and=True, drop_a=0.9, drop_b=0.9, gate_type="and")
    verdicts = pd.DataFrame([
        {**row, "kind": "pair", "out_feature": 0, "members_a": [1], "members_b": [2], "necessary_a": None,
         "necessary_b": None},
        {**row, "kind": "pair", "circuit_rank": 2, "out_feature": 0, "members_a": [2], "members_b": [1],
         "necessary_a": None, "necessary_b": None},
        {**row, "kind": "group", "out_feature": 1, "members_a": [3, 4, 9], "members_b": [4, 5],
         "necessary_a": [3, 9], "necessary_b": [4]},
        # one input of each side of a group AND: a right pair, but not one of the planted pair ANDs
        {**row, "kind": "pair", "circuit_rank": 3, "out_feature": 2, "members_a": [5], "members_b": [7],
         "necessary_a": None, "necessary_b": None},
    ])
    tables = {"gate_verdicts": verdicts,
              "pair_gates": pd.DataFrame({"out_feature": [0], "in_a": [1], "in_b": [2], "gate_type": ["and"]}),
              "group_gates": verdicts[verdicts["kind"] == "group"]}
    _, summary = score(world, tables)
    assert summary["pairs: precision in top 2"] == 1.0 and summary["pairs: recall in top 2"] == 0.5
    assert summary["pairs: precision in top 4"] == 0.5 and summary["pairs: recall in top 4"] == 0.5
    assert summary["groups: precision in top 3"] == 1 / 3 and summary["groups: recall in top 3"] == 1 / 3
