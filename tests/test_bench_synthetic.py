"""benchmarks/bench_synthetic.py on its `tiny` configuration: our trainer goes through the
project's one training loop on views of the generated activations and ends with the SAE that
stepping the trainer by hand on the same slices gives, bit for bit; both trainers' SAEs are
scored by sae-lens's evaluation, and the tables are written as the other benchmarks write theirs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from sae.config import SAETrainConfig
from sae.topk import TopKTrainer
from sae.train import new_trainer

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_synthetic", ROOT / "benchmarks" / "bench_synthetic.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_synthetic"] = bench  # its dataclasses look their module up
spec.loader.exec_module(bench)

STEPS = 52  # past step 50, where the loop reads the losses for its progress bar


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("synthetic")
    threads = torch.get_num_threads()
    bench.generate("tiny", 0, STEPS * bench.BATCH, folder)
    torch.set_num_threads(threads)
    return folder


def test_ours_trains_on_views_of_the_data_and_matches_stepping_the_trainer_by_hand(data, monkeypatch):
    train, held_out = bench.load(data, "tiny", 0)
    spec_ = bench.CONFIGS["tiny"]
    tokens, k, B = STEPS * bench.BATCH, held_out["k"], bench.BATCH
    # a high rate and a short dead-latent window, so the aux-k loss and the dead counters act too
    recipe = {"lr": 3e-3, "dead_after_tokens": 4 * B, "aux_k_coefficient": 1.0}

    seen = []
    step = TopKTrainer.step

    def recording(self, batch, stats=True):
        seen.append((batch.data_ptr(), batch.shape[0]))
        return step(self, batch, stats)

    with monkeypatch.context() as patch:
        patch.setattr(TopKTrainer, "step", recording)
        sae, seconds, used, settings = bench._ours(train, spec_.d_sae, k, 0, tokens, recipe)
    assert seen == [(train[i * B :].data_ptr(), B) for i in range(STEPS)]  # no batch was copied
    assert used == tokens and seconds > 0
    assert settings["lr"] == 3e-3 and settings["dead_after_tokens"] == 4 * B

    cfg = SAETrainConfig(d_sae=spec_.d_sae, k=k, train_tokens=tokens, batch_size=B, seed=0, **recipe)
    cfg = cfg.resolve(spec_.hidden_dim)
    by_hand = new_trainer(spec_.hidden_dim, cfg)
    for i in range(cfg.train_steps):
        by_hand.step(train[i * B : (i + 1) * B], stats=False)
    assert by_hand.dead.any()  # the dead-latent path was exercised
    expected = by_hand.sae.state_dict()
    got = sae.state_dict()
    assert set(expected) <= set(got)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    one, shifted = new_trainer(spec_.hidden_dim, cfg), new_trainer(spec_.hidden_dim, cfg)
    one.step(train[:B], stats=False)
    shifted.step(train[B : 2 * B], stats=False)
    assert not torch.equal(one.sae.W_enc, shifted.sae.W_enc)  # the exact comparison tells batches apart


def test_both_trainers_are_scored_and_the_tables_are_recorded_with_their_command(data, tmp_path, monkeypatch):
    cell = {"config": "tiny", "seed": 0, "tokens": 8 * bench.BATCH, "data": str(data)}
    rows = [bench.run_job({**cell, "trainer": "ours", "label": "defaults", "recipe": {}}),
            bench.run_job({**cell, "trainer": "sae-lens", "label": "const 0.004", "lr": 4e-3})]
    for row in rows:
        assert "error" not in row, row
        assert 0 <= row["mcc"] <= 1 and 0 <= row["f1_score"] <= 1 and row["cpu_s_per_token"] > 0
        assert row["used_tokens"] == 8 * bench.BATCH and row["d_sae"] == 64
    assert rows[1]["settings"]["schedule"] == "constant" and rows[1]["settings"]["lr"] == 4e-3

    lines = tmp_path / "rows.jsonl"
    lines.write_text("".join(json.dumps(row) + "\n" for row in [*rows, {**cell, "error": "a failed SAE is left out"}]))
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_synthetic.py", "--tables-from", str(lines),
                                      "--output", str(tmp_path / "tables.md")])
    bench.main()
    text = (tmp_path / "tables.md").read_text()
    command = f"python benchmarks/bench_synthetic.py --tables-from {lines} --output {tmp_path / 'tables.md'}"
    assert text.startswith(f"<!-- {command} -->\n")
    assert f"| tiny | 32,768 | ours | defaults | 1 | {rows[0]['k']} | {rows[0]['mcc']:.3f} |" in text
    assert "| tiny | 32,768 | sae-lens | const 0.004 | 1 |" in text
    summary = json.loads((tmp_path / "tables.json").read_text())
    assert summary["command"] == command
    [check] = summary["checks"]
    assert (check["ours_mcc"], check["sae_lens_best_mcc"]) == (rows[0]["mcc"], rows[1]["mcc"])
    assert check["cpu_ratio"] == pytest.approx(rows[1]["cpu_s_per_token"] / rows[0]["cpu_s_per_token"])


def test_an_unknown_label_is_refused_before_any_data_is_made(tmp_path, monkeypatch, capsys):
    """--labels that name no recipe of the grid stop the run, naming the flag and the labels there are."""
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_synthetic.py", "--configs", "tiny", "--grid", "rule",
                                      "--labels", "defaults", "dead 2M", "--data", str(tmp_path / "data"),
                                      "--output", "-"])
    with pytest.raises(SystemExit):
        bench.main()
    error = capsys.readouterr().err
    assert "--labels" in error and "'dead 2M'" in error and "previous defaults" in error
    assert not (tmp_path / "data").exists()
