"""Every subcommand end to end on a tiny run, through the command line."""

import subprocess
import sys

import duckdb
import pandas as pd
import pytest

from pipelines.cli import main
from tests.test_convert import published_config, published_weights, write_published

TABLES = ("sae_metrics", "interactions", "gates", "eigen", "lowrank", "features")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run built stage by stage with the subcommands."""
    out = tmp_path_factory.mktemp("run")
    base = ["--out", str(out)]
    assert main(["corpus", *base, "--n-stories", "2000", "--seed", "1"]) == 0
    assert main(["train-lm", *base, "--preset", "tiny", "--train-tokens", "40000", "--vocab-size", "600"]) == 0
    assert main(["train-saes", *base, "--layers", "all", "--sites", "resid_mid,mlp_out",
                 "--train-tokens", "40960", "--k", "4"]) == 0
    assert main(["circuits", *base, "--top-n", "10", "--max-rank", "4", "--corr-rows", "64"]) == 0
    assert main(["features", *base, "--rows", "64"]) == 0
    assert main(["report", *base]) == 0
    return out


def test_stage_outputs(run):
    for part in ("corpus", "lm/model.safetensors", "lm/tokenizer.json", "saes/layer1_mlp_out",
                 "report/index.html"):
        assert (run / part).exists(), part
    for name in TABLES:
        df = pd.read_parquet(run / "tables" / name)
        assert len(df) > 0, name
        assert sorted(df["layer"].astype(int).unique()) == [0, 1], name
    gates = duckdb.sql(
        f"select count(*) from read_parquet('{run}/tables/gates/**/*.parquet', hive_partitioning=true)"
    ).fetchall()[0][0]
    assert gates == len(pd.read_parquet(run / "tables" / "gates"))


def test_rerun_skips_finished_stages(run, capsys):
    before = (run / "tables/lowrank/layer=0/part-0.parquet").stat().st_mtime_ns
    assert main(["circuits", "--out", str(run), "--top-n", "10", "--max-rank", "4", "--corr-rows", "64"]) == 0
    assert "none, all up to date" in capsys.readouterr().out
    assert (run / "tables/lowrank/layer=0/part-0.parquet").stat().st_mtime_ns == before


def test_explicit_paths(run, tmp_path):
    assert main(["circuits", "--out", str(tmp_path), "--corpus", str(run / "corpus"),
                 "--model", str(run / "lm"), "--layer", "1",
                 "--sae-in", str(run / "saes/layer1_resid_mid"), "--sae-out", str(run / "saes/layer1_mlp_out"),
                 "--top-n", "10", "--max-rank", "4", "--corr-rows", "64"]) == 0
    ours = pd.read_parquet(tmp_path / "tables" / "interactions")
    theirs = pd.read_parquet(run / "tables" / "interactions")
    theirs = theirs[theirs["layer"].astype(int) == 1]
    assert ours["coefficient"].tolist() == pytest.approx(theirs["coefficient"].tolist(), rel=1e-5)
    assert main(["report", "--out", str(tmp_path), "--corpus", str(run / "corpus"), "--model", str(run / "lm"),
                 "--layer", "1", "--sae-in", str(run / "saes/layer1_resid_mid"),
                 "--sae-out", str(run / "saes/layer1_mlp_out")]) == 0
    assert list((tmp_path / "report").glob("scatter_L1_*.png"))  # drawn from the explicit model and SAEs


def test_bad_input_gives_clear_errors(run, tmp_path, capsys):
    assert main(["circuits", "--out", str(run), "--layers", "5"]) == 2
    assert "do not exist" in capsys.readouterr().err
    assert main(["features", "--out", str(tmp_path)]) == 2
    assert "no model checkpoint" in capsys.readouterr().err
    assert main(["circuits", "--out", str(run), "--sae-in", str(run / "saes/layer1_resid_mid")]) == 2
    assert "go together" in capsys.readouterr().err


def test_convert_command(tmp_path):
    src = write_published(tmp_path / "published", published_weights(), published_config())
    assert main(["convert", str(src), "--out", str(tmp_path / "ours")]) == 0
    assert (tmp_path / "ours" / "model.safetensors").is_file()


def test_demo_small(tmp_path, capsys):
    assert main(["demo", "--small", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Top AND-gate candidates" in out and "report:" in out
    assert (tmp_path / "report" / "index.html").is_file()
    assert (tmp_path / "demo_config.json").is_file()


def test_module_entry_point_help():
    for command in ("corpus", "train-lm", "convert", "train-saes", "circuits", "features", "report", "demo"):
        done = subprocess.run([sys.executable, "-m", "pipelines", command, "--help"],
                              capture_output=True, text=True)
        assert done.returncode == 0 and "usage: bilinear-circuits" in done.stdout, command


def test_changed_inputs_are_not_taken_for_done(run, tmp_path, capsys):
    assert main(["corpus", "--out", str(tmp_path), "--n-stories", "2000", "--seed", "2"]) == 0
    args = ["circuits", "--out", str(run), "--top-n", "10", "--max-rank", "4", "--corr-rows", "64"]
    assert main([*args, "--corpus", str(tmp_path / "corpus"), "--layers", "0"]) == 0
    assert "computed now: [0]" in capsys.readouterr().out
    assert main([*args, "--layers", "0"]) == 0  # back to the run's own corpus: recomputed again
    assert "computed now: [0]" in capsys.readouterr().out
