"""Stages on a Ray cluster: the same tables as a local run, a killed worker's task retried
and a rerun doing nothing more, a command whose task failed finished by a rerun, a clear
error without Ray or without a shared run directory."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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
    ["verdicts", "--rows", "32", "--min-cell", "3", "--n-ablate", "2"],
]
CIRCUIT_TABLES = ["interactions", "gates", "gate_truth", "eigen", "eigen_inputs", "lowrank", "lowrank_samples"]
PART = "resid_mid-sae"  # the file of a layer's tables for SAE inputs at resid_mid and SAE outputs
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


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
    """`base` with its SAEs trained: where the circuits stage is run, failed and rerun."""
    out = tmp_path_factory.mktemp("trained") / "run"
    shutil.copytree(base, out)
    stage = STAGES[0]
    assert main([stage[0], "--out", str(out), "--threads", "1", "--device", "cpu", *stage[1:]]) == 0
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


def test_a_killed_worker_task_is_retried_and_a_rerun_does_nothing_more(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a cluster of this machine's processes only
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    port = _free_port()
    # a temp dir of its own: every process of this cluster names it, so the test can tell them from another
    # session's Ray on a shared machine (short, as Ray's socket paths under it must be)
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    try:
        head = subprocess.run(["ray", "start", "--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard",
                               "false", "--disable-usage-stats", "--temp-dir", str(temp)],
                              check=False, capture_output=True, text=True)
        assert head.returncode == 0, head.stderr
        address = f"127.0.0.1:{port}"
        command = [sys.executable, "-m", "pipelines", *STAGES[1], "--out", str(run), "--threads", "1", "--ray", address,
                   "--workers", "2"]
        driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed = None
        deadline = time.time() + 240
        while killed is None and driver.poll() is None and time.time() < deadline:
            # a worker of this cluster's raylet that names its process after the task it runs
            running = [pid for pid, cmd in _cluster_processes(temp).items() if cmd.startswith("ray::_run_task")]
            if running:
                killed = running[0]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.1)
        output = driver.communicate(timeout=600)[0]
        assert killed is not None, "no running task was seen to kill"
        assert driver.returncode == 0, output  # Ray reran the killed task
        # both layers were computed by this command, the killed one included, in the order of the tasks
        assert f"(computed now: layer 0 {PART}, layer 1 {PART})" in output, output
    finally:
        _stop_cluster(temp)
    for layer in (0, 1):
        assert (run / "tables" / "gates" / f"layer{layer}" / f"{PART}.parquet").is_file()
    # a rerun finds every layer done
    done = subprocess.run([sys.executable, "-m", "pipelines", *STAGES[1], "--out", str(run), "--threads", "1", "--ray",
                           "--workers", "2"], check=False, capture_output=True, text=True)
    assert done.returncode == 0 and "none, all up to date" in done.stdout, done.stdout + done.stderr


def test_a_command_that_fails_part_way_is_finished_by_a_rerun(trained, tmp_path, capsys):
    clean, run = tmp_path / "clean", tmp_path / "run"
    shutil.copytree(trained, clean)
    shutil.copytree(trained, run)
    circuits = [STAGES[1][0], "--threads", "1", "--device", "cpu", *STAGES[1][1:]]
    assert main([circuits[0], "--out", str(clean), *circuits[1:]]) == 0
    # layer 1's task fails on its worker at its last table (gate_truth), after writing the others: a file
    # stands where that table's layer folder goes; the driver never looks there for a layer not yet stamped
    blocker = run / "tables" / "gate_truth" / "layer1"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("")
    capsys.readouterr()
    # one worker: layer 0's task finishes before layer 1's starts, so the failure keeps layer 0's tables
    ray_circuits = [circuits[0], "--out", str(run), *circuits[1:], "--ray", "--workers", "1"]
    assert main(ray_circuits) == 2
    error = capsys.readouterr().err
    # the task's name and the worker's host and pid as `_run_task` reports them, then the error's type
    assert re.search(rf"^error: circuits: task 'layer 1' failed on worker {re.escape(socket.gethostname())} "
                     rf"\(pid \d+\): FileExistsError: ", error, re.MULTILINE), error
    assert (run / "tables" / "gates" / "layer0" / f"{PART}.parquet").is_file()
    blocker.unlink()
    assert main(ray_circuits) == 0
    # the rerun does only what the failure left: layer 1, the tables it wrote before failing included
    assert f"(computed now: layer 1 {PART})" in capsys.readouterr().out
    for name in CIRCUIT_TABLES:
        pd.testing.assert_frame_equal(read(clean, name), read(run, name), check_exact=False, rtol=1e-6, atol=1e-9,
                                      obj=name)


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


def _cluster_processes(temp: Path) -> dict[int, str]:
    """Pid -> command line of the processes of the Ray cluster started with `--temp-dir temp`:
    those whose command line names it (raylet, GCS, monitors) and their descendants (a worker's
    command line is only its task's name, such as `ray::_run_task`)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
            table[int(entry.name)] = (parent, cmd)
    found = {pid for pid, (_, cmd) in table.items() if f"{temp}/" in cmd}  # its session's paths
    while more := {pid for pid, (parent, _) in table.items() if parent in found} - found:
        found |= more
    return {pid: table[pid][1] for pid in found}


def _stop_cluster(temp: Path) -> None:
    """Stop the cluster started with `--temp-dir temp` and only it (`ray stop` would stop every
    Ray process of this user on the machine, another session's too)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in _cluster_processes(temp):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while _cluster_processes(temp) and time.time() < deadline:
            time.sleep(0.2)
    shutil.rmtree(temp, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
