"""The SAE stage end to end: every point trained from one stream, resume after SIGKILL,
reuse only for the same model, corpus and recipe, metrics for every site."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from pipelines.cli import main
from tests.children import child_env

pytestmark = pytest.mark.slow

# on the CPU, where sums have a fixed order: the tests hold SAEs bit for bit (a GPU's atomic adds
# sum in no fixed order)
SAES = ["--train-tokens", "81920", "--batch-size", "1024", "--buffer-tokens", "8192", "--k", "4",
        "--eval-rows", "8", "--threads", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm")
    assert main(["corpus", "--out", str(out), "--n-stories", "2000", "--seed", "1"]) == 0
    assert main(["train-lm", "--out", str(out), "--preset", "tiny", "--train-tokens", "40000",
                 "--vocab-size", "600"]) == 0
    return out


def _copy(lm_run: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(lm_run, out)
    return out


def _weights(run: Path) -> dict:
    return {p.name: load_file(str(p / "sae_weights.safetensors")) for p in sorted((run / "saes").glob("layer*"))}


def test_every_point_trains_from_one_stream_and_reports_metrics(lm_run, tmp_path, capsys):
    run = _copy(lm_run, tmp_path, "run")
    assert main(["train-saes", "--out", str(run), "--sites", "resid_mid,mlp_in,mlp_out", *SAES]) == 0
    assert "train 6 SAEs" in capsys.readouterr().err
    metrics = pd.read_parquet(run / "tables" / "sae_metrics")
    assert sorted(zip(metrics["layer"], metrics["site"])) == [
        (0, "mlp_in"), (0, "mlp_out"), (0, "resid_mid"), (1, "mlp_in"), (1, "mlp_out"), (1, "resid_mid")]
    assert (metrics["nmse"] < 1).all() and (metrics["l0"] == 4).all()
    # a finished group of points leaves neither its checkpoint nor its hidden checkpoint stamp
    assert not list((run / "saes").glob("checkpoint*.pt"))
    assert not list((run / "saes").glob(".checkpoint*.json"))


def test_resume_after_sigkill_gives_the_same_saes(lm_run, tmp_path, capsys):
    straight = _copy(lm_run, tmp_path, "straight")
    killed = _copy(lm_run, tmp_path, "killed")
    args = ["train-saes", "--sites", "resid_mid,mlp_out", "--checkpoint-every", "3", *SAES]
    assert main(["train-saes", "--out", str(straight), *args[1:]]) == 0
    command = [sys.executable, "-m", "pipelines", "train-saes", "--out", str(killed), *args[1:]]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=child_env())
    deadline = time.time() + 120
    while not list((killed / "saes").glob("checkpoint-*.pt")):
        assert proc.poll() is None, "training ended before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not list((killed / "saes").glob("layer*")), "killed before any SAE was finished"
    # one group of points here: its checkpoint, and the hidden stamp that says which points it is for
    (checkpoint,) = (killed / "saes").glob("checkpoint-*.pt")
    digest = checkpoint.name[len("checkpoint-"):-len(".pt")]
    assert (killed / "saes" / f".checkpoint-{digest}.json").is_file()
    capsys.readouterr()
    assert main(["train-saes", "--out", str(killed), *args[1:]]) == 0
    assert "resuming SAE training at step" in capsys.readouterr().out
    assert not list((killed / "saes").glob("checkpoint*.pt"))
    assert not list((killed / "saes").glob(".checkpoint*.json"))
    a, b = _weights(straight), _weights(killed)
    assert a.keys() == b.keys() and len(a) == 4
    for name in a:
        for tensor in a[name]:
            assert (a[name][tensor] == b[name][tensor]).all(), (name, tensor)


def test_a_changed_recipe_retrains_and_the_same_one_is_kept(lm_run, tmp_path, capsys):
    run = _copy(lm_run, tmp_path, "run")
    base = ["train-saes", "--out", str(run), "--sites", "mlp_out", "--layers", "0", *SAES]
    assert main(base) == 0
    first = (run / "saes/layer0_mlp_out/sae_weights.safetensors").stat().st_mtime_ns
    assert main(base) == 0
    assert (run / "saes/layer0_mlp_out/sae_weights.safetensors").stat().st_mtime_ns == first
    capsys.readouterr()
    assert main([*base, "--k", "6"]) == 0
    assert "retraining layer0_mlp_out" in capsys.readouterr().out
    assert pd.read_parquet(run / "tables" / "sae_metrics")["k"].tolist() == [6]


def test_a_point_trains_alike_whichever_points_train_beside_it(lm_run, tmp_path):
    """Each SAE's seed comes from its point, not its place among the points trained together
    (a group of points on a Ray worker trains the same SAEs as all of them here)."""
    alone = _copy(lm_run, tmp_path, "alone")
    together = _copy(lm_run, tmp_path, "together")
    short = [*SAES, "--train-tokens", "20480"]
    assert main(["train-saes", "--out", str(alone), "--sites", "mlp_out", "--layers", "1", *short]) == 0
    assert main(["train-saes", "--out", str(together), "--sites", "resid_mid,mlp_in,mlp_out", *short]) == 0
    a, b = _weights(alone), _weights(together)
    assert list(a) == ["layer1_mlp_out"] and len(b) == 6
    for tensor in a["layer1_mlp_out"]:
        assert torch.equal(a["layer1_mlp_out"][tensor], b["layer1_mlp_out"][tensor]), tensor
