"""benchmarks/bench_stages.py refuses to time a stage whose output `--from` copies in: such a
stage does no work, and its zero floor once ended the script in a ZeroDivisionError after
the other stages had run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_stages", ROOT / "benchmarks" / "bench_stages.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_from_a_run_refuses_to_time_the_stages_it_copies(tmp_path, monkeypatch):
    source = tmp_path / "source"
    for name in ("corpus", "lm"):
        (source / name).mkdir(parents=True)
    monkeypatch.setattr(sys, "argv", ["bench_stages.py", "--from", str(source), "--stages", "corpus,train-lm",
                                      "--out", str(tmp_path / "out")])
    monkeypatch.setattr(bench, "run_child", lambda *a, **k: pytest.fail("a stage ran"))
    with pytest.raises(SystemExit) as stop:
        bench.main()
    assert "--from" in str(stop.value) and "corpus, train-lm" in str(stop.value)
    assert not (tmp_path / "out").exists()


def _result(stage: str, seconds: float, floor: float, device: str, paper=None) -> dict:
    return {"stage": stage, "seconds": seconds, "floor": floor, "cpu": 4 * seconds, "cpu_floor": floor,
            "flops": 1e12, "cpu_rate": 1e14, "dtype": "float32", "device": device, "device_name": "Some GPU",
            "paper": paper, "paper_stream": 0.0}


def test_projection_on_a_gpu_uses_its_measured_rate_and_wall_ratios():
    """On a GPU the host's CPU seconds measure only its waiting: the paper run is projected at the
    GPU's own rate and each stage's ratio of wall seconds to its floor, not CPU seconds times cores."""
    paper = {stage: 0.0 for stage in bench.STAGES} | {"train-saes": 6e17, "circuits": 6e16}
    results = [_result("train-saes", 30.0, 10.0, "cuda"), _result("circuits", 20.0, 10.0, "cuda", paper)]
    text = bench.projection(results)
    # floors: 6000 s and 600 s at 100 TFLOP/s; at wall ratios 3x and 2x: 18000 + 1200 s = 5.3 h
    assert "this GPU (Some GPU) at 100 TFLOP/s" in text
    assert "floor 110.0 min" in text and "at most 5.3 h" in text and "train-saes 3.0x, circuits 2.0x" in text
    assert "assumed" not in text
    on_cpu = bench.projection([_result("train-saes", 30.0, 10.0, "cpu"), _result("circuits", 20.0, 10.0, "cpu", paper)])
    assert "cores" in on_cpu and "train-saes 12.0x" in on_cpu and "assumed" in on_cpu
