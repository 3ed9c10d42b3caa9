"""Seeds and threads are explicit: with `--threads 1` a run repeats bit for bit, and `--seed`
reaches every stage and changes each stage's own random choices."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from pipelines.cli import main

pytestmark = pytest.mark.slow
STAGES = {
    "corpus": ["--n-stories", "1200"],
    "train-lm": ["--preset", "tiny", "--train-tokens", "30000", "--vocab-size", "500", "--device", "cpu"],
    "train-saes": ["--train-tokens", "20480", "--batch-size", "1024", "--k", "4", "--buffer-tokens", "4096"],
    "circuits": ["--top-n", "8", "--max-rank", "4", "--corr-rows", "32", "--min-active", "3", "--n-samples", "4"],
    "features": ["--rows", "32", "--n-samples", "2"],
    "verdicts": ["--rows", "32", "--min-cell", "3", "--ablate-tokens", "6", "--n-ablate", "2"],
}
TABLES = ["sae_metrics", "interactions", "gates", "gate_truth", "eigen", "eigen_inputs", "lowrank", "lowrank_samples",
          "features", "feature_labels", "gate_ablation", "group_gates", "group_truth", "group_ablation", "gate_verdicts"]


def stage(run: Path, name: str, seed: int, *extra: str) -> None:
    # the corpus generator runs no torch; the rest on the CPU, where sums have a fixed order (a
    # GPU's atomic adds do not: there the SAEs of two runs differ in their last bits)
    threads = [] if name == "corpus" else ["--threads", "1", "--device", "cpu"]
    assert main([name, "--out", str(run), *threads, "--seed", str(seed), *STAGES[name], *extra]) == 0, name


def files(run: Path) -> dict[str, bytes]:
    """The bytes of the corpus, the model and every SAE."""
    found = {str(p.relative_to(run)): p.read_bytes() for p in sorted((run / "corpus").glob("*.parquet"))}
    if (run / "lm" / "model.safetensors").is_file():
        found["lm"] = (run / "lm" / "model.safetensors").read_bytes()
    for sae in sorted((run / "saes").glob("layer*")):
        found[sae.name] = (sae / "sae_weights.safetensors").read_bytes()
    return found


def table(run: Path, name: str) -> pd.DataFrame:
    return pd.read_parquet(run / "tables" / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run twice, every stage with --seed 1 and --threads 1."""
    made = []
    for copy in ("first", "second"):
        run = tmp_path_factory.mktemp(copy)
        for name in STAGES:
            stage(run, name, 1)
        made.append(run)
    return made


def test_one_thread_repeats_a_run_bit_for_bit(runs):
    first, second = runs
    assert files(first) == files(second)
    for name in TABLES:
        pd.testing.assert_frame_equal(table(first, name), table(second, name), check_exact=True, obj=name)


def test_seed_changes_every_stages_random_choices(runs, tmp_path):
    # the corpus generator
    other = tmp_path / "corpus"
    stage(other, "corpus", 2)
    assert files(other)["corpus/part.parquet"] != files(runs[0])["corpus/part.parquet"]
    # every later stage, one at a time, on the same inputs
    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    before = {name: table(run, name) for name in TABLES}
    stage(run, "verdicts", 2)  # which ablation tokens are sampled
    assert not table(run, "gate_ablation")["activation_before"].equals(before["gate_ablation"]["activation_before"])
    stage(run, "features", 2)  # which activations the quantile contexts come from
    assert not table(run, "features")["sample_contexts"].equals(before["features"]["sample_contexts"])
    stage(run, "circuits", 2)  # which active tokens lowrank_samples keeps
    assert not table(run, "lowrank_samples").equals(before["lowrank_samples"])
    pd.testing.assert_frame_equal(table(run, "interactions"), before["interactions"])  # nothing random there
    saes = files(run)
    stage(run, "train-saes", 2)  # initialisation and data order
    assert all(files(run)[name] != saes[name] for name in saes if name.startswith("layer"))
    stage(run, "train-lm", 2, "--force")
    assert files(run)["lm"] != saes["lm"]
