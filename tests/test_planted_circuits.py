"""The planted-circuit benchmark, small (`benchmarks/bench_planted_circuits.py` runs it in
full): a one-layer bilinear LM with known ANDs between input groups and pairs, an OR, an
XOR and split concepts in superposition with distractors, through the circuits, features
and verdicts code paths."""

from __future__ import annotations

import pytest

from circuits.layer import CircuitConfig, intra_op_threads
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


def test_the_planted_ands_are_the_best_group_gates(found):
    world, tables, frame, summary = found
    assert summary["planted ANDs"] == 4
    assert summary["groups: recall in top 4"] == 1.0 and summary["groups: precision in top 4"] == 1.0
    # the planted pair ANDs are also the best pairs (a group AND's alternatives are not a pair)
    pairs = frame[frame["planted"].str.startswith("pair AND")]
    assert sorted(pairs["pair rank"]) == [1, 2] and pairs["pair AND"].all()


def test_split_concepts_are_flagged_and_never_ranked_as_gates(found):
    world, tables, frame, summary = found
    assert summary["pairs: no split concept among the top 8 as a gate"]
    assert summary["groups: no split concept among the top 8 as a gate"]
    splits = frame[frame["kind"] == "split"]
    assert splits["pair found"].str.endswith("(split)").all()
    n = len(frame) + len([g for g in world.gates if g.kind == "distractor"])
    assert (splits["pair rank"] > n - len(splits) - 1).all()  # after every other output's candidate


def test_group_ablation_confirms_the_ands_and_rejects_the_rest(found):
    world, tables, frame, summary = found
    assert summary["group ablation confirms every planted AND"]
    assert summary["group ablation rejects every planted OR, XOR and split"]
    assert summary["pair ablation rejects every planted OR, XOR and split"]
