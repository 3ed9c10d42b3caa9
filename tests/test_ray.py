"""Stages on a Ray cluster: the same tables as a local run, a killed worker's task retried
and a rerun doing nothing more, a clear error without Ray or without a shared run
directory."""

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

from pipelines.cli import main
from pipelines.engine.cluster import TaskFailed, _run_task
from pipelines.engine.tasks import Task

pytestmark = pytest.mark.slow
STAGES = [
    ["train-saes", "--train-tokens", "20480", "--batch-size", "1024", "--k", "4", "--buffer-tokens", "4096"],
    ["circuits", "--top-n", "8", "--max-rank", "4", "--corr-rows", "32", "--min-active", "3"],
    ["features", "--rows", "32"],
    ["verdicts", "--rows", "32", "--min-cell", "3", "--ablate-rows", "32", "--n-ablate", "2"],
]
TABLES = ["sae_metrics", "interactions", "gates", "gate_truth", "eigen", "eigen_inputs", "lowrank", "lowrank_samples",
          "features", "feature_labels", "gate_ablation", "group_gates", "group_truth", "group_ablation", "gate_verdicts"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny run with its corpus and LM: every later stage is run here and on Ray."""
    out = tmp_path_factory.mktemp("base")
    assert main(["corpus", "--out", str(out), "--n-stories", "1200", "--seed", "4"]) == 0
    assert main(["train-lm", "--out", str(out), "--preset", "tiny", "--train-tokens", "30000", "--vocab-size", "500",
                 "--threads", "1", "--device", "cpu"]) == 0
    return out


def stages(run: Path, *extra: str) -> None:
    for stage in STAGES:
        assert main([stage[0], "--out", str(run), "--threads", "1", "--device", "cpu", *stage[1:], *extra]) == 0, stage


def read(run: Path, name: str) -> pd.DataFrame:
    frame = pd.read_parquet(run / "tables" / name)
    keys = [c for c in frame.columns if frame[c].dtype != object or c in ("site", "kind", "cell", "ablated")]
    return frame.sort_values(keys[:8]).reset_index(drop=True)


def test_a_ray_run_gives_the_tables_of_a_local_run(base, tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    shutil.copytree(base, here)
    shutil.copytree(base, there)
    stages(here)
    stages(there, "--ray", "--workers", "2")
    import ray

    assert not ray.is_initialized()  # each command leaves the runtime it started: nothing lingers in this process
    for name in TABLES:
        # the same seeds and one thread per worker: the same numbers, whichever process made them
        pd.testing.assert_frame_equal(read(here, name), read(there, name), check_exact=False, rtol=1e-6, atol=1e-9,
                                      obj=name)
    for sae in sorted((here / "saes").glob("layer*")):
        assert (sae / "sae_weights.safetensors").read_bytes() == (there / "saes" / sae.name / "sae_weights.safetensors"
                                                                 ).read_bytes(), sae.name


def test_a_killed_worker_task_is_retried_and_a_rerun_does_nothing_more(base, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a cluster of this machine's processes only
    run = tmp_path / "run"
    shutil.copytree(base, run)
    stages_before = STAGES[0]
    assert main([stages_before[0], "--out", str(run), "--threads", "1", *stages_before[1:]]) == 0
    port = _free_port()
    head = subprocess.run(["ray", "start", "--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard",
                           "false", "--disable-usage-stats"], capture_output=True, text=True)
    assert head.returncode == 0, head.stderr
    address = f"127.0.0.1:{port}"
    try:
        command = [sys.executable, "-m", "pipelines", *STAGES[1], "--out", str(run), "--threads", "1", "--ray", address,
                   "--workers", "2"]
        driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed = None
        deadline = time.time() + 240
        while killed is None and driver.poll() is None and time.time() < deadline:
            # a Ray worker names its process after the task it runs
            running = _processes_named("ray::_run_task")
            if running:
                killed = running[0]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.1)
        output = driver.communicate(timeout=600)[0]
        assert killed is not None, "no running task was seen to kill"
        assert driver.returncode == 0, output  # Ray reran the killed task
        assert "computed now: layer 0" in output and "layer 1" in output
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
    for layer in (0, 1):
        assert (run / "tables" / "gates" / f"layer{layer}" / "resid_mid-sae.parquet").is_file()
    # a rerun finds every layer done
    done = subprocess.run([sys.executable, "-m", "pipelines", *STAGES[1], "--out", str(run), "--threads", "1", "--ray",
                           "--workers", "2"], capture_output=True, text=True)
    assert done.returncode == 0 and "none, all up to date" in done.stdout, done.stdout + done.stderr


def test_a_worker_that_cannot_see_the_run_refuses_with_a_message(tmp_path):
    task = Task("layer 0", None)
    with pytest.raises(TaskFailed) as failed:
        _run_task(lambda inputs, unit: None, {"run": str(tmp_path / "elsewhere"), "model": "", "tokens": ""},
                  str(tmp_path / "elsewhere" / ".ray-driver-x"), "cpu", 1, task, "circuits", None)
    message = str(failed.value)
    assert "circuits: task 'layer 0' failed on worker" in message
    assert "must be on storage every worker shares" in message


def test_ray_without_ray_installed_is_a_clear_error(base, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    assert main(["circuits", "--out", str(base), "--ray", "--threads", "1"]) == 2
    error = capsys.readouterr().err
    assert "--ray needs Ray, which is not installed" in error and "bilinear-circuits[ray]" in error


def _processes_named(text: str) -> list[int]:
    """Pids whose command line holds `text` (a Ray worker names its process after its task)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
