"""Every subcommand end to end on a tiny run, through the command line."""

import subprocess
import sys

import duckdb
import numpy as np
import pandas as pd
import pytest
import torch

from pipelines.cli import main

pytestmark = pytest.mark.slow

TABLES = ("sae_metrics", "interactions", "gates", "gate_truth", "gate_ablation", "eigen", "eigen_inputs", "lowrank",
          "features", "feature_labels")
CIRCUITS = ["--top-n", "10", "--max-rank", "4", "--corr-rows", "64", "--min-active", "5"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run built stage by stage with the subcommands, each given the device as a string."""
    out = tmp_path_factory.mktemp("run")
    assert main(["corpus", "--out", str(out), "--n-stories", "2000", "--seed", "1"]) == 0
    base = ["--out", str(out), "--device", "cpu"]
    assert main(["train-lm", *base, "--preset", "tiny", "--train-tokens", "40000", "--vocab-size", "600"]) == 0
    assert main(["train-saes", *base, "--layers", "all", "--sites", "resid_mid,mlp_out",
                 "--train-tokens", "40960", "--batch-size", "1024", "--k", "4"]) == 0
    assert main(["circuits", *base, *CIRCUITS]) == 0
    assert main(["features", *base, "--rows", "64"]) == 0
    assert main(["report", *base]) == 0
    return out


def test_stage_outputs(run):
    for part in ("corpus", "lm/model.safetensors", "lm/tokenizer.json", "lm/summary.json", "saes/layer1_mlp_out",
                 "report/index.html"):
        assert (run / part).exists(), part
    for name in TABLES:
        df = pd.read_parquet(run / "tables" / name)
        assert len(df) > 0, name
        assert df["layer"].dtype == "int64" and sorted(df["layer"].unique()) == [0, 1], name
    gates = duckdb.sql(f"select count(*) from read_parquet('{run}/tables/gates/**/*.parquet')").fetchall()[0][0]
    assert gates == len(pd.read_parquet(run / "tables" / "gates"))


def test_rerun_keeps_finished_stages(run, capsys):
    before = (run / "tables/lowrank/layer0/resid_mid-sae.parquet").stat().st_mtime_ns
    assert main(["circuits", "--out", str(run), *CIRCUITS]) == 0
    assert "none, all up to date" in capsys.readouterr().out
    assert (run / "tables/lowrank/layer0/resid_mid-sae.parquet").stat().st_mtime_ns == before


def test_explicit_paths_give_the_same_tables(run, tmp_path):
    explicit = ["--corpus", str(run / "corpus"), "--model", str(run / "lm"), "--layer", "1",
                "--sae-in", str(run / "saes/layer1_resid_mid"), "--sae-out", str(run / "saes/layer1_mlp_out")]
    assert main(["circuits", "--out", str(tmp_path), *explicit, *CIRCUITS]) == 0
    ours = pd.read_parquet(tmp_path / "tables" / "interactions")
    theirs = pd.read_parquet(run / "tables" / "interactions")
    theirs = theirs[theirs["layer"] == 1]
    np.testing.assert_allclose(ours["coefficient"], theirs["coefficient"], rtol=1e-5)
    assert main(["features", "--out", str(tmp_path), *explicit, "--rows", "64"]) == 0
    described = pd.read_parquet(tmp_path / "tables" / "features")
    assert set(described["site"]) == {"resid_mid", "mlp_out"} and set(described["layer"]) == {1}
    assert main(["report", "--out", str(tmp_path), *explicit]) == 0
    assert list((tmp_path / "report").glob("L1_*_scatter.png"))


def test_other_outputs_and_an_mlp_in_input_sae(run, tmp_path):
    np.save(tmp_path / "dirs.npy", np.random.default_rng(0).normal(size=(3, 32)).astype("float32"))
    assert main(["train-saes", "--out", str(run), "--sites", "mlp_in", "--layers", "0", "--train-tokens", "40960",
                 "--batch-size", "1024", "--k", "4"]) == 0
    outputs = f"sae,hosvd,logit:happy-sad,file:{tmp_path / 'dirs.npy'}"
    assert main(["circuits", "--out", str(run), "--layers", "0", "--input-site", "mlp_in", "--outputs", outputs,
                 "--n-hosvd", "4", *CIRCUITS]) == 0
    gates = pd.read_parquet(run / "tables" / "eigen")
    sel = gates[(gates["layer"] == 0) & (gates["input_site"] == "mlp_in")]
    assert set(sel["outputs"]) == {"sae", "hosvd", "logit:happy-sad", f"file:{tmp_path / 'dirs.npy'}"}
    assert sel.groupby("outputs")["out_feature"].nunique().to_dict()["hosvd"] == 4
    lowrank = pd.read_parquet(run / "tables" / "lowrank")
    assert set(lowrank.loc[lowrank["input_site"] == "mlp_in", "outputs"]) == {"sae"}  # only SAE features have activity


def test_bad_input_gives_clear_errors(run, tmp_path, capsys):
    assert main(["circuits", "--out", str(run), "--layers", "5"]) == 2
    assert "do not exist" in capsys.readouterr().err
    assert main(["features", "--out", str(tmp_path)]) == 2
    assert "no model checkpoint" in capsys.readouterr().err
    assert main(["circuits", "--out", str(run), "--sae-in", str(run / "saes/layer1_resid_mid")]) == 2
    assert "single --layer" in capsys.readouterr().err
    assert main(["circuits", "--out", str(run), "--layers", "0", "--outputs", "logit:zzzqqq"]) == 2
    assert "'zzzqqq' is not one token" in capsys.readouterr().err
    assert main(["features", "--out", str(run), "--device", "tpu"]) == 2
    assert "--device must be auto, cpu, cuda or cuda:N, not 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["report", "--out", str(run), "--device", "cuda:0"]) == 2
        assert "no CUDA device is available here" in capsys.readouterr().err


def test_module_entry_point_help():
    for command in ("corpus", "train-lm", "convert", "train-saes", "circuits", "features", "report", "explore", "demo"):
        done = subprocess.run([sys.executable, "-m", "pipelines", command, "--help"], capture_output=True, text=True)
        assert done.returncode == 0 and "usage: bilinear-circuits" in done.stdout, command


def test_changed_inputs_are_not_taken_for_done(run, tmp_path, capsys):
    assert main(["corpus", "--out", str(tmp_path), "--n-stories", "2000", "--seed", "2"]) == 0
    args = ["circuits", "--out", str(run), *CIRCUITS]
    assert main([*args, "--corpus", str(tmp_path / "corpus"), "--layers", "0"]) == 0
    assert "computed now: layer 0" in capsys.readouterr().out
    assert main([*args, "--layers", "0"]) == 0  # back to the run's own corpus: recomputed again
    assert "computed now: layer 0" in capsys.readouterr().out


def test_demo_small_finds_and_checks_gates(tmp_path, capsys):
    assert main(["demo", "--small", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Best gate candidates per layer" in out and "report:" in out
    summary = __import__("json").loads((tmp_path / "lm" / "summary.json").read_text())
    assert summary["held_out_loss"] < summary["unigram_entropy"]  # the LM learned something
    metrics = pd.read_parquet(tmp_path / "tables" / "sae_metrics")
    assert len(metrics) == 4 and (metrics["nmse"] < 0.6).all() and (metrics["loss_added"] < 0.2).all()
    gates = pd.read_parquet(tmp_path / "tables" / "gates")
    best = gates[gates["layer_rank"] == 1]
    assert len(best) == 2 and (best["contribution_share"] > 0).all() and (best["coactivation"] > 0).all()
    truth = pd.read_parquet(tmp_path / "tables" / "gate_truth")
    assert set(truth["cell"]) == {"on_on", "on_off", "off_on", "off_off"}
    # circuits ablates the 2 best candidates per layer, the demo then the rest of its 4
    ablation = pd.read_parquet(tmp_path / "tables" / "gate_ablation")
    from pipelines.analysis.verdicts import best_candidates

    shown = best_candidates(gates, 4)
    done = set(zip(ablation["layer"], ablation["out_feature"], ablation["in_a"], ablation["in_b"]))
    assert len(shown) > 4 and set(zip(shown["layer"], shown["out_feature"], shown["in_a"], shown["in_b"])) <= done
    assert (tmp_path / "report" / "index.html").is_file() and (tmp_path / "demo_config.json").is_file()
